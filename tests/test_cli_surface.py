"""The ``fedveil`` command line as users meet it: every system's ``run`` (and ``demo``) takes the same
common options (``--out``, ``--set``, ``--seed``, ``--no-progress``, ``--resume`` / ``--overwrite``), a
wrong ``--set`` fails before any training in one line naming the key, ``--set`` and ``--seed`` reach the
config beside each system's own options, every run on synthetic data says SYNTHETIC STAND-IN, a resumed
run under another config is refused, and every ``fedveil ...`` line of the README and docs parses."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import time
from pathlib import Path
from typing import Any

import pytest

from fedveil.cli import build_parser, main
from fedveil.experiments.checkpoint import run_sets
from fedveil.experiments.report import STAND_IN

ROOT = Path(__file__).resolve().parents[1]


class _Started(Exception):
    """Raised by a runner stand-in: the command got as far as training, with ``cfg``."""

    def __init__(self, cfg: Any) -> None:
        super().__init__("training started")
        self.cfg = cfg


#: Each run command: its name in errors, its words before the options, and the runner it calls
#: (module, function; the module imports it lazily, so replacing the attribute reaches the command).
RUN_COMMANDS: dict[str, tuple[str, list[str], str, str]] = {
    "run": ("run", ["run", str(ROOT / "configs" / "table1_fdml.yaml")], "fdml.runner", "run_experiment"),
    "demo": ("demo", ["demo"], "fdml.runner", "run_experiment"),
    "feduv": ("feduv", ["feduv", "run"], "feduv.runner", "run_feduv"),
    "aiot": (
        "aiot",
        ["aiot", "run", str(ROOT / "configs" / "aiot" / "small.yaml")],
        "aiot.runner",
        "run_aiot",
    ),
    "ppfl": (
        "ppfl",
        ["ppfl", "run", str(ROOT / "configs" / "ppfl" / "small.yaml")],
        "ppfl.runner",
        "run_ppfl",
    ),
    "polifl": (
        "polifl",
        ["polifl", "run", str(ROOT / "configs" / "polifl" / "small.yaml")],
        "polifl.runner",
        "run_polifl",
    ),
}


def _stub_runner(monkeypatch: pytest.MonkeyPatch, system: str) -> None:
    """Replace ``system``'s runner by one that raises :class:`_Started` with the config it was given."""
    import importlib

    _, _, module, function = RUN_COMMANDS[system]
    target = importlib.import_module(f"fedveil.experiments.{module}")

    def started(cfg: Any, *args: Any, **kwargs: Any) -> Any:
        raise _Started(cfg)

    monkeypatch.setattr(target, function, started)


@pytest.mark.parametrize("system", sorted(RUN_COMMANDS))
def test_every_run_command_takes_the_common_options(system: str, tmp_path: Path) -> None:
    _, words, _, _ = RUN_COMMANDS[system]
    parser = build_parser()
    common = ["--out", str(tmp_path), "--set", "a.b=1", "--set", "c=x", "--seed", "7", "--no-progress"]
    args = parser.parse_args([*words, *common, "--resume"])
    assert args.out == tmp_path and args.overrides == ["a.b=1", "c=x"] and args.seed == 7
    assert args.no_progress and args.resume and not args.overwrite
    assert run_sets(args) == ["a.b=1", "c=x", "seed=7"]
    args = parser.parse_args([*words, "--overwrite"])
    assert args.overwrite and not args.resume and args.overrides == [] and args.seed is None
    assert not args.no_progress and run_sets(args) == []


#: Per system: options (common and its own) and what each must make of the config.
REACH = {
    "run": (["--set", "fdml.lr=0.002", "--set", "rounds=3"], {"fdml.lr": 0.002, "rounds": 3}),
    "demo": (["--set", "rounds=3"], {"rounds": 3}),
    "feduv": (
        ["--set", "train.fraction=0.5", "--set", "writers=6", "--rounds", "2", "--methods", "softmax"],
        {"train.fraction": 0.5, "writers": 6, "rounds": 2, "methods": ("softmax",)},
    ),
    "aiot": (
        ["--set", "rounds=3", "--trials", "1", "--methods", "ours"],
        {"rounds": 3, "trials": 1, "methods": ("ours",)},
    ),
    "ppfl": (
        ["--set", "clients=4", "--rounds", "2", "--no-e2e", "--threads", "1"],
        {"clients": 4, "ppfl.rounds_per_stage": 2, "e2e": False, "threads": 1},
    ),
    "polifl": (["--set", "lr=0.25", "--rounds", "2"], {"lr": 0.25, "rounds": 2}),
}


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("system", sorted(RUN_COMMANDS))
def test_set_seed_and_own_options_reach_the_config(
    system: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _stub_runner(monkeypatch, system)
    _, words, _, _ = RUN_COMMANDS[system]
    options, expected = REACH[system]
    with pytest.raises(_Started) as started:
        main([*words, *options, "--set", "seed=3", "--seed", "11", "--out", str(tmp_path / "run")])
    cfg = started.value.cfg
    assert cfg.seed == 11, "--seed wins over --set seed=..."
    assert {key: _get(cfg, key) for key in expected} == expected


@pytest.mark.parametrize(
    ("system", "json"),
    [("run", False), ("demo", False), ("feduv", False), ("feduv", True), ("aiot", False), ("aiot", True)],
)
def test_a_run_on_synthetic_data_says_so_before_it_trains(
    system: str,
    json: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The banner leads stdout, or goes to stderr where stdout carries JSON."""
    _stub_runner(monkeypatch, system)
    _, words, _, _ = RUN_COMMANDS[system]
    with pytest.raises(_Started):
        main([*words, "--out", str(tmp_path / "run"), *(["--json"] if json else [])])
    printed = capsys.readouterr()
    assert (printed.err if json else printed.out).startswith(f"{STAND_IN}: ")
    assert STAND_IN not in (printed.out if json else printed.err)


def test_a_run_on_real_data_prints_no_banner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _stub_runner(monkeypatch, "run")
    logs = tmp_path / "touch.csv"
    logs.write_text("")
    real = ["--set", "data.kind=touchauth-csv", "--set", f"data.path={logs}"]
    with pytest.raises(_Started):
        main([*RUN_COMMANDS["run"][1], *real, "--out", str(tmp_path / "run")])
    printed = capsys.readouterr()
    assert STAND_IN not in printed.out + printed.err


@pytest.mark.parametrize("system", ["run", "demo", "feduv", "aiot"])
def test_a_run_refused_for_its_used_directory_prints_the_refusal_alone(
    system: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The commands that print the stand-in banner themselves check the run directory before it: a
    refused run says why, and nothing else (no banner, no training)."""
    _stub_runner(monkeypatch, system)
    name, words, _, _ = RUN_COMMANDS[system]
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text("{}")
    assert main([*words, "--out", str(out)]) == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    assert printed.err.startswith(f"fedveil {name}: error: run directory ") and "is not empty" in printed.err
    assert printed.err.count("\n") == 1, printed.err
    assert [p.name for p in out.iterdir()] == ["results.json"]


PPFL_TINY = """
name: tiny
data: synthetic-fashion-mnist:600
model: lenet
clients: 3
samples_per_client: 24
test_samples: 60
tee_mib: [64]
e2e: false
threads: 1
ppfl:
  rounds_per_stage: 1
  local_epochs: 1
  batch_size: 8
  lr: 0.05
"""

POLIFL_TINY = """
name: tiny
task: mpu
clients: 8
hidden: 4
clients_per_round: 2
batch_size: 16
lr: 0.5
clip_norm: 1.0
groups:
  - name: loose
    policy: "get_data . runFL . check_privacy_budget(max_eps=40) . return"
    noise: 1.0
strategies: ["single:loose"]
rounds: 1
eval_every: 1
threads: 1
"""


def test_ppfl_on_the_stand_in_says_so_and_resumes_only_its_own_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(PPFL_TINY)
    out = str(tmp_path / "run")
    assert main(["ppfl", "run", str(config), "--out", out, "--json", "--no-progress"]) == 0
    printed = capsys.readouterr()
    assert f"{STAND_IN}: synthetic-fashion-mnist" in printed.err and printed.out.lstrip().startswith("{")
    assert main(["ppfl", "run", str(config), "--out", out, "--json", "--resume"]) == 0
    capsys.readouterr()
    assert main(["ppfl", "run", str(config), "--out", out, "--resume", "--seed", "5"]) == 2
    err = capsys.readouterr().err
    assert "holds a finished run of another config (seed)" in err and "--overwrite" in err


def test_polifl_on_synthetic_data_says_so_and_resumes_only_its_own_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(POLIFL_TINY)
    out = str(tmp_path / "run")
    assert main(["polifl", "run", str(config), "--out", out, "--json", "--set", "lr=0.25"]) == 0
    printed = capsys.readouterr()
    assert f"{STAND_IN}: 8 users of the synthetic MPU population" in printed.err
    assert printed.out.lstrip().startswith("{")
    assert main(["polifl", "run", str(config), "--out", out, "--resume", "--set", "lr=0.5"]) == 2
    assert "holds a run with other settings (lr)" in capsys.readouterr().err


#: Per system: a ``--set`` of an unknown key and one of a wrong value, and what the error must name.
WRONG = {
    "run": (
        ("bogus.key=1", "bogus: unknown key; allowed keys here are: name, protocol"),
        ("rounds=many", "rounds: expected an integer, got 'many'"),
    ),
    "demo": (
        ("fdml.bogus=1", "fdml.bogus: unknown key; allowed keys here are: "),
        ("rounds=many", "rounds: expected an integer"),
    ),
    "feduv": (
        ("bogus=1", "bogus: unknown key; allowed keys here are: name, seed"),
        ("train.fraction=all", "train.fraction: expected a number"),
    ),
    "aiot": (
        ("bogus=1", "bogus: unknown key; allowed keys here are: name, size"),
        ("rounds=many", "rounds: expected an integer"),
    ),
    "ppfl": (
        ("ppfl.bogus=1", "ppfl.bogus: unknown key; allowed keys here are: rounds_per_stage"),
        ("clients=many", "clients: expected an integer"),
    ),
    "polifl": (
        ("bogus=1", "bogus: unknown key; allowed keys here are: name, task"),
        ("rounds=many", "rounds: expected an integer"),
    ),
}


@pytest.mark.parametrize("which", [0, 1], ids=["unknown-key", "wrong-value"])
@pytest.mark.parametrize("system", sorted(RUN_COMMANDS))
def test_a_wrong_set_fails_before_training_in_one_line(
    system: str,
    which: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _stub_runner(monkeypatch, system)  # imports the runner, so that the clock below times only the check
    name, words, _, _ = RUN_COMMANDS[system]
    item, message = WRONG[system][which]
    start = time.perf_counter()
    assert main([*words, "--set", item, "--out", str(tmp_path / "run")]) == 2
    assert time.perf_counter() - start < 5
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fedveil {name}: error: ") and message in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("system", "options", "message"),
    [
        (
            "aiot",
            ["--methods", "ours", "--set", "solo_devices=3"],
            "solo_devices=3 has no effect: only the solo",
        ),
        ("ppfl", ["--set", "reach_e2e_rounds=2", "--no-e2e"], "e2e=False has no effect: reach_e2e_rounds"),
        (
            "feduv",
            ["--set", "methods=[softmax]", "--set", "code_lengths=[255]"],
            "code_lengths=[255] has no effect",
        ),
        ("polifl", ["--set", "program=x = 1"], "program='x = 1' has no effect: only the 'program' strategy"),
    ],
)
def test_a_set_the_setting_ignores_is_refused_before_training(
    system: str,
    options: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _stub_runner(monkeypatch, system)
    name, words, _, _ = RUN_COMMANDS[system]
    assert main([*words, *options, "--out", str(tmp_path / "run")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fedveil {name}: error: ") and message in lines[0], lines


#: The setting of each system that finishes in about a minute on a 2-core machine, as its command runs it.
QUICK = {
    "demo": ["demo"],
    "feduv": ["feduv", "run", "--config", str(ROOT / "configs" / "feduv" / "quick.yaml")],
    "aiot": ["aiot", "run", str(ROOT / "configs" / "aiot" / "quick.yaml")],
    "ppfl": ["ppfl", "run", str(ROOT / "configs" / "ppfl" / "quick.yaml")],
    "polifl": ["polifl", "run", str(ROOT / "configs" / "polifl" / "small.yaml"), "--set", "threads=1"],
}


@pytest.mark.parametrize("system", sorted(QUICK))
def test_each_system_has_a_minute_setting_whose_time_says_where_it_was_measured(
    system: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stub_runner(monkeypatch, system)
    with pytest.raises(_Started):  # the setting loads and reaches training
        main([*QUICK[system], "--out", str(tmp_path / "run")])
    where = Path(QUICK[system][-3] if system == "polifl" else QUICK[system][-1])
    text = (ROOT / "src" / "fedveil" / "configs" / "demo.yaml" if system == "demo" else where).read_text()
    measured = re.search(r"(\d+) s wall .* 2-core machine at load average [\d.-]+", text.replace("\n#", ""))
    assert measured and int(measured.group(1)) <= 90, "a measured time, with the machine and its load"


# --- every documented command line parses ----------------------------------------------------------------

FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
SCRIPTS = {"", "bash", "sh", "shell", "zsh"}
SESSIONS = {"console", "shell-session"}  # commands are the lines after a "$ " prompt; the rest is output
#: A line of a command's output, not a command: ``fedveil run: error: ...``, ``fedveil demo: FDML, ...``.
OUTPUT = re.compile(r"^fedveil [\w-]+:")
#: A placeholder: <anything> or a word in capitals (CONFIG, NAME, HOST:PORT, ...), replaced by a sample.
ANGLE = re.compile(r"<[^<>\n]+>")
CAPITALS = re.compile(r"^[A-Z][A-Z0-9_]*(?:[:=][A-Z][A-Z0-9_]*)*$")
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>&1", "&>"}


def documented_commands(root: Path = ROOT) -> list[tuple[str, list[str]]]:
    """``(where, words)`` of every ``fedveil ...`` line in a shell or plain fenced block of README.md and
    docs/**/*.md (in a console block, only after a ``$`` prompt; a command's own output, as
    ``fedveil run: error: ...``, is no command): continuation lines joined, ``$`` prompts, comments and
    what follows a shell operator dropped, placeholders replaced by a sample value (``1``)."""
    found = []
    for path in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        if not path.is_file():
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        fence: str | None = None
        kind = "other"
        pending, start = "", 0
        for number, line in enumerate(lines, 1):
            match = FENCE.match(line)
            if fence is None:
                if match:
                    language = match.group(2).lower()
                    fence = match.group(1)
                    kind = "script" if language in SCRIPTS else "session" if language in SESSIONS else "other"
                continue
            if match and match.group(1).startswith(fence) and not match.group(2):
                fence = None
                continue
            if kind == "other":
                continue
            text = line.strip()
            if not pending:
                prompted = text.startswith("$ ")
                text = text[2:] if prompted else text
                if (
                    not text.startswith("fedveil ")
                    or OUTPUT.match(text)
                    or (kind == "session" and not prompted)
                ):
                    continue
                start = number
            pending = f"{pending} {text}".strip()
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            found.append((f"{path.relative_to(root)}:{start}", _words(pending)))
            pending = ""
    return found


def _words(command: str) -> list[str]:
    """The arguments of one ``fedveil ...`` shell line after ``fedveil`` (module docstring)."""
    lexer = shlex.shlex(ANGLE.sub("1", command), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words: list[str] = []
    for word in lexer:
        if word in SHELL_OPERATORS:
            break
        words.append("1" if CAPITALS.match(word) else word)
    return words[1:]


DOCUMENTED = documented_commands()


def test_the_docs_show_commands_to_check() -> None:
    assert len(DOCUMENTED) >= 5, "README.md and docs/ show fedveil commands in ```bash blocks"


_SAMPLE = """Intro.

```bash
$ fedveil run configs/table1_fdml.yaml   # one experiment
fedveil ppfl run <config> --rounds N \\
    --json | tee out.json
echo fedveil is not the first word
fedveil run: error: rounds: expected an integer, got 'many'
```

```console
$ fedveil demo --set rounds=5
fedveil demo: FDML, 5 rounds of 64 users x 8 samples on the synthetic TouchAuth population
fedveil and its output
```

```python
fedveil = 1
```
"""


def documented_commands_of(text: str) -> list[tuple[str, list[str]]]:
    """:func:`documented_commands` of one README ``text`` (in a temporary tree)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "README.md").write_text(text, encoding="utf-8")
        return documented_commands(Path(tmp))


def test_the_extractor_reads_shell_blocks_only() -> None:
    assert documented_commands_of(_SAMPLE) == [
        ("README.md:4", ["run", "configs/table1_fdml.yaml"]),
        ("README.md:5", ["ppfl", "run", "1", "--rounds", "1", "--json"]),
        ("README.md:12", ["demo", "--set", "rounds=5"]),
    ]


@pytest.mark.parametrize("words", [w for _, w in DOCUMENTED], ids=[where for where, _ in DOCUMENTED])
def test_a_documented_command_parses(words: list[str]) -> None:
    parser = build_parser()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(words)
        except SystemExit as exc:
            assert exc.code == 0, f"fedveil {shlex.join(words)}: {err.getvalue().strip().splitlines()[-1]}"
