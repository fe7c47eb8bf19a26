"""Fault-tolerant optimizer wrapper: ``zero_grad`` starts the step's quorum, ``step`` applies the
update only when every group agreed to commit — so a failed step is discarded, never half-applied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ftlaunch.worker.manager import Manager


class Optimizer(torch.optim.Optimizer):
    """``Optimizer(manager, optimizer)``: wraps any torch optimizer (torchft's OptimizerWrapper)."""

    def __init__(
        self,
        manager: Manager,
        optim: torch.optim.Optimizer,
        on_commit: Callable[[int], None] | None = None,
    ) -> None:
        """``on_commit(step)``: called after each committed update, with the step it made
        (``ft.wrap`` passes durable checkpointing's, `ftlaunch.worker.durable`)."""
        # Deliberately not calling super().__init__: all state lives in the wrapped optimizer.
        self.manager = manager
        self.optim = optim
        self._on_commit = on_commit

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise ValueError("ftlaunch.Optimizer does not support closures (the commit decision is per step)")
        if self.manager.should_commit():
            self.optim.step()
            if self._on_commit is not None:
                self._on_commit(self.manager.current_step())
            return True
        return False

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"ftlaunch.Optimizer({self.optim!r})"
