"""Code-free model files: TorchScript, ``torch.export`` programs (``.pt2``) and ONNX, run as saved.

The file is the whole model; reading it never unpickles arbitrary Python objects. TorchScript's loader
knows only tensors and TorchScript types, and its interpreter (not Python) runs the file's code.
``torch.export.load`` falls back to full unpickling for some payloads: :func:`check_export_archive`
first proves each loads with ``torch.load(weights_only=True)`` and refuses custom or opaque objects and
compiled AOTInductor code. ONNX is a protobuf graph of standard operators, run by ONNX Runtime.
:class:`FileModel` gives the stages one callable from a float32 batch to logits for each.
"""

from __future__ import annotations

import io
import json
import posixpath
import re
import warnings
import zipfile
from collections.abc import Callable
from typing import Any

import numpy as np

from rayline.errors import ConfigError, InputDataError, UnsafeModelFileError
from rayline.extras import install_hint
from rayline.specs import ONNX, TORCH_EXPORT, TORCHSCRIPT

FORMAT_NAMES = {TORCHSCRIPT: "TorchScript", TORCH_EXPORT: "torch.export program (.pt2)", ONNX: "ONNX"}
_A_FILE = {TORCHSCRIPT: "a TorchScript file", TORCH_EXPORT: "a torch.export program (.pt2)", ONNX: "an ONNX file"}
SAVE_HINTS = {
    TORCHSCRIPT: "torch.jit.save(torch.jit.script(model), 'model.pt')",
    TORCH_EXPORT: "torch.export.save(torch.export.export(model, (torch.randn(2, 3, 224, 224),)), 'model.pt2')",
    ONNX: "torch.onnx.export(model, (torch.randn(2, 3, 224, 224),), 'model.onnx', dynamic_shapes=...)",
}


def described(fmt: str) -> str:
    """The format with its article, for messages: "an ONNX file", "a state dict"…"""
    return _A_FILE.get(fmt, "a state dict")


def _unpickling_refused(exc: Exception) -> str:
    """The part of torch's weights-only refusal naming what it would have called, without its advice to bypass."""
    text = str(exc)
    found = re.search(r"(Unsupported global: GLOBAL \S+|Unsupported operand \d+)", text)
    return found.group(1) if found else f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


def detect_format(data: bytes, uri: str) -> str:
    """The file's format from its content: ``state_dict``, ``torchscript``, ``torch_export`` or ``onnx``."""
    if data[:2] == b"PK":
        names = _zip_names(data, uri)
        roots = {name.split("/", 1)[1] for name in names if "/" in name}
        if "archive_format" in roots or any(r.startswith("models/") and r.endswith(".json") for r in roots):
            return TORCH_EXPORT
        if any(r.startswith("code/") for r in roots) and "data.pkl" in roots:
            return TORCHSCRIPT
        if "data.pkl" in roots:
            return "state_dict"
        raise InputDataError(f"{uri} is a zip archive but neither a torch.save file, TorchScript nor a .pt2 program")
    # a serialised ONNX ModelProto starts with its ir_version (field 1, a varint: tag byte 0x08)
    if uri.lower().endswith(".onnx") or data[:1] == b"\x08":
        return ONNX
    if data[:1] == b"\x80":  # a legacy (non-zip) torch.save pickle
        return "state_dict"
    raise InputDataError(
        f"{uri}: unrecognised model file (expected a torch.save state dict, TorchScript, a .pt2 program or ONNX)"
    )


def _zip_names(data: bytes, uri: str) -> list[str]:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return archive.namelist()
    except zipfile.BadZipFile as exc:
        raise InputDataError(f"{uri} is not a readable zip archive: {exc}") from exc


def check_export_archive(data: bytes, uri: str) -> None:
    """Refuse a ``.pt2`` whose loading would unpickle anything beyond tensors, or load native code."""
    import torch

    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = archive.namelist()
        native = [n for n in names if n.endswith((".so", ".dll", ".dylib")) or "/data/aotinductor/" in n]
        if native:
            raise UnsafeModelFileError(
                f"refusing {uri}: it holds compiled native code ({native[0]}); rayline runs the exported program "
                f"itself. Save it with {SAVE_HINTS[TORCH_EXPORT]}"
            )
        pickled = [n for n in names if "/data/sample_inputs/" in n or n.endswith(".pt")]
        for config in (n for n in names if n.endswith("_config.json") and "/data/" in n):
            entries = json.loads(archive.read(config)).get("config", {})
            folder = posixpath.dirname(config)
            for fqn, meta in entries.items():
                path = str(meta.get("path_name", ""))
                if path.startswith(("custom_obj", "opaque_obj")):
                    raise UnsafeModelFileError(
                        f"refusing {uri}: constant {fqn} is a pickled Python object ({path}), not a tensor"
                    )
                if meta.get("use_pickle"):
                    pickled.append(posixpath.join(folder, path))
        for name in pickled:
            try:
                torch.load(io.BytesIO(archive.read(name)), map_location="cpu", weights_only=True)
            except Exception as exc:  # any failure to load plain tensors refuses it
                raise UnsafeModelFileError(
                    f"refusing {uri}: its payload {name} holds pickled objects, not just tensors "
                    f"({_unpickling_refused(exc)}); save the program with {SAVE_HINTS[TORCH_EXPORT]}"
                ) from exc


class FileModel:
    """A code-free file, loaded: ``logits(batch)`` from float32 (N, 3, H, W) to (N, classes). ``max_batch``:
    the batch the file was exported for when it is fixed (1 is common); larger ones run in slices of it."""

    def __init__(self, fmt: str, run: Callable[[np.ndarray], np.ndarray], max_batch: int | None, source: Any) -> None:
        self.format = fmt
        self._run = run
        self.max_batch = max_batch
        self.source = source  # the torch module (TorchScript, exported) or the ONNX Runtime session

    def logits(self, batch: np.ndarray) -> np.ndarray:
        step = self.max_batch or len(batch)
        outputs = [self._run_padded(batch[i : i + step], step) for i in range(0, len(batch), step)]
        return np.concatenate(outputs) if len(outputs) > 1 else outputs[0]

    def _run_padded(self, part: np.ndarray, step: int) -> np.ndarray:
        """A file with a fixed batch takes that batch only: a shorter slice (one /predict request, a night's last
        images) is padded with copies of its last image, whose answers are dropped."""
        short = step - len(part)
        if short > 0:
            part = np.concatenate([part, np.repeat(part[-1:], short, axis=0)])
        return self._run(np.ascontiguousarray(part))[: step - short]


# torch.onnx.export writes the weights to a second file (NAME.onnx.data) unless told not to; a model is one file
_ONE_ONNX_FILE = (
    "; its weights are in a separate file (ONNX external data), which is not read: export it as one file, "
    "torch.onnx.export(..., external_data=False)"
)


def load_file_model(fmt: str, data: bytes, uri: str, threads: int | None = None) -> FileModel:
    """Load a code-free file safely (see the module's docstring); the file's own errors are named with it."""
    try:
        if fmt == TORCHSCRIPT:
            return _torchscript(data)
        if fmt == TORCH_EXPORT:
            check_export_archive(data, uri)
            return _exported(data)
        if fmt == ONNX:
            return _onnx(data, threads)
    except (UnsafeModelFileError, ConfigError):
        raise
    except Exception as exc:  # each format's loader has its own classes: any is a file that does not load
        raise InputDataError(
            f"{uri} does not load as {FORMAT_NAMES.get(fmt, fmt)}: {type(exc).__name__}: {str(exc)[:300]}"
            + (_ONE_ONNX_FILE if fmt == ONNX and "external data" in str(exc).lower() else "")
        ) from exc
    raise ConfigError(f"unknown model file format {fmt!r}; expected one of {', '.join(FORMAT_NAMES)}")


def _torch_runner(module: Any) -> Callable[[np.ndarray], np.ndarray]:
    import torch

    def run(batch: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            out = module(torch.from_numpy(batch))
        if isinstance(out, (tuple, list)):
            out = out[0]
        return out.float().numpy()  # type: ignore[no-any-return]

    return run


def _torchscript(data: bytes) -> FileModel:
    import torch

    with warnings.catch_warnings():
        # torch deprecates TorchScript; a user's existing file is still one rayline runs, at every load
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.load.* is deprecated", category=FutureWarning)
        module = torch.jit.load(io.BytesIO(data), map_location="cpu").eval()  # type: ignore[no-untyped-call]
    return FileModel(TORCHSCRIPT, _torch_runner(module), None, module)


def _exported(data: bytes) -> FileModel:
    import torch

    program = torch.export.load(io.BytesIO(data))  # the archive is checked first (check_export_archive)
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    user_inputs = set(program.graph_signature.user_inputs)
    batch_dim = next((n.meta["val"].shape[0] for n in placeholders if n.name in user_inputs and "val" in n.meta), None)
    fixed = batch_dim if isinstance(batch_dim, int) else None
    return FileModel(TORCH_EXPORT, _torch_runner(program.module()), fixed, program)


def _onnx(data: bytes, threads: int | None) -> FileModel:
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise ConfigError(f"ONNX models run with ONNX Runtime, which is not installed: {install_hint('onnx')}") from exc
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    session = ort.InferenceSession(data, sess_options=options, providers=["CPUExecutionProvider"])
    inputs = session.get_inputs()
    if len(inputs) != 1:
        raise InputDataError(
            f"ONNX model takes {len(inputs)} inputs ({', '.join(i.name for i in inputs)}); "
            "expected one image batch (N, 3, H, W)"
        )
    first = inputs[0]
    if first.type != "tensor(float)":
        raise InputDataError(f"ONNX model's input {first.name} is {first.type}; expected tensor(float) (float32)")
    name = first.name
    batch_dim = first.shape[0] if first.shape else None
    fixed = batch_dim if isinstance(batch_dim, int) and batch_dim > 0 else None

    def run(batch: np.ndarray) -> np.ndarray:
        return np.asarray(session.run(None, {name: batch.astype(np.float32, copy=False)})[0], dtype=np.float32)

    return FileModel(ONNX, run, fixed, session)


def onnx_input_shape(model: FileModel) -> list[Any] | None:
    """The ONNX input's declared shape (ints and symbolic names), for naming a size mismatch."""
    if model.format != ONNX:
        return None
    return list(model.source.get_inputs()[0].shape)
