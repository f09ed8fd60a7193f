"""Face data loaders on tiny fixtures written in each published layout: VGGFace2 folders with
identity_meta.csv, insightface's MS1M RecordIO (read without MXNet), and LFW's pairs.txt; every bad input
fails naming the file, record or line."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from fedveil.data.faces import RecordIO, load_face_folder, load_recordio_faces, read_pairs, write_recordio
from fedveil.errors import ConfigError, ValidationError


def _jpeg(colour: tuple[int, int, int], side: int = 40) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), colour).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def test_vggface2_folder_with_identity_meta(tmp_path: Path) -> None:
    root = tmp_path / "train"
    for ident, colour in (("n000001", (200, 30, 30)), ("n000002", (30, 200, 30))):
        (root / ident).mkdir(parents=True)
        for k in range(3):
            (root / ident / f"{k + 1:04d}_01.jpg").write_bytes(_jpeg(colour))
    (tmp_path / "identity_meta.csv").write_text(
        'Class_ID, Name, Sample_Num, Flag, Gender\nn000001, "Ann_A", 3, 1, f\nn000002, "Bob_B", 3, 1, m\n'
    )
    faces = load_face_folder(root, size=16, max_per_identity=2)
    assert faces.x.shape == (4, 3, 16, 16) and faces.x.dtype == np.float32
    assert faces.names == ("Ann_A", "Bob_B")
    assert faces.identity.tolist() == [0, 0, 1, 1]
    assert faces.x[0, 0].mean() > 0.7 and faces.x[2, 1].mean() > 0.7  # red, then green
    (root / "n000003").mkdir()
    with pytest.raises(ValidationError, match=r"n000003 has no \.jpg/\.png photos"):
        load_face_folder(root, size=16)
    (root / "n000003" / "0001_01.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(ValidationError, match=r"0001_01\.jpg is not a readable image"):
        load_face_folder(root, size=16)


def _ms1m(tmp_path: Path, images: int = 4) -> Path:
    records = [(0, [float(images + 1), float(images + 1)], b"")]
    records += [(k, float(k % 2), _jpeg((40 * k, 0, 0))) for k in range(1, images + 1)]
    write_recordio(tmp_path / "train.rec", tmp_path / "train.idx", records)
    return tmp_path


def test_ms1m_recordio_reads_without_mxnet(tmp_path: Path) -> None:
    root = _ms1m(tmp_path)
    faces = load_recordio_faces(root, size=16)
    assert faces.x.shape == (4, 3, 16, 16)
    assert faces.identity.tolist() == [1, 0, 1, 0] and faces.names == ("0", "1")
    assert load_recordio_faces(root, size=16, limit=2).identity.tolist() == [1, 0]
    header = RecordIO(root / "train.rec", root / "train.idx").read(0)
    assert header.flag == 2 and header.labels == (5.0, 5.0)


def test_recordio_damage_is_named(tmp_path: Path) -> None:
    root = _ms1m(tmp_path)
    rec = root / "train.rec"
    data = bytearray(rec.read_bytes())
    offset = RecordIO(rec, root / "train.idx").offsets[2]
    bad = bytearray(data)
    bad[offset] ^= 0xFF
    rec.write_bytes(bytes(bad))
    with pytest.raises(ValidationError, match=r"record 2 at offset \d+: magic 0x"):
        load_recordio_faces(root)
    rec.write_bytes(bytes(data[: offset + 20]))
    with pytest.raises(ValidationError, match=r"offset \d+ outside .*train\.rec"):
        load_recordio_faces(root)  # records 3 and 4 are indexed past the end
    index = (root / "train.idx").read_text().splitlines()
    (root / "train.idx").write_text("\n".join(index[:3]) + "\n")
    with pytest.raises(ValidationError, match=r"record 2 at offset \d+: truncated, 12 of \d+ payload bytes"):
        RecordIO(rec, root / "train.idx").read(2)
    (root / "train.idx").write_text("0\tzero\n")
    with pytest.raises(ValidationError, match=r"train.idx, line 1: expected key<TAB>offset"):
        RecordIO(rec, root / "train.idx")
    with pytest.raises(ConfigError, match="does not exist"):
        RecordIO(tmp_path / "none.rec", root / "train.idx")


def test_a_continuation_flag_is_refused(tmp_path: Path) -> None:
    rec, idx = tmp_path / "t.rec", tmp_path / "t.idx"
    rec.write_bytes(struct.pack("<II", 0xCED7230A, (1 << 29) | 24) + bytes(24))
    idx.write_text("0\t0\n")
    with pytest.raises(ValidationError, match="continuation flag 1"):
        RecordIO(rec, idx).read(0)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(
                st.floats(-1e6, 1e6, width=32),
                st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=5),
            ),
            st.binary(max_size=64),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_recordio_round_trip(tmp_path_factory: pytest.TempPathFactory, entries: list) -> None:
    """Any records written in the format read back identically (labels, flags, payload, padding)."""
    d = tmp_path_factory.mktemp("rio")
    write_recordio(d / "x.rec", d / "x.idx", [(k, label, image) for k, (label, image) in enumerate(entries)])
    reader = RecordIO(d / "x.rec", d / "x.idx")
    for k, (label, image) in enumerate(entries):
        record = reader.read(k)
        assert record.image == image and record.id == k
        expected = [label] if isinstance(label, float) else label
        assert record.flag == (0 if isinstance(label, float) else len(label))
        np.testing.assert_array_equal(np.float32(record.labels), np.float32(expected))


def test_lfw_pairs(tmp_path: Path) -> None:
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("1\t2\nAnn_A\t1\t2\nBob_B\t1\t3\nAnn_A\t1\tBob_B\t2\nBob_B\t3\tCid_C\t1\n")
    parsed = read_pairs(pairs)
    assert [p.same for p in parsed] == [True, True, False, False]
    assert parsed[0].paths("/lfw")[1] == Path("/lfw/Ann_A/Ann_A_0002.jpg")
    with pytest.raises(ValidationError, match=r"line 5: unknown identity 'Cid_C'"):
        read_pairs(pairs, known={"Ann_A", "Bob_B"})
    pairs.write_text("1\t2\nAnn_A\t1\t2\n")
    with pytest.raises(ValidationError, match="announces 4 pairs, the file has 1"):
        read_pairs(pairs)
    pairs.write_text("1\t1\nAnn_A\tone\t2\nAnn_A\t1\tBob_B\t2\n")
    with pytest.raises(ValidationError, match="line 2: expected 'name i j'"):
        read_pairs(pairs)


def test_synthetic_faces_are_seeded_persistent_and_shifted_between_domains() -> None:
    from fedveil.data.faces import synthetic_faces

    faces, reference = synthetic_faces(6, 3, domain="private", size=32, seed=1)
    assert faces.synthetic and "SYNTHETIC" in faces.source
    assert faces.x.shape == (24, 3, 32, 32) and reference.tolist() == [True, False, False, False] * 6
    again, _ = synthetic_faces(6, 3, domain="private", size=32, seed=1)
    np.testing.assert_array_equal(faces.x, again.x)
    # identity k is the same person whichever range it is drawn in
    tail, _ = synthetic_faces(2, 3, domain="private", size=32, seed=1, first_identity=4)
    np.testing.assert_array_equal(tail.x, faces.x[16:])
    assert tail.names == ("private-4", "private-5")
    # a reference photo is closer to its own identity's wild photos than another's, on average
    flat = faces.x.reshape(len(faces), -1)
    refs, wild = flat[reference], flat[~reference]
    d = ((refs[:, None] - wild[None]) ** 2).mean(-1)
    own = d[faces.identity[reference][:, None] == faces.identity[~reference][None]]
    other = d[faces.identity[reference][:, None] != faces.identity[~reference][None]]
    assert own.mean() < other.mean()
    # the domain shift: mostly black hair (the band above the forehead is darker) and a narrower range of
    # skin tones (a cheek's colour varies less across identities) in the private domain
    public, _ = synthetic_faces(40, 0, domain="public", size=32, seed=1)
    private, _ = synthetic_faces(40, 0, domain="private", size=32, seed=1)
    assert public.x[:, :, 4:7, 12:20].mean() - private.x[:, :, 4:7, 12:20].mean() > 0.1
    cheek = [d.x[:, :, 18:20, 8:10].mean(axis=(2, 3)).std(axis=0).mean() for d in (public, private)]
    assert cheek[0] > 2 * cheek[1]
    with pytest.raises(ConfigError, match="face domain 'east' is not one of public, private"):
        synthetic_faces(1, 1, domain="east")
