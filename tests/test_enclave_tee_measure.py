"""The enclave measurement (emulated MRENCLAVE) and ``fedveil enclave measure``."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest

from fedveil.commands import enclave as enclave_command
from fedveil.enclave.measure import (
    DEFAULT_MEMORY_LIMIT_BYTES,
    MEASUREMENT_DOMAIN,
    EnclaveConfig,
    measure_enclave,
    package_root,
    trusted_files,
)
from fedveil.errors import ConfigError


def _copy_package(dest: Path) -> Path:
    """A copy of the trusted files (the enclave package, fedveil/__init__.py, fedveil/_version.py,
    fedveil/errors.py)."""
    src = package_root()
    shutil.copytree(src / "fedveil" / "enclave", dest / "fedveil" / "enclave")
    for name in ("__init__.py", "_version.py", "errors.py"):
        shutil.copy2(src / "fedveil" / name, dest / "fedveil" / name)
    return dest


def test_measurement_matches_the_documented_formula() -> None:
    config = EnclaveConfig()
    m = measure_enclave(config)
    root = package_root()
    h = hashlib.sha256(MEASUREMENT_DOMAIN + struct.pack(">I", len(m.files)))
    for rel in trusted_files():
        name = rel.encode()
        h.update(struct.pack(">I", len(name)) + name + hashlib.sha256((root / rel).read_bytes()).digest())
    cfg = config.canonical_json()
    h.update(struct.pack(">I", len(cfg)) + cfg)
    assert m.digest == h.digest()
    assert m.hex == h.hexdigest()
    assert cfg == (
        b'{"dp_bound_T":0.0,"dp_drop_rate":0.0,"dp_mode":null,"dp_noise_b":0.0,"dp_seed":null,'
        b'"margin":1.0,"memory_limit_bytes":100663296,"strategy":"batch-all"}'
    )


def test_trusted_files_cover_the_enclave_package_and_nothing_cached() -> None:
    files = trusted_files()
    assert "fedveil/enclave/service.py" in files and "fedveil/enclave/measure.py" in files
    shared = ("fedveil/__init__.py", "fedveil/_version.py", "fedveil/errors.py")
    assert set(shared) <= set(files)
    assert all(f.startswith("fedveil/enclave/") or f in shared for f in files)
    assert not any("__pycache__" in f or f.endswith(".pyc") for f in files)
    assert files == sorted(files)


def test_measurement_is_location_independent_and_any_byte_changes_it(tmp_path: Path) -> None:
    config = EnclaveConfig()
    root = _copy_package(tmp_path)
    original = measure_enclave(config).digest
    assert measure_enclave(config, root=root).digest == original
    (root / "fedveil/enclave/__pycache__").mkdir(exist_ok=True)
    (root / "fedveil/enclave/__pycache__/x.cpython-311.pyc").write_bytes(b"cache")
    assert measure_enclave(config, root=root).digest == original

    target = root / "fedveil/enclave/channel.py"
    content = target.read_bytes()
    target.write_bytes(content + b"\n")
    assert measure_enclave(config, root=root).digest != original
    target.write_bytes(content)
    assert measure_enclave(config, root=root).digest == original

    (root / "fedveil/errors.py").write_bytes(
        (root / "fedveil/errors.py").read_bytes().replace(b"Base", b"base")
    )
    assert measure_enclave(config, root=root).digest != original


def test_an_added_file_changes_the_measurement(tmp_path: Path) -> None:
    root = _copy_package(tmp_path)
    before = measure_enclave(EnclaveConfig(), root=root)
    (root / "fedveil/enclave/extra.py").write_text("x = 1\n")
    after = measure_enclave(EnclaveConfig(), root=root)
    assert after.digest != before.digest
    assert ("fedveil/enclave/extra.py", hashlib.sha256(b"x = 1\n").hexdigest()) in after.files


@pytest.mark.parametrize(
    "other",
    [
        EnclaveConfig(memory_limit_bytes=DEFAULT_MEMORY_LIMIT_BYTES + 1),
        EnclaveConfig(margin=0.5),
        EnclaveConfig(strategy="semi-hard"),
    ],
)
def test_every_config_value_changes_the_measurement(other: EnclaveConfig) -> None:
    assert measure_enclave(other).digest != measure_enclave(EnclaveConfig()).digest


def test_config_round_trips_and_margin_is_normalised() -> None:
    config = EnclaveConfig(margin=2, strategy="semi-hard")
    assert config.margin == 2.0 and isinstance(config.margin, float)
    assert EnclaveConfig.from_json(config.canonical_json()) == config


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"memory_limit_bytes": 1000}, "memory_limit_bytes 1000"),
        ({"memory_limit_bytes": 2.0**27}, "memory_limit_bytes"),
        ({"margin": 0.0}, "margin 0.0"),
        ({"margin": float("nan")}, "margin nan"),
        ({"margin": True}, "margin True"),
        ({"strategy": "hardest"}, "strategy 'hardest'"),
    ],
)
def test_bad_config_is_refused_naming_the_value(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        EnclaveConfig(**kwargs)


@pytest.mark.parametrize(
    "data", [b"[1]", b"{", b'{"margin":1.0}', b'{"margin":1.0,"memory_limit_bytes":1,"x":1}']
)
def test_config_json_with_wrong_keys_is_refused(data: bytes) -> None:
    with pytest.raises(ConfigError):
        EnclaveConfig.from_json(data)


def test_missing_package_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no enclave package"):
        trusted_files(tmp_path)


def _cli(argv: list[str]) -> int:
    """Run ``fedveil enclave ...`` through the command module's own parser (as ``fedveil.cli`` does)."""
    parser = argparse.ArgumentParser(prog="fedveil")
    enclave_command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_prints_the_measurement(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["enclave", "measure"]) == 0
    assert capsys.readouterr().out.strip() == measure_enclave(EnclaveConfig()).hex
    assert _cli(["enclave", "measure", "--memory-limit-mib", "64", "--margin", "0.5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    expected = measure_enclave(EnclaveConfig(memory_limit_bytes=64 * 2**20, margin=0.5))
    assert doc["measurement"] == expected.hex
    assert doc["simulated"] is True
    assert doc["config"] == {
        "margin": 0.5,
        "memory_limit_bytes": 64 * 2**20,
        "strategy": "batch-all",
        "dp_mode": None,
        "dp_bound_T": 0.0,
        "dp_noise_b": 0.0,
        "dp_drop_rate": 0.0,
        "dp_seed": None,
    }
    assert [f["path"] for f in doc["trusted_files"]] == trusted_files()


def test_cli_reports_a_bad_limit() -> None:
    with pytest.raises(ConfigError, match="memory_limit_bytes 524288"):
        _cli(["enclave", "measure", "--memory-limit-mib", "0.5"])
