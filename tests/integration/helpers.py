"""Assertions shared by integration tests: read outputs back the way a user would."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

import httpx
import numpy as np
import pyarrow as pa
from prefect import Task, flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import State

from rayline import storage
from rayline.models import registry
from rayline.ray_workloads.architectures.build import ModelSpec, build_model, imagenet_image_spec, state_dict_bytes
from rayline.ray_workloads.data.preprocess import ERRORS, SPLITS, PreprocessResult
from rayline.ray_workloads.nightly.blocks import BlockReport, block_file_uri
from rayline.ray_workloads.nightly.holding import night_lease_uri
from rayline.ray_workloads.nightly.predictor import PredictorUDF
from rayline.seed import EXPECTED_ERROR_TYPE, SeedResult
from rayline.specs import ImageSpec, WeightsSource
from rayline.storage import leases
from rayline.tables.delta_tables import Night

DIGITS = 1797


def read_outputs(result: PreprocessResult) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(good rows without pixels, error rows) of a committed preprocess output."""
    good: list[dict[str, Any]] = []
    files = result.read_files()
    assert {part: len(uris) for part, uris in files.items()} == result.file_counts
    for split in SPLITS:
        table = storage.read_parquet(files.get(split, []))
        if table.num_rows:
            rows = table.drop_columns(["image"]).to_pylist()
            good.extend({**row, "split": split} for row in rows)
    errors = storage.read_parquet(files.get(ERRORS, [])).to_pylist()
    return good, errors


def assert_exactly_one_row_per_object(result: PreprocessResult, seeded: SeedResult) -> None:
    good, errors = read_outputs(result)
    all_uris = [r["uri"] for r in good] + [r["uri"] for r in errors]
    assert len(all_uris) == len(set(all_uris)), "an object produced more than one row"
    expected = {storage.join(seeded.uri, o.key) for o in storage.list_objects(seeded.uri)}
    assert set(all_uris) == expected
    assert len(good) == seeded.digits, "a good image was lost"
    corrupt_uris = {storage.join(seeded.uri, key): kind for key, kind in seeded.corrupt.items()}
    assert {r["uri"] for r in errors} == set(corrupt_uris)
    for row in errors:
        assert row["error_type"] == EXPECTED_ERROR_TYPE[corrupt_uris[row["uri"]]], row
        assert row["stage"] == "decode" and row["error_message"]
    # each good row carries its object's label (the folder its key is in)
    labels = {storage.join(seeded.uri, o.key): o.key.split("/")[0] for o in storage.list_objects(seeded.uri)}
    assert all(r["label"] == labels[r["uri"]] for r in good), "a row's label is not its object's folder"
    if seeded.digits == DIGITS:  # the whole set: scikit-learn's counts per class
        assert Counter(r["label"] for r in good) == Counter(
            {str(d): n for d, n in enumerate([178, 182, 177, 183, 181, 182, 181, 179, 174, 180])}
        )


def register_untrained(
    name: str = "digits", seed: int = 0, broken: bool = False, class_prefix: str = "", trained_here: bool = True
) -> registry.ModelVersion:
    """An untrained SmallCNN (``seed`` fixes its weights); ``broken`` answers every input with NaNs;
    ``trained_here`` False registers it without training data (the monitor then judges against its first night).

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
        image_spec=ImageSpec(crop=32),
        classes=[f"{class_prefix}{i}" for i in range(10)],
        metrics={"test_accuracy": 0.1},
        data_manifest_uri="-" if trained_here else None,
        data_content_hash="-" if trained_here else None,
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

    from rayline.ray_workloads.architectures.build import imagenet_classes

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


class OutOfMemoryPredictor(PredictorUDF):
    """The batch-inference UDF over a model whose forward raises torch's own CUDA out-of-memory error."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import torch

        super().__init__(*args, **kwargs)

        from rayline.ray_workloads.execution.interface import LoadedModel

        def out_of_memory(images: np.ndarray) -> np.ndarray:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {images.size * 64 // 2**20} MiB (GPU 0; 0 B free)"
            )

        self.model = LoadedModel(self.model.spec, self.model.image_spec, out_of_memory)


HUNG_MARK = "hung-"  # + the pid of an actor of the night that hangs
SIBLING_MARK = "sibling-"  # + the pid of an actor of another night, once it saw the hung one gone
SIBLING_WAIT_S = 90.0


class HangsOneNight(PredictorUDF):
    """The batch-inference UDF, except that the night ``hang_dt`` hangs, and every other night waits for it.

    Which night hangs is the file ``hang.json`` beside the storage root (local storage), and the marks go
    beside it too. An actor of the hanging night marks its pid as it starts (before its model loads) and
    then sleeps in every block; an actor of any other night, before its first block, polls until the
    hanging night gave its lease up and none of its marked actors is running (a night alive while its hung
    sibling was stopped), marks its own pid and predicts.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        output = args[4]  # model, top_k, batch_size, io_concurrency, output, constants
        root = Path(output.predictions_table).parent
        self.marks = root.parent / "marks"
        hang_dt = json.loads((root.parent / "hang.json").read_text())["hang_dt"]
        self.hung_lease = night_lease_uri(str(root), Night(output.night.model_name, hang_dt))
        self.hangs = output.night.dt == hang_dt
        if self.hangs:
            self.marks.mkdir(exist_ok=True)
            (self.marks / f"{HUNG_MARK}{os.getpid()}").touch()
        super().__init__(*args, **kwargs)

    def run_block(self, block: str, uris: list[str], etags: list[str]) -> BlockReport:
        if self.hangs:
            time.sleep(600)  # far past any test: only being stopped ends it
        elif not (self.marks / f"{SIBLING_MARK}{os.getpid()}").exists():
            self._wait_for_the_hung_night_to_be_stopped()
        return super().run_block(block, uris, etags)

    def _hung_pids(self) -> list[int]:
        return [int(p.name[len(HUNG_MARK) :]) for p in self.marks.glob(f"{HUNG_MARK}*")]

    def _wait_for_the_hung_night_to_be_stopped(self) -> None:
        deadline = time.monotonic() + SIBLING_WAIT_S
        lease = None
        while time.monotonic() < deadline:
            lease = leases.read(self.hung_lease)
            if lease is not None and lease.released and not running_pids(self._hung_pids()):
                self.marks.mkdir(exist_ok=True)
                (self.marks / f"{SIBLING_MARK}{os.getpid()}").touch()
                return
            time.sleep(0.2)
        raise RuntimeError(
            f"the hung night was not stopped within {SIBLING_WAIT_S:g} s: its lease {lease}, its actors still "
            f"running: {_describe(running_pids(self._hung_pids()))}"
        )


def _describe(pids: list[int]) -> str:
    """Each process by pid, state and command line (for a failure's message)."""
    described = []
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            state = next(line for line in status if line.startswith("State"))
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except OSError:
            state, command = "gone", ""
        described.append(f"{pid} ({state}) {command}")
    return "; ".join(described)


def running_pids(pids: list[int]) -> list[int]:
    """The processes of ``pids`` still there (a dead worker is reaped by its raylet at once)."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


class LeaseWaiters(logging.Handler):
    """Counts the distinct holders that logged waiting for a lease (``rayline.storage.leases`` says so once a wait)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self._holders: set[str] = set()
        self._changed = threading.Condition()
        self._logger = logging.getLogger("rayline.storage.leases")
        self._level = self._logger.level

    def emit(self, record: logging.LogRecord) -> None:
        if " waits up to " in record.getMessage():
            with self._changed:
                self._holders.add(record.getMessage().split(" waits up to ")[0])
                self._changed.notify_all()

    def wait_for(self, count: int, timeout_s: float) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: len(self._holders) >= count, timeout=timeout_s):
                raise AssertionError(f"only {sorted(self._holders)} waited for the night's lease in {timeout_s} s")

    def __enter__(self) -> LeaseWaiters:
        self._logger.addHandler(self)
        self._logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)


GATE_OPEN = "gate-open"  # beside the tables: GatedPredictor's actors take their spans once it exists
AT_GATE = "at-gate-"  # + the pid of a GatedPredictor actor waiting at the gate


class GatedPredictor(PredictorUDF):
    """The batch-inference UDF, except that each actor waits before its first span (before it reads the
    span's listing part) until the file ``GATE_OPEN`` exists beside the tables (local storage), having
    marked its pid there (``AT_GATE``)."""

    def __call__(self, batch: pa.Table) -> dict[str, Any]:
        root = Path(self.output.predictions_table).parent
        if not (root / GATE_OPEN).exists():
            (root / f"{AT_GATE}{os.getpid()}").touch()
            deadline = time.monotonic() + 120
            while not (root / GATE_OPEN).exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the gate {root / GATE_OPEN} was not opened within 120 s")
                time.sleep(0.1)
        result: dict[str, Any] = super().__call__(batch)
        return result


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


def stored_events(
    api: str, event: str, resource_id: str | None = None, since: float | None = None
) -> list[dict[str, Any]]:
    """The events named ``event`` (about ``resource_id``, since the unix time ``since``) that the Prefect API
    at ``api`` stored."""
    wanted: dict[str, Any] = {"event": {"name": [event]}}
    if resource_id is not None:
        wanted["resource"] = {"id": [resource_id]}
    if since is not None:
        wanted["occurred"] = {"since": datetime.fromtimestamp(since, UTC).isoformat()}
    with httpx.Client(base_url=api) as client:
        answer = client.post("/events/filter", json={"filter": wanted})
        answer.raise_for_status()
        return list(answer.json()["events"])


def one_stored_event(api: str, event: str, resource_id: str, *, since: float) -> dict[str, Any]:
    """The event reached the server once since the unix time ``since`` (a retry's second emission, with the
    same id, was not kept): it. ``since`` is the calling test's start, as the server is shared by the session
    and an earlier test may have announced the same resource."""
    deadline = time.monotonic() + 20
    while not stored_events(api, event, resource_id, since):
        assert time.monotonic() < deadline, f"{event} for {resource_id} never reached the server"
        time.sleep(0.5)
    time.sleep(1.0)  # a second copy, had there been one, was sent right after the first
    stored = stored_events(api, event, resource_id, since)
    assert len(stored) == 1, stored
    return stored[0]
