"""Batch inference: every input object gets exactly one prediction row or one error row.

The driver streams the listing into parts, Ray Data cuts them into blocks that an actor pool
predicts (fetch, decode, predict, write each block at fixed names), the driver checks predictions
plus errors against the listing by counts and digests, compacts the block files and commits each
table once. How and why, step by step, with the layout: docs/nights.md.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rayline import progress, ray_work, storage
from rayline.errors import InputDataError, LeaseLost, NightCommittedElsewhere, StorageError
from rayline.ray_workloads.execution.cache import demote_overflowing
from rayline.ray_workloads.execution.fallback import PlanUse
from rayline.ray_workloads.nightly.blocks import NightOutput, night_key
from rayline.ray_workloads.nightly.compaction import (
    SCHEMAS,
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
from rayline.ray_workloads.quality.shadow import ShadowSummary, as_record, summarize
from rayline.skipped import skipped_text
from rayline.storage import leases
from rayline.storage.layout import ERRORS_TABLE, PREDICTIONS_TABLE, SHADOW_TABLE, table_uri
from rayline.storage.listing import ListingStart, StreamedListing, begin_listing, finish_listing
from rayline.tables.delta_probe import require_delta_writes
from rayline.tables.delta_tables import Night, NightCommit, attempt_run_id, commit_log_bytes, find_commit, open_table
from rayline.tables.predictions_table import check_night_unchanged, commit_night, night_seq

# Imported by every worker of a batch-inference process's embedded cluster at start
# (``ray_cluster.connect(preload=...)``), so a predictor actor need not wait for them (bench/README.md);
# ray.util.state is what unpickling Ray Data's context imports; torchvision (which imports torch._dynamo: ~1.8 s
# on these cores) and the model interface are what loading a model imports.
WORKER_PRELOAD = (
    "torch",
    "torchvision.models",
    "ray.data",
    "ray.util.state",
    "rayline.ray_workloads.nightly.predictor",
    "rayline.ray_workloads.execution.interface",
)
TABLES = {"predictions": PREDICTIONS_TABLE, "errors": ERRORS_TABLE, "shadow": SHADOW_TABLE}


def objects_per_task(cfg: InferenceConfig, count: int) -> int:
    """Block size for a night of ``count`` objects: large for cheap models (fewer calls), small for
    compute-bound ones, and larger again past ``MAX_BLOCKS_PER_NIGHT`` blocks.

    A night ends when its last block does: a 32-object block of a ResNet at 224 px keeps the tail of one
    actor working alone short, where 256 objects left it several seconds. The driver's work and the files
    written grow with the number of blocks (bench/README.md), so 100 M photos would be 3.1 M blocks: capped
    at 100,000 blocks, the tail stays under a minute of one core at ResNet-18's rate (docs/capacity.md).
    """
    return block_size(cfg.model.image_spec.size, count, cfg.objects_per_task)


def blocks_key(cfg: InferenceConfig, listing: ListingStart, size: int) -> str:
    """The key of the night's blocks of ``size`` objects: what decides their rows (blocks.night_key).

    Not the listing's content hash, known only once the whole prefix is listed, after the first blocks are
    predicted: a rerun reuses only blocks whose inputs have the same ETags (``blocks.reused_report``).
    """
    shadow = cfg.shadow
    return night_key(
        {
            "model": [cfg.model.name, cfg.model.version, cfg.model.weights_uri],
            **({"shadow": [shadow.name, shadow.version, shadow.weights_uri]} if shadow else {}),
            "dt": cfg.dt,
            "input": listing.prefix,
            "objects_per_task": size,
            "top_k": cfg.top_k,
            "code_version": cfg.code_version,
            "parts": cfg.listing_part_objects,
        }
    )


def new_run_id() -> str:
    """A run's id: sortable by start time, unique across runs started together."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]


def _tables(cfg: InferenceConfig) -> dict[str, str]:
    """Each kind of rows with its table: predictions, errors, and the shadow's on a shadowed night."""
    return {kind: table_uri(cfg.tables_root, name) for kind, name in TABLES.items() if kind != "shadow" or cfg.shadow}


def _commit_of(table: str, landed: NightCommit) -> NightCommit:
    """The commit of ``landed``'s run in another of its tables: made before its predictions commit, so there."""
    commit = find_commit(table, open_table(table), Night(landed.model_name, landed.dt), landed.run_id)
    if commit is None:  # a predictions commit without it is not rayline's
        raise StorageError(f"{table} has no commit of run {landed.run_id}, though its predictions commit landed")
    return commit


def _landed_result(
    cfg: InferenceConfig, tables: dict[str, str], landed: NightCommit, started: float
) -> InferenceResult:
    """What a run whose commits landed committed, read back from its tables' commits."""
    commits = {kind: landed if kind == "predictions" else _commit_of(table, landed) for kind, table in tables.items()}
    return InferenceResult.from_commit(cfg, commits, elapsed_s=time.perf_counter() - started)


def _begin_night(source: str, staging: str, part_objects: int) -> ListingStart:
    listing = begin_listing(source, staging, rows_per_part=part_objects)
    if listing.complete and listing.own.count == 0:
        left_out = f"; skipped {skipped_text(listing.own.skipped)}" if listing.own.skipped else ""
        raise InputDataError(f"no input objects under {source}{left_out}")
    return listing


def run(cfg: InferenceConfig, run_id: str | None = None) -> InferenceResult:
    """Predict every object under ``cfg.input_uri`` and commit the night to both tables. ``run_id`` (default:
    a new one) names the files and commits: a retry of a run whose commit landed returns it, predicting nothing.
    """
    started = time.perf_counter()
    night, tables = Night(cfg.model.name, cfg.dt), _tables(cfg)
    attempt_id, landed = attempt_run_id(tables["predictions"], tables["errors"], night, run_id or new_run_id())
    if landed is not None:  # a retry of a run whose commit landed: that commit is the result
        return _landed_result(cfg, tables, landed, started)
    require_delta_writes(cfg.tables_root)  # refused here, not after predicting every input
    # what the night looked like when this run started: a predictions commit after this is another run's
    seen = night_seq(tables["predictions"], night)
    with (
        held_night(cfg.tables_root, night, cfg) as lease,
        ray_work.stoppable(f"the night {night.model_name} {night.dt}") as stopper,
    ):
        lease.on_lost(stopper.stop)  # a run whose lease was taken over stops predicting: its actors are killed
        held = _night_as_held(tables, night, seen, attempt_id)
        return NightRun(cfg, night, attempt_id, tables, lease, held, started).run()


def _night_as_held(tables: dict[str, str], night: Night, seen: int, run_id: str) -> dict[str, int]:
    """The night's commit count per kind of table that this run's commits expect, read once it holds the lease.

    The run it waited for may have committed the night (``NightCommittedElsewhere``). A holder that died
    between its errors (or shadow) commit and its predictions commit, the done marker, left that table a
    commit ahead of an uncommitted night: this run completes it, its own commit replacing that one.
    """
    check_night_unchanged(tables["predictions"], night, seen, run_id)
    return {kind: seen if kind == "predictions" else night_seq(table, night) for kind, table in tables.items()}


@dataclass
class NightRun:
    """A run of one night that holds its lease: what its steps share. :meth:`run` lists the night, predicts
    it, compacts its block files and commits them; what a step found, the next ones read here."""

    cfg: InferenceConfig
    night: Night
    run_id: str
    tables: dict[str, str]  # per kind of rows (_tables)
    lease: leases.HeldLease
    seen: dict[str, int]  # per kind, the night's commit count this run's commits expect (_night_as_held)
    started: float
    phases: dict[str, float] = field(default_factory=dict)  # wall-clock seconds per step: where the time goes
    lapped: float = field(default_factory=time.perf_counter)
    cpu_started: float = field(default_factory=time.process_time)  # the driver's CPU, for the night's core-seconds
    # set by the steps: the fence and staging folder of this holding, then what predict found
    fence: int = field(init=False)
    staging: str = field(init=False)
    output: NightOutput = field(init=False)
    totals: NightTotals = field(init=False)
    listing: StreamedListing = field(init=False)
    ray_data_stats: str = field(init=False)

    def __post_init__(self) -> None:
        self.fence = self.lease.fencing_token().generation
        self.staging = listing_staging_uri(self.cfg.tables_root, self.night, self.fence, uuid.uuid4().hex[:8])

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase], self.lapped = round(now - self.lapped, 3), now

    def run(self) -> InferenceResult:
        try:
            self.predict(self.list())
            result = self.commit(self.compact())
        except NightCommittedElsewhere:
            raise
        except Exception as exc:  # whatever failed first (a stopped Ray Data run, a read), a lost lease is why
            lost = None if isinstance(exc, LeaseLost) else self.lease.lost()
            if lost is None:
                raise
            raise lost from exc
        finally:
            storage.remove_tree(self.staging)
        # once this run committed the night: never while an earlier holder that lost the lease might read its own
        remove_earlier_listings(self.cfg.tables_root, self.night, self.fence, self.staging)
        return result

    def list(self) -> ListingStart:
        """The driver's part of the listing: the rest is listed by the cutters as the night goes."""
        begun = _begin_night(storage.normalize(self.cfg.input_uri), self.staging, self.cfg.listing_part_objects)
        self.lap("list")
        return begun

    def predict(self, begun: ListingStart) -> None:
        """Predict and write every block; then the listing, finished, must name every block's inputs once."""
        size = objects_per_task(self.cfg, begun.estimated_count)
        key = blocks_key(self.cfg, begun, size)
        self.output = NightOutput(
            self.tables["predictions"], self.tables["errors"], self.night, self.run_id, key, self.tables.get("shadow")
        )
        label = f"predict {self.night.model_name} {self.night.dt}"
        with progress.stage(label, total=begun.estimated_count, unit="images", remote=True) as shown:
            reports = predict_and_write(self.cfg, begun, self.output, shown, size=size, predictor=PredictorUDF)
            self.totals = sum_reports(reports)
        self.ray_data_stats = reports.stats()
        self.lap("predict_and_write")
        self.listing = begun.own if begun.complete else finish_listing(begun)
        check_rows(self.listing.uris, self.totals.uris, "the night's blocks")

    def compact(self) -> Sequence[CompactedFile]:
        sizes = {"min_rows": self.cfg.min_file_rows, "min_bytes": self.cfg.min_file_bytes}
        # columns set to the committing run's, in the files of predictions and the shadow's (compact_group)
        constants = {kind: run_constants(self.cfg, kind) for kind in self.tables if kind != "errors"}
        compacted = compact_checked(
            self.output, self.totals, self.listing.uris, constants, self.seen["predictions"], **sizes
        )
        self.lap("compact")
        return compacted

    def commit(self, compacted: Sequence[CompactedFile]) -> InferenceResult:
        """Each table's commit of the night, errors (and shadow) first: the predictions commit is the night's
        done marker (module docstring). A run that committed the night since this one started wins, also if
        this one started between its commits; a run that lost the night's lease (paused past its ttl)
        commits nothing."""
        shadowed = self._shadow_summary(compacted)
        # each cached plan of the night's version that fell back to fp32 too often is demoted (execution.fallback)
        demoted = demote_overflowing(
            self.cfg.model.uri, self.totals.plan_use, f"the night {self.cfg.model.name} dt={self.cfg.dt}"
        )
        plans = self.totals.plan_records(demoted)
        record = self._record(plans)
        shadow = None if shadowed is None else record.model_copy(update={"shadow_summary": as_record(shadowed)})
        records = {"errors": record, **({"shadow": shadow} if shadow else {}), "predictions": record}
        check_night_unchanged(self.tables["predictions"], self.night, self.seen["predictions"], self.run_id)
        self.lease.ensure_held()
        commits = {kind: self._commit(kind, compacted, described) for kind, described in records.items()}
        self.lap("commit")
        remove_blocks(self.output, [part.name for part in self.listing.parts])
        self.lap("remove_blocks")
        return InferenceResult.from_commit(self.cfg, commits, **self._observed(commits, plans))

    def _commit(self, kind: str, compacted: Sequence[CompactedFile], record: NightCommit) -> NightCommit:
        table, files = self.tables[kind], [f.uri for f in compacted if f.kind == kind]
        return commit_night(
            table, files, self.night, self.run_id, SCHEMAS[kind], expected_seq=self.seen[kind], record=record
        )

    def _record(self, plans: dict[str, dict[str, Any]]) -> NightCommit:
        """What this run records in each of its commits: its input, model, code, errors and plans."""
        cfg, listing = self.cfg, self.listing
        return NightCommit(
            run_id=self.run_id,
            model_name=self.night.model_name,
            dt=self.night.dt,
            input_uri=storage.normalize(cfg.input_uri),
            input_content_hash=listing.content_hash,
            input_digest=listing.uris.encode(),
            inputs=listing.count,
            model_version=cfg.model.version,
            weights_uri=cfg.model.weights_uri,
            code_version=cfg.code_version,
            flow_run_id=cfg.flow_run_id or "",
            error_types=dict(sorted(self.totals.error_types.items())),
            plans=sorted(self.totals.plans),
            plan_use=_plan_use(plans),
            core_seconds=round(self.totals.actor_cpu_s + time.process_time() - self.cpu_started, 3),
        )

    def _observed(self, commits: dict[str, NightCommit], plans: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """What only the run that made the commits saw, for its result (InferenceResult.from_commit)."""
        log_bytes = {
            kind: commit_log_bytes(self.tables[kind], commits[kind].version) for kind in ("predictions", "errors")
        }
        return {
            "skipped": self.listing.skipped,
            "skipped_examples": self.listing.skipped_examples,
            "listing_parts": len(self.listing.parts),
            "blocks": self.totals.blocks,
            "reused_blocks": self.totals.reused_blocks,
            "delta_log_bytes": log_bytes,
            "elapsed_s": time.perf_counter() - self.started,
            "phase_s": self.phases,
            "ray_data_stats": self.ray_data_stats,
            "plans": plans,
        }

    def _shadow_summary(self, compacted: Sequence[CompactedFile]) -> ShadowSummary | None:
        """The shadow's night from its blocks' summed counts, checked against the shadow files to be committed."""
        if self.cfg.shadow is None:
            return None
        committed = compacted_digest([f for f in compacted if f.kind == "shadow"])
        return summarize(self.totals.shadow, committed, self.cfg.shadow, self.tables["shadow"], self.listing.count)


def _plan_use(plans: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per plan, the night's model calls, those fp32 answered, and a demotion: for the commit's record."""
    kept = (*PlanUse().record(), "demoted")
    return {name: {key: record[key] for key in kept if key in record} for name, record in plans.items()}
