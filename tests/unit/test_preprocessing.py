"""The one preprocessing implementation against torchvision's own ImageNet transforms.

For ``--preprocess imagenet`` specs with full decoding, ``decode_image(bytes)``
must equal the weights entry's ``transforms()`` applied to the same decoded
RGB image (EXIF orientation applied) within ``IMAGENET_MAX_ABS_DIFF``: on the
two real photos, crops of them at several sizes and aspect ratios, grayscale,
CMYK, palette and alpha images and an EXIF-rotated JPEG. Reduced-scale
decoding (the default) must leave small photos alone and stay within
``DRAFT_MAX_MEAN_ABS_DIFF`` of full decoding on camera-sized ones.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image, ImageOps

from rayline.ray_workloads.architectures.build import imagenet_classes, imagenet_image_spec
from rayline.ray_workloads.data.images import DRAFT_MAX_MEAN_ABS_DIFF, IMAGENET_MAX_ABS_DIFF, decode_image, decode_rgb
from rayline.ray_workloads.registration.outside_models import RegisterModelConfig, image_spec_for
from rayline.seed import EXIF_ORIENTATION, camera_photo, camera_size, jpeg_bytes, photo_variant, source_photos
from rayline.specs import ImageSpec

pytestmark = pytest.mark.unit


def _encode(img: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def _reference(data: bytes, arch: str) -> np.ndarray:
    """torchvision's transforms() on the fully decoded, upright RGB image."""
    transforms = torchvision.models.get_model_weights(arch).DEFAULT.transforms()
    with Image.open(io.BytesIO(data)) as img:
        rgb = ImageOps.exif_transpose(img).convert("RGB")
    out: torch.Tensor = transforms(rgb)
    return out.numpy()


def _views() -> dict[str, Callable[[], bytes]]:
    china, flower = source_photos()
    cmyk = china.crop((100, 50, 400, 300)).convert("CMYK")
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6
    return {
        "china-full": lambda: jpeg_bytes(china, 92),
        "flower-full": lambda: jpeg_bytes(flower, 92),
        "tall-crop": lambda: jpeg_bytes(china.crop((200, 0, 330, 427)), 85),
        "wide-crop": lambda: jpeg_bytes(flower.crop((0, 150, 640, 260)), 85),
        "small-crop": lambda: jpeg_bytes(flower.crop((300, 200, 400, 290)), 75),
        "upscaled": lambda: jpeg_bytes(china.crop((0, 0, 320, 240)).resize((720, 540)), 80),
        "png": lambda: _encode(flower.crop((50, 50, 350, 300)), "PNG"),
        "grayscale": lambda: jpeg_bytes(china.convert("L"), 90),
        "cmyk": lambda: _encode(cmyk, "JPEG", quality=90),
        "palette-png": lambda: _encode(flower.convert("P", palette=Image.Palette.ADAPTIVE), "PNG"),
        "exif-rotated": lambda: jpeg_bytes(china.transpose(Image.Transpose.ROTATE_90), 90, exif),
        "over-2-megapixels": lambda: photo_variant(flower, np.random.default_rng(5), large=True)[0],
    }


@pytest.mark.parametrize("arch", ["resnet50", "resnet18"])
@pytest.mark.parametrize("view", sorted(_views()))
def test_imagenet_spec_matches_torchvision_transforms(arch: str, view: str) -> None:
    data = _views()[view]()
    default = imagenet_image_spec(arch)
    ours = decode_image(data, default.model_copy(update={"draft": False}))
    reference = _reference(data, arch)
    assert ours.shape == reference.shape == (3, 224, 224)
    assert float(np.abs(ours - reference).max()) <= IMAGENET_MAX_ABS_DIFF
    if view != "over-2-megapixels":  # under twice the needed side: reduced-scale decoding leaves it alone
        assert np.array_equal(decode_image(data, default), ours)


def test_imagenet_specs_come_from_each_weights_entry() -> None:
    resnet50, resnet18 = imagenet_image_spec("resnet50"), imagenet_image_spec("resnet18")
    assert (resnet50.resize, resnet50.crop, resnet50.interpolation) == (232, 224, "bilinear")
    assert (resnet18.resize, resnet18.crop) == (256, 224)
    assert resnet50.mean == pytest.approx((0.485, 0.456, 0.406)) and resnet50.std == pytest.approx(
        (0.229, 0.224, 0.225)
    )
    classes = imagenet_classes()
    assert len(classes) == 1000 and classes[0] == "tench"


def test_exif_orientation_is_applied() -> None:
    china = source_photos()[0]
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6
    stored_sideways = jpeg_bytes(china.transpose(Image.Transpose.ROTATE_90), 95, exif)
    upright = decode_rgb(stored_sideways, ImageSpec(draft=False))
    assert upright.size == china.size  # 640×427 again, not 427×640
    difference = np.abs(np.asarray(upright, dtype=np.int16) - np.asarray(china, dtype=np.int16)).mean()
    assert difference < 4  # JPEG noise only


def test_alpha_is_composited_on_white_not_dropped() -> None:
    # fully transparent pixels whose stored colour is black: dropping alpha would show black
    rgba = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    rgb = decode_rgb(_encode(rgba, "PNG"), ImageSpec())
    assert rgb.mode == "RGB" and np.asarray(rgb).min() == 255
    half = Image.new("LA", (8, 8), (0, 128))
    assert 120 < np.asarray(decode_rgb(_encode(half, "PNG"), ImageSpec())).mean() < 135


def test_sixteen_bit_grayscale_is_scaled_not_clipped() -> None:
    gray16 = Image.fromarray(np.full((8, 8), 32768, dtype=np.uint16))
    rgb = decode_rgb(_encode(gray16, "PNG"), ImageSpec())
    assert 120 < np.asarray(rgb).mean() < 135


def test_squash_keeps_the_digits_behaviour() -> None:
    """The digits' spec is what it was: a bilinear resize to size × size, normalised to [-1, 1]."""
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (20, 30, 3), dtype=np.uint8))
    spec = ImageSpec(crop=16)
    expected = np.asarray(img.resize((16, 16), Image.Resampling.BILINEAR), dtype=np.float32) / 255.0
    expected = ((expected - 0.5) / 0.5).transpose(2, 0, 1)
    assert np.abs(decode_image(_encode(img, "PNG"), spec) - expected).max() < 1e-6


@pytest.mark.parametrize("megapixels", [3, 12])
def test_reduced_scale_decoding_stays_within_its_bound_on_camera_photos(megapixels: int) -> None:
    """The default decodes a camera photo at a reduced scale, never below twice the needed side, close to full."""
    default = imagenet_image_spec("resnet18")
    assert default.draft, "reduced-scale decoding is the default"
    full = default.model_copy(update={"draft": False})
    data = camera_photo(megapixels, np.random.default_rng(megapixels))
    assert decode_rgb(data, full).size == camera_size(megapixels)
    reduced = decode_rgb(data, default)
    assert 2 * default.needed_side <= min(reduced.size) <= camera_size(megapixels)[1] // 2
    difference = float(np.abs(decode_image(data, default) - decode_image(data, full)).mean())
    assert 0 < difference <= DRAFT_MAX_MEAN_ABS_DIFF


def test_reduced_scale_decoding_samples_the_same_geometry_in_every_orientation() -> None:
    """Odd sides make the reduced decode overhang the photo; every EXIF orientation must crop the same way."""
    default = imagenet_image_spec("resnet18")
    full = default.model_copy(update={"draft": False})
    stored = source_photos()[1].resize((1031, 1543), Image.Resampling.BICUBIC)
    differences = []
    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[EXIF_ORIENTATION] = orientation
        data = jpeg_bytes(stored, 92, exif)
        differences.append(float(np.abs(decode_image(data, default) - decode_image(data, full)).mean()))
    # a box on the wrong side shifts the crop by half a reduced pixel: ~5x the difference (0.03 vs 0.006)
    assert max(differences) <= DRAFT_MAX_MEAN_ABS_DIFF and max(differences) - min(differences) < 0.002


def test_camera_photos_are_camera_sized() -> None:
    assert [camera_size(mp) for mp in (1, 3, 12)] == [(1152, 864), (2000, 1500), (4000, 3000)]
    data = camera_photo(1, np.random.default_rng(0))
    with Image.open(io.BytesIO(data)) as img:
        assert (img.format, img.size) == ("JPEG", (1152, 864))
    assert 150_000 < len(data) < 600_000  # a camera's 1 MP JPEG, not a smooth upscale's


def test_spec_rejects_inconsistent_sizes() -> None:
    with pytest.raises(ValueError, match="smaller than crop"):
        ImageSpec(mode="resize_crop", resize=200, crop=224)
    with pytest.raises(ValueError, match="needs resize"):
        ImageSpec(mode="resize_crop", crop=224)


def test_imagenet_preprocessing_comes_from_the_architecture() -> None:
    def spec(arch: str, **sizes: int) -> tuple[int | None, int]:
        image = image_spec_for(RegisterModelConfig(name="m", arch=arch, weights_uri="-", **sizes))
        return image.resize, image.crop

    assert spec("resnet50") == (232, 224)
    assert spec("resnet18") == (256, 224)
    assert spec("resnet50", resize=300, crop=256) == (300, 256)
    squash = image_spec_for(RegisterModelConfig(name="m", arch="resnet18", weights_uri="-", preprocess="squash"))
    assert (squash.mode, squash.crop) == ("squash", 224)
