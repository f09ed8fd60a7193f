"""Binary BCH codes: FedUV's Table 1, published generator polynomials, the BCH bound, the disk cache."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedveil.commands import codes as codes_command
from fedveil.errors import ConfigError, FedveilError, ValidationError
from fedveil.privacy import codes
from fedveil.privacy.codes import (
    BchCode,
    bch_code,
    cache_key,
    cache_paths,
    default_cache_dir,
    default_message_length,
    designed_distance,
    valid_dimensions,
)

PROPERTY = settings(max_examples=40, deadline=None)

# FedUV Table 1: code length, message length, d_min.
TABLE_1 = [(127, 64, 21), (255, 71, 59), (511, 67, 175)]

# Lin & Costello, "Error Control Coding", Appendix C: generator polynomials of the binary primitive
# BCH codes in octal (primitive polynomials x^4+x+1, x^5+x^2+1, x^7+x^3+1, as MATLAB's).
LIN_COSTELLO_OCTAL = {
    (15, 11): "23",
    (15, 7): "721",
    (15, 5): "2467",
    (31, 26): "45",
    (31, 21): "3551",
    (31, 16): "107657",
    (31, 11): "5423325",
    (31, 6): "313365047",
    (127, 120): "211",
    (127, 113): "41567",
    (127, 106): "11554743",
}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bch-cache")


@pytest.fixture(scope="module")
def table1_codes(cache_dir: Path) -> dict[int, BchCode]:
    """Table 1's codes, built once with galois per test session (a few seconds) and cached."""
    return {n: bch_code(n, cache_dir=cache_dir) for n, _, _ in TABLE_1}


def reference_encode(message: np.ndarray, poly: np.ndarray, n: int) -> np.ndarray:
    """Systematic cyclic encoding by long division: ``c(x) = m(x) x^(n-k) + (m(x) x^(n-k) mod g(x))``."""
    k = message.size
    word = np.concatenate([message, np.zeros(n - k, dtype=np.uint8)]).astype(np.uint8)
    rem = word.copy()
    for i in range(k):
        if rem[i]:
            rem[i : i + poly.size] ^= poly
    word[k:] = rem[k:]
    return word


def remainder(word: np.ndarray, poly: np.ndarray) -> np.ndarray:
    """``word(x) mod poly(x)`` over GF(2), coefficients highest degree first."""
    rem = word.astype(np.uint8).copy()
    for i in range(word.size - poly.size + 1):
        if rem[i]:
            rem[i : i + poly.size] ^= poly
    return rem[word.size - poly.size + 1 :]


def octal_of(code: BchCode) -> str:
    return format(int(code.generator_poly_hex, 16), "o")


# ---- Table 1 -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "k", "d"), TABLE_1)
def test_table1_known_answers(table1_codes: dict[int, BchCode], n: int, k: int, d: int) -> None:
    code = table1_codes[n]
    assert (code.n, code.k, code.d) == (n, k, d)
    assert default_message_length(n) == k
    assert designed_distance(n, k) == d
    assert code.generator_matrix.shape == (k, n)
    assert code.generator_poly.size == n - k + 1


def test_table1_derived_statistics(table1_codes: dict[int, BchCode]) -> None:
    """Table 1 lists only (n, k, d_min); t, rate and Theorem 1's correlation bound follow from them."""
    stats = [(c.t, round(c.rate, 4), round(c.max_correlation, 4)) for c in table1_codes.values()]
    assert stats == [(10, 0.5039, 0.6693), (29, 0.2784, 0.5373), (87, 0.1311, 0.3151)]


@pytest.mark.parametrize("n", [127, 255, 511])
def test_encode_matches_long_division_reference(table1_codes: dict[int, BchCode], n: int) -> None:
    code = table1_codes[n]
    rng = np.random.default_rng(n)
    messages = rng.integers(0, 2, (6, code.k), dtype=np.uint8)
    words = code.encode(messages)
    assert words.shape == (6, n) and words.dtype == np.uint8
    for m, w in zip(messages, words, strict=True):
        assert np.array_equal(w, reference_encode(m, code.generator_poly, n))
        assert not remainder(w, code.generator_poly).any()
        assert np.array_equal(w[: code.k], m)


def test_generator_poly_divides_x_n_minus_1(table1_codes: dict[int, BchCode]) -> None:
    for code in table1_codes.values():
        x_n_1 = np.zeros(code.n + 1, dtype=np.uint8)
        x_n_1[[0, -1]] = 1
        assert not remainder(x_n_1, code.generator_poly).any()


@PROPERTY
@given(st.data())
def test_distinct_codewords_differ_in_at_least_d_bits(
    table1_codes: dict[int, BchCode], data: st.DataObject
) -> None:
    """The BCH bound behind Theorem 1: distinct messages give codewords at Hamming distance >= d."""
    code = table1_codes[data.draw(st.sampled_from([127, 255, 511]))]
    bits = st.lists(st.integers(0, 1), min_size=code.k, max_size=code.k)
    a = np.array(data.draw(bits), dtype=np.uint8)
    b = np.array(data.draw(bits), dtype=np.uint8)
    wa, wb = code.encode(a), code.encode(b)
    assert np.array_equal(code.encode(a ^ b), wa ^ wb)
    distance = int((wa != wb).sum())
    if np.array_equal(a, b):
        assert distance == 0
    else:
        assert distance >= code.d
        va, vb = 1.0 - 2.0 * wa, 1.0 - 2.0 * wb
        assert va @ vb / code.n <= code.max_correlation + 1e-12


def test_encode_batches_of_any_leading_shape(table1_codes: dict[int, BchCode]) -> None:
    code = table1_codes[127]
    messages = np.random.default_rng(0).integers(0, 2, (2, 3, code.k)).astype(bool)
    words = code.encode(messages)
    assert words.shape == (2, 3, 127)
    assert np.array_equal(words[1, 2], code.encode(messages[1, 2].astype(np.uint8)))
    assert code.encode(np.zeros((0, code.k), dtype=np.uint8)).shape == (0, 127)


# ---- small codes: published polynomials, valid dimensions, true minimum distance -------------------


def test_valid_dimensions_known_answers() -> None:
    assert valid_dimensions(7) == [(4, 3), (1, 7)]
    assert valid_dimensions(15) == [(11, 3), (7, 5), (5, 7), (1, 15)]
    assert valid_dimensions(31) == [(26, 3), (21, 5), (16, 7), (11, 11), (6, 15), (1, 31)]
    dims127 = valid_dimensions(127)
    assert dims127[:9] == [
        (120, 3),
        (113, 5),
        (106, 7),
        (99, 9),
        (92, 11),
        (85, 13),
        (78, 15),
        (71, 19),
        (64, 21),
    ]
    assert len(valid_dimensions(4095)) > 100


def test_valid_dimensions_agree_with_galois() -> None:
    """galois.BCH(n, d=d) has dimension k, and d + 1 already gives a smaller code: d is the largest."""
    import galois

    for n in (15, 31):
        poly = galois.matlab_primitive_poly(2, n.bit_length())
        ext = galois.GF(n + 1, irreducible_poly=poly, compile="python-calculate")
        try:
            for k, d in valid_dimensions(n):
                assert (galois.BCH(n, d=d, extension_field=ext).k, d) == (k, d)
                if d < n:
                    assert galois.BCH(n, d=d + 1, extension_field=ext).k < k
        finally:
            ext.compile("auto")


@pytest.mark.parametrize(("n", "k"), sorted(LIN_COSTELLO_OCTAL))
def test_generator_polynomials_match_published_table(cache_dir: Path, n: int, k: int) -> None:
    assert octal_of(bch_code(n, k, cache_dir=cache_dir)) == LIN_COSTELLO_OCTAL[n, k]


@pytest.mark.parametrize(("n", "k"), [(15, 11), (15, 7), (15, 5), (31, 16), (31, 11), (31, 6)])
def test_true_minimum_distance_by_enumeration(cache_dir: Path, n: int, k: int) -> None:
    """For these codes the minimum weight over all 2^k - 1 nonzero codewords equals the designed d."""
    code = bch_code(n, k, cache_dir=cache_dir)
    messages = np.array(list(itertools.product((0, 1), repeat=k))[1:], dtype=np.uint8)
    assert int(code.encode(messages).sum(axis=1).min()) == code.d


# ---- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "named"),
    [
        (128, ["n=128", "n=127", "n=255"]),
        (3, ["n=3", "n=7"]),
        (8191, ["n=8191", "n=4095"]),
        (0, ["n=0", "n=7"]),
    ],
)
def test_invalid_length_names_value_and_nearest(n: int, named: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        bch_code(n)
    for text in named:
        assert text in str(info.value)


def test_invalid_dimension_names_value_and_nearest(cache_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"k=65 .*n=127.*nearest valid: k=64 \(d=21\), k=71 \(d=19\)"):
        bch_code(127, 65, cache_dir=cache_dir)
    with pytest.raises(ConfigError, match=r"k=200.*nearest valid: k=120 \(d=3\)"):
        bch_code(127, 200, cache_dir=cache_dir)
    with pytest.raises(ConfigError, match="not the message length"):
        designed_distance(127, 64.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"integer 2\^i - 1, not '127'"):
        valid_dimensions("127")  # type: ignore[arg-type]


def test_no_default_dimension_for_short_codes() -> None:
    with pytest.raises(ConfigError, match=r"n=63 has message length k >= 64; the largest is k=57.*n=127"):
        bch_code(63)
    assert default_message_length(63, minimum=31) == 36


def test_bad_messages_are_rejected(table1_codes: dict[int, BchCode]) -> None:
    code = table1_codes[127]
    with pytest.raises(ValidationError, match=r"shape \(\.\.\., 64\), not \(63,\)"):
        code.encode(np.zeros(63, dtype=np.uint8))
    with pytest.raises(ValidationError, match="found values in"):
        code.encode(np.full(64, 2, dtype=np.uint8))
    with pytest.raises(ValidationError, match="dtype float"):
        code.encode(np.zeros(64))
    with pytest.raises(ValidationError, match="not \\(\\)"):
        code.encode(np.uint8(1))


def test_inconsistent_code_objects_are_rejected(table1_codes: dict[int, BchCode]) -> None:
    code = table1_codes[127]
    with pytest.raises(ConfigError, match=r"d=20 is not the designed distance of BCH\(127, 64\); it is d=21"):
        BchCode(127, 64, 20, code.generator_matrix, code.generator_poly)
    with pytest.raises(ValidationError, match="not systematic"):
        BchCode(127, 64, 21, code.generator_matrix[::-1], code.generator_poly)
    with pytest.raises(FedveilError, match="shape"):
        BchCode(127, 64, 21, code.generator_matrix[:, :-1], code.generator_poly)
    assert not code.generator_matrix.flags.writeable


# ---- the disk cache ------------------------------------------------------------------------------------


def test_cache_key_holds_n_k_galois_version_and_format(monkeypatch: pytest.MonkeyPatch) -> None:
    key = cache_key(127, 64)
    assert key.startswith("bch-n127-k64-galois") and key.endswith(f"-fmt{codes.CACHE_FORMAT_VERSION}")
    monkeypatch.setattr(codes, "_galois_version", lambda: "9.9.9+local")
    assert cache_key(127, 64) == f"bch-n127-k64-galois9_9_9_local-fmt{codes.CACHE_FORMAT_VERSION}"
    monkeypatch.setattr(codes, "CACHE_FORMAT_VERSION", codes.CACHE_FORMAT_VERSION + 1)
    assert cache_key(127, 64).endswith(f"-fmt{codes.CACHE_FORMAT_VERSION}")


def test_default_cache_dir_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(codes.CACHE_DIR_ENV, str(tmp_path))
    assert default_cache_dir() == tmp_path / "bch"
    monkeypatch.delenv(codes.CACHE_DIR_ENV)
    assert default_cache_dir() == Path.home() / ".cache" / "fedveil" / "bch"


def _count_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = codes.build_with_galois

    def counting(n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
        calls.append(n)
        return real(n, d)

    monkeypatch.setattr(codes, "build_with_galois", counting)
    return calls


def test_second_load_reads_the_cache_without_galois(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, table1_codes: dict[int, BchCode], cache_dir: Path
) -> None:
    calls = _count_builds(monkeypatch)
    first = bch_code(15, 7, cache_dir=tmp_path)
    second = bch_code(15, 7, cache_dir=tmp_path)
    assert calls == [15]
    assert np.array_equal(first.generator_matrix, second.generator_matrix)
    npy, meta = cache_paths(first, tmp_path)
    assert npy.is_file() and meta.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([npy.name, meta.name])  # no temp files left
    doc = json.loads(meta.read_text())
    assert (doc["n"], doc["k"], doc["d"], doc["format"]) == (15, 7, 5, codes.CACHE_FORMAT_VERSION)
    # Table 1's codes come from the module cache without another construction.
    assert bch_code(511, cache_dir=cache_dir).d == 175
    assert calls == [15]


def test_changed_galois_version_is_a_cache_miss(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = _count_builds(monkeypatch)
    bch_code(15, 7, cache_dir=tmp_path)
    monkeypatch.setattr(codes, "_galois_version", lambda: "0.0.1")
    bch_code(15, 7, cache_dir=tmp_path)
    assert calls == [15, 15]
    assert len(list(tmp_path.glob("*.npy"))) == 2


def _corrupt_matrix(npy: Path, meta: Path) -> None:
    g = np.load(npy)
    g[0, -1] ^= 1
    np.save(npy, g)


def _pickled_object_array(npy: Path, meta: Path) -> None:
    np.save(npy, np.array([{"evil": 1}], dtype=object), allow_pickle=True)


def _wrong_metadata(npy: Path, meta: Path) -> None:
    doc = json.loads(meta.read_text())
    doc["d"] = 3
    meta.write_text(json.dumps(doc))


def _truncated(npy: Path, meta: Path) -> None:
    npy.write_bytes(npy.read_bytes()[:50])


def _bad_json(npy: Path, meta: Path) -> None:
    meta.write_text("{not json")


def _non_binary_poly(npy: Path, meta: Path) -> None:
    doc = json.loads(meta.read_text())
    doc["generator_poly"] = "12"
    meta.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "damage",
    [_corrupt_matrix, _pickled_object_array, _wrong_metadata, _truncated, _bad_json, _non_binary_poly],
)
def test_invalid_cache_entries_are_rebuilt(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: object
) -> None:
    good = bch_code(15, 7, cache_dir=tmp_path)
    npy, meta = cache_paths(good, tmp_path)
    damage(npy, meta)  # type: ignore[operator]
    calls = _count_builds(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="fedveil.privacy.codes"):
        rebuilt = bch_code(15, 7, cache_dir=tmp_path)
    assert calls == [15]
    assert "ignoring invalid BCH cache entry" in caplog.text
    assert np.array_equal(rebuilt.generator_matrix, good.generator_matrix)
    assert np.array_equal(np.load(npy, allow_pickle=False), good.generator_matrix)


# ---- command line -------------------------------------------------------------------------------------


def run_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="fedveil")
    codes_command.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    status = args.func(args)
    return status, capsys.readouterr().out


@pytest.mark.parametrize(("n", "k", "d"), TABLE_1)
def test_cli_prints_table1(
    table1_codes: dict[int, BchCode],
    cache_dir: Path,
    capsys: pytest.CaptureFixture[str],
    n: int,
    k: int,
    d: int,
) -> None:
    status, out = run_command(
        ["codes", "bch", "--n", str(n), "--json", "--cache-dir", str(cache_dir)], capsys
    )
    doc = json.loads(out)
    assert status == 0
    assert (doc["n"], doc["k"], doc["d"]) == (n, k, d)
    assert doc["t"] == (d - 1) // 2
    assert doc["generator_poly"] == table1_codes[n].generator_poly_hex


def test_cli_uses_environment_cache_and_explicit_k(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(codes.CACHE_DIR_ENV, str(tmp_path))
    status, out = run_command(["codes", "bch", "--n", "127", "--k", "71"], capsys)
    assert status == 0
    assert out.strip() == "BCH(127, 71): d = 19, t = 9, rate = 0.559, max correlation = 0.701"
    assert (tmp_path / "bch" / f"{cache_key(127, 71)}.npy").is_file()


def test_cli_lists_dimensions(capsys: pytest.CaptureFixture[str]) -> None:
    status, out = run_command(["codes", "bch", "--n", "15", "--list", "--json"], capsys)
    assert status == 0
    assert json.loads(out)["dimensions"] == [
        {"k": 11, "d": 3},
        {"k": 7, "d": 5},
        {"k": 5, "d": 7},
        {"k": 1, "d": 15},
    ]


def test_cli_bench_reports_per_user_times(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["codes", "bench", "--n", "127", "--users", "20", "--json", "--cache-dir", str(cache_dir)]
    status, out = run_command(argv, capsys)
    doc = json.loads(out)
    assert status == 0
    assert (doc["n"], doc["k"], doc["users"]) == (127, 64, 20)
    assert 0 < doc["median_ms"] <= doc["p90_ms"] <= doc["p99_ms"] <= doc["max_ms"]


def test_cli_bad_input_is_a_fedveil_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="n=128"):
        run_command(["codes", "bch", "--n", "128", "--json"], capsys)
