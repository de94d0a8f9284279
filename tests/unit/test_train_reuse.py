"""A finished training run is returned again without Ray; anything that differs trains (resumes) instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayline import storage
from rayline.ray_workloads.training import train
from rayline.ray_workloads.training.loop import TrainLoopConfig
from rayline.storage import layout

pytestmark = pytest.mark.unit


def _finished(tmp_path: Path) -> tuple[train.TrainConfig, train.TrainResult]:
    """A run folder as a finished fit leaves it: its best checkpoint's weights and its result file."""
    cfg = train.TrainConfig(
        data_manifest_uri=str(tmp_path / "pre" / "manifest.json"),
        output_root=str(tmp_path / "training"),
        run_name="digits-1",
        loop=TrainLoopConfig(epochs=3),
    )
    run_uri = train.run_folder(cfg)
    weights = storage.join(run_uri, "checkpoint_000002", layout.WEIGHTS_FILE)
    storage.write_bytes_atomic(weights, b"tensors")
    result = train.TrainResult(
        run_name=cfg.run_name,
        run_uri=run_uri,
        checkpoint_uri=storage.join(run_uri, "checkpoint_000002"),
        weights_uri=weights,
        metrics={"val_accuracy": 0.9},
        history=[],
        epochs=3,
        elapsed_s=30.0,
        samples_per_s=100.0,
        data_manifest_uri=cfg.data_manifest_uri,
    )
    finished = {"config": cfg.model_dump(mode="json"), "result": result.model_dump(mode="json")}
    storage.write_json_atomic(storage.join(run_uri, layout.TRAIN_RESULT_FILE), finished)
    return cfg, result


def test_a_finished_run_is_returned_without_training(tmp_path: Path) -> None:
    cfg, result = _finished(tmp_path)
    again = train.run(cfg.model_copy(update={"num_workers": 1, "cpus_per_worker": 0.25}))  # no Ray here
    assert again.reused and not result.reused
    assert again.model_dump(exclude={"reused", "elapsed_s"}) == result.model_dump(exclude={"reused", "elapsed_s"})


def test_another_loop_other_data_lost_weights_or_an_unreadable_file_train_instead(tmp_path: Path) -> None:
    cfg, result = _finished(tmp_path)
    assert train.finished_result(cfg) == result
    assert train.finished_result(cfg.model_copy(update={"loop": TrainLoopConfig(epochs=4)})) is None, "more epochs"
    assert train.finished_result(cfg.model_copy(update={"data_manifest_uri": "other/manifest.json"})) is None
    assert train.finished_result(cfg.model_copy(update={"run_name": "digits-2"})) is None, "no such run"

    storage.write_bytes_atomic(storage.join(train.run_folder(cfg), layout.TRAIN_RESULT_FILE), b"{not json")
    assert train.finished_result(cfg) is None
    storage.write_json_atomic(storage.join(train.run_folder(cfg), layout.TRAIN_RESULT_FILE), {"result": {}})
    assert train.finished_result(cfg) is None, "a file of another version"

    _finished(tmp_path)
    storage.remove_tree(result.checkpoint_uri)
    assert train.finished_result(cfg) is None, "its best checkpoint is gone"
