"""Batch inference: every input object gets exactly one prediction row or one error row.

The driver streams the listing into parts, Ray Data cuts them into blocks that an actor pool
predicts (fetch, decode, predict, write each block at fixed names), the driver checks predictions
plus errors against the listing by counts and digests, compacts the block files and commits each
table once. How and why, step by step, with the layout: docs/nights.md.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from rayline import progress, ray_work, storage
from rayline.errors import InputDataError, LeaseLost, NightCommittedElsewhere, StorageError
from rayline.ray_workloads.execution.cache import demote_overflowing
from rayline.ray_workloads.execution.fallback import PlanUse
from rayline.ray_workloads.nightly.blocks import NightOutput, night_key
from rayline.ray_workloads.nightly.compaction import (
    CompactedFile,
    NightTotals,
    check_rows,
    compact_checked,
    compacted_digest,
    remove_blocks,
)
from rayline.ray_workloads.nightly.contract import InferenceConfig as InferenceConfig  # callers import it from here
from rayline.ray_workloads.nightly.contract import InferenceResult as InferenceResult
from rayline.ray_workloads.nightly.contract import NightSkipped as NightSkipped
from rayline.ray_workloads.nightly.contract import block_size
from rayline.ray_workloads.nightly.holding import held_night, listing_staging_uri, remove_earlier_listings
from rayline.ray_workloads.nightly.pipeline import predict_and_write, run_constants, sum_reports
from rayline.ray_workloads.nightly.predictor import PredictorUDF
from rayline.ray_workloads.quality.shadow import ShadowSummary, as_metadata, from_commit_info, summarize
from rayline.skipped import skipped_text
from rayline.storage import leases
from rayline.storage.layout import ERRORS_TABLE, PREDICTIONS_TABLE, SHADOW_TABLE, table_uri
from rayline.storage.listing import ListingStart, begin_listing, finish_listing
from rayline.tables.delta_probe import require_delta_writes
from rayline.tables.delta_tables import Night, NightCommit, attempt_run_id, commit_log_bytes, find_commit, open_table
from rayline.tables.predictions_table import (
    ERRORS_SCHEMA,
    PREDICTIONS_SCHEMA,
    CommitResult,
    check_night_unchanged,
    commit_night,
    night_seq,
)

if TYPE_CHECKING:
    from ray.data import Dataset

# What a process that runs batch inference asks its embedded Ray cluster to
# import in every worker at start (``ray_cluster.connect(preload=...)``), so
# that a predictor actor starts without waiting for these imports (bench/README.md):
# torch for the model; ray.data, and ray.util.state that unpickling Ray Data's
# context imports, for the actor pool's worker; the UDF's own module.
WORKER_PRELOAD = ("torch", "ray.data", "ray.util.state", "rayline.ray_workloads.nightly.predictor")
SCHEMAS = {"predictions": PREDICTIONS_SCHEMA, "errors": ERRORS_SCHEMA, "shadow": PREDICTIONS_SCHEMA}


def objects_per_task(cfg: InferenceConfig, count: int) -> int:
    """Block size for a night of ``count`` objects: large for cheap models (fewer calls), small for
    compute-bound ones, and larger again past ``MAX_BLOCKS_PER_NIGHT`` blocks.

    A night ends when its last block does: with a compute-bound model (a ResNet
    at 224 px) a 256-object block can leave one actor working alone for several
    seconds at the end while the others idle; a 32-object block keeps that tail
    short (bench/README.md). Block files are compacted before the commit, so
    the size of a block does not decide the size of the night's files. What
    does grow with the number of blocks is the driver's work (Ray Data
    schedules and reports each one: bench/README.md's CPU per block) and the
    files written, listed and compacted: a 100 M-photo night in 32-object blocks
    would be 3.1 M of each. Capped at 100,000 blocks it is 1,000 photos a block,
    a tail of under a minute of one core at ResNet-18's rate (docs/capacity.md).
    """
    return block_size(cfg.model.image_spec.size, count, cfg.objects_per_task)


def blocks_key(cfg: InferenceConfig, listing: ListingStart) -> str:
    """The key of the night's blocks: what decides their rows (blocks.night_key).

    Not the listing's content hash: that is known only once the whole prefix
    is listed, and the first blocks are predicted before (``listing.groups``).
    Each block's report holds the digest of its inputs with their ETags, and a
    rerun reuses only blocks whose inputs are the same objects at the same
    versions (``blocks.reused_report``).
    """
    shadow = cfg.shadow
    return night_key(
        {
            "model": [cfg.model.name, cfg.model.version, cfg.model.weights_uri],
            **({"shadow": [shadow.name, shadow.version, shadow.weights_uri]} if shadow else {}),
            "dt": cfg.dt,
            "input": listing.prefix,
            "objects_per_task": objects_per_task(cfg, listing.estimated_count),
            "top_k": cfg.top_k,
            "code_version": cfg.code_version,
            "parts": cfg.listing_part_objects,
        }
    )


def _predict_and_write(
    cfg: InferenceConfig, listing: ListingStart, output: NightOutput, shown: progress.Stage
) -> Dataset:
    """The night's Ray Data pipeline with this module's ``PredictorUDF``, looked up when called (a test's
    stand-in predictor, one that crashes on a poison input, is the one that runs)."""
    size = objects_per_task(cfg, listing.estimated_count)
    return predict_and_write(cfg, listing, output, shown, size=size, predictor=PredictorUDF)


class _Phases:
    """Wall-clock seconds per named phase (where a run's time goes)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._last, 3)
        self._last = now


def new_run_id() -> str:
    """A run's id: sortable by start time, unique across runs started together."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]


def _shadow_table(cfg: InferenceConfig) -> str | None:
    return table_uri(cfg.tables_root, SHADOW_TABLE) if cfg.shadow is not None else None


def _committed_shadow(cfg: InferenceConfig, night: Night, run_id: str) -> ShadowSummary | None:
    """The shadow's part of a run whose commits landed: committed before its predictions, so there."""
    table = _shadow_table(cfg)
    if table is None:
        return None
    commit = find_commit(table, open_table(table), night, run_id)
    if commit is None:
        raise StorageError(f"{table} has no commit of run {run_id}, though it shadowed the night")
    return from_commit_info(dict(commit.info), commit.version)


def _committed_result(
    cfg: InferenceConfig, tables: tuple[str, str], night: Night, landed: NightCommit, elapsed_s: float
) -> InferenceResult:
    """What a run whose commits landed committed, read back from the two tables' commit infos."""
    predictions_table, errors_table = tables
    errors_commit = find_commit(errors_table, open_table(errors_table), night, landed.run_id)
    if errors_commit is None:  # the errors commit comes first: a predictions commit without it is not rayline's
        raise StorageError(f"{errors_table} has no commit of run {landed.run_id}, {predictions_table} has one")
    info, error_info = landed.info, errors_commit.info
    return InferenceResult(
        input_uri=cfg.input_uri,
        weights_uri=cfg.model.weights_uri,
        predictions_table=predictions_table,
        errors_table=errors_table,
        model_name=night.model_name,
        dt=night.dt,
        run_id=landed.run_id,
        predictions_version=landed.version,
        errors_version=errors_commit.version,
        replaced=landed.night_seq > 1,
        already_committed=True,
        inputs=int(info["rayline.inputs"]),
        predictions=int(info["rayline.rows"]),
        errors=int(error_info["rayline.rows"]),
        error_types=json.loads(str(error_info.get("rayline.error_types", "{}"))),
        input_content_hash=str(info["rayline.input_content_hash"]),
        input_digest=str(info.get("rayline.input_digest", "")),
        model=f"{cfg.model.name} v{cfg.model.version}",
        data_files={"predictions": int(info["rayline.files"]), "errors": int(error_info["rayline.files"])},
        elapsed_s=elapsed_s,
        shadow=_committed_shadow(cfg, night, landed.run_id),
    )


def _begin_night(source: str, staging: str, part_objects: int) -> ListingStart:
    listing = begin_listing(source, staging, rows_per_part=part_objects)
    if listing.complete and listing.own.count == 0:
        left_out = f"; skipped {skipped_text(listing.own.skipped)}" if listing.own.skipped else ""
        raise InputDataError(f"no input objects under {source}{left_out}")
    return listing


def run(cfg: InferenceConfig, run_id: str | None = None) -> InferenceResult:
    """Predict every object under ``cfg.input_uri`` and commit the night to both tables.

    ``run_id`` (default: a new one) names the files and the commits: a retry
    of a run whose commit landed returns that commit, predicting nothing.
    """
    started = time.perf_counter()
    night = Night(cfg.model.name, cfg.dt)
    tables = (table_uri(cfg.tables_root, PREDICTIONS_TABLE), table_uri(cfg.tables_root, ERRORS_TABLE))
    attempt_id, landed = attempt_run_id(*tables, night, run_id or new_run_id())
    if landed is not None:  # a retry of a run whose commit landed: that commit is the result
        return _committed_result(cfg, tables, night, landed, time.perf_counter() - started)
    require_delta_writes(cfg.tables_root)  # refused here, not after predicting every input
    # what the night looked like when this run started: a predictions commit after this is another run's
    seen = night_seq(tables[0], night)
    with (
        held_night(cfg.tables_root, night, cfg) as lease,
        ray_work.stoppable(f"the night {night.model_name} {night.dt}") as stopper,
    ):
        lease.on_lost(stopper.stop)  # a run whose lease was taken over stops predicting: its actors are killed
        expected = _night_as_held(tables, night, seen, attempt_id, _shadow_table(cfg))
        fence = lease.fencing_token().generation
        staging = listing_staging_uri(cfg.tables_root, night, fence, uuid.uuid4().hex[:8])
        try:
            result = _predict_night(cfg, night, tables, attempt_id, staging, started, expected, lease)
        except NightCommittedElsewhere:
            raise
        except Exception as exc:  # a lost lease explains any failure (its stopped Ray run, a read); else re-raised
            lost = _lost_lease(exc, lease)
            if lost is None:
                raise
            raise lost from exc
        finally:
            storage.remove_tree(staging)
        # once this run committed the night: never while an earlier holder that lost the lease might read its own
        remove_earlier_listings(cfg.tables_root, night, fence, staging)
        return result


def _lost_lease(exc: Exception, lease: leases.HeldLease) -> LeaseLost | None:
    """Why a failed run lost the night's lease, if it did and ``exc`` does not say so already: whatever failed
    first (its stopped Ray Data run, a storage read), the run then fails saying that it lost the lease."""
    return None if isinstance(exc, LeaseLost) else lease.lost()


def _night_as_held(tables: tuple[str, str], night: Night, seen: int, run_id: str, shadow: str | None) -> dict[str, int]:
    """The night's commit count per table that this run's commits expect, read once it holds the lease.

    The run it waited for may have committed the night: then there is nothing to predict
    (``NightCommittedElsewhere``). A holder that died between its errors commit and its predictions commit
    left the errors table a commit ahead: that night is not committed (the predictions commit is its done
    marker), so this run completes it, its own errors commit replacing that one. So with the shadow's table.
    """
    predictions, errors = tables
    check_night_unchanged(predictions, night, seen, run_id)
    held = {predictions: seen, errors: night_seq(errors, night)}
    return held if shadow is None else {**held, shadow: night_seq(shadow, night)}


def _predict_night(
    cfg: InferenceConfig,
    night: Night,
    tables: tuple[str, str],
    run_id: str,
    staging: str,
    started: float,
    seen: dict[str, int],
    lease: leases.HeldLease,
) -> InferenceResult:
    phases = _Phases()
    source = storage.normalize(cfg.input_uri)
    begun = _begin_night(source, staging, cfg.listing_part_objects)
    phases.lap("list")  # the driver's own part of the listing: the rest is listed by the cutters as the night goes
    output = NightOutput(tables[0], tables[1], night, run_id, blocks_key(cfg, begun), _shadow_table(cfg))
    with progress.stage(
        f"predict {night.model_name} {night.dt}", total=begun.estimated_count, unit="images", remote=True
    ) as shown:
        reports = _predict_and_write(cfg, begun, output, shown)
        totals = sum_reports(reports)
    ray_data_stats = reports.stats()
    phases.lap("predict_and_write")
    listing = begun.own if begun.complete else finish_listing(begun)
    check_rows(listing.uris, totals.uris, "the night's blocks")
    sizes = {"min_rows": cfg.min_file_rows, "min_bytes": cfg.min_file_bytes}
    constants = _constants_per_kind(cfg)
    compacted = compact_checked(output, totals, listing.uris, SCHEMAS, constants, seen[tables[0]], **sizes)
    phases.lap("compact")
    files = {kind: [f.uri for f in compacted if f.kind == kind] for kind in output.tables()}
    shadowed = _compare_shadow(cfg, output, totals, compacted, listing.count)
    plans = totals.plan_records(_demote_overflowing(cfg, totals))
    metadata: dict[str, str | int] = {
        "rayline.input_uri": source,
        "rayline.input_content_hash": listing.content_hash,
        "rayline.input_digest": listing.uris.encode(),
        "rayline.inputs": listing.count,
        "rayline.model_version": cfg.model.version,
        "rayline.weights_uri": cfg.model.weights_uri,
        "rayline.code_version": cfg.code_version,
        "rayline.flow_run_id": cfg.flow_run_id or "",
        "rayline.error_types": json.dumps(dict(sorted(totals.error_types.items()))),
        "rayline.plans": json.dumps(sorted(totals.plans)),
        "rayline.plan_use": json.dumps(_plan_use(plans), sort_keys=True),
    }

    def commit(kind: str, extra: dict[str, str] | None = None) -> CommitResult:
        table = output.tables()[kind]
        info = {**metadata, **(extra or {})}
        return commit_night(table, files[kind], night, run_id, SCHEMAS[kind], expected_seq=seen[table], metadata=info)

    # errors (and shadow) first: the predictions commit is the night's done marker (module docstring). A run
    # that committed the night since this one started wins, also if this one started between its commits.
    check_night_unchanged(output.predictions_table, night, seen[output.predictions_table], run_id)
    lease.ensure_held()  # a run that lost the night's lease (paused past its ttl) commits nothing
    errors_commit = commit("errors")
    if shadowed is not None:
        shadow_commit = commit("shadow", as_metadata(shadowed))
        shadowed = shadowed.model_copy(update={"table_version": shadow_commit.version})
    predictions_commit = commit("predictions")
    phases.lap("commit")
    remove_blocks(output, [part.name for part in listing.parts])
    phases.lap("remove_blocks")
    return InferenceResult(
        input_uri=cfg.input_uri,
        weights_uri=cfg.model.weights_uri,
        predictions_table=output.predictions_table,
        errors_table=output.errors_table,
        model_name=night.model_name,
        dt=night.dt,
        run_id=run_id,
        predictions_version=predictions_commit.version,
        errors_version=errors_commit.version,
        replaced=predictions_commit.replaced,
        already_committed=predictions_commit.already_committed,
        inputs=listing.count,
        predictions=totals.rows["predictions"],
        errors=totals.rows["errors"],
        error_types=dict(sorted(totals.error_types.items())),
        skipped=listing.skipped,
        skipped_examples=listing.skipped_examples,
        input_content_hash=listing.content_hash,
        input_digest=listing.uris.encode(),
        model=f"{cfg.model.name} v{cfg.model.version}",
        data_files={kind: len(uris) for kind, uris in files.items()},
        listing_parts=len(listing.parts),
        blocks=totals.blocks,
        reused_blocks=totals.reused_blocks,
        delta_log_bytes={
            "predictions": commit_log_bytes(output.predictions_table, predictions_commit.version),
            "errors": commit_log_bytes(output.errors_table, errors_commit.version),
        },
        elapsed_s=time.perf_counter() - started,
        phase_s=phases.seconds,
        ray_data_stats=ray_data_stats,
        plans=plans,
        shadow=shadowed,
    )


def _demote_overflowing(cfg: InferenceConfig, totals: NightTotals) -> dict[str, str]:
    """Demote each cached plan of the night's version that fell back to fp32 too often (execution.fallback)."""
    return demote_overflowing(cfg.model.uri, totals.plan_use, f"the night {cfg.model.name} dt={cfg.dt}")


def _plan_use(plans: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per plan, the night's model calls, those fp32 answered, and a demotion: for the commit's metadata."""
    kept = (*PlanUse().record(), "demoted")
    return {name: {key: record[key] for key in kept if key in record} for name, record in plans.items()}


def _constants_per_kind(cfg: InferenceConfig) -> dict[str, dict[str, object]]:
    """Columns set to the committing run's, per kind of file: the shadow's rows name the shadow's version."""
    constants = run_constants(cfg)
    if cfg.shadow is None:
        return {"predictions": constants}
    return {"predictions": constants, "shadow": {**constants, "model_version": cfg.shadow.version}}


def _compare_shadow(
    cfg: InferenceConfig, output: NightOutput, totals: NightTotals, compacted: list[CompactedFile], inputs: int
) -> ShadowSummary | None:
    """The shadow's night from its blocks' summed counts, checked against the shadow files to be committed."""
    if cfg.shadow is None or output.shadow_table is None:
        return None
    committed = compacted_digest([f for f in compacted if f.kind == "shadow"])
    return summarize(totals.shadow, committed, cfg.shadow, output.shadow_table, inputs)
