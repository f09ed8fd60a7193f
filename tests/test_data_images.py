"""Image loaders on tiny fixtures written in each published format, their bad-input paths, Fashion-MNIST
(real when Debian's package is installed, else the labelled stand-in), and ``fedveil data info``."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedveil.cli import main
from fedveil.data.images import (
    CIFAR10_CLASSES,
    FASHION_MNIST_DIRS,
    fashion_mnist,
    load_cifar10_binary,
    load_image_dataset,
    load_image_folder,
    load_mnist_layout,
    synthetic_fashion_mnist,
)
from fedveil.errors import ConfigError, ValidationError
from idx_files import write_idx


def _write_mnist(root: Path, n: int, *, gz: bool, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, n, dtype=np.uint8)
    for prefix in ("train", "t10k"):
        for kind, arr in (("images-idx3", images), ("labels-idx1", labels)):
            name = root / f"{prefix}-{kind}-ubyte"
            write_idx(name.with_name(name.name + ".gz") if gz else name, arr, compress=gz)
    return images, labels


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_layout_reads_idx_plain_and_gzipped(tmp_path: Path, gz: bool) -> None:
    images, labels = _write_mnist(tmp_path, 5, gz=gz)
    data = load_mnist_layout(tmp_path, "test")
    assert data.x.shape == (5, 1, 28, 28) and data.x.dtype == np.float32
    np.testing.assert_allclose(data.x[:, 0], images / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(data.y, labels)
    assert not data.synthetic and "t10k-images" in data.source


def test_idx_bad_input_names_the_file(tmp_path: Path) -> None:
    _write_mnist(tmp_path, 3, gz=False)
    bad = tmp_path / "t10k-images-idx3-ubyte"
    raw = bad.read_bytes()
    bad.write_bytes(b"\x01\x02" + raw[2:])
    with pytest.raises(ValidationError, match="t10k-images-idx3-ubyte is not an IDX file"):
        load_mnist_layout(tmp_path, "test")
    bad.write_bytes(raw[:-10])
    with pytest.raises(ValidationError, match=r"t10k-images-idx3-ubyte: IDX shape \(3, 28, 28\).*needs"):
        load_mnist_layout(tmp_path, "test")
    bad.unlink()
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(raw)[:-20])
    with pytest.raises(ValidationError, match="gzipped but does not decompress"):
        load_mnist_layout(tmp_path, "test")
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", np.zeros((4, 28, 28), np.uint8), compress=True)
    with pytest.raises(ValidationError, match=r"has 4 images but .* has 3 labels"):
        load_mnist_layout(tmp_path, "test")
    with pytest.raises(ConfigError, match="neither"):
        load_mnist_layout(tmp_path / "nowhere", "train")
    with pytest.raises(ConfigError, match="split 'val'"):
        load_mnist_layout(tmp_path, "val")


def _cifar_records(n: int, seed: int) -> tuple[bytes, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n, dtype=np.uint8)
    pixels = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
    raw = b"".join(bytes([labels[i]]) + pixels[i].tobytes() for i in range(n))
    return raw, pixels, labels


def test_cifar10_binary_layout(tmp_path: Path) -> None:
    expected = []
    for i in range(1, 6):
        raw, pixels, labels = _cifar_records(2, i)
        (tmp_path / f"data_batch_{i}.bin").write_bytes(raw)
        expected.append((pixels, labels))
    raw, pixels, labels = _cifar_records(3, 9)
    (tmp_path / "test_batch.bin").write_bytes(raw)
    test = load_cifar10_binary(tmp_path, "test")
    assert test.x.shape == (3, 3, 32, 32) and test.classes == CIFAR10_CLASSES
    np.testing.assert_allclose(test.x, pixels / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(test.y, labels)
    train = load_cifar10_binary(tmp_path, "train")
    np.testing.assert_array_equal(train.y, np.concatenate([lab for _, lab in expected]))
    np.testing.assert_allclose(train.x[2:4], expected[1][0] / 255.0, rtol=1e-6)
    names = [f"c{i}" for i in range(10)]
    (tmp_path / "batches.meta.txt").write_text("\n".join(names) + "\n\n")
    assert load_cifar10_binary(tmp_path, "test").classes == tuple(names)


def test_cifar10_bad_input(tmp_path: Path) -> None:
    raw, _, _ = _cifar_records(2, 0)
    (tmp_path / "test_batch.bin").write_bytes(raw[:-1])
    with pytest.raises(ValidationError, match=r"test_batch.bin has 6145 bytes.*3073"):
        load_cifar10_binary(tmp_path, "test")
    (tmp_path / "test_batch.bin").write_bytes(bytes([10]) + raw[1:])
    with pytest.raises(ValidationError, match="record 0 has label 10"):
        load_cifar10_binary(tmp_path, "test")
    with pytest.raises(ConfigError, match=r"data_batch_1\.bin"):
        load_cifar10_binary(tmp_path, "train")


def test_image_folder(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for cls, suffix in (("cat", "png"), ("dog", "jpg")):
        (tmp_path / cls).mkdir()
        for i in range(2):
            arr = rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)
            Image.fromarray(arr).save(tmp_path / cls / f"{i}.{suffix}")
    data = load_image_folder(tmp_path)
    assert data.classes == ("cat", "dog") and data.x.shape == (4, 3, 6, 5)
    np.testing.assert_array_equal(data.y, [0, 0, 1, 1])
    png = np.asarray(Image.open(tmp_path / "cat" / "0.png"))
    np.testing.assert_allclose(data.x[0], png.transpose(2, 0, 1) / 255.0, rtol=1e-6)
    assert load_image_folder(tmp_path, size=(8, 8), grayscale=True).x.shape == (4, 1, 8, 8)
    Image.fromarray(np.zeros((7, 7, 3), np.uint8)).save(tmp_path / "dog" / "odd.png")
    with pytest.raises(ValidationError, match=r"odd\.png is 7x7.*pass size"):
        load_image_folder(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValidationError, match="empty has no"):
        load_image_folder(tmp_path, size=(8, 8))


def test_fashion_mnist_is_real_when_installed_else_a_labelled_stand_in(tmp_path: Path, monkeypatch) -> None:
    installed = Path(FASHION_MNIST_DIRS[0], "t10k-labels-idx1-ubyte.gz").is_file()
    test = fashion_mnist("test", synthetic_size=50)
    if installed:
        assert not test.synthetic and len(test) == 10000 and test.classes[0] == "T-shirt/top"
        assert "SYNTHETIC" not in test.describe()
    else:
        assert test.synthetic and "SYNTHETIC STAND-IN" in test.describe()
        assert "apt-get install dataset-fashion-mnist" in test.describe()
    monkeypatch.setattr("fedveil.data.images.FASHION_MNIST_DIRS", (str(tmp_path / "none"),))
    monkeypatch.delenv("FEDVEIL_DATA_DIR", raising=False)
    stand_in = fashion_mnist("train", synthetic_size=30)
    assert stand_in.synthetic and len(stand_in) == 30 and "SYNTHETIC STAND-IN" in stand_in.describe()
    assert "apt-get install dataset-fashion-mnist" in stand_in.source
    with pytest.raises(ConfigError, match="apt-get install dataset-fashion-mnist"):
        fashion_mnist("train", allow_synthetic=False)
    _write_mnist(tmp_path, 4, gz=True)
    monkeypatch.setenv("FEDVEIL_DATA_DIR", str(tmp_path.parent))
    (tmp_path.parent / "fashion-mnist").mkdir(exist_ok=True)
    for f in tmp_path.glob("*.gz"):
        (tmp_path.parent / "fashion-mnist" / f.name).write_bytes(f.read_bytes())
    assert not fashion_mnist("train").synthetic and len(fashion_mnist("train")) == 4


def test_synthetic_stand_in_is_learnable_but_not_trivial() -> None:
    train = synthetic_fashion_mnist(1500, seed=0)
    test = synthetic_fashion_mnist(500, seed=0, split="test")
    assert not np.array_equal(train.x[:5], test.x[:5])
    np.testing.assert_array_equal(
        synthetic_fashion_mnist(20, seed=3).x, synthetic_fashion_mnist(20, seed=3).x
    )
    means = np.stack([train.x[train.y == c].mean(0) for c in range(10)])
    pred = ((test.x[:, None] - means[None]) ** 2).sum((2, 3, 4)).argmin(1)
    accuracy = float((pred == test.y).mean())
    assert 0.4 < accuracy < 0.99
    assert train.x.min() >= 0 and train.x.max() <= 1


def test_dataset_names_and_data_info(capsys, monkeypatch) -> None:
    with pytest.raises(ConfigError, match="not one of fashion-mnist"):
        load_image_dataset("imagenet", "train")
    monkeypatch.delenv("FEDVEIL_DATA_DIR", raising=False)
    with pytest.raises(ConfigError, match="FEDVEIL_DATA_DIR"):
        load_image_dataset("cifar10", "train", allow_synthetic=False)
    assert main(["data", "info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    installed = Path(FASHION_MNIST_DIRS[0], "t10k-labels-idx1-ubyte.gz").is_file()
    names = [d["name"] for d in report["found"]]
    assert ("fashion-mnist" in names) == installed
    assert (report["hint"] is None) == installed


def test_sized_synthetic_stand_in_by_name() -> None:
    from fedveil.data.images import load_image_dataset

    train = load_image_dataset("synthetic-fashion-mnist:60", "train")
    test = load_image_dataset("synthetic-fashion-mnist:60", "test")
    assert (len(train), len(test)) == (60, 10) and train.synthetic
    with pytest.raises(ConfigError, match="training size after ':' must be an integer >= 6"):
        load_image_dataset("synthetic-fashion-mnist:x", "train")


def test_cifar10_falls_back_to_a_labelled_stand_in(monkeypatch) -> None:
    from fedveil.data.images import load_image_dataset

    monkeypatch.delenv("FEDVEIL_DATA_DIR", raising=False)
    small = load_image_dataset("synthetic-cifar10:60", "train")
    assert (
        small.x.shape == (60, 3, 32, 32)
        and small.synthetic
        and len(load_image_dataset("synthetic-cifar10:60", "test")) == 12
    )
    assert small.x.min() >= 0.0 and small.x.max() <= 1.0 and set(small.y.tolist()) <= set(range(10))
    stand_in = load_image_dataset("cifar10", "test")
    assert stand_in.synthetic and len(stand_in) == 10000
    assert "CIFAR-10's binary version not found" in stand_in.describe()
    assert "SYNTHETIC" in stand_in.describe()


def test_the_stand_ins_bits_are_the_ones_every_recorded_result_was_computed_on() -> None:
    """The seeded stand-ins are a fixed data set: recorded results (docs/results.md, docs/benchmarks.md)
    were computed on exactly these bytes, so a faster generator must reproduce them bit for bit."""
    import hashlib

    from fedveil.data.images import synthetic_cifar10

    d = synthetic_fashion_mnist(600, seed=3)
    c = synthetic_cifar10(200, seed=1)
    assert hashlib.sha256(d.x.tobytes() + d.y.tobytes()).hexdigest()[:16] == "c8c6b976b38be224"
    assert hashlib.sha256(c.x.tobytes() + c.y.tobytes()).hexdigest()[:16] == "941574384fdc38ce"
