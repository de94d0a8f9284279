"""The plain loop of Ray Data's documented batch-inference pattern, without Ray: what a new user writes.

Ray Data's "Image Classification Batch Inference with PyTorch" example, in one process: a DataLoader whose
workers (one per core) read images whole (PIL, full decode, RGB) and apply the weights' ``transforms()``,
the model in eager fp32 under ``torch.inference_mode()`` with a torch thread per core, top-1 written to
one Parquet file. Nothing of rayline's (draft decoding, channels-last, plans): the baseline they beat.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class DocumentedDataset:
    """Item i: (i, the transformed image) — PIL's full decode, then the weights' transforms."""

    def __init__(self, paths: list[str], arch: str) -> None:
        from torchvision.models import get_model_weights

        self.paths = paths
        self.transforms = get_model_weights(arch).DEFAULT.transforms()  # metadata only: nothing is downloaded

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[int, Any]:
        from PIL import Image, ImageOps

        with Image.open(self.paths[index]) as image:
            return index, self.transforms(ImageOps.exif_transpose(image).convert("RGB"))


def documented_loop(paths: list[str], version: Any, out: Path, batch_size: int) -> int:
    """Predict every path with ``version``'s weights; returns the rows written."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from torch.utils.data import DataLoader

    from rayline.ray_workloads.architectures.build import load_model

    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    model = load_model(version.model_spec, version.weights_uri).eval()
    loader = DataLoader(DocumentedDataset(paths, version.model_spec.arch), batch_size=batch_size, num_workers=cores)
    indices: list[int] = []
    classes: list[int] = []
    confidences: list[float] = []
    with torch.inference_mode():
        for index, images in loader:
            values, top = torch.softmax(model(images), dim=1).max(dim=1)
            indices += index.tolist()
            classes += top.tolist()
            confidences += values.tolist()
    out.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "uri": [paths[i] for i in indices],
            "predicted_class": [version.classes[c] for c in classes],
            "confidence": pa.array(confidences, pa.float32()),
        }
    )
    pq.write_table(table, out)
    return table.num_rows
