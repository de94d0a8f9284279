"""The plain side of the compute-bound bench: a DataLoader loop in one process, no Ray.

Workers read (a local file or an S3 GET) and decode with rayline's ``decode_image``; the main process runs
the model as rayline's actors do and writes their Parquet files, with the same per-sample error capture.
"""

from __future__ import annotations

import os
import time
from typing import Any


class Reader:
    """Reads a local file or an S3 object; one boto3 client per process (DataLoader workers are forked)."""

    def __init__(self) -> None:
        self._client: Any = None
        self._pid = -1

    def __call__(self, uri: str) -> bytes:
        if not uri.startswith("s3://"):
            with open(uri, "rb") as handle:
                return handle.read()
        if self._pid != os.getpid():  # a client made before the fork is not the worker's to use
            import boto3

            self._client = boto3.session.Session().client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL"))
            self._pid = os.getpid()
        bucket, _, key = uri[len("s3://") :].partition("/")
        return bytes(self._client.get_object(Bucket=bucket, Key=key)["Body"].read())


class PhotoDataset:
    """Map-style dataset for the DataLoader: item i = (i, image or None, (stage, type, message) or None)."""

    def __init__(self, uris: list[str], image_spec: Any) -> None:
        self.uris, self.image_spec, self.read = uris, image_spec, Reader()

    def __len__(self) -> int:
        return len(self.uris)

    def __getitem__(self, index: int) -> tuple[int, Any, tuple[str, str, str] | None]:
        from rayline.ray_workloads.data.images import decode_image

        stage = "fetch"
        try:
            data = self.read(self.uris[index])
            stage = "decode"
            return index, decode_image(data, self.image_spec), None
        except Exception as exc:  # per-sample error capture, as rayline's actors do
            return index, None, (stage, type(exc).__name__, str(exc)[:500])


def collate(items: list[tuple[int, Any, tuple[str, str, str] | None]]) -> dict[str, Any]:
    """A batch: the decoded images stacked (the workers do it), their indices, and the failures."""
    import numpy as np
    import torch

    good = [(i, image) for i, image, error in items if error is None]
    return {
        "index": [i for i, _ in good],
        "images": torch.from_numpy(np.stack([image for _, image in good])) if good else None,
        "errors": [(i, *error) for i, _, error in items if error is not None],
    }


class _Files:
    """Collects rows and writes one predictions (and errors) file per ``per_file`` objects."""

    def __init__(self, objects: list[Any], version: Any, out_dir: str, per_file: int) -> None:
        self.objects, self.version, self.out_dir, self.per_file = objects, version, out_dir, per_file
        self.predictions: list[tuple[int, list[int], list[float], float]] = []
        self.errors: list[tuple[int, str, str, str]] = []
        self.files = self.rows = 0

    def add(self, predictions: list[tuple[int, list[int], list[float], float]], errors: list[Any]) -> None:
        self.predictions += predictions
        self.errors += errors
        if len(self.predictions) + len(self.errors) >= self.per_file:
            self.flush()

    def flush(self) -> None:
        from bench.support.plain_inference import write_files

        good = [self.objects[i] for i, *_ in self.predictions]
        top, probs, millis = ([p[k] for p in self.predictions] for k in (1, 2, 3))
        errors = [(self.objects[i].uri, *rest) for i, *rest in self.errors]
        name = f"part-{self.files:05d}.parquet"
        self.rows += write_files(self.out_dir, name, self.version, good, top, probs, millis, errors)
        self.predictions, self.errors, self.files = [], [], self.files + 1


def plain_loop(objects: list[Any], version: Any, out_dir: str, cfg: dict[str, Any]) -> int:
    """The DataLoader loop: returns the rows written (predictions + errors)."""
    import torch
    from torch.utils.data import DataLoader

    from rayline.ray_workloads.architectures.build import load_model, prepare_for_inference

    device = torch.device("cuda" if cfg["gpu"] else "cpu")
    model = prepare_for_inference(load_model(version.model_spec, version.weights_uri).to(device))
    loader = DataLoader(
        PhotoDataset([o.uri for o in objects], version.image_spec),  # type: ignore[arg-type]
        batch_size=cfg["batch_size"],
        num_workers=cfg["workers"],
        collate_fn=collate,
        pin_memory=cfg["gpu"],
    )
    files = _Files(objects, version, out_dir, cfg["objects_per_file"])
    for batch in loader:
        predictions = []
        if batch["images"] is not None:
            began = time.perf_counter()
            with torch.no_grad():
                images = batch["images"].to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
                values, indices = torch.softmax(model(images), dim=1).topk(3, dim=1)
                values, indices = values.cpu(), indices.cpu()  # waits for the GPU: inference_ms is the real time
            millis = (time.perf_counter() - began) * 1000 / len(batch["index"])
            predictions = [
                (i, idx, val, millis)
                for i, idx, val in zip(batch["index"], indices.tolist(), values.tolist(), strict=True)
            ]
        files.add(predictions, batch["errors"])
    files.flush()
    return files.rows
