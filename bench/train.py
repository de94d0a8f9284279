"""Training throughput: Ray Train with 2 workers vs a plain single-process PyTorch loop.

Same preprocessed digits, model, epochs, global batch (2 workers x 32 vs 64) and work per epoch (train,
validate, save weights and optimizer state). Reports samples/s over the whole fit (start-up included: what
a user waits for), the ratio, the training passes alone and the test accuracy. Each length of
``BENCH_EPOCHS`` (default ``12,60``; the last is the headline) runs in a process and cluster of its own:
a fit leaves actors behind that would skew the next. Why two lengths, the target: bench/README.md.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.support, run as a script

from bench.support.children import print_result, run_child  # noqa: E402
from bench.support.results import emit  # noqa: E402

LENGTHS = [int(e) for e in os.environ.get("BENCH_EPOCHS", "12,60").split(",")]


def prepare(root: str) -> Any:
    """The digits ingested and preprocessed under ``root``: the prepared manifest."""
    import ray

    from rayline import storage
    from rayline.ray_workloads.data import ingest, preprocess
    from rayline.seed import seed

    seed(storage.join(root, "raw"))
    ray.data.DataContext.get_current().enable_progress_bars = False
    ingested = ingest.run(ingest.IngestConfig(source_uri=storage.join(root, "raw"), output_root=f"{root}/in"))
    return preprocess.run(
        preprocess.PreprocessConfig(ingest_manifest_uri=ingested.manifest_uri, output_root=f"{root}/pre")
    )


def ray_fit(root: str, prepared: Any, epochs: int) -> dict[str, Any]:
    from rayline.ray_workloads.training import evaluate, train
    from rayline.ray_workloads.training.loop import TrainLoopConfig

    loop = TrainLoopConfig(epochs=epochs, batch_size=32)
    started, started_at = time.perf_counter(), time.time()
    result = train.run(
        train.TrainConfig(
            data_manifest_uri=prepared.manifest_uri,
            output_root=f"{root}/training",
            run_name=f"bench-{epochs}",
            loop=loop,
        )
    )
    wall = time.perf_counter() - started
    first, last = result.history[0], result.history[-1]
    startup_s = first.attempt_started_at - started_at
    epochs_s = last.epoch_ended_at - first.attempt_started_at
    return {
        "wall": wall,
        "samples": sum(h.train_samples for h in result.history),
        "loop_s": sum(h.train_seconds for h in result.history),
        "startup_s": startup_s,
        "epochs_s": epochs_s,
        "teardown_s": wall - startup_s - epochs_s,
        "accuracy": evaluate.run(loop.model, result.weights_uri, prepared.manifest_uri).accuracy,
    }


def _split_in_memory(prepared: Any, split: str) -> dict[str, Any]:
    import torch

    from rayline import storage

    table = storage.read_parquet(prepared.read_files()[split])
    return {
        "image": torch.from_numpy(table.column("image").combine_chunks().to_numpy_ndarray().copy()),
        "label_index": torch.from_numpy(table.column("label_index").to_numpy()),
    }


def plain_fit(root: str, prepared: Any, epochs: int) -> dict[str, Any]:
    """One process, both cores, the splits in memory; per epoch the Ray run's work (train, validate, save
    weights and optimizer state, here to a local file). The training passes alone: ``train_s``."""
    import torch

    from rayline.ray_workloads.architectures.build import build_model
    from rayline.ray_workloads.training.loop import (
        TrainLoopConfig,
        in_memory_batches,
        make_optimizer,
        run_epoch,
        set_epoch_lr,
    )

    train_data, val_data = _split_in_memory(prepared, "train"), _split_in_memory(prepared, "val")
    torch.set_num_threads(os.cpu_count() or 1)
    cfg = TrainLoopConfig(epochs=epochs, batch_size=64)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"num_classes": len(prepared.classes)})})
    model = build_model(cfg.model)
    optimizer = make_optimizer(model, cfg)
    checkpoint = Path(root) / "plain-checkpoint.pt"
    cpu = torch.device("cpu")
    started, samples, train_s = time.perf_counter(), 0, 0.0
    for epoch in range(epochs):
        set_epoch_lr(optimizer, cfg, epoch)
        stats = run_epoch(model, in_memory_batches(train_data, 64, epoch), cpu, optimizer)
        samples, train_s = samples + stats.samples, train_s + stats.seconds
        run_epoch(model, in_memory_batches(val_data, 256, None), cpu)
        torch.save({"weights": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, checkpoint)
    return {"wall": time.perf_counter() - started, "samples": samples, "train_s": train_s}


def report(epochs: int, ray_: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    ray_rate, plain_rate = ray_["samples"] / ray_["wall"], plain["samples"] / plain["wall"]
    inside, plain_train_only = ray_["samples"] / ray_["loop_s"], plain["samples"] / plain["train_s"]
    print(f"{epochs} epochs over {int(ray_['samples'] / epochs)} training images")
    print(f"  Ray Train, 2 workers: {ray_rate:8.1f} samples/s over the whole fit ({ray_['wall']:.1f}s)")
    print(f"                        {inside:8.1f} samples/s inside the training passes ({ray_['loop_s']:.1f}s)")
    print(
        f"    of which start-up {ray_['startup_s']:.1f}s, epochs incl. validation and checkpoints "
        f"{ray_['epochs_s']:.1f}s, teardown {ray_['teardown_s']:.1f}s"
    )
    print(f"  plain PyTorch loop:   {plain_rate:8.1f} samples/s ({plain['wall']:.1f}s with validation, checkpoints)")
    print(f"                        {plain_train_only:8.1f} samples/s in the training passes ({plain['train_s']:.1f}s)")
    print(
        f"  ratio {ray_rate / plain_rate:.2f}; training passes only {inside / plain_train_only:.2f}; "
        f"whole Ray fit vs the plain training passes alone {ray_rate / plain_train_only:.2f}"
    )
    print(f"  test accuracy of the Ray-trained model: {ray_['accuracy']:.4f}")
    return {
        "ray_samples_s": round(ray_rate, 1),
        "plain_samples_s": round(plain_rate, 1),
        "ratio": round(ray_rate / plain_rate, 3),
        "test_accuracy": round(ray_["accuracy"], 4),
        "ratio_training_passes_only": round(inside / plain_train_only, 3),
        "ratio_vs_plain_training_passes": round(ray_rate / plain_train_only, 3),
        "ray_fixed_overhead_s": round(ray_["startup_s"] + ray_["teardown_s"], 1),
    }


def measure(epochs: int) -> dict[str, Any]:
    """One run length in this process: its own embedded cluster and data."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    root = tempfile.mkdtemp(prefix="rayline-bench-train-")
    os.environ["RAYLINE_STORAGE"] = root

    from rayline import ray_cluster

    ray_cluster.connect()
    prepared = prepare(root)
    figures = report(epochs, ray_fit(root, prepared, epochs), plain_fit(root, prepared, epochs))
    ray_cluster.disconnect()
    return figures


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print_result(measure(int(sys.argv[2])))
        return
    figures = {e: run_child(f"{e} epochs", __file__, ["--child", str(e)], echo=True) for e in LENGTHS}
    headline = dict(figures[LENGTHS[-1]])
    headline.update({f"ratio_{epochs}_epochs": figures[epochs]["ratio"] for epochs in LENGTHS})
    print(
        f"ratio at {LENGTHS[-1]} epochs {headline['ratio']:.2f} (target >= 0.7); by length: "
        + ", ".join(f"{e} epochs {figures[e]['ratio']:.2f}" for e in LENGTHS)
    )
    emit("train", headline)


if __name__ == "__main__":
    main()
