from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from rayline.errors import CorruptImageError, EmptyImageError, ImageTooLargeError, UnsupportedFormatError
from rayline.ray_workloads.data.images import ImageSpec, decode_image
from rayline.ray_workloads.data.ingest import IngestConfig, content_hash, cut_shards, label_from_key, objects_per_shard
from rayline.ray_workloads.data.preprocess import SplitFractions, decode_batch, ordered_classes, split_for_key
from rayline.storage import ObjectInfo

pytestmark = pytest.mark.unit


def _png(size: tuple[int, int] = (20, 10), mode: str = "L") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, color=128).save(buffer, format="PNG")
    return buffer.getvalue()


def _noise_png() -> bytes:
    buffer = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_decode_gives_normalised_chw_rgb() -> None:
    array = decode_image(_png(), ImageSpec(crop=16))
    assert array.shape == (3, 16, 16) and array.dtype == np.float32
    assert np.allclose(array, (128 / 255 - 0.5) / 0.5, atol=1e-2)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"", EmptyImageError),
        (b"plain text, not an image", UnsupportedFormatError),
        (_noise_png()[: len(_noise_png()) // 2], CorruptImageError),
    ],
)
def test_bad_bytes_raise_a_typed_error(data: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        decode_image(data, ImageSpec())


def test_pixel_limit_is_checked_before_decoding() -> None:
    with pytest.raises(ImageTooLargeError, match="limit is 100"):
        decode_image(_png((20, 10)), ImageSpec(max_pixels=100))


def test_decode_batch_emits_one_row_per_input() -> None:
    batch = {
        "uri": np.array(["u/0/a.png", "u/1/b.png", "u/1/c.png"], dtype=object),
        "key": np.array(["0/a.png", "1/b.png", "1/c.png"], dtype=object),
        "etag": np.array(["e1", "e2", "e3"], dtype=object),
        "label": np.array(["0", "1", "1"], dtype=object),
        "data": np.array([_png(), b"junk", None], dtype=object),
        "error_type": np.array([None, None, "FileNotFoundError"], dtype=object),
        "error_message": np.array([None, None, "gone"], dtype=object),
    }
    out = decode_batch(batch, ImageSpec(crop=8), SplitFractions(), ["0", "1"])
    assert out["ok"].tolist() == [True, False, False]
    assert out["stage"].tolist() == [None, "decode", "fetch"]
    assert out["error_type"].tolist() == [None, "UnsupportedFormatError", "FileNotFoundError"]
    assert out["label_index"].tolist() == [0, 1, 1]
    assert out["image"].shape == (3, 3, 8, 8)


def test_split_is_stable_and_close_to_fractions() -> None:
    fractions = SplitFractions()
    keys = [f"{i % 10}/img-{i}.png" for i in range(5000)]
    first = [split_for_key(k, fractions) for k in keys]
    assert first == [split_for_key(k, fractions) for k in keys]
    share = Counter(first)
    assert abs(share["train"] / 5000 - 0.8) < 0.03
    assert abs(share["test"] / 5000 - 0.1) < 0.02
    # adding objects never moves existing ones
    assert [split_for_key(k, fractions) for k in keys[:10]] == first[:10]


def test_split_fractions_must_sum_to_one() -> None:
    with pytest.raises(ValueError, match="sum to 1"):
        SplitFractions(train=0.9, val=0.2, test=0.1)


def test_classes_sort_numerically() -> None:
    assert ordered_classes(["10", "2", "1"]) == ["1", "2", "10"]
    assert ordered_classes(["cat", "ant"]) == ["ant", "cat"]


def _obj(key: str, size: int = 10, etag: str = "e") -> ObjectInfo:
    return ObjectInfo(uri=f"s3://b/{key}", key=key, size=size, etag=etag, last_modified="")


def test_content_hash_depends_on_keys_and_etags_only() -> None:
    a = [_obj("1/a.png", etag="x"), _obj("2/b.png", etag="y")]
    assert content_hash(a) == content_hash(list(reversed(a)))
    assert content_hash(a) != content_hash([_obj("1/a.png", etag="x"), _obj("2/b.png", etag="z")])


def test_labels_come_from_the_parent_folder() -> None:
    assert label_from_key("7/digit-1.png") == "7"
    assert label_from_key("a/b/c.png") == "b"
    assert label_from_key("c.png") is None


def test_shards_respect_count_and_byte_limits() -> None:
    objects = [_obj(f"{i}.png", size=100) for i in range(1000)]

    def plan(cfg: IngestConfig) -> list[list[ObjectInfo]]:
        return list(cut_shards(objects, objects_per_shard(len(objects), cfg), cfg.shard_max_bytes))

    shards = plan(IngestConfig(source_uri="x", output_root="y", shard_max_objects=300))
    assert sum(len(s) for s in shards) == 1000
    assert max(len(s) for s in shards) <= 300
    assert len(shards) >= 4
    by_bytes = plan(IngestConfig(source_uri="x", output_root="y", shard_max_bytes=1000))
    assert max(sum(o.size for o in s) for s in by_bytes) <= 1000
