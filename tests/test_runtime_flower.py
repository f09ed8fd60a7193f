"""fedveil's protocols on Flower (the ``fedveil[flower]`` extra, installed by scripts/bootstrap).

- On Flower's simulation engine (``fedveil run --runtime flower``, ``fedveil feduv run --runtime flower``,
  each in its own process), FedAvg, FDML through the emulated TEE and FedUV give the in-process model
  bit for bit.
- On a real deployment (a TLS SuperLink, two SuperNodes and ``flwr run`` of ``packaging/flower-app``),
  FedAvg gives the in-process model bit for bit, though Flower runs each message in a fresh ClientApp
  process (the clients' generators travel in the node's Context.state).
- The runtime's failure paths, through a stand-in grid whose nodes run the real ClientApp handler: a
  reply that is not a fedveil record, a Flower error, a failed node, a client that raises, an oversized
  reply, a node that never answers; and the ClientApp's own refusals.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip(
    "flwr", reason="the Flower runtime is the fedveil[flower] extra (installed by scripts/bootstrap)"
)

from flwr.app import ConfigRecord, Context, RecordDict

from fedveil import flower_app
from fedveil.errors import ConfigError
from fedveil.experiments.agent_options import pool_from_command
from fedveil.experiments.config import config_to_dict, effective_overrides, load_config
from fedveil.protocols.messages import Register, RegistrationCall
from fedveil.runtime import flower
from test_experiments_runner import SMALL as RUNNER_SMALL

ROOT = Path(__file__).resolve().parents[1]


def _handle(content: RecordDict, context: Context) -> RecordDict:
    """The fedveil ClientApp's answer to ``content``, its clients built as a device agent builds them."""
    return flower.handle(content, context, pool_from_command)


SMALL = [
    "rounds=3",
    *RUNNER_SMALL,
    "runtime.batched=false",
    "faults.embed.latency.kind=constant",
    "faults.grad.latency.kind=constant",
    "faults.train.latency.kind=constant",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "FLWR_TELEMETRY_ENABLED": "0"}


def _sets(overrides: list[str]) -> list[str]:
    """``--set`` arguments of the ``overrides`` a run of table1_fdml.yaml reads (it refuses the others)."""
    used = effective_overrides(ROOT / "configs/table1_fdml.yaml", overrides)
    return [arg for o in used for arg in ("--set", o)]


def _fedveil(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "fedveil", *args], capture_output=True, text=True, env=ENV, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _weights(run: Path) -> dict[str, np.ndarray]:
    with np.load(run / "checkpoint.npz") as z:
        return {k: z[k] for k in z.files if z[k].dtype.kind == "f"}


@pytest.mark.parametrize(
    ("protocol", "extra"),
    [("fedavg", []), ("fdml", ["enclave.boundary=inprocess"])],
    ids=["fedavg", "fdml-tee"],
)
def test_flowers_simulation_engine_gives_the_in_process_model(
    tmp_path: Path, protocol: str, extra: list[str]
) -> None:
    sets = _sets([f"protocol={protocol}", *SMALL, *extra])
    _fedveil(["run", str(ROOT / "configs/table1_fdml.yaml"), *sets, "--out", str(tmp_path / "sim")])
    on_flower = ["--out", str(tmp_path / "fl"), "--runtime", "flower", "--supernodes", "3"]
    _fedveil(["run", str(ROOT / "configs/table1_fdml.yaml"), *sets, *on_flower])
    sim, fl = _weights(tmp_path / "sim"), _weights(tmp_path / "fl")
    assert sim.keys() == fl.keys() and "weights" in sim
    for key in sim:
        np.testing.assert_array_equal(fl[key], sim[key], err_msg=key)
    results = json.loads((tmp_path / "fl" / "results.json").read_text())
    expected = json.loads((tmp_path / "sim" / "results.json").read_text())
    assert results["runtime"] == "flower" and results["dropouts"] == 0
    assert results["bytes_up"] == expected["bytes_up"] and results["bytes_down"] == expected["bytes_down"]


def test_feduv_on_flowers_simulation_engine_gives_the_in_process_verifier(tmp_path: Path) -> None:
    common = [
        "feduv", "run", "--methods", "feduv", "--code-lengths", "127", "--rounds", "3", "--writers", "6",
        "--unseen-writers", "3", "--train-examples", "8", "--width-divisor", "8", "--no-progress", "--json",
    ]  # fmt: skip
    _fedveil([*common, "--out", str(tmp_path / "sim")])
    _fedveil([*common, "--out", str(tmp_path / "fl"), "--runtime", "flower", "--supernodes", "2"])
    sim = json.loads((tmp_path / "sim" / "results.json").read_text())
    fl = json.loads((tmp_path / "fl" / "results.json").read_text())
    assert fl["auc"] == sim["auc"]
    assert fl["methods"]["feduv-127"]["bytes_up"] == sim["methods"]["feduv-127"]["bytes_up"]
    assert fl["methods"]["feduv-127"]["dropouts"] == 0


# ------------------------------------------------------------------------------------ a real deployment


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_for_port(port: int, seconds: float, procs: list[subprocess.Popen[bytes]], log: Path) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), log.read_text()[-2000:]
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on {port} after {seconds} s: {log.read_text()[-2000:]}")


def test_fedavg_through_a_tls_superlink_and_two_supernodes_gives_the_in_process_model(tmp_path: Path) -> None:
    from fedveil.runtime.network.certs import init_pki

    pki = init_pki(tmp_path / "pki")
    home = tmp_path / "flwr-home"
    home.mkdir()
    port = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "test"\n\n[superlink.test]\naddress = "127.0.0.1:{port}"\n'
        f'root-certificates = "{pki.ca_cert}"\n'
    )
    env = {**ENV, "FLWR_HOME": str(home)}
    link = [
        "flower-superlink", "--host", "127.0.0.1", "--port", str(port),
        "--ssl-ca-certfile", str(pki.ca_cert), "--ssl-certfile", str(pki.server_cert),
        "--ssl-keyfile", str(pki.server_key), "--database", ":flwr-in-memory:",
        "--disable-runtime-dependency-installation",
    ]  # fmt: skip
    node = ["flower-supernode", "--superlink", f"127.0.0.1:{port}", "--root-certificates", str(pki.ca_cert)]
    overrides = ["protocol=fedavg", *SMALL, "rounds=2"]
    argv = shlex.join(
        ["run", str(ROOT / "configs/table1_fdml.yaml"), *_sets(overrides), "--out", str(tmp_path / "fl")]
    )
    run = ["flwr", "run", str(ROOT / "packaging/flower-app"), "test", "--stream"]
    run += ["--run-config", f"argv={json.dumps(argv + ' --no-progress')}"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        link_log = tmp_path / "superlink.log"
        procs.append(_start(link, link_log, env))
        _wait_for_port(port, 60, procs, link_log)
        for i in range(2):
            shard = ["--port", str(_free_port()), "--node-config", f"partition-id={i} num-partitions=2"]
            procs.append(_start([*node, *shard], tmp_path / f"supernode-{i}.log", env))
        done = subprocess.run(run, capture_output=True, text=True, env=env, timeout=400)
        assert (tmp_path / "fl" / "results.json").is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    results = json.loads((tmp_path / "fl" / "results.json").read_text())
    assert results["runtime"] == "flower" and results["rounds"] == 2 and results["dropouts"] == 0
    _fedveil(
        ["run", str(ROOT / "configs/table1_fdml.yaml"), *_sets(overrides), "--out", str(tmp_path / "sim")]
    )
    np.testing.assert_array_equal(_weights(tmp_path / "fl")["weights"], _weights(tmp_path / "sim")["weights"])


# ------------------------------------------------------------------------------------ failure paths


@dataclass
class _Reply:
    """A Flower reply as the runtime reads it."""

    content: RecordDict | None
    reply_to: str = ""
    error: Any = None

    @property
    def metadata(self) -> Any:
        return type("Metadata", (), {"reply_to_message_id": self.reply_to})()

    def has_error(self) -> bool:
        return self.error is not None

    def has_content(self) -> bool:
        return self.content is not None


@dataclass
class _Grid:
    """A stand-in Flower grid: each node is the real ClientApp handler with its own Context; ``tamper``
    rewrites a node's reply content, or replaces it (a :class:`_Reply`), or withholds it (None)."""

    parts: int
    tamper: Callable[[int, RecordDict], RecordDict | _Reply | None] = lambda node, content: content
    contexts: dict[int, Context] = field(default_factory=dict)
    replies: dict[str, _Reply] = field(default_factory=dict)
    pushed: int = 0

    def __post_init__(self) -> None:
        for i in range(self.parts):
            self.contexts[100 + i] = Context(
                run_id=7,
                node_id=100 + i,
                node_config={"partition-id": i, "num-partitions": self.parts},
                state=RecordDict(),
                run_config={},
            )

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Any) -> list[str]:
        ids = []
        for msg in messages:
            self.pushed += 1
            mid = f"m{self.pushed}"
            node = msg.metadata.dst_node_id
            out = self.tamper(node, _handle(msg.content, self.contexts[node]))
            if out is not None:
                reply = out if isinstance(out, _Reply) else _Reply(out)
                reply.reply_to = mid
                self.replies[mid] = reply
            ids.append(mid)
        return ids

    def pull_messages(self, ids: Any) -> list[_Reply]:
        return [self.replies.pop(m) for m in list(ids) if m in self.replies]


@pytest.fixture(autouse=True)
def task_identity() -> Any:
    """Flower stamps each message with the run it belongs to, which its runtimes set; here, a stand-in."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 7, 1, 1
    yield
    TaskIdentity.run_id = TaskIdentity.task_id = TaskIdentity.node_id = None


@pytest.fixture(scope="module")
def agent_command(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    import yaml

    path = tmp_path_factory.mktemp("flower") / "config.yaml"
    cfg = load_config(None, ["protocol=fedavg", *SMALL])
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return ["agent", "--config", str(path)]


def _connected(grid: _Grid, command: list[str], **kw: Any) -> tuple[flower.FlowerRuntime, list[str]]:
    from fedveil.experiments.fdml.runner import build_population

    ids = list(build_population(load_config(command[2])).train_user_ids())
    runtime = flower.FlowerRuntime(grid, **kw)
    hosted = asyncio.run(runtime.connect(command, ids, wait=2.0))
    assert hosted == ids, "hosted in the population's order"
    return runtime, ids


def _request(runtime: flower.FlowerRuntime, ids: list[str], msg: Any, **kw: Any) -> dict[str, Any]:
    args = {"phase": "reg", "min_replies": len(ids), "timeout": 2.0, "expected": Register, **kw}
    return asyncio.run(runtime.request({c: msg for c in ids}, **args))


def _is_hello(content: RecordDict) -> bool:
    return "errors" not in content.config_records[flower.RECORD]


def test_replies_that_are_not_fedveil_records_are_dropouts_with_the_reason(agent_command: list[str]) -> None:
    def tamper(node: int, content: RecordDict) -> Any:
        if _is_hello(content):
            return content
        if node == 100:
            return RecordDict({"other": ConfigRecord({"x": 1})})
        if node == 101:
            return _Reply(None, error=type("Error", (), {"code": 3, "reason": "node went away"})())
        return content

    runtime, ids = _connected(_Grid(3, tamper), agent_command)
    got = _request(runtime, ids, RegistrationCall("fedavg"))
    reasons = {d.client: d.reason for d in runtime.stats().dropouts}
    node = runtime._node_of
    assert set(got) == {c for c in ids if node[c] == 102} and got
    assert all(isinstance(m, Register) for m in got.values())
    assert all("not a fedveil record" in reasons[c] for c in ids if node[c] == 100)
    assert all("node went away" in reasons[c] for c in ids if node[c] == 101)


def test_a_client_that_raises_an_oversized_reply_and_a_silent_node_are_dropouts(
    agent_command: list[str],
) -> None:
    def tamper(node: int, content: RecordDict) -> Any:
        if _is_hello(content):
            return content
        if node == 100:
            return None  # never answers
        if node == 101:
            rec = content.config_records[flower.RECORD]
            rec["payloads"] = [rec["payloads"][0] + b"\0" * 2000, *rec["payloads"][1:]]
        return content

    runtime, ids = _connected(_Grid(3, tamper), agent_command, max_message_bytes=1000)
    node = runtime._node_of
    got = _request(runtime, ids, Register("fedavg", {}), timeout=0.3)  # a message devices cannot handle
    reasons = {d.client: d.reason for d in runtime.stats().dropouts}
    assert not got
    assert all(reasons[c].startswith("late: no reply within") for c in ids if node[c] == 100)
    assert all(reasons[c].startswith("client raised ValidationError") for c in ids if node[c] != 100)

    seen = len(runtime.stats().dropouts)
    got = _request(runtime, ids, RegistrationCall("fedavg"), timeout=0.3)
    reasons = {d.client: d.reason for d in runtime.stats().dropouts[seen:]}
    first_of_101 = next(c for c in ids if node[c] == 101)
    assert "exceeds the limit of 1000 bytes" in reasons[first_of_101]
    assert set(got) == {c for c in ids if node[c] == 102 or (node[c] == 101 and c != first_of_101)}


def test_fold_takes_each_valid_reply_it_keeps_and_no_other(agent_command: list[str]) -> None:
    """A fold that strips replies: the request returns what it kept; an oversized reply never reaches it,
    and with ``min_replies`` it sees exactly that many (the rest are late)."""

    def tamper(node: int, content: RecordDict) -> Any:
        if not _is_hello(content) and node == 101:
            rec = content.config_records[flower.RECORD]
            rec["payloads"] = [rec["payloads"][0] + b"\0" * 2000, *rec["payloads"][1:]]
        return content

    runtime, ids = _connected(_Grid(2, tamper), agent_command, max_message_bytes=1000)
    first_of_101 = next(c for c in ids if runtime._node_of[c] == 101)
    folded: list[str] = []

    def strip(cid: str, msg: Register) -> tuple[str, str]:
        folded.append(cid)
        return ("folded", cid)

    got = _request(runtime, ids, RegistrationCall("fedavg"), fold=strip)
    assert sorted(folded) == sorted(c for c in ids if c != first_of_101)
    assert got == {c: ("folded", c) for c in folded} and list(got) == [c for c in ids if c in got]

    folded.clear()
    seen = len(runtime.stats().dropouts)
    got = _request(runtime, ids, RegistrationCall("fedavg"), fold=strip, min_replies=3)
    assert len(folded) == 3 and first_of_101 not in folded and set(got) == set(folded)
    late = [d.client for d in runtime.stats().dropouts[seen:] if d.reason.startswith("late")]
    assert not set(late) & set(folded) and set(late) | set(folded) | {first_of_101} == set(ids)


def test_min_replies_keeps_the_earliest_in_request_order(agent_command: list[str]) -> None:
    runtime, ids = _connected(_Grid(2), agent_command)
    got = _request(runtime, ids, RegistrationCall("fedavg"), min_replies=3)
    assert list(got) == [c for c in ids if c in got] and len(got) == 3
    assert all(d.reason == "late: round moved on without this reply" for d in runtime.stats().dropouts)
    stats = runtime.stats()
    # it returned once the first node's replies were enough: the other node's were never read
    assert stats.messages_down == len(ids) and 3 <= stats.messages_up < len(ids) and stats.bytes_up > 0
    assert len(stats.dropouts) == len(ids) - 3


def test_the_client_app_refuses_what_it_cannot_serve(agent_command: list[str]) -> None:
    grid = _Grid(2)
    ctx = grid.contexts[100]

    def ask(record: dict[str, Any], context: Context = ctx) -> ConfigRecord:
        return _handle(RecordDict({flower.RECORD: ConfigRecord(record)}), context)[flower.RECORD]

    assert (
        "has not been sent a hello"
        in ask({"phase": "train", "clients": [], "blobs": [], "index": []})["error"]
    )
    assert "not a device-agent command" in ask({"phase": "hello", "command": ["serve", "--demo"]})["error"]
    assert "bad device-agent command" in ask({"phase": "hello", "command": ["agent", "--nope"]})["error"]
    bare = Context(run_id=7, node_id=5, node_config={}, state=RecordDict(), run_config={})
    assert "partition-id" in ask({"phase": "hello", "command": agent_command}, bare)["error"]
    hosted = ask({"phase": "hello", "command": agent_command})["clients"]
    other = grid.contexts[101]
    theirs = ask({"phase": "hello", "command": agent_command}, other)["clients"]
    assert set(hosted).isdisjoint(theirs)
    reply = ask({"phase": "train", "clients": [theirs[0]], "blobs": [b""], "index": [0]})
    assert "not hosted by this node" in reply["error"]
    reply = ask({"phase": "train", "clients": [hosted[0]], "blobs": [b""], "index": [3]})
    assert "index does not match" in reply["error"]
    assert _handle(RecordDict({"x": ConfigRecord({})}), ctx)[flower.RECORD]["error"].endswith(
        "the message has no fedveil record"
    )
    ask({"phase": "bye"})
    assert flower.RECORD not in ctx.state.config_records


def test_nodes_that_cannot_host_clients_are_named_when_the_wait_ends(agent_command: list[str]) -> None:
    grid = _Grid(2)
    grid.contexts[101].node_config = {}  # a SuperNode started without its share
    runtime = flower.FlowerRuntime(grid)
    ids = [f"u{i:03d}" for i in range(12)]
    why = r"only 0 of 12 clients .* SuperNode 101: ConfigError: .*partition-id"
    with pytest.raises(ConfigError, match=why):
        asyncio.run(runtime.connect(agent_command, ids, wait=0.3))


def test_a_fresh_process_refuses_devices_whose_state_it_cannot_rebuild(tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "fdml.yaml"
    path.write_text(
        yaml.safe_dump(
            config_to_dict(load_config(None, ["protocol=fdml", *SMALL, "enclave.boundary=none"])),
            sort_keys=False,
        )
    )
    grid = _Grid(1)
    ctx = grid.contexts[100]
    hello = ConfigRecord({"phase": "hello", "command": ["agent", "--config", str(path)]})
    assert "clients" in _handle(RecordDict({flower.RECORD: hello}), ctx)[flower.RECORD]
    flower._POOLS.clear()  # what a new ClientApp process sees
    phase = ConfigRecord({"phase": "embed", "clients": [], "blobs": [], "index": []})
    error = _handle(RecordDict({flower.RECORD: phase}), ctx)[flower.RECORD]["error"]
    assert "did not serve the node's earlier messages" in error and "FDMLClients" in error


def test_bad_runtime_options_and_server_app_config_are_refused(tmp_path: Path) -> None:
    from fedveil.cli import main

    cfg = str(ROOT / "configs/table1_fdml.yaml")
    assert main(["run", cfg, "--runtime", "flower", "--supernodes", "0", "--out", str(tmp_path / "x")]) == 2
    with pytest.raises(ConfigError, match="supernodes"):
        flower.run_on_flower(lambda plan: None, pool_from_command, supernodes=0)
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(ConfigError, match="needs argv"):
        flower_app._serve_app(None, ctx)  # type: ignore[arg-type]
    ctx = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={"argv": "serve --demo"}
    )
    with pytest.raises(ConfigError, match="must be a `fedveil run`"):
        flower_app._serve_app(None, ctx)  # type: ignore[arg-type]
    argv = {"argv": "run --no-such-option"}
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=argv)
    with pytest.raises(ConfigError, match="exited with status 2"):
        flower_app._serve_app(object(), ctx)  # type: ignore[arg-type]
