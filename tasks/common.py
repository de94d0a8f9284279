"""What every rayline task shares: retry policy, its run (Ray connection, start, OpenLineage), lineage recording,
run ids, lease holders, events, artifacts.

The tasks layer's one shared base: a task module imports no other task module, only this one
(``tests/unit/test_structure.py``), and flows take these helpers from here too.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ParamSpec, TypeVar

from prefect import Task, get_run_logger, task
from prefect.assets import Asset, AssetProperties, add_asset_metadata, materialize
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State, TaskRun
from prefect.context import TaskRunContext
from prefect.events import emit_event
from prefect.runtime import flow_run, task_run

from rayline import events, lineage, ray_cluster, ray_work
from rayline.errors import RaylineError, is_transient
from rayline.lineage import DatasetRef, DeclaresLineage, LineageRecord, RunContext, openlineage_events, written
from rayline.models.aliases import AliasMove
from rayline.ray_cluster import RayConnection
from rayline.storage import leases

# backoff for transient failures (S3 throttling, connection resets, lost Ray workers); jitter spreads retries
RETRY_DELAYS_S: list[float] = [5.0, 20.0, 60.0]
RETRY_JITTER = 0.5
# Every task that waits on Ray gets a timeout: a starved cluster hangs silently.
DEFAULT_TIMEOUT_S = 3600


P = ParamSpec("P")
R = TypeVar("R")


def ray_task(
    name: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, preload: Sequence[str] = (), connects: bool = True
) -> Callable[[Callable[P, R]], Task[P, R]]:
    """The one retry/timeout/caching policy of every task that runs a Ray workload, and its run's ceremony.

    No Prefect result caching: workloads skip committed outputs themselves, which also survives a lost
    Prefect database. Each run is an OpenLineage run (START, then COMPLETE or FAIL) that connects to Ray
    first (``connects=False``: a stage that needs no cluster). An attempt that times out or is cancelled
    stops the Ray work it started (``rayline.ray_work``): Prefect's timeout only raises in the task's thread.
    """

    def decorate(fn: Callable[P, R]) -> Task[P, R]:
        @functools.wraps(fn)
        def run_with_openlineage(*args: P.args, **kwargs: P.kwargs) -> R:
            context = TaskRunContext.get()  # the limit in force: with_options(timeout_seconds=…) may change it
            limit = context.task.timeout_seconds if context else timeout_s
            with openlineage_run(name) as run, ray_work.cancel_on_abort(f"task {name}", limit):
                if connects:
                    run.connection = ray_cluster.connect(preload=preload)
                return fn(*args, **kwargs)

        # Prefect keys the task by this function's code, not the wrapper's.
        setattr(run_with_openlineage, "__prefect_task_source__", fn)  # noqa: B010
        return maintenance_task(name, timeout_s)(run_with_openlineage)

    return decorate


def maintenance_task(name: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Callable[[Callable[P, R]], Task[P, R]]:
    """The same retry/timeout/caching policy, without an OpenLineage run: for upkeep that produces no dataset
    (a vacuum every monitor run would otherwise add two empty OpenLineage events every 15 minutes)."""

    def decorate(fn: Callable[P, R]) -> Task[P, R]:
        return task(
            name=name,
            retries=len(RETRY_DELAYS_S),
            retry_delay_seconds=RETRY_DELAYS_S,
            retry_jitter_factor=RETRY_JITTER,
            retry_condition_fn=retry_if_transient,
            timeout_seconds=timeout_s,
            cache_policy=NO_CACHE,
            persist_result=False,
        )(fn)

    return decorate


def retry_if_transient(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Prefect retry condition: retry only errors that a retry can fix."""
    try:
        state.result()
    except Exception as exc:  # the task's own error, of any class: is_transient decides
        return is_transient(exc)
    return False


def run_context() -> RunContext:
    """Prefect and Ray identifiers of the current run (its task's Ray connection, if any), for lineage."""
    run = _current_run.get()
    connection = run.connection if run else None
    return RunContext(
        flow_run_id=_str_or_none(flow_run.get_id()),
        flow_name=_str_or_none(flow_run.get_flow_name()),
        task_run_id=_str_or_none(task_run.get_id()),
        task_name=_str_or_none(task_run.get_task_name()),
        ray_job_id=connection.job_id if connection else None,
        ray_address=connection.address if connection else None,
    )


@dataclass
class _StageRun:
    """The task running now: its OpenLineage run, start, Ray connection and the datasets its records named."""

    identity: openlineage_events.RunIdentity
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    connection: RayConnection | None = None  # set by ray_task once connected
    inputs: list[DatasetRef] = field(default_factory=list)
    outputs: list[DatasetRef] = field(default_factory=list)


_current_run: ContextVar[_StageRun | None] = ContextVar("rayline_openlineage_run", default=None)


def _run_identity(job_name: str) -> openlineage_events.RunIdentity:
    """The Prefect task run is the OpenLineage run (a new id outside Prefect); its flow run is the parent."""
    return openlineage_events.RunIdentity(
        run_id=openlineage_events.as_run_id(_str_or_none(task_run.get_id())),
        job_name=job_name,
        parent_run_id=_str_or_none(flow_run.get_id()),
        parent_job_name=_str_or_none(flow_run.get_flow_name()),
    )


@contextmanager
def openlineage_run(job_name: str) -> Iterator[_StageRun]:
    """Start the stage's run: emit START now, then COMPLETE with the datasets recorded meanwhile, or
    FAIL/ABORT on an exception (re-raised; emission itself never raises)."""
    run = _StageRun(_run_identity(job_name))
    token = _current_run.set(run)
    openlineage_events.emit("START", run.identity)
    try:
        yield run
    except Exception as exc:  # any failure of the stage is a FAIL event; re-raised
        openlineage_events.emit("FAIL", run.identity, run.inputs, run.outputs, error=exc)
        raise
    except BaseException as exc:  # cancelled or interrupted: not the stage's own failure
        openlineage_events.emit("ABORT", run.identity, run.inputs, run.outputs, error=exc)
        raise
    else:
        openlineage_events.emit("COMPLETE", run.identity, run.inputs, run.outputs)
    finally:
        _current_run.reset(token)


def record_lineage(stage: str, datasets: DeclaresLineage, parameters: dict[str, Any], cached: bool = False) -> str:
    """Write this stage run's lineage record of the datasets ``datasets`` declares; returns its URI.

    Each dataset's schema (and an output's size) is read back from what was written first; the outputs the run
    wrote become Prefect assets. The start time and Ray connection are the current run's (``ray_task``; outside
    one: now, no Ray job). The record's id derives from the task run and the stage: a retried attempt adds no
    second record.
    """
    run = _current_run.get()
    inputs = [_read_back(ref, statistics=False) for ref in datasets.lineage_inputs()]
    outputs = [_read_back(ref) for ref in datasets.lineage_outputs()]
    run_id = task_run.get_id()
    identity = {"record_id": uuid.uuid5(uuid.NAMESPACE_URL, f"rayline:{run_id}:{stage}").hex} if run_id else {}
    record = LineageRecord(
        **identity,
        stage=stage,
        started_at=run.started_at if run else datetime.now(UTC),
        inputs=inputs,
        outputs=outputs,
        parameters=parameters,
        code_version=lineage.code_version(),
        run=run_context(),
        cached=cached,
    )
    uri = lineage.write_record(record, maybe_written=bool(run_id) and (task_run.run_count or 1) > 1)
    if run is None:  # no openlineage_run around: this record is the whole run
        openlineage_events.emit("COMPLETE", _run_identity(stage), inputs, outputs)
    else:  # COMPLETE (or FAIL, if the task fails later) is emitted when the task returns
        run.inputs.extend(inputs)
        run.outputs.extend(outputs)
    if not cached:  # found committed by an earlier run: not materialized by this one
        _materialize(run.identity.job_name if run else stage, inputs, outputs, on_ray=bool(run and run.connection))
    return uri


def warn_in_run(message: str, *args: object) -> None:
    """A warning in the task's log inside a task run, else in rayline's."""
    logger = get_run_logger() if TaskRunContext.get() else logging.getLogger(__name__)
    logger.warning(message, *args)


def _read_back(ref: DatasetRef, statistics: bool = True) -> DatasetRef:
    """``ref`` with its schema (and ``statistics``: its size) read from storage; as it was when that fails: the
    record and the run stand without them."""
    try:
        found = written.describe(ref, statistics=statistics)
    except RaylineError as exc:
        warn_in_run("lineage: the schema of %s not read back: %s", ref.uri, exc)
        return ref
    return ref if found is None else ref.model_copy(update={"written": found})


def _asset(ref: DatasetRef) -> Asset | None:
    """The Prefect asset of a stored dataset: its key the dataset's OpenLineage URI, its name the OpenLineage name."""
    if not lineage.is_storage_uri(ref.uri):
        return None
    try:
        return Asset(
            key=openlineage_events.dataset_uri(ref.uri),
            properties=AssetProperties(name=openlineage_events.dataset_id(ref.uri)[1]),
        )
    except ValueError as exc:  # a key Prefect refuses (a space, a '%' in a path): the run stands without it
        warn_in_run("lineage: %s is not declared a Prefect asset: %s", ref.uri, exc)
        return None


def _asset_metadata(ref: DatasetRef) -> dict[str, Any]:
    """What a materialization adds to its asset: the rows, bytes and files written, and the version."""
    found = ref.written
    sizes = found.model_dump(include={"rows", "bytes", "files"}) if found else {}
    version = ref.table_version if ref.table_version is not None else ref.content_hash or ref.etag
    quality = ref.quality.model_dump() | {"error_fraction": ref.quality.error_fraction} if ref.quality else None
    namespace, name = openlineage_events.dataset_id(ref.uri)
    metadata = {**sizes, "version": version, "openlineage": {"namespace": namespace, "name": name}}
    return {k: v for k, v in {**metadata, "error_budget": quality}.items() if v is not None}


def _materialize(job: str, inputs: list[DatasetRef], outputs: list[DatasetRef], on_ray: bool) -> None:
    """Declare the outputs the run wrote as Prefect assets (its inputs their upstream), with their metadata.

    Their keys are known only now, after the stage: a materializing task made for them runs inside this task run.
    A version an alias moved to was not written by the run; outside a task run there is no run to declare it.
    """
    if TaskRunContext.get() is None:
        return
    made = [(asset, ref) for ref in outputs if ref.stored_as != "alias" and (asset := _asset(ref)) is not None]
    if not made:
        return
    upstream: list[Asset | str] = [asset for ref in inputs if (asset := _asset(ref)) is not None]

    def add_metadata() -> None:
        for asset, ref in made:
            add_asset_metadata(asset, _asset_metadata(ref))

    declare = materialize(
        *[asset for asset, _ in made],
        by="ray" if on_ray else None,
        name=f"{job}-assets",
        asset_deps=upstream,
        cache_policy=NO_CACHE,
        persist_result=False,
    )
    try:
        declare(add_metadata)()
    except Exception as exc:  # like OpenLineage's events, Prefect's assets never fail the stage that wrote them
        warn_in_run("lineage: %s not declared Prefect assets: %s: %s", job, type(exc).__name__, exc)


def idempotency_key(*inputs: object) -> str:
    """The same in every attempt of this Prefect task run, different in any other run: side effects a retry
    would repeat (a registered version, an emitted event) carry it, so the retry finds the first attempt's."""
    run = task_run.get_id() or flow_run.get_id() or uuid.uuid4().hex  # outside Prefect: every call is a run
    joined = "\x1f".join(str(part) for part in (run, *inputs))
    return hashlib.sha256(joined.encode()).hexdigest()[:32]


def emit(
    event: str,
    resource_id: str,
    payload: dict[str, Any],
    labels: dict[str, str] | None = None,
    idempotency_key: str | None = None,
) -> None:
    """Emit ``event`` (a name of ``rayline.events``); with ``idempotency_key`` its id is derived from the
    key, so an event a retried task emits again is the same event: Prefect's server stores it and fires
    its triggers once."""
    event_id = uuid.uuid5(uuid.NAMESPACE_URL, f"rayline:{event}:{idempotency_key}") if idempotency_key else None
    emit_event(
        event=event, resource={"prefect.resource.id": resource_id, **(labels or {})}, payload=payload, id=event_id
    )


def emit_alias_move(move: AliasMove) -> None:
    """The one event of an alias move, whoever made it: the promotion gate, a registration or a rollout.

    Its resource is the version the alias now names, labelled with the model and the alias (``serve-rollout``
    listens for ``challenger``); a retried task emits the same move again as the same event.
    """
    emit(
        events.ALIAS_MOVED,
        events.model_resource(move.name, move.version),
        payload={"model": move.name, **move.model_dump(include={"alias", "version", "previous", "reason"})},
        labels={"rayline.model": move.name, "rayline.alias": move.alias},
        idempotency_key=f"{move.name}:{move.alias}:v{move.version}:from:{move.previous}:{move.moved_at.isoformat()}",
    )


def png_markdown(title: str, png: bytes, link: str | None = None) -> str:
    """Markdown with the PNG inline, so the Prefect UI shows it without access to storage."""
    encoded = base64.b64encode(png).decode()
    where = f"\n\nStored at `{link}`" if link else ""
    return f"### {title}\n\n![{title}](data:image/png;base64,{encoded}){where}\n"


def lease_holder() -> str:
    """Who takes a lease (``rayline.storage.leases``): this flow run by name and id, on this host and process;
    outside a flow run, this process (with a random tag: two calls are two holders)."""
    run_id = _str_or_none(flow_run.get_id())
    return leases.run_holder(f"flow run {flow_run.get_name()} ({run_id})" if run_id else None)


def folder_wait_text(waited_s: float, cached: bool, what: str) -> str:
    """For a task's log line: that the run waited for another run holding its output folder, and what it found."""
    if waited_s < 1.0:  # taking a free lease takes a few ms: no wait worth a word
        return ""
    found = "found it committed" if cached else "then wrote it"
    return f" (another run held the {what}; waited {waited_s:.0f} s, {found})"


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)


def log_ray_data_stats(stats: str) -> None:
    """Ray Data's per-operator execution stats, in the Prefect task's log (Ray keeps them in its own)."""
    if stats.strip():
        get_run_logger().info("Ray Data execution stats:\n%s", stats.strip())


# a flow's own reads and small writes of the registry and storage take seconds: one this long is stuck
IO_TIMEOUT_S = 300


def io_task(name: str, timeout_s: float = IO_TIMEOUT_S) -> Callable[[Callable[P, R]], Task[P, R]]:
    """The policy of the tasks through which flows read and write the registry and storage: ``maintenance_task``'s.
    Flows never call the registry, storage, MLflow or leases themselves (``tests/unit/test_structure.py``): a
    throttled read retries here as in any stage."""
    return maintenance_task(name, timeout_s)
