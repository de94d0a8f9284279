"""rayline's MLflow model, logged as code: image bytes in, the version's classes out, without rayline.

The registry mirror (``mlflow_models``) logs this file, which MLflow runs on load. It imports MLflow, numpy,
pandas, Pillow and ONNX Runtime, the model's whole ``requirements.txt``, and nothing of rayline or torch, so
the model loads and serves anywhere those install. Nothing is pickled. Its artifacts: ``version.json`` (the
classes and the image spec) and ``model.onnx`` (an ONNX version's own file, any other its module exported by
``onnx_export``).

The preprocessing is rayline's ``decode_image`` (ray_workloads/data/images.py) with the version's image spec
and the spec's own decode (a JPEG over twice the needed size at a reduced DCT scale where ``draft``, else in
full), restated with Pillow and numpy: tests/unit/test_mlflow_pyfunc.py holds the two equal, pixel for pixel,
on every path. A plan's judged decode (``/predict`` after a night) is not applied: it changes no answer the
plan's own check let through. Input: a DataFrame with a binary column ``image`` of encoded image files (or
``{"image": [...]}``); MLflow's scoring server takes them base64-encoded in JSON. An image that does not decode
is a row with ``error`` set, named as rayline names it (``UnsupportedFormatError: ...``): this file defines no
exception class of its own (rayline's are in rayline/errors.py, which it cannot import).
"""

import base64
import binascii
import io
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
from mlflow.models import set_model
from mlflow.pyfunc.model import PythonModel, PythonModelContext
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

# names of the logged artifacts (``context.artifacts`` keys)
VERSION_ARTIFACT = "version"
MODEL_ARTIFACT = "model"
IMAGE_COLUMN = "image"
OUTPUT_COLUMNS = ["class_index", "class_name", "confidence", "top_classes", "top_confidences", "error"]
TOP_K = 5
BATCH = 64  # images per model call: bounds the memory of a large input
DRAFT_FACTOR = 2  # decode_image without a plan: a JPEG is reduced while both sides stay >= 2x the needed side
BACKGROUND = (255, 255, 255)
RESIZE_CROP = "resize_crop"
_RESAMPLE = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "nearest": Image.Resampling.NEAREST,
}


class Reduced(NamedTuple):
    """Where a reduced-scale decode came from: the upright full size, and the box of the image that holds it."""

    full_size: tuple[int, int]
    box: tuple[float, float, float, float]


def decode(data: bytes | None, spec: dict[str, Any]) -> np.ndarray | str:
    """Bytes → normalised float32 (3, crop, crop), as rayline's ``decode_image(data, spec)``; for an image it
    cannot read, what is wrong as rayline says it (``UnsupportedFormatError: not a recognised image format``)."""
    if not data:
        return "EmptyImageError: object is empty (0 bytes)"
    try:
        with warnings.catch_warnings():
            # PIL warns (rather than raises) between 1x and 2x its own limit
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                width, height = img.size
                if width * height > spec["max_pixels"]:
                    pixels = f"{width}x{height} = {width * height} pixels"
                    return f"ImageTooLargeError: image is {pixels}, limit is {spec['max_pixels']}"
                reduced = _draft(img, spec) if spec["draft"] and img.format == "JPEG" else None
                rgb = _to_rgb(ImageOps.exif_transpose(img))
    except UnidentifiedImageError:
        return f"UnsupportedFormatError: not a recognised image format ({len(data)} bytes)"
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        return f"ImageTooLargeError: {exc}"
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        # truncated or corrupt data surfaces as OSError/SyntaxError inside PIL's plugins
        return f"CorruptImageError: corrupt image data: {exc}"
    return model_input(rgb, spec, reduced)


def _needed_side(spec: dict[str, Any]) -> int:
    return int(spec["resize"] if spec["resize"] is not None else spec["crop"])


def _draft(img: Image.Image, spec: dict[str, Any]) -> Reduced | None:
    """The JPEG decoder's largest DCT reduction keeping both sides >= twice the needed side, and its box."""
    full_size = img.size
    side = DRAFT_FACTOR * _needed_side(spec)
    drafted = img.draft("RGB", (side, side))
    if drafted is None or img.size == full_size:
        return None
    orientation = int(img.getexif().get(ExifTags.Base.Orientation, 1))
    move = _EXIF_MOVES.get(orientation)
    if move is None:
        return Reduced(full_size, drafted[1])
    # the box in the upright image exif_transpose makes: the overhang may end up on any side
    x0, y0, x1, y1 = drafted[1]
    (ax, ay), (bx, by) = move(x0, y0, *img.size), move(x1, y1, *img.size)
    upright = full_size[::-1] if orientation >= 5 else full_size
    return Reduced((upright[0], upright[1]), (min(ax, bx), min(ay, by), max(ax, bx), max(ay, by)))


# where exif_transpose's transposition for each EXIF orientation takes a point (x, y) of a width × height image
_EXIF_MOVES: dict[int, Callable[[float, float, int, int], tuple[float, float]]] = {
    2: lambda x, y, w, h: (w - x, y),
    3: lambda x, y, w, h: (w - x, h - y),
    4: lambda x, y, w, h: (x, h - y),
    5: lambda x, y, w, h: (y, x),
    6: lambda x, y, w, h: (h - y, x),
    7: lambda x, y, w, h: (h - y, w - x),
    8: lambda x, y, w, h: (y, w - x),
}


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB, transparency composited on white, 16-bit grayscale scaled to 8 bits (not clipped)."""
    if img.mode == "P":
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "RGBa", "La", "PA"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (*BACKGROUND, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if img.mode.startswith("I;16") or img.mode == "I":
        array = np.asarray(img, dtype=np.float32)
        peak = 65535.0 if img.mode.startswith("I;16") else max(float(array.max()), 1.0)
        img = Image.fromarray(np.clip(array * (255.0 / peak), 0, 255).astype(np.uint8))
    img.load()
    return img.convert("RGB")


def model_input(rgb: Image.Image, spec: dict[str, Any], reduced: Reduced | None = None) -> np.ndarray:
    """An RGB image → normalised float32 (3, crop, crop): torchvision's resize and centre crop on a PIL image
    (``resize_crop``), or one resize to crop × crop (``squash``); then scaled to [0, 1] and normalised."""
    resample = _RESAMPLE[spec["interpolation"]]
    crop = int(spec["crop"])
    box = reduced.box if reduced else None
    if spec["mode"] == RESIZE_CROP:
        size = _resized_size(reduced.full_size if reduced else rgb.size, int(spec["resize"]))
        resized = rgb if reduced is None and size == rgb.size else rgb.resize(size, resample, box=box)
        top = int(round((resized.height - crop) / 2.0))
        left = int(round((resized.width - crop) / 2.0))
        image = resized.crop((left, top, left + crop, top + crop))
    else:
        image = rgb.resize((crop, crop), resample, box=box)
    array = np.asarray(image, dtype=np.float32) / np.float32(255.0)
    mean = np.asarray(spec["mean"], dtype=np.float32)
    std = np.asarray(spec["std"], dtype=np.float32)
    return np.ascontiguousarray(((array - mean) / std).transpose(2, 0, 1))


def _resized_size(size: tuple[int, int], shorter: int) -> tuple[int, int]:
    """The (width, height) torchvision's ``F.resize(img, [shorter])`` gives an image of ``size``."""
    width, height = size
    if width <= height:
        return shorter, int(shorter * height / width)
    return int(shorter * width / height), shorter


class OnnxClassifier:
    """The ONNX file under ONNX Runtime: a float32 batch (N, 3, S, S) in, class probabilities out. A file exported
    for one batch size is called with batches of that size, the last padded."""

    def __init__(self, path: str) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        first = self.session.get_inputs()[0]
        self.input_name = first.name
        batch = first.shape[0] if first.shape else None
        self.fixed_batch = batch if isinstance(batch, int) and batch > 0 else None

    def probabilities(self, batch: np.ndarray) -> np.ndarray:
        step = self.fixed_batch or len(batch)
        rows = [self._logits(batch[start : start + step], step) for start in range(0, len(batch), step)]
        return softmax(np.concatenate(rows)).astype(np.float32)

    def _logits(self, batch: np.ndarray, size: int) -> np.ndarray:
        padded = np.zeros((size, *batch.shape[1:]), dtype=np.float32)
        padded[: len(batch)] = batch
        return np.asarray(self.session.run(None, {self.input_name: padded})[0], dtype=np.float32)[: len(batch)]


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities of each row, in float64 as rayline computes them."""
    with np.errstate(invalid="ignore"):
        shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
        exp = np.exp(shifted)
        return exp / exp.sum(axis=1, keepdims=True)  # type: ignore[no-any-return]


def image_bytes(model_input: Any) -> list[Any]:
    """The images of a DataFrame's ``image`` column, a Series, an array or a list."""
    if isinstance(model_input, pd.DataFrame):
        if IMAGE_COLUMN not in model_input.columns:
            raise ValueError(
                f"expected a column {IMAGE_COLUMN!r} of encoded image files; got columns {list(model_input.columns)}"
            )
        return list(model_input[IMAGE_COLUMN])
    if isinstance(model_input, bytes | bytearray | str):
        return [model_input]
    if isinstance(model_input, dict) and IMAGE_COLUMN in model_input:
        return image_bytes(pd.DataFrame({IMAGE_COLUMN: list(np.atleast_1d(model_input[IMAGE_COLUMN]))}))
    return list(model_input)


def _as_bytes(value: Any) -> bytes | None:
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error:
            return value.encode()  # not base64: decoding it as an image fails with its own message
    return None


def classify(model: OnnxClassifier, version: dict[str, Any], images: list[Any], top_k: int = TOP_K) -> pd.DataFrame:
    """One row per image: its class, confidence and top ``top_k``; ``error`` for one that does not decode."""
    spec, classes = version["image_spec"], list(version["classes"])
    decoded: dict[int, np.ndarray] = {}
    errors: dict[int, str] = {}
    for i, value in enumerate(images):
        image = decode(_as_bytes(value), spec)
        if isinstance(image, str):
            errors[i] = image
        else:
            decoded[i] = image
    probabilities = np.zeros((len(images), len(classes)), dtype=np.float32)
    good = sorted(decoded)
    for start in range(0, len(good), BATCH):
        rows = good[start : start + BATCH]
        probabilities[rows] = model.probabilities(np.stack([decoded[i] for i in rows]))
    top = np.argsort(-probabilities, axis=1, kind="stable")[:, : max(1, min(top_k, len(classes)))]
    records: list[dict[str, Any]] = []
    for i, ranked in enumerate(top):
        if i in errors:
            nothing = {"class_index": -1, "class_name": None, "confidence": float("nan")}
            records.append({**nothing, "top_classes": [], "top_confidences": [], "error": errors[i]})
            continue
        records.append(
            {
                "class_index": int(ranked[0]),
                "class_name": classes[ranked[0]],
                "confidence": float(probabilities[i, ranked[0]]),
                "top_classes": [classes[j] for j in ranked],
                "top_confidences": [float(probabilities[i, j]) for j in ranked],
                "error": None,
            }
        )
    return pd.DataFrame.from_records(records, columns=OUTPUT_COLUMNS)


class RaylineClassifier(PythonModel):
    """A registered rayline version as an MLflow pyfunc (see the module's docstring)."""

    def load_context(self, context: PythonModelContext) -> None:
        self.version = json.loads(Path(context.artifacts[VERSION_ARTIFACT]).read_text())
        self.model = OnnxClassifier(context.artifacts[MODEL_ARTIFACT])

    def predict(
        self, context: PythonModelContext, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> pd.DataFrame:
        top_k = int((params or {}).get("top_k", TOP_K))
        return classify(self.model, self.version, image_bytes(model_input), top_k)


set_model(RaylineClassifier())
