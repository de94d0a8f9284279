"""The epoch loop shared by Ray Train workers and Ray Tune trials.

Plain PyTorch over iterables of ``{"image", "label_index"}`` batches: it knows
nothing of Scaling or Run configs, nor where the batches come from.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from pydantic import BaseModel, Field
from torch import nn

from ray_workloads.models import ModelSpec
from rayline import storage

Batch = dict[str, torch.Tensor]


class TrainLoopConfig(BaseModel):
    """Hyper-parameters of one training run (what Tune searches over)."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(1e-4, ge=0)
    batch_size: int = Field(64, ge=1)
    epochs: int = Field(8, ge=1)
    seed: int = 0
    # Shards are sorted by key (i.e. by class): batches must be shuffled.
    shuffle_buffer_rows: int = Field(4096, ge=1)
    # Fault drill: raise once at the start of this epoch (marker in storage makes it once).
    fail_once_at_epoch: int | None = None
    fail_marker_uri: str | None = None


class InjectedFailure(RuntimeError):
    """Raised by the fault drill to exercise recovery from checkpoints."""


@dataclass
class EpochStats:
    loss: float
    accuracy: float
    samples: int
    seconds: float


def make_optimizer(model: nn.Module, cfg: TrainLoopConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def _reduce(values: list[float]) -> list[float]:
    """Sum across data-parallel workers when running distributed."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        tensor = torch.tensor(values, dtype=torch.float64)
        torch.distributed.all_reduce(tensor)
        return [float(v) for v in tensor.tolist()]
    return values


def run_epoch(
    model: nn.Module,
    batches: Iterable[Batch],
    device: torch.device,
    optimizer: torch.optim.Optimizer | None = None,
) -> EpochStats:
    """One pass over ``batches``: trains when given an optimizer, else evaluates."""
    started = time.perf_counter()
    training = optimizer is not None
    model.train(training)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    total_loss, correct, seen = 0.0, 0, 0
    with torch.set_grad_enabled(training):
        for batch in batches:
            images = batch["image"].to(device, dtype=torch.float32)
            labels = batch["label_index"].to(device, dtype=torch.long)
            logits = model(images)
            loss = loss_fn(logits, labels)
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
                (loss / max(1, len(labels))).backward()
                optimizer.step()
            total_loss += float(loss.detach())
            correct += int((logits.argmax(dim=1) == labels).sum())
            seen += len(labels)
    total_loss, correct_f, seen_f = _reduce([total_loss, float(correct), float(seen)])
    samples = int(seen_f)
    return EpochStats(
        loss=total_loss / max(1, samples),
        accuracy=correct_f / max(1, samples),
        samples=samples,
        seconds=time.perf_counter() - started,
    )


def inject_failure_if_due(cfg: TrainLoopConfig, epoch: int) -> None:
    """The fault drill: fail once, at the configured epoch, across all restarts."""
    if cfg.fail_once_at_epoch != epoch or not cfg.fail_marker_uri:
        return
    if storage.exists(cfg.fail_marker_uri):
        return
    storage.write_bytes_atomic(cfg.fail_marker_uri, f"failed at epoch {epoch}\n".encode())
    raise InjectedFailure(f"injected failure at epoch {epoch}")
