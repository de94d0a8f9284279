"""Training throughput: Ray Train with 2 workers vs a plain single-process PyTorch loop.

Same preprocessed digits, same model, same epochs and the same global batch
(2 workers x 32 vs 64). Reports samples/s over the whole fit (start-up
included: what a user waits for) and over the epochs alone, the ratio, and the
test accuracy of the Ray-trained model. Target: ratio >= 0.7. Needs nothing
started by hand. Last line: JSON.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

EPOCHS = int(os.environ.get("BENCH_EPOCHS", "12"))


def main() -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    root = tempfile.mkdtemp(prefix="rayline-bench-train-")
    os.environ["RAYLINE_STORAGE"] = root

    import ray
    import torch

    from ray_workloads import evaluate, ingest, preprocess, train
    from ray_workloads.models import build_model
    from ray_workloads.training_loop import (
        TrainLoopConfig,
        in_memory_batches,
        make_optimizer,
        run_epoch,
        set_epoch_lr,
    )
    from rayline import ray_cluster, storage
    from rayline.seed import seed

    seed(storage.join(root, "raw"))
    ray_cluster.connect()
    ray.data.DataContext.get_current().enable_progress_bars = False
    ingested = ingest.run(ingest.IngestConfig(source_uri=storage.join(root, "raw"), output_root=f"{root}/in"))
    prepared = preprocess.run(
        preprocess.PreprocessConfig(ingest_manifest_uri=ingested.manifest_uri, output_root=f"{root}/pre")
    )
    loop = TrainLoopConfig(epochs=EPOCHS, batch_size=32)

    started = time.perf_counter()
    result = train.run(
        train.TrainConfig(
            data_manifest_uri=prepared.manifest_uri, output_root=f"{root}/training", run_name="bench", loop=loop
        )
    )
    ray_wall = time.perf_counter() - started
    fit_started_at = time.time() - ray_wall
    first, last = result.history[0], result.history[-1]
    startup_s = first["attempt_started_at"] - fit_started_at
    epochs_s = last["epoch_ended_at"] - first["attempt_started_at"]
    teardown_s = ray_wall - startup_s - epochs_s
    samples = sum(h["train_samples"] for h in result.history)
    ray_loop_s = sum(h["train_seconds"] for h in result.history)
    accuracy = evaluate.run(loop.model, result.weights_uri, prepared.manifest_uri).accuracy

    # the plain loop: one process, both cores, the whole split in memory
    table = storage.read_parquet(prepared.files["train"])
    data = {
        "image": torch.from_numpy(table.column("image").combine_chunks().to_numpy_ndarray().copy()),
        "label_index": torch.from_numpy(table.column("label_index").to_numpy()),
    }
    torch.set_num_threads(os.cpu_count() or 1)
    plain_cfg = loop.model_copy(update={"batch_size": 64, "model": result_model_spec(loop, len(prepared.classes))})
    model = build_model(plain_cfg.model)
    optimizer = make_optimizer(model, plain_cfg)
    started = time.perf_counter()
    plain_samples = 0
    for epoch in range(EPOCHS):
        set_epoch_lr(optimizer, plain_cfg, epoch)
        stats = run_epoch(model, in_memory_batches(data, 64, epoch), torch.device("cpu"), optimizer)
        plain_samples += stats.samples
    plain_wall = time.perf_counter() - started
    ray_cluster.disconnect()

    ray_rate, plain_rate = samples / ray_wall, plain_samples / plain_wall
    figures = {
        "ray_samples_s": round(ray_rate, 1),
        "plain_samples_s": round(plain_rate, 1),
        "ratio": round(ray_rate / plain_rate, 3),
        "test_accuracy": round(accuracy, 4),
        "ratio_epochs_only": round(samples / ray_loop_s / plain_rate, 3),
        "ray_fixed_overhead_s": round(startup_s + teardown_s, 1),
    }
    print(f"{EPOCHS} epochs over {int(samples / EPOCHS)} training images")
    print(f"Ray Train, 2 workers: {ray_rate:8.1f} samples/s over the whole fit ({ray_wall:.1f}s)")
    print(f"                      {samples / ray_loop_s:8.1f} samples/s inside the epochs ({ray_loop_s:.1f}s)")
    print(
        f"  of which start-up {startup_s:.1f}s, epochs incl. validation and checkpoints {epochs_s:.1f}s, "
        f"teardown {teardown_s:.1f}s"
    )
    print(f"plain PyTorch loop:   {plain_rate:8.1f} samples/s ({plain_wall:.1f}s)")
    print(f"ratio {figures['ratio']:.2f} (target >= 0.7); epochs-only ratio {samples / ray_loop_s / plain_rate:.2f}")
    print(f"test accuracy of the Ray-trained model: {accuracy:.4f}")
    print(json.dumps(figures))


def result_model_spec(loop, num_classes):  # type: ignore[no-untyped-def]
    return loop.model.model_copy(update={"num_classes": num_classes})


if __name__ == "__main__":
    main()
