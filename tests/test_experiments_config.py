"""Config loading: every bad key or value fails before training, naming key, value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fedveil.errors import ConfigError
from fedveil.experiments.config import config_to_dict, effective_overrides, load_config, parse_overrides

ROOT = Path(__file__).parents[1] / "configs"
CONFIGS = sorted([*ROOT.glob("*.yaml"), *(ROOT / "fdml").glob("*.yaml")])


def _write(tmp_path: Path, data: object) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_defaults_are_the_papers_settings() -> None:
    cfg = load_config()
    assert (cfg.fdml.num_required, cfg.fdml.samples_per_client, cfg.fdml.lr) == (64, 8, 1e-4)
    assert cfg.data.train_users_per_model == (507, 333, 287, 270)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.name
    assert cfg.rounds >= 1


def test_round_trip_through_yaml(tmp_path: Path) -> None:
    cfg = load_config(None, ["fdml.lr=0.01", "faults.grad.fail_prob=0.4", "data.test_users_per_model=[5,5]"])
    assert load_config(_write(tmp_path, config_to_dict(cfg))) == cfg
    assert cfg.fdml.lr == 0.01 and cfg.faults.grad.fail_prob == 0.4
    assert cfg.data.test_users_per_model == (5, 5)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"fdml": {"lrr": 0.1}}, "fdml.lrr: unknown key; allowed keys here are: num_required"),
        ({"protocol": "fedprox"}, "protocol: 'fedprox' is not one of fdml, fedavg"),
        ({"rounds": "ten"}, "rounds: expected an integer, got 'ten'"),
        ({"rounds": 0}, "rounds: 0 must be >= 1"),
        ({"fdml": {"rate_p": 2}}, "rate_p 2.0 must be in (0, 1]"),
        ({"fdml": {"num_required": True}}, "fdml.num_required: expected an integer, got True"),
        ({"faults": {"grad": {"fail_prob": 1.5}}}, "faults.grad.fail_prob: 1.5 must be in [0, 1]"),
        ({"faults": {"embed": {"latency": {"kind": "gamma"}}}}, "faults.embed.latency.kind: 'gamma'"),
        ({"data": {"kind": "touchauth-csv"}}, "data.path: touchauth-csv needs the path"),
        ({"data": {"train_users_per_model": 5}}, "data.train_users_per_model: expected a list of int"),
        ({"runtime": {"batched": "yes"}}, "runtime.batched: expected true or false, got 'yes'"),
        ({"eval": {"every": -1}}, "eval.every: -1 must be >= 0"),
        ([1, 2], "must hold a mapping at the top level"),
    ],
)
def test_bad_configs_name_key_value_and_alternatives(tmp_path: Path, data: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, data))
    assert message in str(info.value)


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_overrides() -> None:
    assert parse_overrides(["a.b=1", "a.c=x", "d=[1, 2]"]) == {"a": {"b": 1, "c": "x"}, "d": [1, 2]}
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_overrides(["fdml.lr"])


@pytest.mark.parametrize(
    ("items", "named"),
    [
        (["data.path=/nonexistent/touch.csv"], "data.path='/nonexistent/touch.csv' has no effect"),
        (["fedavg.lr=0.5"], "fedavg.lr=0.5 has no effect: protocol is 'fdml'"),
        (["protocol=fedavg", "fdml.lr=0.5"], "fdml.lr=0.5 has no effect: protocol is 'fedavg'"),
        (["enclave.boundary=none", "enclave.memory_limit_mib=8"], "enclave.memory_limit_mib=8 has no effect"),
        (["dp.round_epsilon=4"], "dp.round_epsilon=4 has no effect: dp.enabled is false"),
        (["data.image_size=48"], "it sizes CameraAuth photos; data.kind is 'touchauth-synthetic'"),
        (["model.width=0.5"], "only ResNet-34 has it; the network is 'touchauth'"),
        (["faults.train.fail_prob=0.5"], "faults.train.fail_prob=0.5 has no effect"),
        (["data.kind=cameraauth-synthetic", "data.test_users_per_model=[3]"], "it counts touch users"),
    ],
)
def test_a_key_the_setting_ignores_is_refused(items: list[str], named: str) -> None:
    assert load_config(None, items)  # accepted where ignored keys are allowed (library default)
    with pytest.raises(ConfigError, match="remove it, or change the setting it depends on") as err:
        load_config(None, items, refuse_ignored=True)
    assert named in str(err.value)


def test_every_shipped_config_sets_only_keys_it_uses() -> None:
    for path in CONFIGS:
        load_config(path, refuse_ignored=True)


def test_a_data_path_that_is_read_must_exist(tmp_path: Path) -> None:
    items = ["data.kind=touchauth-csv", f"data.path={tmp_path / 'missing.csv'}"]
    with pytest.raises(ConfigError, match=r"missing\.csv' does not exist"):
        load_config(None, items, refuse_ignored=True)


def test_cli_refuses_an_ignored_key_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fedveil.cli import main

    out = tmp_path / "x"
    config = str(ROOT / "table1_fdml.yaml")
    assert main(["run", config, "--out", str(out), "--set", "data.path=/nonexistent/x.csv"]) == 2
    assert "data.path='/nonexistent/x.csv' has no effect" in capsys.readouterr().err
    assert not out.exists(), "nothing was trained or written"


def test_the_upload_norm_bound_is_a_finite_positive_number() -> None:
    """``fdml.max_upload_norm`` and ``fedavg.max_upload_norm`` bound one device's upload; the default is
    generous (it changes no honest run), and a value that would disable or break it is refused."""
    assert load_config(None, []).fdml.max_upload_norm == 1e6
    assert load_config(None, ["fdml.max_upload_norm=1e3"]).fdml.max_upload_norm == 1000.0
    assert load_config(None, ["protocol=fedavg", "fedavg.max_upload_norm=50"]).fedavg.max_upload_norm == 50.0
    for value in ("0", "-1", ".inf", ".nan"):
        with pytest.raises(ConfigError, match=r"fdml\.max_upload_norm .* must be a finite number > 0"):
            load_config(None, [f"fdml.max_upload_norm={value}"])
    with pytest.raises(ConfigError, match=r"fedavg\.max_upload_norm"):
        load_config(None, ["protocol=fedavg", "fedavg.max_upload_norm=0"])


def test_a_file_key_its_own_setting_ignores_is_refused_but_an_override_may_switch_the_setting(
    tmp_path: Path,
) -> None:
    path = _write(tmp_path, {"protocol": "fdml", "fedavg": {"lr": 0.5}})
    with pytest.raises(ConfigError, match=r"fedavg\.lr=0\.5 has no effect: protocol is 'fdml'"):
        load_config(path, refuse_ignored=True)
    # a key the setting ignores at its default value has no effect either way: a run's resolved
    # config.yaml states every setting, and it runs again as it is
    default_lr = load_config(None).fedavg.lr
    stated = _write(tmp_path, {"protocol": "fdml", "fedavg": {"lr": default_lr}})
    assert load_config(stated, refuse_ignored=True).fedavg.lr == default_lr
    fdml_file = ROOT / "table1_fdml.yaml"  # its fdml: section is moot once protocol=fedavg is asked for
    assert load_config(fdml_file, ["protocol=fedavg"], refuse_ignored=True).protocol == "fedavg"
    items = ["protocol=fedavg", "fdml.lr=0.5", "fedavg.lr=0.5"]
    assert effective_overrides(fdml_file, items) == ["protocol=fedavg", "fedavg.lr=0.5"]
