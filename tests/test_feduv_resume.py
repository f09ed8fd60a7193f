"""FedUV over the network resumes a method from its last checkpointed round: a server SIGKILLed between
two rounds and started again with ``--resume`` trains only the rounds after the checkpoint, with the
agent kept (its users keep their codewords when set-up runs again), and ends with the simulation's
numbers. Real processes on loopback, each bounded in time and killed on exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from fedveil.cli import main
from fedveil.data.mnist_uv import MnistUvConfig, generate_mnist_uv
from fedveil.experiments.checkpoint import CRASH_ENV, load_checkpoint
from fedveil.experiments.feduv.runner import agent_clients
from fedveil.privacy.codewords import Codeword
from fedveil.protocols.feduv import FedUVMethod, UvClients, UvModel
from fedveil.protocols.feduv_messages import BaseVector, CodewordReady
from fedveil.runtime.network import certs
from processes import wait_for_file
from test_protocols_feduv import TinyNet
from test_runtime_network_processes import _free_port

RUN = [
    "feduv", "run", "--methods", "feduv", "--code-lengths", "127", "--rounds", "4", "--writers", "4",
    "--unseen-writers", "2", "--train-examples", "4", "--width-divisor", "32", "--no-progress", "--json",
]  # fmt: skip
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def test_a_server_killed_between_rounds_resumes_after_its_checkpoint_with_the_agent_kept(
    tmp_path: Path,
) -> None:
    pki = tmp_path / "pki"
    certs.init_pki(pki)
    run = tmp_path / "run"
    port = _free_port()
    server_cmd = [
        sys.executable, "-m", "fedveil", *RUN, "--out", str(run), "--runtime", "network", "--agents", "0",
        "--pki", str(pki), "--listen", f"127.0.0.1:{port}", "--wait", "30",
    ]  # fmt: skip
    procs: list[subprocess.Popen] = []

    def start(cmd: list[str], log: str, **env: str) -> subprocess.Popen:
        with open(tmp_path / log, "wb") as fh:
            procs.append(subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**ENV, **env}))
        return procs[-1]

    try:
        # killed after round 2's checkpoint, before round 3 is sent: the agent has drawn nothing for it
        server = start(server_cmd, "server-1.log", **{CRASH_ENV: "round:3"})
        wait_for_file(run / "config.json", server, 30)
        creds = tmp_path / "creds"
        for name in agent_clients(run / "config.json", "feduv", 127).client_ids():
            certs.issue_device(pki, name).write(creds / name)
        agent = start(
            [
                sys.executable, "-m", "fedveil", "feduv", "agent", "--server", f"127.0.0.1:{port}",
                "--config", str(run / "config.json"), "--method", "feduv", "--code-length", "127",
                "--credentials", str(creds), "--give-up-after", "30",
            ],
            "agent.log",
        )  # fmt: skip
        assert server.wait(60) == -signal.SIGKILL, "the server kills itself before round 3"
        ckpt = load_checkpoint(run / "methods", name="feduv-127.checkpoint.npz")
        assert ckpt is not None and ckpt.round == 2
        assert ckpt.meta["pool"] is None, "the users' generators live in the agent"
        # resumed, the server would kill itself if it trained round 1 or 2 again
        resumed = start([*server_cmd, "--resume"], "server-2.log", **{CRASH_ENV: "round:2"})
        assert resumed.wait(60) == 0, (tmp_path / "server-2.log").read_text()[-2000:]
        assert agent.wait(30) == 0, "the agent exits when the server says training is over"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rounds = [x for x in lines if "eval" not in x]
    assert [x["round"] for x in rounds] == [1, 2, 3, 4] and all(x["applied"] for x in rounds)
    assert not list((run / "methods").glob("*.checkpoint.npz")), "the finished method's checkpoint is gone"
    assert main([*RUN, "--out", str(tmp_path / "sim")]) == 0
    net = json.loads((run / "results.json").read_text())
    sim = json.loads((tmp_path / "sim" / "results.json").read_text())
    assert net["auc"] == sim["auc"], "the same model as the uninterrupted simulation"


def test_a_user_keeps_its_codeword_when_set_up_runs_again_with_the_same_base_vector() -> None:
    data = generate_mnist_uv(
        MnistUvConfig(
            seed=3, writers=2, train=2, val=2, test=1, unseen_writers=1, sub_images_per_digit=(2, 2, 2)
        )
    )
    pool = UvClients(FedUVMethod(), UvModel(TinyNet(127)), data, seed=0)
    user = pool.client_ids()[0]
    base = np.array([1, 0, 1, 1], dtype=np.uint8)

    def codeword(bits: np.ndarray) -> Codeword:
        assert isinstance(pool.handle_batch({user: BaseVector(127, 64, bits)})[user], CodewordReady)
        held = pool._users[user].codeword
        assert held is not None
        return held

    first = codeword(base)
    assert codeword(base) is first, "a restarted server's set-up leaves the training target as it was"
    other = codeword(1 - base)
    assert np.array_equal(other.base_bits, 1 - base), "another base vector is another codeword"
