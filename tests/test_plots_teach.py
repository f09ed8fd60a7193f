"""Plots that teach: FDML's learning signals (active fraction, loss over all valid triplets, accuracy
against the untrained network), one colour per method across a run's plots, PoliFL's chance line and
epsilon notes, AIoT's plots."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_hex
from matplotlib.container import BarContainer
from matplotlib.figure import Figure
from matplotlib.image import imread

from fedveil.enclave.triplet import loss_and_derivatives
from fedveil.eval.plots import method_colours
from fedveil.experiments.config import load_config
from fedveil.experiments.fdml.figures import run_figures
from fedveil.experiments.fdml.runner import run_experiment
from fedveil.experiments.plots import Reference, series_figure
from fedveil.models.flat import FlatModel

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

SMALL = [
    "data.train_users_per_model=[6, 6]",
    "data.test_users_per_model=[11, 11]",
    "fdml.num_required=4",
    "fdml.samples_per_client=4",
]


def assert_png(path: Path) -> None:
    """``path`` is a PNG that matplotlib decodes to a non-empty image."""
    assert path.read_bytes()[:8] == PNG_MAGIC, path
    assert min(imread(path).shape[:2]) > 50, path


def line_colours(fig: Figure) -> dict[str, str]:
    """Legend label -> hex colour of every labelled line of every axes of ``fig``."""
    return {
        line.get_label(): to_hex(line.get_color())
        for ax in fig.axes
        for line in ax.get_lines()
        if not line.get_label().startswith("_")
    }


@pytest.mark.parametrize("strategy", ["batch-all", "semi-hard"])
def test_active_fraction_and_valid_loss_match_a_brute_force_count(strategy: str) -> None:
    rng = np.random.default_rng(3)
    emb = rng.normal(0, 1, (12, 3))
    labels = np.repeat(np.arange(4), 3)
    res = loss_and_derivatives(emb, labels, margin=1.0, strategy=strategy)
    valid, hinges = 0, []
    for a, p, n in itertools.permutations(range(12), 3):
        if labels[a] != labels[p] or labels[n] == labels[a]:
            continue
        valid += 1
        d_ap, d_an = np.linalg.norm(emb[a] - emb[p]), np.linalg.norm(emb[a] - emb[n])
        h = d_ap + 1.0 - d_an
        if h > 0 and (strategy == "batch-all" or d_ap < d_an):
            hinges.append(h)
    assert 0 < len(hinges) < valid
    assert res.active_fraction == pytest.approx(len(hinges) / valid, rel=1e-12)
    assert res.valid_loss == pytest.approx(sum(hinges) / valid, rel=1e-9)
    assert res.valid_loss < res.loss


def test_no_valid_triplet_gives_zero_fraction_and_loss() -> None:
    res = loss_and_derivatives(np.zeros((3, 2)), np.arange(3), margin=1.0)
    assert (res.active_fraction, res.valid_loss) == (0.0, 0.0)


@pytest.mark.parametrize("boundary", ["none", "inprocess"])
def test_fdml_run_records_the_learning_signals_and_plots_them(
    tmp_path: Path, toy_population, boundary: str
) -> None:
    cfg = load_config(None, ["rounds=4", "eval.every=2", "name=t", f"enclave.boundary={boundary}", *SMALL])
    results = run_experiment(cfg, tmp_path, progress=False, population=toy_population)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rounds = [x for x in lines if "round" in x]
    assert len(rounds) == 4
    for line in rounds:
        assert 0.0 <= line["active_fraction"] <= 1.0
        assert 0.0 <= line["valid_loss"] <= line["loss"]
        assert line["active_triplets"] > 0  # the existing key keeps its meaning
    for name in ("loss.png", "active_fraction.png", "accuracy.png", "roc.png"):
        assert_png(tmp_path / name)
    baseline = results["untrained_accuracy_percent"]
    assert 0.0 <= baseline <= 100.0
    figures = run_figures(tmp_path, "t", untrained_percent=baseline)
    ax = figures["accuracy.png"].axes[0]
    assert ax.get_ylim()[0] == 0.0 and ax.get_ylim()[1] >= 100.0
    drawn = {line.get_label(): line for line in ax.get_lines()}
    (label,) = [k for k in drawn if k.startswith("untrained network (round 0)")]
    assert list(drawn[label].get_ydata()) == [baseline, baseline]
    assert figures["active_fraction.png"].axes[0].get_ylim()[0] == 0.0


def test_two_points_are_markers_without_a_line() -> None:
    fig = series_figure(
        {"two": [(1, 0.2), (2, 0.4)], "three": [(1, 0.1), (2, 0.3), (3, 0.5)]},
        title="t",
        ylabel="y",
        references=[Reference("chance", 0.1)],
    )
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert lines["two"].get_linestyle() == "None" and lines["two"].get_marker() == "o"
    assert lines["three"].get_linestyle() == "-"
    assert list(lines["chance"].get_ydata()) == [0.1, 0.1]


def test_a_smoothed_series_keeps_its_colour_for_raw_and_mean() -> None:
    rng = np.random.default_rng(0)
    series = {m: [(r, float(rng.random())) for r in range(200)] for m in ("a", "b", "c")}
    fig = series_figure(series, title="t", ylabel="y")
    colours = method_colours(series)
    for ax_line in fig.axes[0].get_lines():
        label = ax_line.get_label()
        if not label.startswith("_"):
            assert line_colours(fig)[label] == colours[label.split(" ")[0]]
    raw = [line for line in fig.axes[0].get_lines() if line.get_label().startswith("_")]
    assert [to_hex(line.get_color()) for line in raw] == list(colours.values())


def test_feduv_gives_each_method_one_colour_in_both_figures() -> None:
    from fedveil.eval.verification import Roc
    from fedveil.experiments.feduv.runner import run_figures as feduv_figures

    methods = ["softmax", "fedaws", "feduv-127"]
    rng = np.random.default_rng(1)
    rocs = {
        m: Roc(
            np.r_[0.0, np.sort(rng.random(5)), 1.0], np.r_[0.0, np.sort(rng.random(5)), 1.0], np.arange(7.0)
        )
        for m in methods
    }
    curves = {"train": dict(rocs), "test_known": dict(rocs)}
    losses = {
        m: [(r, float(rng.random())) for r in range(1, 301)] for m in methods
    }  # smoothed: two lines each
    figures = feduv_figures("t", "t", curves, losses)
    roc_colours = line_colours(figures["roc.png"])
    loss_colours = line_colours(figures["loss.png"])
    for m in methods:
        in_roc = {c for label, c in roc_colours.items() if label.startswith(f"{m} (")}
        in_loss = {c for label, c in loss_colours.items() if label.startswith(f"{m} (")}
        assert len(in_roc) == 1 and in_roc == in_loss, m
    assert len({next(c for k, c in roc_colours.items() if k.startswith(m)) for m in methods}) == 3


POLIFL = """
name: tiny
task: mpu
clients: 8
hidden: 4
clients_per_round: 2
batch_size: 16
lr: 0.5
clip_norm: 1.0
groups:
  - name: strict
    policy: "get_data . runFL . check_privacy_budget(max_eps=20) . return"
    noise: 2.0
  - name: loose
    policy: "get_data . runFL . return"
    noise: 1.0
strategies: [cascaded]
rounds: 2
eval_every: 1
threads: 1
"""


def test_polifl_curves_show_chance_and_each_stage_epsilon_over_its_budget(tmp_path: Path) -> None:
    from fedveil.experiments.polifl.runner import build_task, curves_figure, load_polifl_run, run_polifl

    (tmp_path / "tiny.yaml").write_text(POLIFL)
    run = load_polifl_run(tmp_path / "tiny.yaml")
    results = run_polifl(run, tmp_path / "run", progress=False)
    assert_png(tmp_path / "run" / "curves.png")
    ax = curves_figure(run, build_task(run), results["strategies"]).axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["chance (AUC 0.5)"].get_ydata()) == [0.5, 0.5]
    notes = [t.get_text() for t in ax.texts]
    stages = results["strategies"]["cascaded"]["stages"]
    assert len(notes) == len(stages) == 2
    first = stages[0]["epsilon"]["strict"]
    assert notes[0] == f"ε strict {first:.3g}/20"  # spent over the policy's budget
    assert notes[1].startswith("ε loose ") and "/" not in notes[1]  # no budget in its policy


@pytest.mark.parametrize(("task", "classes"), [("images", 7), ("text", 50)])
def test_polifl_chance_is_one_over_the_classes(task: str, classes: int) -> None:
    import torch

    from fedveil.experiments.polifl.runner import ModelSpec, Task, chance_level

    spec = ModelSpec(task, num_classes=classes if task == "images" else 10, vocab=classes)
    flat = FlatModel(torch.nn.Linear(2, 2))
    made = Task(flat, {}, {}, torch.nn.functional.cross_entropy, None, "accuracy", None, spec=spec)
    chance = chance_level(made)
    assert chance is not None and chance.value == pytest.approx(1 / classes)
    assert f"1 / {classes} classes" in chance.label


AIOT = """
name: tiny
size: 32
width: 0.25
public_identities: 8
pretrain_epochs: 1
private_identities: 6
test_identities: 5
wild: 2
identities_per_device: 3
rounds: 1
clients_per_round: 2
batch_size: 4
trials: 2
methods: [pretrained, ours]
threads: 1
"""


def test_aiot_run_plots_each_method_beside_chance(tmp_path: Path) -> None:
    from fedveil.experiments.aiot.runner import load_aiot_run, run_aiot, run_figures

    (tmp_path / "tiny.yaml").write_text(AIOT)
    run = load_aiot_run(tmp_path / "tiny.yaml")
    record = run_aiot(run, tmp_path / "run", progress=False)
    assert_png(tmp_path / "run" / "scores.png")
    ax = run_figures(run, record["summary"])["scores.png"].axes[0]
    colours = method_colours(["pretrained", "ours"])
    bars = [(c.get_label(), c.patches[0]) for c in ax.containers if isinstance(c, BarContainer)]
    assert {label for label, _ in bars} == {"pretrained", "ours"} and len(bars) == 6  # 3 scores x 2 methods
    assert all(to_hex(bar.get_facecolor()) == colours[label] for label, bar in bars)
    means = sorted(bar.get_height() for label, bar in bars if label == "ours")
    ours = record["summary"]["ours"]
    keys = ("tar_at_far_1e-3", "tar_at_far_1e-4", "identification_accuracy")
    assert means == sorted(ours[k]["mean"] for k in keys)
    chance = [line for line in ax.get_lines() if line.get_label() in ("chance", "_chance")]
    assert sorted(line.get_ydata()[0] for line in chance) == pytest.approx([1e-4, 1e-3, 1 / 5])


def test_seed_curves_keep_a_cells_colour_in_every_panel() -> None:
    from fedveil.experiments.plots import seed_curves_figure

    curves = {
        "no accuracy": [{"loss": [(1, 1.0), (2, 0.5)]}],
        "both": [{"loss": [(1, 0.9), (2, 0.4)], "accuracy": [(2, 60.0)]}],
    }
    fig = seed_curves_figure(curves, title="t", panels=[("loss", "loss"), ("accuracy", "%")])
    in_loss = {line.get_label(): to_hex(line.get_color()) for line in fig.axes[0].get_lines()}
    in_accuracy = {line.get_label(): to_hex(line.get_color()) for line in fig.axes[1].get_lines()}
    assert in_accuracy["both (1 run)"] == in_loss["both (1 run)"] == method_colours(curves)["both"]


def test_the_enclave_releases_the_fraction_and_valid_loss_of_alg1() -> None:
    from fedveil.core.attestation_verify import EnclaveClientSession, SimulatedQuoteVerifier
    from fedveil.enclave.measure import EnclaveConfig, measure_enclave
    from fedveil.runtime.enclave_host import EnclaveHost
    from fedveil.runtime.quoting import SimulatedPlatform

    platform = SimulatedPlatform.generate()
    config = EnclaveConfig(memory_limit_bytes=8 * 2**20, margin=1.0)
    host = EnclaveHost.start(config, platform=platform, boundary="inprocess")
    verifier = SimulatedQuoteVerifier(platform.public_key)
    ids = [f"c{i}" for i in range(5)]
    sealed = {}
    rng = np.random.default_rng(0)
    emb = {c: rng.standard_normal((4, 8)).astype(np.float32) for c in ids}
    for cid in ids:
        session = EnclaveClientSession(
            cid, verifier=verifier, expected_measurement=measure_enclave(config).digest
        )
        session.establish(host.open_session(session.hello()))
        sealed[cid] = session.seal_embeddings(1, emb[cid])
    try:
        released = host.loss_and_derivatives(1, sealed, shape=(4, 8))
        none_accepted = host.loss_and_derivatives(2, {ids[0]: b"\0" * len(sealed[ids[0]])}, shape=(4, 8))
    finally:
        host.close()
    direct = loss_and_derivatives(
        np.concatenate([emb[c] for c in ids]),
        np.repeat(np.arange(5), 4),
        margin=1.0,
        memory_limit_bytes=8 * 2**20,
    )
    assert (released.active_fraction, released.valid_loss) == (direct.active_fraction, direct.valid_loss)
    assert 0 < released.active_fraction < 1
    assert none_accepted.rejected and (none_accepted.active_fraction, none_accepted.valid_loss) == (0.0, None)
