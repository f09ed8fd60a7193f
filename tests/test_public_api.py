"""The public API (``fedveil.__all__``): every name loads, docs/api.md documents exactly these names,
``import fedveil`` stays light, :func:`fedveil.run` returns what the run directory holds, and
:func:`fedveil.train_fedavg` trains on the FedAvg engine, accounts for its noise with fedveil's own
accountant, records what the server saw, is reproducible and refuses bad arguments by name."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fedveil
from fedveil.errors import ConfigError, ValidationError
from fedveil.privacy.accounting import GaussianRelease, epsilon_of

ROOT = Path(__file__).parents[1]
API_PAGE = ROOT / "docs" / "api.md"
BYO_PAGE = ROOT / "docs" / "tutorials" / "byo.md"
# the tutorial's settings at test size: the synthetic stand-in of 1,200 images, two short rounds
BYO_SETTINGS = {
    "DATA": '"synthetic-fashion-mnist:1200"',
    "CLIENTS": "6",
    "EXAMPLES_PER_CLIENT": "20",
    "ROUNDS": "2",
    "LOCAL_EPOCHS": "1",
}
CONFIG = ROOT / "configs" / "table1_fdml.yaml"
# plain FDML (no emulated TEE), 6 + 6 synthetic users, 2 rounds
TINY = [
    "rounds=2",
    "eval.every=2",
    "data.train_users_per_model=[6, 6]",
    "data.test_users_per_model=[11, 11]",
    "fdml.num_required=4",
    "fdml.samples_per_client=4",
    "enclave.boundary=none",
    "runtime.threads=1",
]


def _separable(clients: int = 10, per_client: int = 40, seed: int = 0) -> fedveil.FederatedDataset:
    """Two classes split by the sign of ``x0 + x1``, IID over ``clients``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(clients * per_client, 8)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    parts = fedveil.partition(y, "iid", clients, rng)
    return fedveil.FederatedDataset(
        fedveil.UserData(f"client{i:02d}", {}, {"x": x[idx], "y": y[idx]}) for i, idx in enumerate(parts)
    )


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _norm(update: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in update.values())))


# --- the names ------------------------------------------------------------------------------------------


def test_every_public_name_loads_from_the_module_that_defines_it() -> None:
    assert len(set(fedveil.__all__)) == len(fedveil.__all__), "no name twice"
    for name in fedveil.__all__:
        value = getattr(fedveil, name)
        assert value is not None, name
    assert fedveil.train_fedavg.__module__ == "fedveil.api"
    assert fedveil.FedAvgEngine.__module__ == "fedveil.protocols.fedavg"
    assert fedveil.parse_policy("runFL . release") == fedveil.parse_policy("runFL.release")
    namespace: dict[str, object] = {}
    exec("from fedveil import *", namespace)
    assert set(fedveil.__all__) <= set(namespace)


def test_each_public_name_is_in_the_all_of_the_module_it_comes_from() -> None:
    for name in fedveil.__all__:
        module_name, attr = fedveil._WHERE[name]
        module = importlib.import_module(module_name)
        assert attr in getattr(module, "__all__", ()), f"{module_name}.__all__ lacks {attr} (fedveil.{name})"
    assert set(fedveil._WHERE) == set(fedveil.__all__)


def test_a_name_that_is_not_public_says_where_the_public_names_are() -> None:
    with pytest.raises(AttributeError, match=r"no attribute 'ModelServe'.*fedveil.__all__"):
        fedveil.ModelServe  # noqa: B018


def test_the_api_page_maps_and_documents_exactly_the_public_names() -> None:
    text = API_PAGE.read_text(encoding="utf-8")
    mapped = re.findall(r"^\| `fedveil\.(\w+)` \|", text, flags=re.M)
    directives = re.findall(r"^::: fedveil\.(\w+)\s*$", text, flags=re.M)
    assert len(mapped) == len(set(mapped)), "each name in the map once"
    assert set(mapped) == set(fedveil.__all__)
    assert directives == mapped, "one mkdocstrings directive per name, in the map's order"


def test_import_fedveil_imports_neither_torch_nor_numpy() -> None:
    code = "import sys, fedveil; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# --- running an experiment ------------------------------------------------------------------------------


def test_run_returns_the_results_that_the_run_directory_holds(tmp_path: Path) -> None:
    out = tmp_path / "run"
    results = fedveil.run(fedveil.load_config(CONFIG, TINY), out)
    assert results == json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert results["rounds"] == 2 and results["protocol"] == "fdml"
    with pytest.raises(ConfigError, match=r"not empty.*--resume.*--overwrite"):
        fedveil.run(fedveil.load_config(CONFIG, TINY), out)


def test_load_config_refuses_an_unknown_key_and_a_bare_string() -> None:
    with pytest.raises(ConfigError, match="nonsense"):
        fedveil.load_config(CONFIG, ["nonsense=1"])
    with pytest.raises(ConfigError, match="list of 'key=value' strings"):
        fedveil.load_config(CONFIG, "rounds=2")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ExperimentConfig or the path"):
        fedveil.run(42, "out")  # type: ignore[arg-type]


# --- train_fedavg ---------------------------------------------------------------------------------------


def test_train_fedavg_learns_a_separable_task_and_leaves_the_model_alone() -> None:
    data, model = _separable(), _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = np.concatenate([data.array(u, "x") for u in data.user_ids])
    y = np.concatenate([data.array(u, "y") for u in data.user_ids])
    result = fedveil.train_fedavg(
        model, data, rounds=6, clients_per_round=5, lr=0.2, batch_size=8, local_epochs=2, test=(x, y)
    )
    losses = [line["loss"] for line in result.history]
    assert [line["round"] for line in result.history] == list(range(1, 7))
    assert losses[-1] < 0.6 * losses[0], losses
    assert result.history[-1]["test_accuracy"] > 0.9
    assert result.privacy is None and result.epsilon is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed: the user's model is not trained in place"
    model.load_state_dict(result.state_dict)
    with torch.no_grad():
        accuracy = (model(torch.from_numpy(x)).argmax(1).numpy() == y).mean()
    assert accuracy == pytest.approx(result.history[-1]["test_accuracy"])


def test_train_fedavg_epsilon_is_the_privacy_calculators() -> None:
    data = _separable(clients=8, per_client=10)
    dp = {"clip_norm": 0.5, "noise_multiplier": 1.1, "delta": 1e-5}
    result = fedveil.train_fedavg(_mlp(), data, rounds=3, clients_per_round=2, lr=0.1, batch_size=5, **dp)
    privacy = result.privacy
    assert privacy is not None and privacy.accountant == "pld" and privacy.noise_on == "local"
    assert privacy.sampling_rate == 2 / 8 and privacy.rounds == 3
    assert result.epsilon == pytest.approx(epsilon_of([GaussianRelease(1.1, 0.25, 3)], 1e-5), rel=1e-12)
    assert privacy.epsilon_round == pytest.approx(
        epsilon_of([GaussianRelease(1.1, 0.25, 1)], 1e-5), rel=1e-12
    )
    assert privacy.epsilon_round < privacy.epsilon
    assert "clipped to L2 norm clip_norm" in privacy.mechanism and "Poisson" in privacy.mechanism
    assert json.loads(json.dumps(privacy.as_dict()))["epsilon"] == privacy.epsilon


def test_train_fedavg_falls_back_to_rdp_where_the_pld_grid_would_be_too_fine() -> None:
    data = _separable(clients=4, per_client=8)
    dp = {"clip_norm": 1.0, "noise_multiplier": 0.2, "delta": 1e-5}
    result = fedveil.train_fedavg(_mlp(), data, rounds=2, clients_per_round=2, lr=0.1, batch_size=4, **dp)
    assert result.privacy is not None and result.privacy.accountant == "rdp"
    expected = epsilon_of([GaussianRelease(0.2, 0.5, 2)], 1e-5, method="rdp")
    assert result.epsilon == pytest.approx(expected, rel=1e-12)


def test_train_fedavg_runs_its_rounds_on_the_fedavg_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    rounds: list[int] = []
    run_round = fedveil.FedAvgEngine.run_round

    async def spy(self: fedveil.FedAvgEngine, rnd: int, comm: object) -> object:
        rounds.append(rnd)
        return await run_round(self, rnd, comm)

    monkeypatch.setattr(fedveil.FedAvgEngine, "run_round", spy)
    fedveil.train_fedavg(
        _mlp(), _separable(clients=4, per_client=8), rounds=3, clients_per_round=2, lr=0.1, batch_size=4
    )
    assert rounds == [1, 2, 3]


def test_train_fedavg_is_reproducible_with_its_seed() -> None:
    data = _separable(clients=6, per_client=12)
    kwargs = dict(rounds=2, clients_per_round=3, lr=0.1, batch_size=4, clip_norm=1.0, noise_multiplier=0.8)
    a = fedveil.train_fedavg(_mlp(), data, delta=1e-5, seed=3, **kwargs)
    b = fedveil.train_fedavg(_mlp(), data, delta=1e-5, seed=3, **kwargs)
    c = fedveil.train_fedavg(_mlp(), data, delta=1e-5, seed=4, **kwargs)
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    assert [h["loss"] for h in a.history] == [h["loss"] for h in b.history]
    assert not all(torch.equal(a.state_dict[k], c.state_dict[k]) for k in a.state_dict)


def test_the_server_sees_clipped_uploads_noised_only_when_the_devices_add_the_noise() -> None:
    data = _separable(clients=6, per_client=12)
    common = dict(
        rounds=2, clients_per_round=3, lr=0.5, batch_size=4, local_epochs=3, clip_norm=0.05, observe=True
    )
    clipped = fedveil.train_fedavg(_mlp(), data, **common)
    central = fedveil.train_fedavg(
        _mlp(), data, noise_multiplier=2.0, delta=1e-5, noise_on="central", **common
    )
    local = fedveil.train_fedavg(_mlp(), data, noise_multiplier=2.0, delta=1e-5, **common)
    for result in (clipped, central):
        views = result.uploads(2)
        assert len(views) == 3 and set(views) <= set(data.user_ids)
        norms = [_norm(v.update) for v in views.values()]
        assert max(norms) <= 0.05 * (1 + 1e-5), norms
        assert max(norms) > 0.04, "local training moved further than the clip norm: clipping applied"
    # local noise: each device's share has standard deviation z * S / sqrt(m) per coordinate
    share = 2.0 * 0.05 / np.sqrt(3)
    params = sum(p.numel() for p in _mlp().parameters())
    for view in local.uploads(1).values():
        assert _norm(view.update) == pytest.approx(share * np.sqrt(params), rel=0.25)
        assert (
            view.kind == "delta" and view.lr == 0.5 and view.local_steps == 3 * 3 and view.num_samples == 12
        )
    assert local.server_uploads is not None and local.server_uploads.rounds == [1, 2]
    with pytest.raises(ValidationError, match=r"round 5.*recorded rounds: \[1, 2\]"):
        local.uploads(5)


def test_an_attack_runs_on_an_upload_the_server_saw() -> None:
    data = _separable(clients=4, per_client=16)
    result = fedveil.train_fedavg(
        _mlp(), data, rounds=1, clients_per_round=2, lr=0.5, batch_size=4, local_epochs=5, observe=True
    )
    cid, view = next(iter(result.uploads(1).items()))
    local_model = fedveil.snapshot_model(view)
    members_x, members_y = data.array(cid, "x"), data.array(cid, "y")
    others = [u for u in data.user_ids if u != cid]
    outside_x = np.concatenate([data.array(u, "x") for u in others])[: len(members_x)]
    outside_y = np.concatenate([data.array(u, "y") for u in others])[: len(members_y)]
    scores = fedveil.yeom_attack(
        fedveil.ModelView("server", local_model),
        np.concatenate([members_x, outside_x]),
        np.concatenate([members_y, outside_y]),
        np.r_[np.ones(len(members_x), bool), np.zeros(len(outside_x), bool)],
    )
    assert 0.0 <= scores.auc <= 1.0 and scores.num_positives == len(members_x)
    without = fedveil.train_fedavg(_mlp(), data, rounds=1, clients_per_round=2, lr=0.5, batch_size=4)
    with pytest.raises(ConfigError, match="observe=True"):
        without.uploads(1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"clients_per_round": 11}, r"clients_per_round 11 exceeds the 10 clients.*at most 10"),
        ({"clients_per_round": 0}, r"clients_per_round 0 must be an integer >= 1"),
        ({"rounds": 1.5}, r"rounds 1.5 must be an integer >= 1"),
        ({"lr": 0.0}, r"lr 0.0 must be a finite number > 0"),
        ({"noise_multiplier": 1.0, "delta": 1e-5}, r"noise_multiplier 1.0 needs clip_norm"),
        ({"noise_multiplier": 1.0, "clip_norm": 1.0}, r"noise_multiplier 1.0 needs delta"),
        ({"delta": 1e-5}, r"delta 1e-05 is only used with noise_multiplier"),
        ({"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 2.0}, r"delta 2.0 must be in \(0, 1\)"),
        ({"clip_norm": 1.0, "noise_on": "server"}, r"noise_on 'server' is not one of central, local"),
        ({"test": (np.zeros((3, 8)), np.zeros(2))}, r"test must be a pair \(x, y\)"),
    ],
)
def test_train_fedavg_refuses_bad_arguments_by_name(change: dict[str, object], message: str) -> None:
    kwargs: dict[str, object] = dict(rounds=1, clients_per_round=2, lr=0.1, batch_size=4) | change
    with pytest.raises(ConfigError, match=message):
        fedveil.train_fedavg(_mlp(), _separable(), **kwargs)  # type: ignore[arg-type]


def test_train_fedavg_refuses_data_the_model_cannot_train_on() -> None:
    data = _separable(clients=2, per_client=4)
    with pytest.raises(ConfigError, match=r"does not accept client 'client00''s inputs of shape \(8,\)"):
        fedveil.train_fedavg(torch.nn.Linear(5, 2), data, rounds=1, clients_per_round=1, lr=0.1, batch_size=2)
    with pytest.raises(ConfigError, match="client 'client01' has label 1, but the model has 1 outputs"):
        fedveil.train_fedavg(torch.nn.Linear(8, 1), data, rounds=1, clients_per_round=1, lr=0.1, batch_size=2)
    floats = fedveil.FederatedDataset([fedveil.UserData("u", {}, {"x": np.zeros((2, 8)), "y": np.zeros(2)})])
    with pytest.raises(ValidationError, match=r"client 'u'.*integer class label"):
        fedveil.train_fedavg(_mlp(), floats, rounds=1, clients_per_round=1, lr=0.1, batch_size=2)
    negative = fedveil.FederatedDataset(
        [fedveil.UserData("v", {}, {"x": np.zeros((1, 8)), "y": -np.ones(1, int)})]
    )
    with pytest.raises(ValidationError, match=r"client 'v' has label -1: class labels are 0, 1, 2"):
        fedveil.train_fedavg(_mlp(), negative, rounds=1, clients_per_round=1, lr=0.1, batch_size=2)
    with pytest.raises(ConfigError, match="dataset must be a FederatedDataset"):
        fedveil.train_fedavg(_mlp(), [1, 2], rounds=1, clients_per_round=1, lr=0.1, batch_size=2)  # type: ignore[arg-type]


# --- the tutorial ---------------------------------------------------------------------------------------


def test_the_bring_your_own_tutorial_runs_at_small_settings(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = re.findall(r"^```python\n(.*?)^```\s*$", BYO_PAGE.read_text(encoding="utf-8"), flags=re.M | re.S)
    assert len(blocks) == 1, "the page's program is one python block"
    code = blocks[0]
    for name, value in BYO_SETTINGS.items():
        code, count = re.subn(rf"^{name} = .*$", f"{name} = {value}", code, flags=re.M)
        assert count == 1, f"the tutorial sets {name} once at the top"
    namespace: dict[str, object] = {"__name__": "byo_tutorial"}
    with torch.random.fork_rng(devices=[]):
        exec(compile(code, str(BYO_PAGE), "exec"), namespace)
    printed = capsys.readouterr().out
    assert "SYNTHETIC STAND-IN" in printed
    assert re.search(r"plain: local loss [\d.]+ -> [\d.]+, test accuracy [\d.]+ after 2 rounds", printed)
    assert re.search(r"epsilon = [\d.]+ at delta = 1e-05 over 2 rounds", printed)
    assert re.search(
        r"membership AUC on the uploads \(0.5 = guessing\): plain [\d.]+, with DP [\d.]+", printed
    )
    private = namespace["private"]
    assert isinstance(private, fedveil.FedAvgResult) and private.epsilon is not None
