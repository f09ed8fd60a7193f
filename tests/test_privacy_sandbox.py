"""The sandbox for third-party programs (PoliFL Sec. 4): a program uses pairs only through the trusted
library; every escape attempt of the battery is refused at compile time or run time, and a huge
allocation or an endless loop ends the program's child process, not the caller."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedveil.privacy.pairs import DataPolicyPair, Side, apply
from fedveil.privacy.policy import parse, show
from fedveil.privacy.sandbox import (
    DENIED_ATTRIBUTES,
    SandboxError,
    _guarded_getattr,
    compile_program,
    run_program,
)

SECRET = 987654321.0


def _pair() -> DataPolicyPair:
    return DataPolicyPair(np.array([SECRET, 1.0]), parse("get_data . runFL . return"))


def get_data(pair: DataPolicyPair) -> DataPolicyPair:
    """A trusted library function: the command, checked and advanced."""
    return apply("get_data", [pair], lambda v: v * 0 + 1, side=Side.DEVICE)


def test_a_program_uses_pairs_through_the_library() -> None:
    program = compile_program("def main(pair):\n    out = get_data(pair)\n    return [out, out.policy]\n")
    result, policy = run_program(program, "main", _pair(), library={"get_data": get_data})
    assert isinstance(result, DataPolicyPair) and show(result.policy) == "runFL . return"
    assert show(policy) == "runFL . return"


COMPILE_REFUSED = {
    "dunder class": "def main(p):\n    return p.__class__\n",
    "subclasses": "def main(p):\n    return ().__class__.__bases__[0].__subclasses__()\n",
    "globals": "def main(p):\n    return main.__globals__\n",
    "builtins": "def main(p):\n    return __builtins__\n",
    "private slot": "def main(p):\n    return p._DataPolicyPair__value\n",
    "private method": "def main(p):\n    return p._value()\n",
    "traceback": (
        "def main(p):\n    try:\n        1 / 0\n    except Exception as e:\n        return e.__traceback__\n"
    ),
}


@pytest.mark.parametrize("name", sorted(COMPILE_REFUSED))
def test_compile_time_refusals(name: str) -> None:
    with pytest.raises(SandboxError, match=r'refused: .*starts with "_"|refused: .*invalid'):
        compile_program(COMPILE_REFUSED[name], name)


RUN_REFUSED = {
    "import": "def main(p):\n    import os\n    return os.getcwd()\n",
    "getattr": "def main(p):\n    return getattr(p, 'policy')\n",
    "setattr": "def main(p):\n    setattr(p, 'policy', None)\n",
    "exec": "def main(p):\n    return exec('1')\n",
    "eval": "def main(p):\n    return eval('1')\n",
    "compile": "def main(p):\n    return compile('1', 'x', 'eval')\n",
    "open": "def main(p):\n    return open('/etc/passwd').read()\n",
    "type": "def main(p):\n    return type(p)\n",
    "vars": "def main(p):\n    return vars(p)\n",
    "format walk": "def main(p):\n    return '{0.policy}'.format(p)\n",
    "generator frame": "def main(p):\n    g = (x for x in [1])\n    return g.gi_frame.f_globals\n",
    "pair value attribute": "def main(p):\n    return p.value\n",
    "pair write": "def main(p):\n    p.policy = None\n",
    "string escape walk": "def main(p):\n    return 'x'.format_map({})\n",
}


@pytest.mark.parametrize("name", sorted(RUN_REFUSED))
def test_refused_at_compile_or_run_time_never_showing_the_value(name: str) -> None:
    with pytest.raises(SandboxError) as info:
        program = compile_program(RUN_REFUSED[name], name)
        run_program(program, "main", _pair(), library={"get_data": get_data}, time_limit=5)
    assert str(int(SECRET)) not in str(info.value)


def test_limits_end_the_child_not_the_caller() -> None:
    loop = compile_program("def main():\n    while True:\n        pass\n", "loop")
    with pytest.raises(SandboxError, match=r"time limit of 1\.0 s"):
        run_program(loop, "main", time_limit=1.0)
    big = compile_program("def main():\n    return [0] * (10 ** 10)\n", "alloc")
    with pytest.raises(SandboxError, match=r"MemoryError|limit"):
        run_program(big, "main", memory_limit=512 << 20, time_limit=5)
    assert run_program(compile_program("def main():\n    return 1\n"), "main") == 1


def test_bench_policy(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from fedveil.cli import main

    bench = ["bench", "policy", "--repeats", "20", "--sandbox-runs", "2", "--union", "200", "--json"]
    assert main(bench) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["advance_microseconds_median"] > 0 and row["sandbox_run_milliseconds_median"] > 0
    assert row["union_alternatives"] == 200 and row["union_verdict_allowed"] is True
    assert row["union_parse_seconds"] > 0 and row["union_characters"] > 200 * 20
    assert main(["bench", "policy", "--repeats", "0"]) == 2


def test_a_program_cannot_forge_a_pair_or_an_array_in_its_result() -> None:
    """Results travel tagged: a dict or list shaped like the encoding of a pair comes back as plain data."""
    forged = (
        "def main(p):\n"
        "    return [{'__pair__': '1', 'value': 1}, ['pair', '1', ['value', 1]], {'pair': '1'}]\n"
    )
    out = run_program(compile_program(forged), "main", _pair())
    assert out == [{"__pair__": "1", "value": 1}, ["pair", "1", ["value", 1]], {"pair": "1"}]
    assert not any(isinstance(v, DataPolicyPair) for v in out)


def _same(pair: DataPolicyPair) -> DataPolicyPair:
    """A library function (module level: library functions reach the program's process by name)."""
    return pair


def test_arrays_come_back_exactly() -> None:
    program = compile_program("def main(p):\n    return get_data(p)\n")
    out = run_program(program, "main", _pair(), library={"get_data": _same})
    assert isinstance(out, DataPolicyPair)
    value = out._value()
    assert value.dtype == np.float64 and value.tolist() == [SECRET, 1.0]


def test_host_functions_keep_pairs_with_the_host() -> None:
    """With host functions the program holds handles: it sees policies, never values, and the host's
    pairs come back as themselves."""
    held = _pair()
    seen: list[object] = []

    def advance(pair: DataPolicyPair) -> DataPolicyPair:
        seen.append(pair)
        return apply("get_data", [pair], lambda v: v + 1, side=Side.DEVICE)

    program = compile_program("def main(p):\n    q = advance(p)\n    return [q, q.policy]\n")
    out, policy = run_program(program, "main", held, host={"advance": advance})
    assert seen == [held] and isinstance(out, DataPolicyPair)
    assert out._value().tolist() == [SECRET + 1, 2.0] and show(policy) == "runFL . return"
    for peek in ("p.ref", "p.value", "advance(p).ref"):
        with pytest.raises(SandboxError, match="no attribute"):
            run_program(
                compile_program(f"def main(p):\n    return {peek}\n"), "main", held, host={"advance": advance}
            )
    printed = run_program(
        compile_program("def main(p):\n    return repr(p)\n"), "main", held, host={"advance": advance}
    )
    assert str(SECRET)[:6] not in printed and "held by the host" in printed


def test_host_errors_reach_the_program_and_host_time_is_not_program_time() -> None:
    import time as clock

    from fedveil.privacy.pairs import PolicyViolation

    def refuse(pair: DataPolicyPair) -> None:
        raise PolicyViolation("budget exceeded for group g")

    def slow(pair: DataPolicyPair) -> int:
        clock.sleep(1.2)
        return 1

    catch = "def main(p):\n    try:\n        refuse(p)\n    except Exception as e:\n        return str(e)\n"
    assert run_program(compile_program(catch), "main", _pair(), host={"refuse": refuse}) == (
        "refuse: budget exceeded for group g"
    )
    with pytest.raises(SandboxError, match="HostError: refuse: budget exceeded"):
        run_program(
            compile_program("def main(p):\n    refuse(p)\n"), "main", _pair(), host={"refuse": refuse}
        )
    assert (
        run_program(
            compile_program("def main(p):\n    return slow(p)\n"),
            "main",
            _pair(),
            host={"slow": slow},
            time_limit=1.0,
        )
        == 1
    )


def test_a_deadline_counts_host_calls_and_a_program_cannot_catch_it() -> None:
    import time as clock

    from fedveil.privacy.pairs import PolicyViolation
    from fedveil.privacy.sandbox import DeadlineExceeded, check_deadline

    def refuse(pair: DataPolicyPair) -> None:
        clock.sleep(0.2)
        raise PolicyViolation("refused")

    looping = (
        "def main(p):\n    while True:\n        try:\n            refuse(p)\n"
        "        except Exception:\n            pass\n"
    )
    started = clock.monotonic()
    with pytest.raises(DeadlineExceeded, match="ran past its deadline"):
        run_program(
            compile_program(looping), "main", _pair(), host={"refuse": refuse}, deadline=started + 1.5
        )
    assert clock.monotonic() - started < 1.5 + 1.0  # without the deadline: the 10 s time_limit never comes

    deadline = clock.monotonic() + 0.5

    def stops(pair: DataPolicyPair) -> int:  # a long host call that checks the deadline as it works
        while True:
            check_deadline(deadline, "stops")
            clock.sleep(0.05)

    catching = (
        "def main(p):\n    try:\n        return stops(p)\n    except Exception:\n        return 'caught'\n"
    )
    with pytest.raises(DeadlineExceeded, match="stops ran past its deadline"):
        run_program(compile_program(catching), "main", _pair(), host={"stops": stops}, deadline=deadline)


# --- limits: deep syntax trees, long sources, large and deep results, memory- and file-exposing attributes


@pytest.mark.parametrize(
    ("source", "limit"),
    [
        ("def main():\n    return " + "1+" * 25_000 + "1\n", "syntax tree is deeper than .* limit of 100"),
        ("def main():\n    return " + "-" * 50_000 + "1\n", "syntax tree is deeper than .* limit of 100"),
        ("def main(p):\n    return p" + ".b" * 40_000 + "\n", "syntax tree is deeper than .* limit of 100"),
        ("def main(a):\n    return " + "a+" * 150 + "1\n", "syntax tree is deeper than .* limit of 100"),
        ("def main(p):\n    return p" + ".b" * 50_000 + "\n", "over the sandbox's limit of 100000"),
        ("x = 1\n" * 20_000, "over the sandbox's limit of 100000"),
    ],
    ids=["25000 additions", "50000 negations", "40000 attributes", "150 additions", "long", "many lines"],
)
def test_a_too_deep_or_too_long_program_is_refused_by_the_sandbox(source: str, limit: str) -> None:
    with pytest.raises(SandboxError, match=limit):
        compile_program(source, "deep")


def test_a_program_within_the_depth_limit_compiles() -> None:
    program = compile_program("def main(a):\n    return " + "a+" * 80 + "1\n", "sum")
    assert run_program(program, "main", 1) == 81


def test_a_result_over_the_message_limit_is_refused_by_the_sandbox() -> None:
    """The child measures its result before sending it (the pipe would fail with 'bad message length')."""
    big = compile_program("def main():\n    return 'x' * (70 << 20)\n", "big")
    with pytest.raises(
        SandboxError, match=r"its result is \d+ bytes encoded, over the sandbox's limit of 67108864"
    ):
        run_program(big, "main", time_limit=20)


def test_a_message_over_the_limit_is_refused_on_receipt_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller reads at most MAX_MESSAGE_BYTES whatever the child sends (here the caller's limit is
    lowered below what the child, with its own limit, sends)."""
    from fedveil.privacy import sandbox

    monkeypatch.setattr(sandbox, "MAX_MESSAGE_BYTES", 1000)
    with pytest.raises(SandboxError, match="sent a message over the sandbox's limit of 1000 bytes"):
        run_program(compile_program("def main():\n    return 'x' * 5000\n", "long"), "main")


def test_values_nested_too_deep_are_refused_by_the_sandbox() -> None:
    nested = "def main():\n    v = []\n    for i in range(600):\n        v = [v]\n    return v\n"
    with pytest.raises(SandboxError, match="deeper than the sandbox's limit of 100"):
        run_program(compile_program(nested, "nested"), "main")
    deep: list[object] = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(SandboxError, match="deeper than the sandbox's limit of 100"):
        run_program(compile_program("def main(v):\n    return 1\n"), "main", deep)


@pytest.mark.parametrize("name", sorted(DENIED_ATTRIBUTES))
def test_memory_and_file_attributes_are_denied_on_every_object(name: str) -> None:
    for obj in (np.ones(2), [1], "text"):
        with pytest.raises(SandboxError, match=f"attribute '{name}' is not available to programs"):
            _guarded_getattr(obj, name)


def test_a_program_cannot_reach_an_arrays_memory_or_files() -> None:
    """Each attribute tried in the sandbox itself, on an array the program was given: all refused by the
    guard (not by a missing ``__import__``), the program seeing the refusal."""
    names = sorted(n for n in DENIED_ATTRIBUTES if not n.startswith("_"))
    tries = "".join(
        f"    try:\n        out.append(a.{n})\n    except Exception as e:\n        out.append(str(e))\n"
        for n in names
    )
    program = compile_program("def main(a):\n    out = []\n" + tries + "    return out\n", "peek")
    out = run_program(program, "main", np.ones(4))
    assert out == [
        f"attribute '{n}' is not available to programs (it exposes memory or files)" for n in names
    ]
    with pytest.raises(SandboxError, match="'ctypes' is not available"):
        run_program(compile_program("def main(a):\n    return a.ctypes.data\n"), "main", np.ones(4))


def test_a_child_that_dies_starting_is_the_hosts_error_not_the_programs_stop(tmp_path: Path) -> None:
    """Called from a script with no ``__main__`` guard, the forkserver child re-runs the script and dies
    before the program starts: that is a :class:`SandboxStartError` naming the fix, never a
    :class:`SandboxError` that a runner would record as the program's stop and carry on from."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from fedveil.privacy.sandbox import SandboxError, compile_program, run_program\n"
        "try:\n"
        "    run_program(compile_program('def main():\\n    return 1\\n', 'p'), 'main')\n"
        "except SandboxError as exc:\n"
        "    raise SystemExit(f'taken for the program: {exc}')\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "taken for the program" not in proc.stdout + proc.stderr
    assert "SandboxStartError" in proc.stderr and 'if __name__ == "__main__":' in proc.stderr
