"""MNIST-UV from EMNIST-byclass IDX files with writer ids, and from LEAF FEMNIST JSON (tiny fixtures)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedveil.data.emnist import (
    HandwritingSamples,
    MnistUvRecipe,
    build_mnist_uv,
    load_emnist_byclass,
    load_leaf_femnist,
    read_idx,
    read_writer_ids,
    split_pool_sizes,
)
from fedveil.data.mnist_uv import DIGITS, SPLITS, SUB_IMAGE_KEY, X_KEY
from fedveil.errors import ConfigError, ValidationError
from idx_files import IDX_CODES, write_idx

# A fake handwriting source: writer w wrote n_images[w][label] images of each label; every image is
# unique (random pixels seeded by its row), so an example channel can be traced back by equality.
WRITER_COUNTS = {
    "w00": 6,
    "w01": 6,
    "w02": 5,
    "w03": 7,
    "w04": 6,
    "w05": 2,  # too few for a seen writer, enough for an unseen one
    "w06": 1,
    "w07": 4,
}
LABELS = (0, 2, 3, 4, 5, 7, 11, 40)  # digits and letters; only 2-5 are kept


def _source() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = [(w, label) for w, n in WRITER_COUNTS.items() for label in LABELS for _ in range(n)]
    order = np.random.default_rng(0).permutation(len(rows))
    writers = np.array([rows[i][0] for i in order])
    labels = np.array([rows[i][1] for i in order], dtype=np.uint8)
    images = np.random.default_rng(1).integers(0, 256, (len(rows), 28, 28), dtype=np.uint8)
    return images, labels, writers


@pytest.fixture(scope="module")
def emnist_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("emnist")
    images, labels, writers = _source()
    # EMNIST stores every image transposed.
    img = write_idx(
        root / "emnist-byclass-train-images-idx3-ubyte.gz", images.transpose(0, 2, 1), compress=True
    )
    lab = write_idx(root / "emnist-byclass-train-labels-idx1-ubyte", labels)
    ids = root / "writers.csv"
    ids.write_text("writer_id\n" + "\n".join(writers.tolist()) + "\n")
    return img, lab, ids


RECIPE = MnistUvRecipe(seed=1, writers=4, train=20, val=8, test=8, unseen_writers=2)


def test_load_emnist_keeps_digits_upright_and_traceable(emnist_files: tuple[Path, Path, Path]) -> None:
    images, labels, writers = _source()
    samples = load_emnist_byclass(*emnist_files)
    keep = np.flatnonzero(np.isin(labels, DIGITS))
    assert samples.source_index.tolist() == keep.tolist() and samples.source_rows == len(labels)
    assert np.array_equal(samples.images, images[keep].astype(np.float32) / 255)
    assert samples.labels.tolist() == labels[keep].tolist()
    assert samples.writer_ids.tolist() == writers[keep].tolist()


def _check_mnist_uv(data, samples: HandwritingSamples, source_images: np.ndarray) -> None:
    lookup = {int(i): k for k, i in enumerate(samples.source_index)}
    seen = set(data.train.user_ids)
    assert seen == {"w00", "w01", "w03", "w04"}
    assert set(data.unseen.user_ids).isdisjoint(seen) and len(data.unseen) == 2
    for writer in data.train.user_ids:
        used = []
        for split, count in zip(SPLITS, (20, 8, 8), strict=True):
            x, ids = data.split(split).array(writer, X_KEY), data.split(split).array(writer, SUB_IMAGE_KEY)
            assert x.shape == (count, 4, 28, 28) and x.dtype == np.float32
            assert len({tuple(r) for r in ids.tolist()}) == count  # unique examples within a split
            for e, j in itertools.product(range(count), range(4)):
                k = lookup[int(ids[e, j])]
                assert samples.labels[k] == DIGITS[j] and samples.writer_ids[k] == writer
                assert np.array_equal(x[e, j], source_images[k])
            used.append(set(ids.ravel().tolist()))
        assert all(a.isdisjoint(b) for a, b in itertools.combinations(used, 2))  # never across splits
    for user in data.unseen:
        x, ids = user.arrays[X_KEY], user.arrays[SUB_IMAGE_KEY]
        assert x.shape == (1, 4, 28, 28)
        for j in range(4):
            k = lookup[int(ids[0, j])]
            assert samples.labels[k] == DIGITS[j] and samples.writer_ids[k] == user.user_id


def test_build_from_emnist_follows_the_recipe(emnist_files: tuple[Path, Path, Path]) -> None:
    samples = load_emnist_byclass(*emnist_files)
    data = build_mnist_uv(samples, RECIPE)
    _check_mnist_uv(data, samples, samples.images)
    again = build_mnist_uv(samples, RECIPE)
    assert all(
        np.array_equal(data.train.array(w, SUB_IMAGE_KEY), again.train.array(w, SUB_IMAGE_KEY))
        for w in data.train.user_ids
    )


def test_too_few_writers_is_an_error(emnist_files: tuple[Path, Path, Path]) -> None:
    samples = load_emnist_byclass(*emnist_files)
    # Five images of each digit cannot hold 20/8/8 distinct examples, so w02 (and w05-w07) drop out.
    with pytest.raises(ValidationError, match=r"only 4 of 8 writers .* at most 4 writers"):
        build_mnist_uv(samples, MnistUvRecipe(writers=5, train=20, val=8, test=8, unseen_writers=0))
    with pytest.raises(ValidationError, match="at most 4 unseen writers"):
        build_mnist_uv(samples, MnistUvRecipe(writers=4, train=20, val=8, test=8, unseen_writers=5))


def test_concatenate_shifts_source_rows(emnist_files: tuple[Path, Path, Path]) -> None:
    part = load_emnist_byclass(*emnist_files)
    both = HandwritingSamples.concatenate([part, part])
    assert both.source_rows == 2 * part.source_rows
    assert (
        both.source_index.tolist()
        == part.source_index.tolist() + (part.source_index + part.source_rows).tolist()
    )


def _leaf_files(root: Path, images: np.ndarray, labels: np.ndarray, writers: np.ndarray) -> list[Path]:
    """Two LEAF JSON files (writers split between them), white background: x = 1 - ink."""
    names = sorted(set(writers.tolist()))
    paths = []
    for f, group in enumerate((names[:3], names[3:])):
        doc = {"users": group, "num_samples": [], "user_data": {}}
        for w in group:
            rows = np.flatnonzero(writers == w)
            doc["num_samples"].append(len(rows))
            doc["user_data"][w] = {
                "x": (1.0 - images[rows].reshape(len(rows), -1) / 255.0).tolist(),
                "y": labels[rows].tolist(),
            }
        paths.append(root / f"all_data_{f}.json")
        paths[-1].write_text(json.dumps(doc))
    return paths


def test_leaf_femnist_builds_the_same_recipe(tmp_path: Path) -> None:
    images, labels, writers = _source()
    paths = _leaf_files(tmp_path, images, labels, writers)
    samples = load_leaf_femnist(tmp_path)
    assert set(samples.labels.tolist()) == set(DIGITS)
    assert np.allclose(samples.images.max(), 1.0) and samples.source_rows == len(labels)
    first = samples.writer_ids == "w00"
    assert np.allclose(
        samples.images[first], images[(writers == "w00") & np.isin(labels, DIGITS)] / 255, atol=1e-6
    )
    data = build_mnist_uv(samples, RECIPE)
    _check_mnist_uv(data, samples, samples.images)
    assert load_leaf_femnist(paths).source_index.tolist() == samples.source_index.tolist()


def _leaf_doc(**changes: object) -> dict:
    doc = {"users": ["a"], "num_samples": [2], "user_data": {"a": {"x": [[0.5] * 784] * 2, "y": [2, 3]}}}
    doc.update(changes)
    return doc


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"users": ["a"]}, "'users', 'num_samples' and 'user_data'"),
        (_leaf_doc(num_samples=[3]), "declares 3 samples"),
        (_leaf_doc(user_data={"a": {"x": [[0.5] * 783] * 2, "y": [2, 3]}}), "user 'a' .*784"),
        (_leaf_doc(user_data={"a": {"x": [[1.5] * 784] * 2, "y": [2, 3]}}), "outside \\[0, 1\\]"),
        (_leaf_doc(user_data={"a": {"x": [[0.5] * 784] * 2, "y": [2, 70]}}), "byclass labels"),
        (_leaf_doc(user_data={}), "'a' is listed but has no user_data"),
        (_leaf_doc(users=["a", "a"], num_samples=[2, 2]), "appears more than once"),
        (_leaf_doc(users=[""]), "non-empty strings"),
    ],
)
def test_leaf_rejects_malformed_files(tmp_path: Path, doc: dict, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValidationError, match=message):
        load_leaf_femnist(path)


def test_leaf_rejects_non_json_and_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ValidationError, match=r"x\.json is not valid JSON"):
        load_leaf_femnist(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValidationError, match="holds no"):
        load_leaf_femnist(tmp_path / "empty")


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(sorted(IDX_CODES, key=str)),
    shape=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    compress=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_idx_round_trip(tmp_path_factory: pytest.TempPathFactory, dtype, shape, compress, seed) -> None:
    values = np.random.default_rng(seed).integers(-100, 100, shape).astype(dtype)
    path = write_idx(tmp_path_factory.mktemp("idx") / "a.idx", values, compress=compress)
    out = read_idx(path)
    assert out.dtype == dtype and out.dtype.isnative and np.array_equal(out, values)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x01\x00\x08\x01\x00\x00\x00\x01\x05", "two zero bytes"),
        (b"\x00\x00\x07\x01\x00\x00\x00\x01\x05", "unknown IDX type byte 0x07"),
        (b"\x00\x00\x08\x00", "number of dimensions must be 1 to 8, got 0"),
        (b"\x00\x00\x08\x02\x00\x00", "header needs 12 bytes"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x03\x05", r"shape \(3,\) of uint8 needs 11 bytes, the file has 9"),
        (b"\x1f\x8bnot gzip", "does not decompress"),
    ],
)
def test_idx_rejects_bad_files(tmp_path: Path, raw: bytes, message: str) -> None:
    path = tmp_path / "bad.idx"
    path.write_bytes(raw)
    with pytest.raises(ValidationError, match=message):
        read_idx(path)


def test_emnist_rejects_misaligned_or_wrong_files(
    tmp_path: Path, emnist_files: tuple[Path, Path, Path]
) -> None:
    img, lab, _ = emnist_files
    short = tmp_path / "short.txt"
    short.write_text("a\nb\n")
    with pytest.raises(ValidationError, match="must align row by row"):
        load_emnist_byclass(img, lab, short)
    with pytest.raises(ValidationError, match="expected uint8 images"):
        load_emnist_byclass(lab, lab, short)
    with pytest.raises(ValidationError, match="cannot read"):
        load_emnist_byclass(tmp_path / "missing", lab, short)
    bad_labels = write_idx(tmp_path / "labels", np.array([1, 62], dtype=np.uint8))
    images = write_idx(tmp_path / "images", np.zeros((2, 28, 28), dtype=np.uint8))
    with pytest.raises(ValidationError, match="row 1: label 62"):
        load_emnist_byclass(images, bad_labels, short)


def test_writer_id_formats(tmp_path: Path) -> None:
    plain = tmp_path / "ids.txt"
    plain.write_text("f0001\n f0002 \nf0001\n")
    assert read_writer_ids(plain).tolist() == ["f0001", "f0002", "f0001"]
    table = tmp_path / "ids.csv"
    table.write_text("row,writer_id\n0,7\n1,9\n")
    assert read_writer_ids(table).tolist() == ["7", "9"]
    npz = tmp_path / "ids.npz"
    np.savez(npz, writer_ids=np.array([3, 4, 3]))
    assert read_writer_ids(npz).tolist() == ["3", "4", "3"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("a.csv", "writer_id\nx\n\ny\n", "line 3: expected 1 columns, got 0"),
        ("b.csv", "writer_id,row\n ,0\n", "line 2: empty writer id"),
        ("c.csv", "a,b\n1,2\n", "no 'writer_id' column"),
        ("d.csv", "", "holds no writer ids"),
    ],
)
def test_writer_ids_rejected(tmp_path: Path, name: str, content: str, message: str) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(ValidationError, match=message):
        read_writer_ids(tmp_path / name)


def test_writer_ids_npz_without_pickle(tmp_path: Path) -> None:
    np.savez(tmp_path / "obj.npz", writer_ids=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValidationError, match="without pickle"):
        read_writer_ids(tmp_path / "obj.npz")
    np.savez(tmp_path / "other.npz", ids=np.arange(3))
    with pytest.raises(ValidationError, match="no array 'writer_ids'"):
        read_writer_ids(tmp_path / "other.npz")


def test_split_pool_sizes_known_answers() -> None:
    # About what an EMNIST writer has (10 images per digit): val and test 2 each, training the rest.
    assert split_pool_sizes([10, 10, 10, 10], (50, 15, 15)).tolist() == [[6] * 4, [2] * 4, [2] * 4]
    # Validation and test images come from the digit with the most to spare.
    assert split_pool_sizes([4, 4, 4, 12], (30, 2, 2)).tolist() == [[2, 2, 2, 8], [1, 1, 1, 2], [1, 1, 1, 2]]
    assert split_pool_sizes([2, 10, 10, 10], (1, 1, 1)) is None
    assert split_pool_sizes([5, 5, 5, 5], (50, 15, 15)) is None


def _brute_force_best_train(per_digit: list[int], counts: tuple[int, int, int]) -> int:
    """The largest training-pool product over every split into three pools of >= 1 image per digit."""
    best = 0
    ranges = [range(1, n - 1) for n in per_digit]
    for v in itertools.product(*ranges):
        if math.prod(v) < counts[1]:
            continue
        for t in itertools.product(*[range(1, n - a) for n, a in zip(per_digit, v, strict=True)]):
            train = [n - a - b for n, a, b in zip(per_digit, v, t, strict=True)]
            if math.prod(t) >= counts[2] and min(train) >= 1:
                best = max(best, math.prod(train))
    return best if best >= counts[0] else 0


@settings(max_examples=150, deadline=None)
@given(
    per_digit=st.lists(st.integers(0, 7), min_size=1, max_size=4),
    counts=st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(1, 12)),
)
def test_split_pool_sizes_is_optimal_against_brute_force(
    per_digit: list[int], counts: tuple[int, int, int]
) -> None:
    sizes = split_pool_sizes(per_digit, counts)
    best = _brute_force_best_train(per_digit, counts)
    if best == 0:
        assert sizes is None
        return
    assert sizes is not None and np.all(sizes >= 1) and sizes.sum(axis=0).tolist() == per_digit
    assert all(math.prod(sizes[s].tolist()) >= counts[s] for s in range(3))
    assert math.prod(sizes[0].tolist()) == best


def test_recipe_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="writers must be an integer >= 1, got 0"):
        MnistUvRecipe(writers=0)
    with pytest.raises(ConfigError, match="unseen_writers"):
        MnistUvRecipe(unseen_writers=-1)
