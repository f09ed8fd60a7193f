"""``fedveil certs {init,device,token,revoke,list}`` through the ``fedveil`` entry point."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from fedveil.cli import main
from fedveil.runtime.network import certs


def test_init_prints_the_files_and_next_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "pki"
    assert main(["certs", "init", str(root), "--host", "fl.example.org", "--host", "10.1.2.3"]) == 0
    out = capsys.readouterr().out.splitlines()
    for name in ("ca.crt", "ca.key", "server.crt", "server.key", "revoked.json", "tokens.json"):
        assert any(line.startswith(str(root / name)) for line in out), name
        assert (root / name).is_file()
    assert any(line.startswith("next: fedveil certs device NAME") for line in out)
    assert any("fl.example.org, 10.1.2.3" in line for line in out)
    if os.name == "posix":
        assert stat.S_IMODE((root / "ca.key").stat().st_mode) == 0o600


def test_init_twice_needs_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["certs", "init", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["certs", "init", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedveil certs: error:") and "--force" in err
    assert main(["certs", "init", str(tmp_path), "--force"]) == 0


def test_device_writes_credentials_under_the_pki(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["certs", "init", "pki"]) == 0
    capsys.readouterr()
    assert main(["certs", "device", "dev1"]) == 0  # --dir defaults to ./pki
    out = capsys.readouterr().out
    creds = certs.DeviceCredentials.read(tmp_path / "pki" / "devices" / "dev1")
    assert creds.name == "dev1"
    assert certs.certificate_identity(creds.cert_pem)[1] in out
    assert str(Path("pki") / "devices" / "dev1") in out
    assert main(["certs", "device", "dev2", "--dir", "pki", "--out", str(tmp_path / "elsewhere")]) == 0
    assert certs.DeviceCredentials.read(tmp_path / "elsewhere").name == "dev2"


def test_device_rejects_a_bad_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["certs", "init", str(tmp_path)])
    capsys.readouterr()
    assert main(["certs", "device", "../x", "--dir", str(tmp_path)]) == 2
    assert "device name '../x'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_token_is_printed_once_and_stored_hashed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["certs", "init", str(tmp_path)])
    capsys.readouterr()
    assert main(["certs", "token", "dev1", "--dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    token = captured.out.strip()
    assert token.startswith("dev1.") and len(token.splitlines()) == 1
    assert "only once" in captured.err and "hashed" in captured.err and token not in captured.err
    assert token.split(".", 1)[1] not in (tmp_path / "tokens.json").read_text()
    assert certs.redeem_token(tmp_path, token) == "dev1"


def test_revoke_and_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = str(tmp_path)
    main(["certs", "init", d])
    main(["certs", "device", "alice", "--dir", d])
    main(["certs", "device", "bob", "--dir", d])
    main(["certs", "token", "carol", "--dir", d])
    captured = capsys.readouterr()
    secret = captured.out.strip().splitlines()[-1].split(".", 1)[1]
    bob_serial = certs.issued_devices(tmp_path)[1]["serial"]

    assert main(["certs", "revoke", "alice", "--dir", d]) == 0
    assert "device 'alice'" in capsys.readouterr().out
    assert main(["certs", "revoke", bob_serial, "--dir", d]) == 0
    assert bob_serial in capsys.readouterr().out

    assert main(["certs", "list", "--dir", d, "--json"]) == 0
    text = capsys.readouterr().out
    doc = json.loads(text)
    assert [(x["name"], x["revoked"]) for x in doc["devices"]] == [("alice", True), ("bob", True)]
    assert doc["devices"][1]["serial"] == bob_serial
    assert doc["revoked"] == {"serials": [bob_serial], "names": ["alice"]}
    assert [(t["name"], t["used"]) for t in doc["tokens"]] == [("carol", False)]
    stored = json.loads((tmp_path / "tokens.json").read_text())["carol"]
    for hidden in (secret, stored["hash"], stored["salt"]):
        assert hidden not in text

    assert main(["certs", "list", "--dir", d]) == 0
    text = capsys.readouterr().out
    assert "alice" in text and bob_serial in text and "REVOKED" in text and "carol  unused" in text
    for hidden in (secret, stored["hash"], stored["salt"]):
        assert hidden not in text


def test_list_without_a_pki_says_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["certs", "list", "--dir", str(tmp_path / "none")]) == 2
    assert "fedveil certs init" in capsys.readouterr().err
