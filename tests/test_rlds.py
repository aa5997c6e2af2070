"""RLDS without TensorFlow: TFRecord/Example wire format, the genuine OXE fixture, DROID-shaped round trips,
and the errors bad files must raise (each test corrupts its own copy under tmp_path)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vla.data.readers.base import DatasetFormatError
from vla.data.readers.rlds import RLDSReader, parse_features_json
from vla.data.readers.tfrecord import (
    crc32c,
    decode_varints,
    iter_tfrecord,
    masked_crc32c,
    parse_example,
    scan_tfrecord,
)
from vla.data.writers.rlds import (
    Feature,
    droid_features,
    encode_example,
    encode_record,
    encode_varints,
    features_json,
    image,
    scalar,
    synthetic_droid_episode,
    tensor,
    text,
    write_rlds,
)

IMG = (24, 40, 3)  # small DROID-shaped frames keep the tests fast


def _droid(tmp_path: Path, splits: dict[str, int], shards: dict[str, int], seed: int | None = 3) -> tuple:
    """Write a DROID-shaped dataset; returns (reader, {split: episodes in input order}, order)."""
    rng = np.random.default_rng(0)
    steps, meta = droid_features(IMG)
    steps["observation/depth_png"] = image((IMG[0], IMG[1], 1), "png")  # lossless, for exact image equality
    eps: dict[str, list] = {}
    for split, n in splits.items():
        eps[split] = []
        for _ in range(n):
            ep = synthetic_droid_episode(rng, int(rng.integers(1, 9)), IMG)
            t = len(ep["steps"]["is_first"])
            ep["steps"]["observation/depth_png"] = rng.integers(
                0, 256, (t, IMG[0], IMG[1], 1), dtype=np.uint8
            )
            eps[split].append(ep)
    root = tmp_path / "droid_100" / "1.0.0"
    order = write_rlds(root, "droid_100", eps, steps, meta, num_shards=shards, shuffle_seed=seed)
    return RLDSReader(root), eps, order


CORRUPT_EPISODES, CORRUPT_STEPS = 8, 5  # train split of ``_shard_to_corrupt`` (val has 2 episodes)


def _shard_to_corrupt(tmp_path: Path) -> Path:
    """A small Bridge-like RLDS dataset written by our writer (state [7], a JPEG camera), for the tests that
    corrupt one copy each; returns its version folder ``.../written/1.0.0``."""
    rng = np.random.default_rng(0)
    steps = {
        "is_first": scalar("bool"),
        "observation/state": tensor([7]),
        "observation/image_0": image((16, 16, 3)),
    }

    def episode() -> dict[str, Any]:
        t = CORRUPT_STEPS
        return {
            "steps": {
                "is_first": np.arange(t) == 0,
                "observation/state": rng.standard_normal((t, 7)).astype(np.float32),
                "observation/image_0": rng.integers(0, 256, (t, 16, 16, 3), dtype=np.uint8),
            }
        }

    root = tmp_path / "written" / "1.0.0"
    splits = {"train": [episode() for _ in range(CORRUPT_EPISODES)], "val": [episode(), episode()]}
    write_rlds(root, "written", splits, steps)
    return root


# ---- wire format ------------------------------------------------------------------------------------------


def test_crc32c_known_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # RFC 3720 check value
    assert masked_crc32c(b"") == 0xA282EAD8  # CRC of nothing is 0: the mask's constant alone


def test_varints_roundtrip_including_negative_and_large() -> None:
    values = np.array(
        [0, 1, 127, 128, 300, 2**31, 2**40 + 7, 2**63 - 1, -1, -(2**63), -12345], dtype=np.int64
    )
    assert (decode_varints(np.frombuffer(encode_varints(values), np.uint8)) == values).all()
    assert encode_varints(np.array([1, 0, 1])) == b"\x01\x00\x01"  # single-byte fast path
    assert encode_varints(np.array([300])) == b"\xac\x02"  # protobuf docs' example


def test_example_encoding_matches_protobuf_both_ways() -> None:
    """Our encoder and decoder against the protobuf library's own implementation of tf.train.Example."""
    example_cls = _protobuf_example_class()
    values = {
        "f": np.array([1.5, -2.25, 3.0e-8], np.float32),
        "i": np.array([0, 1, -7, 2**40], np.int64),
        "b": [b"", b"\xff\xd8jpeg", "text é".encode()],
        "empty": np.zeros(0, np.float32),
    }
    msg = example_cls()
    msg.ParseFromString(encode_example(values))
    feats = msg.features.feature
    assert list(feats["f"].float_list.value) == values["f"].tolist()
    assert list(feats["i"].int64_list.value) == values["i"].tolist()
    assert list(feats["b"].bytes_list.value) == values["b"]
    decoded = parse_example(msg.SerializeToString())
    assert decoded["f"].dtype == np.float32 and (decoded["f"] == values["f"]).all()
    assert decoded["i"].dtype == np.int64 and (decoded["i"] == values["i"]).all()
    assert [bytes(x) for x in decoded["b"]] == values["b"]
    assert set(parse_example(msg.SerializeToString(), keys={"i"})) == {"i"}


def test_fixture_record_decodes_like_protobuf_and_reframes_byte_identically(bridge_fixture: Path) -> None:
    example_cls = _protobuf_example_class()
    shard = bridge_fixture / "bridge_dataset-train.tfrecord-00000-of-00001"
    index = scan_tfrecord(shard)
    assert len(index) == 25
    payload = next(iter(iter_tfrecord(shard)))
    offset, length = index[0]
    raw = shard.read_bytes()[offset : offset + length + 16]
    assert encode_record(payload) == raw  # our framing (masked CRC32C) == TensorFlow's, byte for byte
    msg = example_cls()
    msg.ParseFromString(payload)
    ours = parse_example(payload)
    assert set(ours) == set(msg.features.feature)
    for key, feat in msg.features.feature.items():
        kind = feat.WhichOneof("kind")
        expected = list(getattr(feat, kind).value)
        got = [bytes(x) for x in ours[key]] if kind == "bytes_list" else ours[key].tolist()
        assert got == (expected if kind != "float_list" else np.float32(expected).tolist()), key


def test_writer_features_json_reproduces_fixture_layout(bridge_fixture: Path) -> None:
    spec = json.loads((bridge_fixture / "features.json").read_text())
    leaves = parse_features_json(spec)
    kinds = {"Text": "string"}

    def as_feature(f: Any) -> Feature:
        return Feature(f.cls, kinds.get(f.cls, f.dtype), f.shape, f.encoding, f.description)

    steps = {f.name: as_feature(f) for f in leaves if f.in_steps}
    meta = {f.name: as_feature(f) for f in leaves if not f.in_steps}
    assert features_json(steps, meta) == spec


# ---- the genuine Open X-Embodiment export ------------------------------------------------------------------


def test_bridge_fixture_structure_and_values(bridge_fixture: Path) -> None:
    from vla.data.readers import open_dataset

    r = open_dataset(bridge_fixture.parent)  # the dataset folder resolves to its version folder 1.0.0
    assert isinstance(r, RLDSReader) and r.path == bridge_fixture
    assert (r.format, r.name, r.fps, r.robot_type) == ("rlds", "bridge_dataset", None, None)
    assert r.splits() == ["train", "val"]
    assert [r.num_episodes(s) for s in r.splits()] == [25, 25]
    assert r.episode_lengths("train").tolist() == [10] * 25 and r.num_frames("val") == 250
    feats = r.features()
    assert sorted(r.image_keys()) == [f"observation/image_{i}" for i in range(4)]
    assert (feats["observation/state"].dtype, feats["observation/state"].shape) == ("float32", (7,))
    assert (feats["is_first"].kind, feats["is_first"].dtype) == ("tensor", "bool")
    assert feats["language_instruction"].kind == "string"
    ep = r.read_episode("train", 0)
    assert ep.length == 10 and ep.steps["action"].shape == (10, 7) and ep.steps["action"].dtype == np.float32
    assert ep.steps["language_embedding"].shape == (10, 512)
    assert ep.steps["is_first"].dtype == bool and ep.steps["is_first"].tolist() == [True] + [False] * 9
    assert not ep.steps["is_last"].any()  # Octo cut the episodes (PROVENANCE.md)
    assert ep.steps["language_instruction"].dtype == object
    assert ep.steps["language_instruction"][0] == "put cup from counter or drying rack into sink"
    assert ep.metadata["episode_id"] == 5 and isinstance(ep.metadata["has_language"], bool)
    assert ep.metadata["file_path"].endswith("out.npy")
    imgs = r.read_images("train", 0, [0, 9], ["observation/image_0", "observation/image_3"])
    assert (
        imgs["observation/image_0"].shape == (2, 64, 64, 3) and imgs["observation/image_0"].dtype == np.uint8
    )
    assert imgs["observation/image_0"].std() > 10  # a real photo, not a blank frame
    assert (imgs["observation/image_3"] == 0).all()  # Bridge pads missing cameras with black frames
    with pytest.raises(IndexError, match="frames \\[10\\] out of range"):
        r.read_images("train", 0, [10], ["observation/image_0"])
    with pytest.raises(KeyError, match="not an image feature"):
        r.read_images("train", 0, [0], ["observation/state"])
    with pytest.raises(IndexError, match="episode 25 out of range for split 'val'"):
        r.read_episode("val", 25)
    with pytest.raises(KeyError, match="no split 'test'"):
        r.num_episodes("test")
    frame = r.read_frame("val", 24, 9)
    assert set(frame) == set(feats) and isinstance(frame["language_instruction"], str)
    assert frame["observation/image_1"].shape == (64, 64, 3)


def test_bridge_fixture_after_pickle_and_in_forked_dataloader_workers(bridge_fixture: Path) -> None:
    torch = pytest.importorskip("torch")
    r = RLDSReader(bridge_fixture)
    expected = [r.read_episode("train", e).steps["observation/state"].sum() for e in range(25)]
    clone = pickle.loads(pickle.dumps(r))
    assert clone.read_episode("train", 3).steps["observation/state"].sum() == expected[3]

    class Episodes(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 25

        def __getitem__(self, e: int) -> tuple[int, float, int]:
            img = r.read_images("train", e, [e % 10], ["observation/image_0"])["observation/image_0"]
            return e, float(r.read_episode("train", e).steps["observation/state"].sum()), int(img.sum())

    ctx = "fork" if "fork" in torch.multiprocessing.get_all_start_methods() else None
    loader = torch.utils.data.DataLoader(
        Episodes(), batch_size=None, num_workers=2, multiprocessing_context=ctx
    )
    got = {int(e): (s, px) for e, s, px in loader}
    assert len(got) == 25
    for e in range(25):
        assert got[e][0] == pytest.approx(float(expected[e]))
        px = r.read_images("train", e, [e % 10], ["observation/image_0"])["observation/image_0"].sum()
        assert got[e][1] == int(px)


# ---- DROID-shaped round trips ------------------------------------------------------------------------------


def test_droid_roundtrip_multi_shard_splits_shuffled(tmp_path: Path) -> None:
    r, eps, order = _droid(tmp_path, {"train": 7, "val": 3, "test": 1}, {"train": 3, "val": 2, "test": 1})
    assert r.name == "droid_100" and sorted(r.splits()) == ["test", "train", "val"]
    assert len(list((tmp_path / "droid_100" / "1.0.0").glob("droid_100-train.tfrecord-*-of-00003"))) == 3
    assert sorted(order["train"]) == list(range(7)) and order["train"] != list(range(7))  # really shuffled
    lengths = [len(eps["train"][i]["steps"]["is_first"]) for i in order["train"]]
    assert r.episode_lengths("train").tolist() == lengths and r.num_frames("train") == sum(lengths)
    feats = r.features()
    assert feats["observation/joint_position"].dtype == "float64" and feats["is_last"].dtype == "bool"
    assert feats["observation/exterior_image_1_left"].shape == IMG
    for split in r.splits():
        assert r.num_episodes(split) == len(eps[split])
        for e in range(r.num_episodes(split)):
            src = eps[split][order[split][e]]
            ep = r.read_episode(split, e)
            assert ep.length == len(src["steps"]["is_first"]) == r.episode_length(split, e)
            assert ep.metadata == src["episode_metadata"]
            for key, value in src["steps"].items():
                if feats[key].kind == "image":
                    continue
                got = ep.steps[key]
                assert got.dtype == (object if feats[key].kind == "string" else np.dtype(feats[key].dtype)), (
                    key
                )
                assert got.shape[0] == ep.length and (got == np.asarray(value, dtype=got.dtype)).all(), key
            assert ep.steps["observation/cartesian_position"].dtype == np.float64
            assert ep.steps["is_first"][0] and ep.steps["is_last"][-1]
            frames = list(range(ep.length))[::-1]
            imgs = r.read_images(split, e, frames, r.image_keys())
            assert (imgs["observation/depth_png"] == src["steps"]["observation/depth_png"][frames]).all()
            jpeg = imgs["observation/wrist_image_left"].astype(int)
            assert np.abs(jpeg - src["steps"]["observation/wrist_image_left"][frames]).mean() < 3


def test_episode_index_is_file_order_and_shuffling_only_permutes(tmp_path: Path) -> None:
    a, _, order_a = _droid(tmp_path / "a", {"train": 6}, {"train": 2}, seed=None)
    b, _, order_b = _droid(tmp_path / "b", {"train": 6}, {"train": 2}, seed=11)
    assert order_a["train"] == list(range(6))
    for e in range(6):  # episode e of the shuffled copy is input episode order_b[e] of the ordered one
        x = a.read_episode("train", order_b["train"][e]).steps["observation/joint_position"]
        assert (b.read_episode("train", e).steps["observation/joint_position"] == x).all()


def test_splits_found_by_globbing_when_dataset_info_lacks_them(tmp_path: Path) -> None:
    r, _, _ = _droid(tmp_path, {"train": 4, "val": 2}, {"train": 2, "val": 1})
    info_path = r.path / "dataset_info.json"
    info = json.loads(info_path.read_text())
    del info["splits"][0]["shardLengths"]
    info_path.write_text(json.dumps(info))
    assert RLDSReader(r.path).num_episodes("train") == 4
    info["splits"] = []
    info_path.write_text(json.dumps(info))
    r2 = RLDSReader(r.path)
    assert sorted(r2.splits()) == ["train", "val"] and r2.num_episodes("val") == 2


def test_writer_rejects_episodes_that_disagree_with_the_spec(tmp_path: Path) -> None:
    steps = {"observation/state": tensor([3], "float64"), "is_first": scalar("bool"), "instruction": text()}
    ep = {
        "steps": {"observation/state": np.zeros((2, 4)), "is_first": [True, False], "instruction": ["a", "b"]}
    }
    with pytest.raises(ValueError, match=r"observation/state.*spec shape \(2, 3\)"):
        write_rlds(tmp_path / "x", "x", {"train": [ep]}, steps)


# ---- bad input -> DatasetFormatError naming file, record/episode, field and a fix -------------------------


def test_missing_json_files(tmp_path: Path) -> None:
    root = _shard_to_corrupt(tmp_path)
    with pytest.raises(DatasetFormatError, match=r"found version folders \['1.0.0'\]"):
        RLDSReader(root.parent)
    (root / "features.json").unlink()
    with pytest.raises(DatasetFormatError, match=r"features\.json: missing.*re-download"):
        RLDSReader(root)
    (root / "dataset_info.json").unlink()
    with pytest.raises(DatasetFormatError, match=r"dataset_info\.json: missing"):
        RLDSReader(root)


LAST = CORRUPT_EPISODES - 1


@pytest.mark.parametrize(
    ("cut", "match"),
    [
        (lambda index: index[-1][0] + 12 + 100, rf"record {LAST} at byte \d+ needs \d+ bytes"),  # payload cut
        (lambda index: index[-1][0] + 5, rf"record {LAST} at byte \d+ has a 5-byte header"),  # header cut
    ],
)
def test_truncated_shard(tmp_path: Path, cut: Any, match: str) -> None:
    root = _shard_to_corrupt(tmp_path)
    shard = root / "written-train.tfrecord-00000-of-00001"
    data = shard.read_bytes()
    shard.write_bytes(data[: cut(scan_tfrecord(shard))])
    r = RLDSReader(root)
    with pytest.raises(DatasetFormatError, match=f"{shard.name}: truncated TFRecord: {match}.*re-download"):
        r.read_episode("train", 0)
    assert r.read_episode("val", 0).length == CORRUPT_STEPS  # other splits unaffected


def test_crc_mismatches(tmp_path: Path) -> None:
    root = _shard_to_corrupt(tmp_path)
    shard = root / "written-train.tfrecord-00000-of-00001"
    index = scan_tfrecord(shard)
    data = bytearray(shard.read_bytes())
    data[int(index[3][0]) + 12 + int(index[3][1]) // 2] ^= 0x01  # one bit in episode 3's payload
    shard.write_bytes(bytes(data))
    r = RLDSReader(root)
    assert r.read_episode("train", 2).length == CORRUPT_STEPS
    with pytest.raises(DatasetFormatError, match=r"CRC mismatch in the payload of record 3 .*re-download"):
        r.read_episode("train", 3)
    assert (
        RLDSReader(root, verify_crc=False).read_episode("train", 3).length == CORRUPT_STEPS
    )  # opt-out works
    data[int(index[7][0]) + 2] ^= 0x01  # a bit of episode 7's length field
    shard.write_bytes(bytes(data))
    with pytest.raises(DatasetFormatError, match=r"CRC mismatch in the length header of record 7"):
        RLDSReader(root).read_episode("train", 0)  # indexing the shard checks every header


def test_shard_record_count_disagrees_with_dataset_info(tmp_path: Path) -> None:
    root = _shard_to_corrupt(tmp_path)
    info = json.loads((root / "dataset_info.json").read_text())
    train = next(s for s in info["splits"] if s["name"] == "train")
    train["shardLengths"] = [str(CORRUPT_EPISODES + 1)]
    (root / "dataset_info.json").write_text(json.dumps(info))
    with pytest.raises(
        DatasetFormatError,
        match=rf"lists {CORRUPT_EPISODES + 1} episodes for this shard but the file holds {CORRUPT_EPISODES}",
    ):
        RLDSReader(root).read_episode("train", 0)


def test_element_count_disagrees_with_features_json(tmp_path: Path) -> None:
    root = _shard_to_corrupt(tmp_path)
    spec = json.loads((root / "features.json").read_text())
    steps = spec["featuresDict"]["features"]["steps"]["sequence"]["feature"]["featuresDict"]["features"]
    steps["observation"]["featuresDict"]["features"]["state"]["tensor"]["shape"]["dimensions"] = ["6"]
    (root / "features.json").write_text(json.dumps(spec))
    with pytest.raises(
        DatasetFormatError,
        match=rf"record 0 \(train episode 0\), feature 'steps/observation/state' has {7 * CORRUPT_STEPS} "
        rf"elements; features\.json shape \(6,\) x {CORRUPT_STEPS} steps needs {6 * CORRUPT_STEPS}.*fix features\.json",
    ):
        RLDSReader(root).read_episode("train", 0)


def test_undecodable_jpeg_names_episode_frame_and_key(tmp_path: Path) -> None:
    steps = {"is_first": scalar("bool"), "observation/cam": image((8, 8, 3))}
    frames: list[Any] = [
        np.full((8, 8, 3), 100, np.uint8),
        b"\xff\xd8 not a jpeg",
        np.zeros((8, 8, 3), np.uint8),
        np.zeros((6, 8, 3), np.uint8),  # decodes, but not to the features.json shape
    ]
    ep = {"steps": {"is_first": np.array([1, 0, 0, 0], bool), "observation/cam": frames}}
    write_rlds(tmp_path / "d" / "1.0.0", "d", {"train": [ep, ep]}, steps)
    r = RLDSReader(tmp_path / "d" / "1.0.0")
    assert r.read_images("train", 1, [0, 2], ["observation/cam"])["observation/cam"].shape == (2, 8, 8, 3)
    with pytest.raises(
        DatasetFormatError,
        match=r"d-train\.tfrecord-00000-of-00001: record 1 \(train episode 1\), frame 1, image "
        r"'observation/cam': cannot decode jpeg data .*re-download or re-export",
    ):
        r.read_images("train", 1, [1], ["observation/cam"])
    with pytest.raises(
        DatasetFormatError, match=r"frame 3, image 'observation/cam': decoded shape \(6, 8, 3\)"
    ):
        r.read_images("train", 0, [3], ["observation/cam"])


def test_feature_missing_from_record(tmp_path: Path) -> None:
    steps = {"is_first": scalar("bool"), "observation/state": tensor([2])}
    ep = {"steps": {"is_first": np.array([True]), "observation/state": np.zeros((1, 2))}}
    root = tmp_path / "d" / "1.0.0"
    write_rlds(root, "d", {"train": [ep]}, steps)
    spec = features_json({**steps, "observation/extra": tensor([3])}, {})
    (root / "features.json").write_text(json.dumps(spec))
    with pytest.raises(
        DatasetFormatError, match=r"feature 'steps/observation/extra' is missing from the record"
    ):
        RLDSReader(root).read_episode("train", 0)


# ---- helpers ----------------------------------------------------------------------------------------------


def _protobuf_example_class() -> Any:
    """``tf.train.Example`` built from its .proto definition by the protobuf library (independent decoder)."""
    pytest.importorskip("google.protobuf")
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fd = descriptor_pb2.FieldDescriptorProto
    msg, repeated, optional = fd.TYPE_MESSAGE, fd.LABEL_REPEATED, fd.LABEL_OPTIONAL
    fdp = descriptor_pb2.FileDescriptorProto(
        name="vla_test_example.proto", package="vlatest", syntax="proto3"
    )
    lists = {"bytes_list": ("BytesList", fd.TYPE_BYTES), "float_list": ("FloatList", fd.TYPE_FLOAT)}
    lists["int64_list"] = ("Int64List", fd.TYPE_INT64)
    feature = fdp.message_type.add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for i, (name, (cls, typ)) in enumerate(lists.items(), 1):  # packed by default in proto3, as in TF
        fdp.message_type.add(name=cls).field.add(name="value", number=1, type=typ, label=repeated)
        feature.field.add(
            name=name, number=i, type=msg, label=optional, type_name=f".vlatest.{cls}", oneof_index=0
        )
    features = fdp.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=fd.TYPE_STRING, label=optional)
    entry.field.add(name="value", number=2, type=msg, label=optional, type_name=".vlatest.Feature")
    features.field.add(
        name="feature", number=1, type=msg, label=repeated, type_name=".vlatest.Features.FeatureEntry"
    )
    example = fdp.message_type.add(name="Example")
    example.field.add(name="features", number=1, type=msg, label=optional, type_name=".vlatest.Features")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("vlatest.Example"))
