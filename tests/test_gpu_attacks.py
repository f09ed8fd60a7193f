"""The attack suite on a CUDA device gives the CPU's results within stated tolerances (``pytest -m gpu``;
every test here is skipped, saying so, where torch sees no CUDA device): gradient inversion (DLG on the
batch gradient, behind AIoT's projector, iDLG on the FedAvg wire view), membership inference (FedAvg's
clients, LiRA's shadows, Yeom's losses, the Nasr-style features), Melis et al.'s property inference,
FDML's attacks (fdml-membership's networks, fdml-lira's shadows, fdml-inversion's matching) and FedUV's
codeword attack. Each test checks that the work really ran on CUDA (spies on the models and tensors the
runners hand on) and that the report records the device.

Not bit for bit: cuBLAS and cuDNN pick other kernels than the CPU's, so each float32 result differs in its
last bits (tests/test_gpu.py). Where both paths pose the same problem the tolerances are tight: the
observed gradient within ``RELATIVE`` (``1e-4`` of its largest entry; ``WIRE_RELATIVE``, ``1e-3``, for an
update read off the wire, a difference of two nearly equal weight vectors), the objective at an attack's
seeded start within ``RELATIVE`` (float32) or ``1e-6`` (FDML's float64 matching), a shadow's first
triplet loss within ``RELATIVE``. Scores of models trained on each path can swap the ranks of neighbouring
candidates, so an AUC is held within ``SCORE_TOLERANCE`` (0.05: a few swapped pairs among 48 + 48
candidates) and, for the tiny runs with 8 or 16 scored candidates, within two swapped pairs; FDML's
server steps with Adam, whose first step keeps only each coordinate's sign, so its target networks (not
its shadows' first steps) are compared by their attack's AUC alone. The CPU-side promises (``cpu`` and
``auto`` the same bits, a misspelt device refused as parsed, the device handed to every runner) are tested
in tests/test_cli_attack.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import fedveil.attacks.lira as lira_module
import fedveil.attacks.mia_metric as mia_metric
import fedveil.attacks.pia_melis as pia_melis
from fedveil.attacks.scores import model_logits
from fedveil.experiments.attacks import fdml_lira, fdml_views, feduv_codeword
from fedveil.experiments.attacks import runs as attack_runs
from fedveil.experiments.attacks.fdml_inversion import (
    device_labels,
    fdml_inversion_table,
    fdml_round_difference,
    invert_model_difference,
)
from fedveil.models.device import module_device
from fedveil.models.touchauth import TouchAuthNet

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none here"),
]

DATA = "synthetic-fashion-mnist:1500"
"""1,500 training and 250 test images of the labelled stand-in: enough for every tiny run here."""
RELATIVE = 1e-4
WIRE_RELATIVE = 1e-3
SCORE_TOLERANCE = 0.05


def _close(cpu: torch.Tensor, cuda: torch.Tensor, relative: float = RELATIVE) -> None:
    """``max |cpu - cuda| <= relative * max |cpu|``, ``cuda`` brought to the host."""
    a, b = cpu.detach().double().cpu(), cuda.detach().double().cpu()
    scale = float(a.abs().max())
    assert float((a - b).abs().max()) <= relative * scale, (float((a - b).abs().max()), scale)


def _swaps(candidates_per_side: int, pairs: int) -> float:
    """The AUC change of ``pairs`` swapped (member, non-member) pairs among that many of each."""
    return pairs / candidates_per_side**2 + 1e-12


def test_inversion_on_cuda_observes_and_starts_the_cpus_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client model, its batch and the observed gradient are on CUDA (behind the projector the
    attacker's guess too; on the wire view the FedAvg client trains there), the matching runs there, the
    reconstructions come back to the host, and both paths pose the same problem."""
    seen: dict[str, list[tuple[Any, torch.device, Any]]] = {"dlg": [], "idlg": []}
    for name in seen:
        real = attack_runs.INVERSIONS[name]

        def spy(view: Any, *, real: Any = real, name: str = name, **k: Any) -> Any:
            result = real(view, **k)
            seen[name].append((view, k["device"], result))
            return result

        monkeypatch.setitem(attack_runs.INVERSIONS, name, spy)
    reports = {}
    for device in ("cpu", "cuda"):
        reports[device] = attack_runs.run_inversion("dlg", data=DATA, targets=1, iterations=2, device=device)
        attack_runs.run_inversion("idlg", data=DATA, targets=1, iterations=2, view="fedavg", device=device)
        attack_runs.run_inversion(
            "dlg", data=DATA, targets=1, iterations=2, defence="projector", device=device
        )
    assert reports["cpu"]["device"] == "cpu" and reports["cuda"]["device"] == "cuda"
    pairs = [
        (seen["dlg"][0], seen["dlg"][2], RELATIVE),  # the batch gradient
        (seen["dlg"][1], seen["dlg"][3], RELATIVE),  # behind the projector
        (seen["idlg"][0], seen["idlg"][1], WIRE_RELATIVE),  # one FedAvg step read off the wire
    ]
    for (view_cpu, _, cpu), (view_cuda, device, cuda), relative in pairs:
        assert device.type == "cuda" and module_device(view_cuda.model).type == "cuda"
        assert view_cpu.update.keys() == view_cuda.update.keys()
        for name, value in view_cpu.update.items():
            _close(value, view_cuda.update[name], relative)
        assert cuda.images.device.type == "cpu" and cuda.labels.device.type == "cpu"
        assert cuda.losses[0] == pytest.approx(cpu.losses[0], rel=10 * relative)


def test_membership_on_cuda_trains_the_target_and_shadows_and_scores_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FedAvg's clients, LiRA's shadows (their batches too), Yeom's losses, the Nasr-style features and
    LiRA's statistics all run on CUDA; the AUCs are the CPU's within ``SCORE_TOLERANCE`` (Nasr's, whose
    classifier trains 300 steps on the features, within twice that)."""

    def run(device: str) -> dict[str, Any]:
        target = attack_runs.membership_run(
            data=DATA, clients=3, samples_per_client=16, rounds=2, local_epochs=1, device=device
        )
        return attack_runs.run_membership(run=target, shadows=4, shadow_epochs=2, progress=False)

    cpu = run("cpu")
    where: dict[str, list[str]] = {}

    def spy(module: Any, name: str, pick: Any) -> None:
        real = getattr(module, name)

        def wrapped(*a: Any, **k: Any) -> Any:
            where.setdefault(name, []).append(pick(*a, **k))
            return real(*a, **k)

        monkeypatch.setattr(module, name, wrapped)

    spy(attack_runs, "local_train", lambda loss, p, batches, *a, **k: f"{p.device} {batches[0][0].device}")
    spy(attack_runs, "per_example_loss", lambda model, x, y: str(module_device(model)))
    spy(attack_runs, "nasr_attack", lambda *a, **k: str(k["device"]))
    spy(lira_module, "model_logits", lambda model, x, **k: str(module_device(model)))
    cuda = run("cuda")
    assert cpu["run"]["device"] == "cpu" and cuda["run"]["device"] == "cuda"
    assert where["local_train"] == ["cuda:0 cuda:0"] * 8  # 4 shadows for the target, 4 for the control
    assert where["per_example_loss"] == ["cuda:0"] * 2 and where["nasr_attack"] == ["cuda"] * 2
    assert where["model_logits"] and set(where["model_logits"]) == {"cuda:0"}
    assert cpu["attacks"].keys() == cuda["attacks"].keys()
    for key, row in cpu["attacks"].items():
        bound = 2 * SCORE_TOLERANCE if key.startswith("nasr") else SCORE_TOLERANCE
        assert abs(row["auc"] - cuda["attacks"][key]["auc"]) <= bound, key


def test_property_inference_on_cuda_simulates_the_cpus_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    """FedAvg's clients and the attack's simulated updates (on the auxiliary data moved there) run on
    CUDA; the updates simulated at the first broadcast (the same initial model on both paths) are the
    CPU's within ``RELATIVE``, and the AUC over 8 views is within two swapped pairs."""
    simulated: dict[str, list[tuple[str, torch.Tensor]]] = {}
    real = pia_melis.simulate_updates

    def spy(model: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor, **k: Any) -> torch.Tensor:
        out = real(model, xb, yb, **k)
        simulated.setdefault(str(xb.device.type), []).append((f"{module_device(model)} {xb.device}", out))
        return out

    monkeypatch.setattr(pia_melis, "simulate_updates", spy)
    reports = {
        device: attack_runs.run_property(
            data=DATA, model="lenet-sigmoid", clients=4, samples_per_client=10, rounds=2, device=device
        )
        for device in ("cpu", "cuda")
    }
    assert reports["cuda"]["run"]["device"] == "cuda"
    assert {where for where, _ in simulated["cuda"]} == {"cuda:0 cuda:0"}
    assert simulated["cuda"][0][1].device.type == "cpu"  # the features come back to the host
    _close(simulated["cpu"][0][1], simulated["cuda"][0][1])
    for key, row in reports["cpu"]["attacks"].items():
        assert abs(row["auc"] - reports["cuda"]["attacks"][key]["auc"]) <= _swaps(4, 2), key


def test_fdml_attacks_on_cuda_train_embed_and_match_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """fdml-lira's shadows train on CUDA from the CPU's first loss (within ``RELATIVE``) and every network
    its attacks embed with is there; fdml-membership's networks are there; each AUC over 4 + 4 (8 + 8)
    users is within two swapped pairs of the CPU's."""
    first_losses: dict[str, float] = {}
    networks: list[str] = []
    real_steps = fdml_lira.train_triplet_steps

    def steps(net: torch.nn.Module, *a: Any, **k: Any) -> tuple[list[float], list[float]]:
        losses, active = real_steps(net, *a, **k)
        first_losses.setdefault(str(module_device(net).type), losses[0])
        networks.append(str(module_device(net)))
        return losses, active

    def logits(model: torch.nn.Module, x: torch.Tensor, **k: Any) -> torch.Tensor:
        networks.append(str(module_device(model)))
        return model_logits(model, x, **k)

    monkeypatch.setattr(fdml_lira, "train_triplet_steps", steps)
    monkeypatch.setattr(mia_metric, "model_logits", logits)
    lira = {
        device: fdml_lira.fdml_lira_table(users=8, shadows=4, rounds=2, devices=4, device=device)
        for device in ("cpu", "cuda")
    }
    cuda_networks = networks[len(networks) // 2 :]
    assert cuda_networks and set(cuda_networks) == {"cuda:0"}
    assert first_losses["cuda"] == pytest.approx(first_losses["cpu"], rel=RELATIVE)
    assert lira["cuda"]["run"]["device"] == "cuda"
    for key, row in lira["cpu"]["attacks"].items():
        assert abs(row["auc"] - lira["cuda"]["attacks"][key]["auc"]) <= _swaps(4, 2), key
    networks.clear()
    membership = {
        device: fdml_views.fdml_membership_table(
            users=8, rounds=2, num_required=16, candidate_samples=10, device=device
        )
        for device in ("cpu", "cuda")
    }
    assert set(networks[len(networks) // 2 :]) == {"cuda:0"}
    assert membership["cuda"]["run"]["device"] == "cuda"
    for key, row in membership["cpu"]["attacks"].items():
        assert abs(row["auc"] - membership["cuda"]["attacks"][key]["auc"]) <= _swaps(8, 2), key


def test_fdml_inversion_matches_on_cuda_from_the_cpus_start() -> None:
    """The same model difference (played on the host) matched on CUDA in float64: the objective at the
    seeded start within ``1e-6``; the reconstruction comes back to the host; the table records the
    device."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = TouchAuthNet()
    rng = np.random.default_rng(0)
    windows = [rng.uniform(0.0, 1.0, (2, 30, 10)).astype(np.float32) for _ in range(2)]
    view = fdml_round_difference(net, windows)
    labels = device_labels([2, 2])
    results = {
        device: invert_model_difference(view, labels, iterations=3, seed=0, device=device)
        for device in ("cpu", "cuda")
    }
    assert results["cuda"].images.device.type == "cpu"
    assert results["cuda"].losses[0] == pytest.approx(results["cpu"].losses[0], rel=1e-6)
    table = fdml_inversion_table(cohorts=(2,), iterations=3, device="cuda")
    assert table["run"]["device"] == "cuda"


def test_feduv_codeword_on_cuda_reads_the_cpus_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """FedUV's users train on CUDA; the codeword read off their uploads is the CPU's within 2% of its
    bits (an estimate coordinate next to zero may change sign)."""
    pools: list[Any] = []
    real = feduv_codeword.UvClients

    def users(*a: Any, **k: Any) -> Any:
        pools.append(real(*a, **k))
        return pools[-1]

    monkeypatch.setattr(feduv_codeword, "UvClients", users)
    reports = {
        device: feduv_codeword.feduv_codeword_table(
            methods=("feduv",), writers=5, rounds=2, fraction=0.6, width_divisor=32, device=device
        )
        for device in ("cpu", "cuda")
    }
    assert pools[-1].device.type == "cuda" and reports["cuda"]["run"]["device"] == "cuda"
    cpu, cuda = (reports[d]["attacks"]["feduv"]["target"] for d in ("cpu", "cuda"))
    assert abs(cpu["bit_accuracy_mean"] - cuda["bit_accuracy_mean"]) <= 0.02
