"""The epoch loop shared by Ray Train workers and Ray Tune trials: plain PyTorch over iterables of
``{"image", "label_index"}`` batches, whatever their source."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from pydantic import BaseModel, Field
from torch import nn

from rayline import storage
from rayline.errors import ConfigError, InjectedFailure
from rayline.ray_workloads.architectures.build import (
    ModelSpec,
    build_model,
    fine_tune_model,
    freeze_batchnorm_statistics,
    load_state_dict,
    trainable_parameters,
)
from rayline.ray_workloads.training.request import Hyperparameters

Batch = dict[str, torch.Tensor]
EpochBatches = Callable[[int], Iterable[Batch]]


class InitFrom(BaseModel):
    """Fine-tuning: start from a registered model's weights, with a new head for this data's classes."""

    weights_uri: str
    model: ModelSpec = Field(description="The parent's spec (its architecture and its own class count).")
    freeze_backbone: bool = Field(False, description="Train only the new head.")


class TrainLoopConfig(Hyperparameters):
    """One training run's loop: the model, where it starts, its hyper-parameters (what Tune searches over)."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    init: InitFrom | None = None
    seed: int = 0
    shuffle_buffer_rows: int = Field(4096, ge=1)  # shards are sorted by key (i.e. by class): shuffle
    # each worker's shard held in memory after the first pass skips Ray Data's per-epoch start-up
    cache_data: bool = True
    # Each data-parallel worker validates on the whole validation split (set by the driver).
    val_on_every_worker: bool = False
    # Fault drill: raise once at the start of this epoch (marker in storage makes it once).
    fail_once_at_epoch: int | None = None
    fail_marker_uri: str | None = None
    # Fault drill: raise at the start of this epoch in every attempt (a failure no restart fixes).
    fail_always_at_epoch: int | None = None


@dataclass
class EpochStats:
    loss: float
    accuracy: float
    samples: int
    seconds: float


def initial_model(cfg: TrainLoopConfig) -> nn.Module:
    """The model training starts from: a fresh ``cfg.model``, or the parent's weights with a new head."""
    if cfg.init is None:
        return build_model(cfg.model)
    if cfg.init.model.arch != cfg.model.arch:
        raise ConfigError(f"fine-tuning keeps the parent's architecture {cfg.init.model.arch}, not {cfg.model.arch}")
    state = load_state_dict(cfg.init.weights_uri)
    return fine_tune_model(
        cfg.init.model, state, cfg.init.weights_uri, cfg.model.num_classes, freeze_backbone=cfg.init.freeze_backbone
    )


def make_optimizer(model: nn.Module, cfg: TrainLoopConfig) -> torch.optim.Optimizer:
    # only what is trained: a frozen backbone's parameters get no optimizer state (nor a checkpoint of it)
    return torch.optim.AdamW(trainable_parameters(model), lr=cfg.lr, weight_decay=cfg.weight_decay)


def set_epoch_lr(optimizer: torch.optim.Optimizer, cfg: TrainLoopConfig, epoch: int) -> float:
    """Cosine decay from ``cfg.lr``: a function of the epoch alone, so resuming needs no scheduler state."""
    lr = cfg.lr * 0.5 * (1.0 + math.cos(math.pi * epoch / cfg.epochs))
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


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
    whole_split: bool = False,
) -> EpochStats:
    """One pass over ``batches``: trains when given an optimizer, else evaluates. Figures are summed across
    data-parallel workers, unless ``whole_split`` says each worker saw the whole split."""
    started = time.perf_counter()
    training = optimizer is not None
    model.train(training)
    if training:
        freeze_batchnorm_statistics(model)  # a frozen backbone keeps its running statistics
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
    figures = [total_loss, float(correct), float(seen)]
    total_loss, correct_f, seen_f = figures if whole_split else _reduce(figures)
    samples = int(seen_f)
    return EpochStats(
        loss=total_loss / max(1, samples),
        accuracy=correct_f / max(1, samples),
        samples=samples,
        seconds=time.perf_counter() - started,
    )


def train_epochs(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: TrainLoopConfig,
    start_epoch: int,
    batches: tuple[EpochBatches, EpochBatches],
    device: torch.device,
    drills: bool = True,
) -> Iterator[tuple[int, EpochStats, EpochStats]]:
    """From ``start_epoch`` on, each epoch's number and its training and validation figures (``batches``: the
    train and val sources), after its fault drills (``drills``) and at its learning rate."""
    train_batches, val_batches = batches
    for epoch in range(start_epoch, cfg.epochs):
        if drills:
            inject_failure_if_due(cfg, epoch)
        set_epoch_lr(optimizer, cfg, epoch)
        train = run_epoch(model, train_batches(epoch), device, optimizer)
        yield epoch, train, run_epoch(model, val_batches(epoch), device, whole_split=cfg.val_on_every_worker)


def materialize(batches: Iterable[Batch]) -> Batch:
    """Concatenate a stream of batches into one in-memory batch."""
    parts: dict[str, list[torch.Tensor]] = {}
    for batch in batches:
        for key, value in batch.items():
            parts.setdefault(key, []).append(value)
    return {key: torch.cat(values) for key, values in parts.items()}


def in_memory_batches(data: Batch, batch_size: int, seed: int | None) -> Iterator[Batch]:
    """Batches over an in-memory batch, shuffled when a seed is given."""
    size = len(next(iter(data.values()))) if data else 0
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed)) if seed is not None else None
    for start in range(0, size, batch_size):
        index = order[start : start + batch_size] if order is not None else slice(start, start + batch_size)
        yield {key: value[index] for key, value in data.items()}


def epoch_batches(stream: Callable[..., Iterable[Batch]], cfg: TrainLoopConfig, shuffle: bool) -> EpochBatches:
    """Per-epoch batch source over a Ray Data iterator's ``iter_torch_batches``, shuffled with a seed per epoch.
    With ``cfg.cache_data`` the first pass starts at once in the background and is held for every epoch."""
    batch_size = cfg.batch_size if shuffle else 256

    def seed_for(epoch: int) -> int | None:
        return cfg.seed * 1000 + epoch if shuffle else None

    if cfg.cache_data:
        # a thread: the pass mostly waits on Ray Data's processes, so it overlaps building the model
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="first-pass")
        first_pass = pool.submit(materialize, stream(batch_size=1024))
        pool.shutdown(wait=False)

        def from_cache(epoch: int) -> Iterable[Batch]:
            return in_memory_batches(first_pass.result(), batch_size, seed_for(epoch))

        return from_cache

    def streamed(epoch: int) -> Iterable[Batch]:
        if not shuffle:
            return stream(batch_size=batch_size)
        return stream(
            batch_size=batch_size, local_shuffle_buffer_size=cfg.shuffle_buffer_rows, local_shuffle_seed=seed_for(epoch)
        )

    return streamed


def inject_failure_if_due(cfg: TrainLoopConfig, epoch: int) -> None:
    """The fault drills: fail at the configured epoch once across all restarts, or in every attempt."""
    if cfg.fail_always_at_epoch == epoch:
        raise InjectedFailure(f"injected failure at epoch {epoch} (every attempt)")
    if cfg.fail_once_at_epoch != epoch or not cfg.fail_marker_uri:
        return
    if storage.exists(cfg.fail_marker_uri):
        return
    storage.write_bytes_atomic(cfg.fail_marker_uri, f"failed at epoch {epoch}\n".encode())
    raise InjectedFailure(f"injected failure at epoch {epoch}")
