"""A night's Ray Data pipeline: block cutters on the driver's node, predictor actors, their reports summed.

``predict_and_write`` builds the lazy dataset: listing parts cut into spans of blocks
(:func:`rayline.ray_workloads.nightly.blocks.cut_part`), predicted by a pool of restartable actors that write
each block's files and report them. ``sum_reports`` runs it and adds the reports up as they stream in. The
night's listing, lease, compaction and commits are :mod:`rayline.ray_workloads.nightly.batch_inference`'s.
"""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayline import errors, progress, ray_work
from rayline.errors import RaylineError, RetriesExhausted
from rayline.ray_workloads.execution.interface import remote_options
from rayline.ray_workloads.nightly.blocks import (
    CPU_COLUMN,
    Cutting,
    NightOutput,
    any_block_written,
    blocks_per_span,
    cut_part,
    cutter_rows,
    objects_reported,
    reports_of,
)
from rayline.ray_workloads.nightly.compaction import NightTotals
from rayline.ray_workloads.nightly.contract import InferenceConfig
from rayline.ray_workloads.nightly.predictor import PredictorUDF
from rayline.storage.listing import ListingStart

if TYPE_CHECKING:
    from ray.data import Dataset

# A lost actor (OOM, node loss, killed) is restarted and its block retried; an input that kills its actor
# every time fails the run after this many (Ray Data's default retries forever). Ray's warning that
# "Actor … has constructor arguments in the object store and max_restarts > 0" (ray-project/ray#53727) is
# harmless here: those arguments are Ray Data's own, held by the operator for the whole run on the driver's
# node, so a restart after a worker node's loss finds them (tests/integration/test_node_loss.py).
ACTOR_RESTARTS = 3


def run_constants(cfg: InferenceConfig, kind: str = "predictions") -> dict[str, Any]:
    """Columns with one value per run, added to every row of ``kind``: the shadow's name the shadow's version."""
    version = cfg.shadow.version if kind == "shadow" and cfg.shadow else cfg.model.version
    return {"model_version": version, "code_version": cfg.code_version, "flow_run_id": cfg.flow_run_id or ""}


def _counting(predictor: type[PredictorUDF]) -> type[PredictorUDF]:
    """``predictor``, counting the objects of each block it has reported (for the CLI's progress)."""

    class _CountingPredictor(predictor):  # type: ignore[valid-type,misc]
        def __init__(self, shown: progress.Stage, *args: Any) -> None:
            super().__init__(*args)
            self._shown = shown

        def __call__(self, batch: pa.Table) -> dict[str, Any]:
            reports: dict[str, Any] = super().__call__(batch)
            self._shown.add(objects_reported(reports))
            return reports

    return _CountingPredictor


def predict_and_write(
    cfg: InferenceConfig,
    listing: ListingStart,
    output: NightOutput,
    shown: progress.Stage,
    *,
    size: int,
    predictor: type[PredictorUDF],
) -> Dataset:
    """``predictor`` actors over every block of ``size`` objects of the listing's parts, the groups of
    sub-prefixes the driver left being listed as the night goes (lazy: iterating the dataset runs them)."""
    import ray.data  # here: the driver process needs it only while it runs inference

    per_span = blocks_per_span(math.ceil(listing.estimated_count / size), cfg.actors)  # arithmetic, not a list
    # a small night, listed by the driver whole, needs no more actors than it has spans: each costs a
    # process and a model load; a larger one has spans for all of them
    spans = sum(math.ceil(part.rows / (size * per_span)) for part in listing.own.parts)
    actors = min(cfg.actors, spans) if listing.complete else cfg.actors
    return _spans(listing, output, size, per_span).map_batches(
        _counting(predictor),
        fn_constructor_args=(
            shown,
            cfg.model,
            cfg.top_k,
            cfg.batch_size,
            cfg.io_concurrency,
            output,
            run_constants(cfg),
            cfg.plan,
            cfg.shadow,
        ),
        batch_size=1,  # one span per call: it writes one file of each kind per block
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_cpus=cfg.cpus_per_actor,
        num_gpus=cfg.gpus_per_actor,
        max_restarts=ACTOR_RESTARTS,
        max_task_retries=ACTOR_RESTARTS,
        **_actor_options(cfg),  # a factory's code, shipped to the actors
    )


def _spans(listing: ListingStart, output: NightOutput, size: int, per_span: int) -> Dataset:
    """The listing's parts cut into spans of ``per_span`` blocks, each span its own Ray Data block (lazy)."""
    import ray.data

    written = any_block_written(output)
    cutting = Cutting(size, per_span, written, listing.prefix, listing.staging, listing.rows_per_part)
    rows = cutter_rows(listing)
    dataset = ray.data.from_items(rows, override_num_blocks=len(rows))  # one Ray Data block per row
    context = dataset.context  # this dataset's own copy: the process-wide settings stay as they are
    context.enable_progress_bars = False  # a bar per night in the logs of a Prefect task tells nobody anything
    context.raise_original_map_exception = True  # rayline's own errors reach the driver as themselves
    ray_work.stop_with_scope(context)  # a timed-out night stops its own actors, not its siblings' (a backfill)
    # every span its own Ray Data block, for every actor to take spans as it is free: flat_map would put a
    # part's spans into one block for one actor (a streaming repartition: ~7 s slower to the first block)
    context.target_max_block_size = 1
    # Ray Data's object-store budgets start at zero until a predictor task finishes, and read one span of the
    # cutters until then: every other actor idled through the first span (a first night's judging one). The
    # spans and reports are a few hundred bytes each and the images never enter the object store, so there is
    # nothing for those budgets to bound here.
    context.op_resource_reservation_enabled = False
    # On the driver's node, as from_items puts them, so the spans outlive a lost worker node (Ray Data waited
    # in vain for a lost row's task to run again). Hard affinity and no CPU: a soft one fell back to the
    # worker node whenever the actors held the head's CPUs, and a CPU asked could wait behind them. As many
    # tasks as the listing has groups (at most one per row): they only name spans or list sub-prefixes.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    cutters = ray.data.TaskPoolStrategy(size=min(listing.listers, len(rows)))
    return dataset.flat_map(partial(cut_part, cutting=cutting), compute=cutters, num_cpus=0, scheduling_strategy=here)


def _actor_options(cfg: InferenceConfig) -> dict[str, Any]:
    """The predictor actors' Ray options: the model's factory code, which a shadow shares or does without."""
    options = remote_options(cfg.model.model_spec)
    shadow = remote_options(cfg.shadow.model_spec) if cfg.shadow is not None else {}
    if shadow and shadow != options:
        raise errors.ConfigError(
            f"cannot shadow {cfg.model.name} v{cfg.model.version} with v{cfg.shadow.version if cfg.shadow else ''}: "
            "the shadow's factory ships code of its own, which the champion's actors would lack; "
            "shadow a version built by the same factory"
        )
    return options


def sum_reports(reports: Dataset) -> NightTotals:
    """Run the actors and sum their reports as they stream in (the driver never holds them all).

    Rayline's errors raised in an actor come out as themselves, lost actors as ``RetriesExhausted``: Ray Data
    restarted the lost actor and retried its block ``ACTOR_RESTARTS`` times already, and an input that kills
    its actor each time would kill it in a Prefect retry too.
    """
    totals = NightTotals()
    try:
        for row in reports.iter_rows():  # streamed: spans of blocks are reported as their actors finish them
            for report in reports_of(row):
                totals.add(report)
            totals.actor_cpu_s += float(row.get(CPU_COLUMN, 0.0))
    except Exception as exc:  # Ray wraps an actor's error in classes of its own: the causes decide
        causes = list(errors.causes(exc))
        # the remote exception itself, not Ray's RayTaskError(...) subclass that wraps it
        ours = [e for e in causes if isinstance(e, RaylineError) and not isinstance(e, ray.exceptions.RayTaskError)]
        if ours:
            raise ours[0] from exc
        if any(isinstance(e, ray.exceptions.RayActorError) for e in causes):
            raise RetriesExhausted(
                "a block of batch inference (its predictor actor died: out of memory, lost nodes, or an input "
                "that crashes the decoder or the model)",
                ACTOR_RESTARTS + 1,
                exc,
            ) from exc
        raise
    return totals
