"""The plain side of the batch-inference bench: the seed's TorchPredictor loop run by hand, no Ray.

Same listing, reads, ``decode_image``, batch size, Parquet files and per-sample error capture as rayline's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bench.support.inference_images import IMAGE_SIZE

CODE_VERSION = "bench"
BATCH_SIZE = 64  # nightly_inference's default
OBJECTS_PER_FILE = 256  # InferenceConfig.objects_per_task's default: one output file per block


def plain_loop(objects: list[Any], read: Callable[[str], bytes], version: Any, out_dir: str, prepared: bool) -> int:
    """The seed's TorchPredictor without Ray: read, decode, predict, write Parquet; returns rows written.

    ``prepared``: the model goes through ``prepare_for_inference`` (channels-last input) like rayline's
    actors, so that only Ray differs; otherwise it runs as loaded, as the seed's code does.
    """
    import numpy as np
    import torch

    from rayline.ray_workloads.architectures.build import load_model, prepare_for_inference
    from rayline.ray_workloads.data.images import decode_image

    spec = version.image_spec
    model = load_model(version.model_spec, version.weights_uri)
    layout = torch.channels_last if prepared else torch.contiguous_format
    model = prepare_for_inference(model) if prepared else model
    top_k = min(3, len(version.classes))
    written = 0
    for start in range(0, len(objects), OBJECTS_PER_FILE):
        part = objects[start : start + OBJECTS_PER_FILE]
        good, images, errors = [], [], []
        for obj in part:
            try:
                images.append(decode_image(read(obj.uri), spec))
                good.append(obj)
            except Exception as exc:  # per-sample error capture, as rayline's actors do
                errors.append((obj.uri, "decode", type(exc).__name__, str(exc)[:500]))
        probs, millis = [], []
        for b in range(0, len(images), BATCH_SIZE):
            began = time.perf_counter()
            with torch.no_grad():
                batch = torch.from_numpy(np.stack(images[b : b + BATCH_SIZE])).contiguous(memory_format=layout)
                probs.append(torch.softmax(model(batch), dim=1))
            n = len(images[b : b + BATCH_SIZE])
            millis.extend([(time.perf_counter() - began) * 1000 / n] * n)
        name = f"part-{start // OBJECTS_PER_FILE:05d}.parquet"
        values, indices = torch.cat(probs).topk(top_k, dim=1) if good else (torch.empty(0), torch.empty(0))
        written += write_files(out_dir, name, version, good, indices.tolist(), values.tolist(), millis, errors)
    return written


def write_files(
    out_dir: str,
    name: str,
    version: Any,
    good: list[Any],
    top: list[list[int]],
    probs: list[list[float]],
    millis: list[float],
    errors: list[tuple[str, str, str, str]],
) -> int:
    """One file of each table, as an actor writes a block: the ``good`` objects' predictions (``top`` class
    indices and their ``probs`` a row) and the ``(uri, stage, type, message)`` errors; the rows written."""
    import pyarrow as pa

    from rayline import storage

    if good:
        n = len(good)
        table = pa.table(
            {
                "uri": [o.uri for o in good],
                "etag": [o.etag for o in good],
                "predicted_index": pa.array([t[0] for t in top], pa.int64()),
                "predicted_class": [version.classes[t[0]] for t in top],
                "confidence": pa.array([p[0] for p in probs], pa.float32()),
                "top_k_index": pa.array(top, pa.list_(pa.int64())),
                "top_k_prob": pa.array(probs, pa.list_(pa.float64())),
                "inference_ms": pa.array(millis, pa.float32()),
                "model_name": [version.name] * n,
                "model_version": [version.version] * n,
                "code_version": [CODE_VERSION] * n,
                "flow_run_id": [""] * n,
            }
        )
        storage.write_parquet_atomic(f"{out_dir}/predictions/{name}", table)
    if errors:
        columns = ["uri", "stage", "error_type", "error_message"]
        table = pa.table({c: [e[i] for e in errors] for i, c in enumerate(columns)})
        storage.write_parquet_atomic(f"{out_dir}/errors/{name}", table)
    return len(good) + len(errors)


def choose_torch_threads(version: Any, prepared: bool) -> int:
    """The faster of 1 thread and torch's default for this model, so the plain loop is at its best."""
    import torch

    from rayline.ray_workloads.architectures.build import build_model, prepare_for_inference

    model = build_model(version.model_spec).eval()
    batch = torch.randn(BATCH_SIZE, 3, IMAGE_SIZE, IMAGE_SIZE)
    if prepared:
        model, batch = prepare_for_inference(model), batch.contiguous(memory_format=torch.channels_last)
    timings = {}
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        with torch.no_grad():
            model(batch)
            began = time.perf_counter()
            for _ in range(20):
                model(batch)
        timings[threads] = time.perf_counter() - began
    best = min(timings, key=lambda t: timings[t])
    torch.set_num_threads(best)
    return best
