"""ftlaunch.timeouts: derivation from one knob, overrides, environment, and the consistency rules."""

from __future__ import annotations

import logging
import math
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ftlaunch.errors import ConfigurationError
from ftlaunch.timeouts import (
    ENV_VARS,
    FTLAUNCH_TIMEOUT,
    MAX_QUORUM_TIMEOUT,
    MIN_TIMEOUT,
    POSITIVE,
    RULES,
    Timeouts,
    parse_duration,
)

FIELDS = ("collective", "heal", "commit", "quorum", "connect")
NO_ENV: dict[str, str] = {}


def derive(*args, environ=NO_ENV, **kwargs) -> Timeouts:
    """`Timeouts.derive` that never reads the real environment unless told to."""
    return Timeouts.derive(*args, environ=environ, **kwargs)


def values(t: Timeouts) -> tuple[float, ...]:
    return tuple(getattr(t, f) for f in FIELDS)


# ------------------------------------------------------------------------------------ derivation
@pytest.mark.parametrize(
    ("timeout", "expected"),  # expected: collective, heal, commit, quorum, connect
    [
        (None, (60, 60, 60, 120, 10)),
        (60, (60, 60, 60, 120, 10)),
        (30.0, (30, 30, 30, 60, 10)),
        (20, (20, 20, 20, 40, 10)),
        (10, (10, 10, 10, 20, 5)),
        (1, (1, 1, 1, 2, 0.5)),
        (0.2, (0.2, 0.2, 0.2, 0.4, 0.1)),
        (timedelta(minutes=5), (300, 300, 300, 600, 10)),
        (12 * 3600, (43200, 43200, 43200, 86400, 10)),
        (20 * 3600, (72000, 72000, 72000, 86400, 10)),  # quorum capped at the lighthouse's 24 h
        (MAX_QUORUM_TIMEOUT, (86400, 86400, 86400, 86400, 10)),
        (MIN_TIMEOUT, (0.001, 0.001, 0.001, 0.002, 0.0005)),
    ],
)
def test_derivation(timeout, expected):
    assert values(derive(timeout)) == pytest.approx(expected)


@given(st.floats(min_value=MIN_TIMEOUT, max_value=MAX_QUORUM_TIMEOUT))
def test_derived_values_always_obey_every_rule(base):
    t = derive(base)  # raises if any rule were broken
    t.validate()
    assert all(math.isfinite(v) and v > 0 for v in values(t))
    assert t.connect <= min(t.quorum, t.collective)
    assert t.heal <= t.collective <= t.quorum <= MAX_QUORUM_TIMEOUT
    assert t.commit <= t.quorum


@given(
    st.floats(min_value=MIN_TIMEOUT, max_value=MAX_QUORUM_TIMEOUT),
    st.sampled_from(FIELDS),
    st.floats(allow_nan=True, allow_infinity=True),
)
def test_an_override_is_accepted_exactly_when_the_rules_hold(base, name, value):
    """Cross-check derive() against the rules written out independently here."""
    d = derive(base)
    v = {f: getattr(d, f) for f in FIELDS} | {name: value}
    ok = (
        all(math.isfinite(x) and x > 0 for x in v.values())
        and v["connect"] <= v["quorum"]
        and v["connect"] <= v["collective"]
        and v["heal"] <= v["collective"]
        and v["collective"] <= v["quorum"]
        and v["commit"] <= v["quorum"]
        and v["quorum"] <= MAX_QUORUM_TIMEOUT
    )
    if ok:
        assert getattr(derive(base, **{name: value}), name) == value
    else:
        with pytest.raises(ConfigurationError):
            derive(base, **{name: value})


# ------------------------------------------------------------------------------------ overrides
@pytest.mark.parametrize(
    ("override", "expected"),  # with the default timeout (60 s)
    [
        ({"collective": 90}, (90, 60, 60, 120, 10)),
        ({"collective": 60.0}, (60, 60, 60, 120, 10)),
        ({"heal": 30}, (60, 30, 60, 120, 10)),
        ({"heal": 60}, (60, 60, 60, 120, 10)),
        ({"commit": 120}, (60, 60, 120, 120, 10)),
        ({"commit": 5}, (60, 60, 5, 120, 10)),
        ({"quorum": 60}, (60, 60, 60, 60, 10)),  # the old Manager defaults: timeout 60, quorum 60
        ({"quorum": 600}, (60, 60, 60, 600, 10)),
        ({"quorum": timedelta(hours=24)}, (60, 60, 60, 86400, 10)),
        ({"connect": 60}, (60, 60, 60, 120, 60)),
        ({"connect": timedelta(milliseconds=500)}, (60, 60, 60, 120, 0.5)),
    ],
)
def test_valid_override(override, expected):
    t = derive(**override)
    assert values(t) == pytest.approx(expected)
    (name,) = override
    assert t.sources[name] == f"argument {name}="


@pytest.mark.parametrize(
    ("override", "rules"),  # with the default timeout (60 s)
    [
        ({"collective": 121}, ["collective <= quorum"]),
        ({"collective": 30}, ["heal <= collective"]),
        ({"collective": 5}, ["connect <= collective", "heal <= collective"]),
        ({"heal": 61}, ["heal <= collective"]),
        ({"commit": 120.5}, ["commit <= quorum"]),
        ({"quorum": 59}, ["collective <= quorum", "commit <= quorum"]),
        ({"quorum": 5}, ["connect <= quorum", "collective <= quorum", "commit <= quorum"]),
        ({"connect": 61}, ["connect <= collective"]),
        ({"connect": 121}, ["connect <= quorum", "connect <= collective"]),
    ],
)
def test_invalid_override_names_its_rules(override, rules):
    with pytest.raises(ConfigurationError) as e:
        derive(**override)
    msg = str(e.value)
    assert sorted(r.name for r in RULES if f"(rule: {r.name})" in msg) == sorted(rules)
    if len(rules) > 1:
        assert f"({len(rules)} problems)" in msg
    else:  # one problem: one line, as a worker's error should be
        assert "\n" not in msg and msg.startswith("invalid ftlaunch timeouts (see docs/timeouts.md): ")
    (name,) = override
    assert f"argument {name}=" in msg
    assert "derived from timeout=60 s, the default" in msg


def test_message_has_values_sources_reason_and_fix():
    with pytest.raises(ConfigurationError) as e:
        derive(heal=120)
    msg = str(e.value)
    assert (
        "heal timeout 120 s (argument heal=) > collective timeout 60 s (derived from timeout=60 s, "
        "the default)" in msg
    )
    assert "(rule: heal <= collective)" in msg
    assert "healing group receives its state" in msg  # why
    assert "lower the heal timeout (the heal= argument)" in msg  # fix, side 1
    assert "raise the collective timeout (via `timeout`" in msg  # fix, side 2
    assert "FTLAUNCH_COLLECTIVE_TIMEOUT" in msg
    assert "docs/timeouts.md" in msg


def test_configuration_error_is_a_value_error():
    with pytest.raises(ValueError):
        derive(heal=120)


def test_all_violations_are_reported_together():
    with pytest.raises(ConfigurationError) as e:
        derive(heal=120, quorum=30, connect=-1)
    msg = str(e.value)
    for rule in (POSITIVE, "heal <= collective", "collective <= quorum", "commit <= quorum"):
        assert f"(rule: {rule})" in msg
    assert "(4 problems)" in msg
    assert msg.count("\n  - ") == 4
    assert "effective: collective=60 s" in msg


def test_every_rule_can_be_reported_at_once():
    with pytest.raises(ConfigurationError) as e:
        derive(collective=100_000, heal=200_000, commit=100_000, quorum=90_000, connect=100_001)
    msg = str(e.value)
    for rule in RULES:
        assert f"(rule: {rule.name})" in msg, rule.name


def test_rule_names():
    assert [r.name for r in RULES] == [
        "connect <= quorum",
        "connect <= collective",
        "heal <= collective",
        "collective <= quorum",
        "commit <= quorum",
        "quorum <= 24 h",
    ]


def test_quorum_over_the_lighthouse_limit():
    with pytest.raises(ConfigurationError, match=r"\(rule: quorum <= 24 h\): the lighthouse refuses"):
        derive(quorum=MAX_QUORUM_TIMEOUT + 1)


def test_limit_matches_the_lighthouse_protocol():
    from ftlaunch.lighthouse.protocol import MAX_QUORUM_TIMEOUT as protocol_max

    assert MAX_QUORUM_TIMEOUT == protocol_max


# ------------------------------------------------------------------------------------ bad values
@pytest.mark.parametrize(
    "bad", [0, 0.0, -1, -0.5, float("inf"), float("-inf"), float("nan"), timedelta(seconds=-3)]
)
@pytest.mark.parametrize("name", FIELDS)
def test_non_positive_or_non_finite_override(name, bad):
    with pytest.raises(ConfigurationError) as e:
        derive(**{name: bad})
    msg = str(e.value)
    assert f"{name} timeout" in msg and f"(rule: {POSITIVE})" in msg
    assert f"argument {name}=" in msg


@pytest.mark.parametrize(
    "bad", [0, -1, float("inf"), float("nan"), MIN_TIMEOUT / 2, MAX_QUORUM_TIMEOUT * 1.01, timedelta(0)]
)
def test_base_timeout_out_of_range(bad):
    with pytest.raises(ConfigurationError, match=r"timeout .* \(argument timeout=\) is out of range"):
        derive(bad)


@pytest.mark.parametrize("bad", ["60", True, [60], object()])
def test_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="seconds"):
        derive(bad)
    with pytest.raises(TypeError, match="heal timeout"):
        derive(heal=bad)


# ------------------------------------------------------------------------------------ environment
@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 30),
        ("30s", 30),
        ("30 s", 30),
        ("  45S ", 45),
        ("2.5", 2.5),
        (".5", 0.5),
        ("1.5m", 90),
        ("2M", 120),
        ("1e2", 100),
        ("-5", -5),  # parsed; rejected later by the rule with the variable named
        ("0", 0),
    ],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text, "X") == seconds


@pytest.mark.parametrize(
    "text", ["abc", "30 sec", "1h", "1.5ms", "inf", "nan", "", " ", "5m5s", "1,5", "s", "--5"]
)
def test_parse_duration_rejects_garbage(text):
    with pytest.raises(ConfigurationError, match=r"environment variable X=.* is not a duration"):
        parse_duration(text, "X")


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({FTLAUNCH_TIMEOUT: "30"}, (30, 30, 30, 60, 10)),
        ({FTLAUNCH_TIMEOUT: "2m"}, (120, 120, 120, 240, 10)),
        ({FTLAUNCH_TIMEOUT: ""}, (60, 60, 60, 120, 10)),  # empty = unset
        ({ENV_VARS["quorum"]: "300"}, (60, 60, 60, 300, 10)),
        ({ENV_VARS["connect"]: "3s"}, (60, 60, 60, 120, 3)),
        ({ENV_VARS["heal"]: "45"}, (60, 45, 60, 120, 10)),
        ({ENV_VARS["commit"]: "1m"}, (60, 60, 60, 120, 10)),
        ({ENV_VARS["collective"]: "100"}, (100, 60, 60, 120, 10)),
        ({ENV_VARS["collective"]: ""}, (60, 60, 60, 120, 10)),
        ({FTLAUNCH_TIMEOUT: "100", ENV_VARS["quorum"]: "100"}, (100, 100, 100, 100, 10)),
    ],
)
def test_env(environ, expected):
    t = derive(environ=environ)
    assert values(t) == pytest.approx(expected)
    for name in FIELDS:
        if environ.get(ENV_VARS[name]):
            assert t.sources[name] == f"env {ENV_VARS[name]}"
        elif environ.get(FTLAUNCH_TIMEOUT):
            assert t.sources[name].endswith(f"set by env {FTLAUNCH_TIMEOUT}")


@pytest.mark.parametrize(
    ("name", "env_value", "arg_value"),  # with timeout=100: each keeps every rule
    [
        ("collective", 150, 180),
        ("heal", 90, 80),
        ("commit", 150, 180),
        ("quorum", 150, 180),
        ("connect", 5, 3),
    ],
)
def test_precedence_argument_over_env_over_derived(name, env_value, arg_value):
    var = ENV_VARS[name]
    base = 100.0
    environ = {var: str(env_value), FTLAUNCH_TIMEOUT: "1000"}
    # The argument timeout beats FTLAUNCH_TIMEOUT.
    assert derive(base, environ={FTLAUNCH_TIMEOUT: "1000"}).collective == base
    # The field's variable beats the derivation.
    t = derive(base, environ=environ)
    assert getattr(t, name) == pytest.approx(env_value)
    assert t.sources[name] == f"env {var}"
    # The field's argument beats its variable.
    t = derive(base, environ=environ, **{name: arg_value})
    assert getattr(t, name) == pytest.approx(arg_value)
    assert t.sources[name] == f"argument {name}="


def test_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv(FTLAUNCH_TIMEOUT, "40")
    monkeypatch.setenv(ENV_VARS["connect"], "4")
    t = Timeouts.derive()
    assert (t.collective, t.quorum, t.connect) == (40, 80, 4)


@pytest.mark.parametrize("var", [FTLAUNCH_TIMEOUT, *ENV_VARS.values()])
def test_garbage_env_names_the_variable(var):
    with pytest.raises(ConfigurationError, match=rf"environment variable {var}='soon' is not a duration"):
        derive(environ={var: "soon"})


def test_garbage_env_ignored_when_the_argument_wins():
    assert derive(environ={ENV_VARS["heal"]: "soon"}, heal=5).heal == 5
    assert derive(30, environ={FTLAUNCH_TIMEOUT: "soon"}).collective == 30


def test_env_problems_and_rule_violations_are_reported_together():
    environ = {FTLAUNCH_TIMEOUT: "abc", ENV_VARS["heal"]: "1h", ENV_VARS["commit"]: "0"}
    with pytest.raises(ConfigurationError) as e:
        derive(environ=environ)
    msg = str(e.value)
    assert "FTLAUNCH_TIMEOUT='abc'" in msg and "FTLAUNCH_HEAL_TIMEOUT='1h'" in msg
    assert f"commit timeout 0 s (env FTLAUNCH_COMMIT_TIMEOUT) (rule: {POSITIVE})" in msg
    assert "(3 problems)" in msg


@pytest.mark.parametrize("text", ["0", "-5", "0s"])
def test_non_positive_env_names_the_variable(text):
    with pytest.raises(ConfigurationError, match=rf"env {ENV_VARS['heal']}\) \(rule: {POSITIVE}\)"):
        derive(environ={ENV_VARS["heal"]: text})


def test_env_base_out_of_range_names_the_variable():
    with pytest.raises(ConfigurationError, match=r"timeout 0 s \(env FTLAUNCH_TIMEOUT\) is out of range"):
        derive(environ={FTLAUNCH_TIMEOUT: "0"})


def test_env_violation_names_the_variable_as_the_source():
    with pytest.raises(ConfigurationError) as e:
        derive(environ={FTLAUNCH_TIMEOUT: "30", ENV_VARS["heal"]: "45"})
    msg = str(e.value)
    assert "heal timeout 45 s (env FTLAUNCH_HEAL_TIMEOUT) > collective timeout 30 s" in msg
    assert "set by env FTLAUNCH_TIMEOUT" in msg
    assert "lower the heal timeout (FTLAUNCH_HEAL_TIMEOUT)" in msg


# ------------------------------------------------------------------------------------ the object
def test_direct_construction_validates():
    t = Timeouts(collective=30, heal=20, commit=30, quorum=60, connect=5)
    assert t.heal == 20.0 and isinstance(t.heal, float)
    assert t.sources == dict.fromkeys(FIELDS, "given")
    with pytest.raises(ConfigurationError, match=r"\(rule: heal <= collective\)"):
        Timeouts(collective=30, heal=40, commit=30, quorum=60, connect=5)


def test_frozen_and_equality_ignores_sources():
    a = derive(30)
    b = Timeouts(collective=30, heal=30, commit=30, quorum=60, connect=10)
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.heal = 1  # type: ignore[misc]


def test_describe_lists_every_value_and_source():
    line = derive(environ={FTLAUNCH_TIMEOUT: "30"}, heal=20).describe()
    assert "\n" not in line
    assert line.startswith(
        "ftlaunch timeouts: collective=30 s [derived from timeout=30 s, set by env FTLAUNCH_TIMEOUT]"
    )
    assert "heal=20 s [argument heal=]" in line
    assert "quorum=60 s [derived: min(2 x timeout, 24 h), timeout=30 s" in line
    assert "connect=10 s [derived: min(10 s, timeout / 2)" in line
    assert "commit=30 s" in line


def test_log(caplog):
    t = derive(10)
    with caplog.at_level(logging.INFO, logger="test.timeouts"):
        t.log(logging.getLogger("test.timeouts"))
    assert [r.getMessage() for r in caplog.records] == [t.describe()]


def test_timedeltas():
    t = derive(timedelta(seconds=30))
    assert t.as_timedelta("quorum") == timedelta(seconds=60)
    assert t.timedeltas() == {
        "collective": timedelta(seconds=30),
        "heal": timedelta(seconds=30),
        "commit": timedelta(seconds=30),
        "quorum": timedelta(seconds=60),
        "connect": timedelta(seconds=10),
    }
    assert t.as_dict() == {"collective": 30, "heal": 30, "commit": 30, "quorum": 60, "connect": 10}
    with pytest.raises(ValueError, match="unknown timeout 'store'"):
        t.as_timedelta("store")


def test_the_module_does_not_import_torch_or_the_manager():
    import subprocess
    import sys

    code = (
        "import sys, ftlaunch.timeouts; print('torch' in sys.modules, 'ftlaunch.worker.manager' in "
        "sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
