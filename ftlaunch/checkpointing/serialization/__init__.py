"""The checkpoint wire format both transports share: a JSON header plus raw tensor bytes.

Why not ``torch.save``/pickle: the bytes come from the network, and unpickling them runs whatever
code the peer chooses. Here a receiver only parses JSON it validated and copies raw bytes into
tensors whose dtype and shape it checked first (docs/checkpointing.md has the format). No module
here does I/O; the transports move the bytes.

Modules, in the order a transfer uses them:

* `spec` - the format's constants, limits and dtype whitelist; `invalid` is its one error.
* `tree` - nested Python values <-> the header's JSON tree (encode, validate, rebuild).
* `checksum` - ``sum64``, the per-tensor checksum, whole or piece by piece.
* `encode` - a state dict -> `Encoded` (header + tensors, zero copy); `dumps`.
* `header` - the header frame: written by senders, parsed and fully validated by receivers.
* `layout` - the body as byte segments; ranges and pieces for sockets.
* `receive` - destination tensors (`plan_slots`), verification and rebuild (`finish`); `loads`.
* `buffers` - byte views of tensors and prefaulting fresh memory.
"""
