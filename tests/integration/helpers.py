"""Assertions shared by integration tests: read outputs back the way a user would."""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, Self

import pyarrow as pa
from prefect import Task, flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import State

from ray_workloads.inference_predictor import PredictorUDF
from ray_workloads.models import ModelSpec, build_model, imagenet_image_spec, state_dict_bytes
from ray_workloads.night_blocks import BlockReport, block_file_uri
from ray_workloads.preprocess import ERRORS, SPLITS, PreprocessResult
from rayline import registry, storage
from rayline.seed import EXPECTED_ERROR_TYPE, SeedResult
from rayline.specs import ImageSpec, WeightsSource

DIGITS = 1797


def read_outputs(result: PreprocessResult) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(good rows without pixels, error rows) of a committed preprocess output."""
    good: list[dict[str, Any]] = []
    for split in SPLITS:
        table = storage.read_parquet(result.files.get(split, []))
        if table.num_rows:
            rows = table.drop_columns(["image"]).to_pylist()
            good.extend({**row, "split": split} for row in rows)
    errors = storage.read_parquet(result.files.get(ERRORS, [])).to_pylist()
    return good, errors


def assert_exactly_one_row_per_object(result: PreprocessResult, seeded: SeedResult) -> None:
    good, errors = read_outputs(result)
    all_uris = [r["uri"] for r in good] + [r["uri"] for r in errors]
    assert len(all_uris) == len(set(all_uris)), "an object produced more than one row"
    expected = {storage.join(seeded.uri, o.key) for o in storage.list_objects(seeded.uri)}
    assert set(all_uris) == expected
    assert len(good) == seeded.digits == DIGITS, "a good image was lost"
    corrupt_uris = {storage.join(seeded.uri, key): kind for key, kind in seeded.corrupt.items()}
    assert {r["uri"] for r in errors} == set(corrupt_uris)
    for row in errors:
        assert row["error_type"] == EXPECTED_ERROR_TYPE[corrupt_uris[row["uri"]]], row
        assert row["stage"] == "decode" and row["error_message"]
    assert Counter(r["label"] for r in good) == Counter(
        {str(d): n for d, n in enumerate([178, 182, 177, 183, 181, 182, 181, 179, 174, 180])}
    )


def register_untrained(
    name: str = "digits", seed: int = 0, broken: bool = False, class_prefix: str = ""
) -> registry.ModelVersion:
    """An untrained SmallCNN (``seed`` fixes its weights); ``broken`` answers every input with NaNs.

    Enough to check delivery and serving guarantees (accuracy is tested elsewhere).
    """
    import torch

    spec = ModelSpec(num_classes=10, width=8)
    torch.manual_seed(seed)
    model = build_model(spec)
    if broken:
        with torch.no_grad():
            model.head[-1].weight.fill_(float("nan"))
    return registry.register(
        name,
        state_dict_bytes(model),
        model_spec=spec,
        image_spec=ImageSpec(size=32),
        classes=[f"{class_prefix}{i}" for i in range(10)],
        metrics={"test_accuracy": 0.1},
        data_manifest_uri="-",
        data_content_hash="-",
        code_version="test",
    )


def register_outside(
    name: str = "photos",
    arch: str = "resnet18",
    crop: int = 64,
    classes: list[str] | None = None,
    seed: int = 0,
    alias: str | None = registry.CHAMPION,
) -> registry.ModelVersion:
    """A torchvision model with random weights, registered as an outside model would be.

    ImageNet preprocessing of ``arch`` scaled down to a ``crop``-pixel centre crop (tests check
    behaviour, not fidelity); 1,000 ImageNet classes unless ``classes`` says otherwise.
    """
    import torch

    from ray_workloads.models import imagenet_classes

    names = classes if classes is not None else imagenet_classes(arch)
    spec = ModelSpec(arch=arch, num_classes=len(names))
    torch.manual_seed(seed)
    weights = state_dict_bytes(build_model(spec))
    imagenet = imagenet_image_spec(arch)
    assert imagenet.resize is not None
    image = imagenet.model_copy(update={"resize": crop * imagenet.resize // imagenet.crop, "crop": crop})
    version = registry.register(
        name,
        weights,
        model_spec=spec,
        image_spec=image,
        classes=names,
        metrics={},
        code_version="test",
        weights_source=WeightsSource(uri="test://random-weights", sha256=f"seed-{seed}", size_bytes=len(weights)),
    )
    if alias is not None:
        registry.set_alias(name, alias, version.version, "test")
    return version


def register_untrained_champion(name: str = "digits") -> registry.ModelVersion:
    version = register_untrained(name)
    registry.set_alias(name, registry.CHAMPION, version.version, "test")
    return version


POISON = "poison"


class CrashingPredictor(PredictorUDF):
    """The batch-inference UDF, except that its process dies on any block holding an object named ``POISON``."""

    def run_block(self, block: str, uris: list[str], etags: list[str]) -> BlockReport:
        if any(POISON in uri for uri in uris):
            os._exit(1)  # like a decoder segfault or the OOM killer: no exception, no cleanup
        return super().run_block(block, uris, etags)


class ClientThreads:
    """Client threads running ``loop`` until the ``with`` block ends (load for serving tests)."""

    def __init__(self, loop: Callable[[int], None], count: int, join_timeout_s: float = 120.0) -> None:
        self.stop = threading.Event()
        self.join_timeout_s = join_timeout_s
        self.threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(count)]

    def __enter__(self) -> Self:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=self.join_timeout_s)


def run_task_once(task: Task[..., Any], *args: Any, **options: Any) -> tuple[State[Any], int]:
    """Run ``task`` in a flow with its retry policy (no delay between attempts); its final state and attempts.

    ``options`` go to ``task.with_options`` (e.g. ``timeout_seconds``).
    """
    fast = task.with_options(retry_delay_seconds=0, retry_jitter_factor=None, **options)

    states: list[State[Any]] = []

    @flow(name="attempts-probe")
    def probe() -> None:  # a flow returning a task's failed state would fail with it
        states.append(fast(*args, return_state=True))

    probe()
    state = states[0]
    task_run_id = state.state_details.task_run_id
    assert task_run_id is not None

    async def run_count() -> int:
        async with get_client() as client:
            return (await client.read_task_run(task_run_id)).run_count

    return state, asyncio.run(run_count())


class _PlantingPredictor(PredictorUDF):
    """The batch-inference UDF, except that it changes the files of each listing part's first block after
    writing them (its report stays what it wrote): what a lost, doubled or stray write would leave."""

    def run_block(self, block: str, uris: list[str], etags: list[str]) -> BlockReport:
        report = super().run_block(block, uris, etags)
        if block.endswith("/b000000000"):  # the first block of each listing part
            out = self.output
            predictions = block_file_uri(out.predictions_table, out.night, out.key, block)
            errors = block_file_uri(out.errors_table, out.night, out.key, block)
            self.plant(predictions, errors)
        return report

    def plant(self, predictions: str, errors: str) -> None:
        raise NotImplementedError


class PlantMissingRow(_PlantingPredictor):
    def plant(self, predictions: str, errors: str) -> None:
        table = storage.read_parquet([predictions])
        storage.write_parquet_atomic(predictions, table.slice(1))


class PlantDuplicatedRow(_PlantingPredictor):
    def plant(self, predictions: str, errors: str) -> None:
        table = storage.read_parquet([predictions])
        storage.write_parquet_atomic(predictions, pa.concat_tables([table, table.slice(0, 1)]))


class PlantExtraRow(_PlantingPredictor):
    def plant(self, predictions: str, errors: str) -> None:
        table = storage.read_parquet([errors])
        extra = pa.table(
            {
                "uri": ["s3://nowhere/not-listed.png"],
                "stage": ["fetch"],
                "error_type": ["X"],
                "error_message": ["planted"],
            }
        )
        storage.write_parquet_atomic(errors, pa.concat_tables([table, extra.cast(table.schema)]))
