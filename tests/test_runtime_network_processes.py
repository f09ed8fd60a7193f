"""Real processes on loopback: `fedveil server` and `fedveil agent`, an agent killed with SIGKILL mid-run,
then the server killed with SIGKILL and resumed (every process is bounded in time and killed on exit)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedveil.experiments.checkpoint import SpendLog
from fedveil.experiments.config import load_config
from fedveil.experiments.fdml.runner import build_population
from fedveil.runtime.network import certs
from fedveil.runtime.quoting import PLATFORM_PUB, platform_for

CONFIG = """\
name: net-faults
protocol: fdml
seed: 3
rounds: 40
data:
  train_users_per_model: [6, 6]
  test_users_per_model: [11, 11]
fdml:
  num_required: 3
  samples_per_client: 4
  lr: 3.0e-3
  t_embed: 5
  t_grad: 5
  max_attempts: 5
  min_gradients: 2
enclave:
  boundary: inprocess
dp:
  enabled: true
  mode: strict
  round_epsilon: 8
  bound_T: 1.0e-3
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rounds(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if "round" in obj and "eval" not in obj:
            out.append(obj)
    return out


def _wait_for(pred, timeout: float, what: str, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        for p in procs:
            if p.poll() is not None and p.returncode != 0:
                pytest.fail(f"{what}: process {p.args[3]} exited with {p.returncode}")
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


def test_killed_agent_is_a_dropout_and_a_killed_server_resumes(tmp_path: Path) -> None:
    cfg_path = tmp_path / "net.yaml"
    cfg_path.write_text(CONFIG)
    ids = build_population(load_config(cfg_path)).train_user_ids()
    pki = tmp_path / "pki"
    certs.init_pki(pki)
    platform_for(pki)
    for name in ids:
        certs.issue_device(pki, name).write(tmp_path / "creds" / name)
    port = _free_port()
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    fedveil = [sys.executable, "-m", "fedveil"]
    server_cmd = [
        *fedveil, "server", str(cfg_path), "--pki", str(pki), "--listen", f"127.0.0.1:{port}",
        "--out", str(run), "--wait", "60",
    ]  # fmt: skip
    procs: list[subprocess.Popen] = []

    def start(cmd: list[str], log: str) -> subprocess.Popen:
        with open(tmp_path / log, "wb") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        procs.append(proc)
        return proc

    try:
        server = start(server_cmd, "server-1.log")
        agents = [
            start(
                [
                    *fedveil, "agent", "--server", f"127.0.0.1:{port}", "--config", str(cfg_path),
                    "--shard", f"{i}/3", "--credentials", str(tmp_path / "creds"),
                    "--platform-key", str(pki / PLATFORM_PUB), "--give-up-after", "60",
                ],
                f"agent-{i}.log",
            )
            for i in range(3)
        ]  # fmt: skip
        _wait_for(lambda: len(_rounds(run)) >= 3, 120, "three rounds", procs)
        agents[2].send_signal(signal.SIGKILL)  # a third of the devices vanish mid-run
        agents[2].wait(10)
        procs.remove(agents[2])
        seen = len(_rounds(run))
        _wait_for(lambda: len(_rounds(run)) >= seen + 4, 120, "rounds after the agent died", procs)
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        procs.remove(server)
        killed_at = len(_rounds(run))
        assert killed_at < 40, "the run must still be going when the server is killed"
        resumed = start([*server_cmd, "--resume", "--min-devices", "8"], "server-2.log")
        assert resumed.wait(180) == 0, (tmp_path / "server-2.log").read_text()[-3000:]
        for a in agents[:2]:
            assert a.wait(60) == 0, "agents exit cleanly when the server says training is over"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)

    rounds = _rounds(run)
    assert [r["round"] for r in rounds] == list(range(1, 41)), "no round lost or repeated"
    # at most the round in flight when the agent died loses its devices; later rounds select around them
    after_kill = [r for r in rounds if r["round"] > seen + 1 and not r.get("interrupted")]
    assert after_kill and all(r["dropouts"] == 0 for r in after_kill), "a dead agent's devices are left out"
    assert sum(r["applied"] for r in rounds) >= 30
    results = json.loads((run / "results.json").read_text())
    paid = SpendLog(run).rounds()
    assert len(paid) == len(set(paid)), "no round is paid twice"
    assert results["privacy"]["round"] == len(paid) == results["privacy"]["rounds_paid"]
    assert results["resumed_after_round"] >= killed_at - 1
    assert results["runtime"] == "network"
    log = (tmp_path / "server-2.log").read_text()
    assert "BEGIN" not in log and "PRIVATE KEY" not in log, "no key material in the logs"


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(proc.name))
    return found


def test_fedveil_run_over_the_network_stops_cleanly_and_resumes(tmp_path: Path) -> None:
    """`fedveil run --runtime network --agents N`: a throw-away PKI, N agent processes, the usual files;
    SIGTERM stops the server and every agent, and --resume finishes the run."""
    cfg_path = tmp_path / "fl.yaml"
    cfg_path.write_text(
        "name: fl-net\nprotocol: fedavg\nrounds: 400\n"
        "data:\n  train_users_per_model: [6, 6]\n  test_users_per_model: [11, 11]\n"
        "fedavg:\n  clients_per_round: 4\n  samples_per_client: 4\n"
    )
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fedveil", "run", str(cfg_path), "--runtime", "network", "--agents", "2"]
    cmd += ["--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        _wait_for(lambda: len(_rounds(out)) >= 3, 120, "three rounds", [proc])
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 2
    assert b"interrupted after round" in err and b"--resume" in err, "it says how to continue"
    deadline = time.monotonic() + 30
    while _processes_mentioning(str(out)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _processes_mentioning(str(out)), "every local agent process is gone"
    stopped_at = len(_rounds(out))
    assert stopped_at < 400
    done = subprocess.run([*cmd, "--resume"], capture_output=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert results["runtime"] == "network" and results["rounds"] == 400
    assert [r["round"] for r in _rounds(out)] == list(range(1, 401))
    for name in ("metrics.jsonl", "devices.jsonl", "round_timing.png", "checkpoint.npz", "agent-1.log"):
        assert (out / name).is_file(), name
    devices = [json.loads(x) for x in (out / "devices.jsonl").read_text().splitlines()]
    assert [d["round"] for d in devices] == list(range(1, 401))
    assert all(len(d["devices"]) == 4 and d["devices"][0]["tte"] is not None for d in devices)
    assert all({"ttd_p50", "tte_p50", "ttr_p50", "ttp_p50"} <= set(r) for r in _rounds(out))
    assert (out / "pki" / "ca.key").stat().st_mode & 0o077 == 0


def test_feduv_over_the_network_matches_the_simulation_end_to_end(tmp_path: Path) -> None:
    from fedveil.cli import main

    common = [
        "feduv", "run", "--methods", "feduv", "--code-lengths", "127", "--rounds", "3", "--writers", "6",
        "--unseen-writers", "3", "--train-examples", "8", "--width-divisor", "8", "--no-progress", "--json",
    ]  # fmt: skip
    assert main([*common, "--out", str(tmp_path / "sim")]) == 0
    assert main([*common, "--out", str(tmp_path / "net"), "--runtime", "network", "--agents", "2"]) == 0
    sim = json.loads((tmp_path / "sim" / "results.json").read_text())
    net = json.loads((tmp_path / "net" / "results.json").read_text())
    assert net["auc"] == sim["auc"]
    assert net["methods"]["feduv-127"]["bytes_up"] == sim["methods"]["feduv-127"]["bytes_up"]
