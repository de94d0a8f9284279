"""Before a night's commit: its rows checked against the listing by digests, and its block files compacted.

While the block reports stream in, the driver keeps a :class:`NightTotals` (counts, the sum of the blocks'
URI digests, per listing part the rows and bytes of each kind), never a list of blocks or URIs.
:func:`check_rows` then requires predictions plus errors to name every listed input exactly once (the bound
on a false match: :mod:`rayline.storage.digests`).

Ray tasks rewrite the block files (32 rows each on a ResNet night) into files sized for readers: consecutive
parts grouped until a group holds ``min_rows`` or ``min_bytes`` (:func:`plan_groups`), so every file of a
night reaches the size except one per table. Each task reports its file's rows and URI digest, read from
what it wrote, and the driver checks those against the listing again: what is committed is what was
checked. A killed run's compacted files are orphans that vacuum deletes.

Only the blocks this run cut from each part are read (:class:`PartBlocks`), never whatever else the part's
folder holds: a killed attempt over a longer listing leaves tail blocks under the same night key that would
refuse every rerun until vacuum's retention. They are removed with the night's other block files.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rayline import ray_work, storage
from rayline.errors import StorageError
from rayline.ray_workloads.execution.fallback import PlanUse
from rayline.ray_workloads.nightly.blocks import (
    BlockReport,
    NightOutput,
    block_file_uri,
    block_folder,
    block_name,
    blocks_root,
)
from rayline.ray_workloads.quality.shadow import ShadowCounts
from rayline.storage.digests import SetDigest, combine
from rayline.tables.predictions_table import ERRORS_SCHEMA, PREDICTIONS_SCHEMA, check_night_unchanged, data_file_uri

# Each kind of rows with its data schema; shadow: a shadowed night's (blocks.NightOutput.tables)
SCHEMAS = {"predictions": PREDICTIONS_SCHEMA, "errors": ERRORS_SCHEMA, "shadow": PREDICTIONS_SCHEMA}
MIN_FILE_ROWS = 100_000
MIN_FILE_BYTES = 64 * 2**20
ROW_GROUP_ROWS = 131_072
T = TypeVar("T")


@dataclass(frozen=True)
class PartBlocks:
    """The blocks this run cut from one listing part: ``rows`` inputs in blocks of ``size``."""

    part: str
    rows: int  # of both kinds: the part's inputs
    size: int  # the largest block's rows: every block of a part but its last is full

    def names(self) -> list[str]:
        """The blocks' names (:func:`~rayline.ray_workloads.nightly.blocks.block_name`), in the part's order."""
        return [block_name(self.part, start) for start in range(0, self.rows, self.size)]

    def add(self, rows: int) -> PartBlocks:
        return PartBlocks(self.part, self.rows + rows, max(self.size, rows))


@dataclass
class NightTotals:
    """The sum of a night's block reports, kept as they stream in (bounded by the number of listing parts).
    A report summed twice, or missed, changes ``uris``, which :func:`check_rows` refuses: so the shadow's
    counts summed beside it hold each block once."""

    uris: SetDigest = SetDigest()
    rows: Counter[str] = field(default_factory=Counter)
    error_types: Counter[str] = field(default_factory=Counter)
    blocks: int = 0
    reused_blocks: int = 0
    # part name -> kind -> [rows, bytes]
    per_part: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    cut: dict[str, PartBlocks] = field(default_factory=dict)
    plans: dict[str, dict[str, Any]] = field(default_factory=dict)  # plan name -> the first record of it
    # (plan name, its cache key) -> the night's model calls under it, and those fp32 answered (execution.fallback)
    plan_use: dict[tuple[str, str], PlanUse] = field(default_factory=dict)
    shadow: ShadowCounts = field(default_factory=ShadowCounts)  # a shadowed night's comparison, summed
    actor_cpu_s: float = 0.0  # the predictor actors' CPU seconds, as their calls reported them

    def add(self, report: BlockReport) -> None:
        if report.plan.get("plan"):
            name = str(report.plan["plan"])
            self.plans.setdefault(name, report.plan)
            used = (name, str(report.plan.get("key") or ""))
            self.plan_use[used] = self.plan_use.get(used, PlanUse()) + PlanUse.from_record(report.plan)
        self.uris = self.uris + report.uris
        self.rows.update({"predictions": report.predictions, "errors": report.errors, "shadow": report.shadow})
        self.error_types.update(report.error_types)
        if report.shadow_counts is not None:
            self.shadow.add(report.shadow_counts)
        self.blocks += 1
        self.reused_blocks += report.reused
        sizes = self.per_part.setdefault(report.part, {kind: [0, 0] for kind in SCHEMAS})
        for kind in SCHEMAS:  # each kind's rows and bytes are the report's fields <kind> and <kind>_bytes
            sizes[kind][0] += getattr(report, kind)
            sizes[kind][1] += getattr(report, f"{kind}_bytes")
        cut = self.cut.get(report.part, PartBlocks(report.part, 0, 0))
        self.cut[report.part] = cut.add(report.predictions + report.errors)

    def plan_records(self, demoted: dict[str, str]) -> dict[str, dict[str, Any]]:
        """Each plan's first record with the night's model calls under it (over every block, actor and
        machine) and, for a plan demoted after the night, the fp32 reason now cached in its place."""
        records = {}
        for name, first in self.plans.items():
            use = sum((u for (plan, _), u in self.plan_use.items() if plan == name), PlanUse())
            records[name] = {**first, **use.record(), **({"demoted": demoted[name]} if name in demoted else {})}
        return records

    def sizes(self, kind: str) -> list[tuple[str, int, int]]:
        """(part, rows, bytes) of one kind, in part order."""
        return [(part, s[kind][0], s[kind][1]) for part, s in sorted(self.per_part.items())]


def check_rows(listed: SetDigest, written: SetDigest, what: str) -> None:
    """Refuse the commit unless ``written`` (predictions plus errors) is the listed set of URIs, each once."""
    if written == listed:
        return
    diff = written.count - listed.count
    count = f"{abs(diff)} rows {'more' if diff > 0 else 'fewer'} than" if diff else "as many rows as"
    raise StorageError(
        f"refusing to commit: {what} holds {written.count} rows, {count} the {listed.count} listed inputs"
        + ("" if diff else ", but not the same URIs (an input missing or duplicated where another is extra)")
        + f" (URI digests {written.hex[:12]}… and {listed.hex[:12]}…); nothing was committed"
    )


def plan_groups(sizes: list[tuple[str, int, int]], min_rows: int, min_bytes: int) -> list[list[str]]:
    """Consecutive parts grouped until a group has ``min_rows`` rows or ``min_bytes``; parts without rows left out."""
    groups: list[list[str]] = []
    current: list[str] = []
    rows = size = 0
    for part, part_rows, part_bytes in sizes:
        if part_rows == 0:
            continue
        current.append(part)
        rows, size = rows + part_rows, size + part_bytes
        if rows >= min_rows or size >= min_bytes:
            groups.append(current)
            current, rows, size = [], 0, 0
    if current:  # the rest is smaller than a file should be: it joins the group before, if any
        if groups:
            groups[-1].extend(current)
        else:
            groups.append(current)
    return groups


@dataclass(frozen=True)
class CompactedFile:
    kind: str
    uri: str
    rows: int
    bytes: int
    uris: SetDigest


def _read_block(uri: str) -> pa.Table:
    """One block file of this run's listing; a missing one refuses the commit (the night would lack its rows)."""
    fs, path = storage.arrow_filesystem(uri)
    try:
        return pq.read_table(path, filesystem=fs)
    except OSError as exc:
        if fs.get_file_info(path).type != pafs.FileType.NotFound:
            raise
        raise StorageError(
            f"refusing to commit: the block file {uri} of this night's listing is missing; nothing was committed"
        ) from exc


def _with_constants(data: pa.Table, constants: dict[str, Any]) -> pa.Table:
    for name, value in constants.items():
        index = data.schema.get_field_index(name)
        column = data.schema.field(index)
        data = data.set_column(index, column, pa.array([value] * data.num_rows, column.type))
    return data


def compact_group(
    output: NightOutput, kind: str, parts: list[PartBlocks], index: int, schema: pa.Schema, constants: dict[str, Any]
) -> CompactedFile:
    """Stream the block files of ``parts``' blocks into one file of the night (a Ray task); what it wrote.

    ``constants`` (columns with one value per run) are set to the committing run's: a block reused from an
    earlier attempt carries that attempt's flow run id.
    """
    table = output.tables()[kind]
    uri = data_file_uri(table, output.night, output.run_id, f"c{index:05d}")
    fs, path = storage.arrow_filesystem(uri)
    digest, rows, buffered, buffered_rows = SetDigest(), 0, [], 0
    try:
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with pq.ParquetWriter(path, schema, filesystem=fs) as writer:
            for part in parts:
                for block in part.names():
                    data = _read_block(block_file_uri(table, output.night, output.key, block))
                    data = data.select(schema.names).cast(schema)
                    data = _with_constants(data, constants)
                    digest = digest + SetDigest.of(data.column("uri").to_pylist())
                    rows += data.num_rows
                    buffered.append(data)
                    buffered_rows += data.num_rows
                    if buffered_rows >= ROW_GROUP_ROWS:
                        writer.write_table(pa.concat_tables(buffered), row_group_size=ROW_GROUP_ROWS)
                        buffered, buffered_rows = [], 0
            if buffered or rows == 0:
                writer.write_table(pa.concat_tables(buffered) if buffered else schema.empty_table())
        size = fs.get_file_info(path).size
    except (OSError, pa.ArrowInvalid) as exc:
        raise storage.storage_error(exc, "compacting into", uri) from exc
    return CompactedFile(kind, uri, rows, int(size or 0), digest)


def compact_night(
    output: NightOutput,
    totals: NightTotals,
    constants: dict[str, dict[str, Any]],
    *,
    min_rows: int = MIN_FILE_ROWS,
    min_bytes: int = MIN_FILE_BYTES,
) -> list[CompactedFile]:
    """Compact the night's block files (module docstring), in Ray tasks; one empty predictions file when none.
    ``constants``: per kind, the columns set to the committing run's (the predictions' and the shadow's)."""
    work: list[tuple[Any, ...]] = []
    kinds = output.tables()
    for kind in kinds:
        groups = plan_groups(totals.sizes(kind), min_rows, min_bytes)
        if kind != "errors" and not groups:
            # every input failed: an empty file still marks the night in the predictions table's partitions,
            # so listings (monitor, rollouts) see the night, and the rerun replaces it like any other
            groups = [[]]
        values = constants.get(kind, {})
        for i, parts in enumerate(groups):
            work.append((output, kind, [totals.cut[part] for part in parts], i, SCHEMAS[kind], values))
    # a night of at most one file per table (under min_rows): compacted here
    return _each(compact_group, work, here=len(work) <= len(kinds))


def _each(work: Callable[..., T], calls: list[tuple[Any, ...]], *, here: bool) -> list[T]:
    """``work`` called with each of ``calls``: here, without a task's worker (a small night), or in Ray tasks."""
    if here:
        return [work(*args) for args in calls]
    import ray

    remote = ray.remote(num_cpus=0.25)(work)
    return ray_work.gather([remote.remote(*args) for args in calls])


def compacted_digest(files: list[CompactedFile]) -> SetDigest:
    return combine(f.uris for f in files)


def compact_checked(
    output: NightOutput,
    totals: NightTotals,
    listed: SetDigest,
    constants: dict[str, dict[str, Any]],
    seen_seq: int,
    **sizes: int,
) -> list[CompactedFile]:
    """The night's block files compacted (:func:`compact_night`) and checked against the listing again.

    A run of the same night that committed meanwhile removed the block files this run would compact: that
    run won, and this one says so (:class:`~rayline.errors.NightCommittedElsewhere`) instead of failing.
    """
    check_night_unchanged(output.predictions_table, output.night, seen_seq, output.run_id)
    try:
        compacted = compact_night(output, totals, constants, **sizes)
        # predictions plus errors name every input once; the shadow's rows by their own digest (shadow.summarize)
        check_rows(listed, compacted_digest([f for f in compacted if f.kind != "shadow"]), "the compacted files")
    except StorageError:
        check_night_unchanged(output.predictions_table, output.night, seen_seq, output.run_id)
        raise
    return compacted


PARTS_PER_REMOVAL = 16


def _remove_parts(output: NightOutput, parts: list[str]) -> None:
    for table in output.tables().values():
        for part in parts:
            storage.remove_tree(block_folder(table, output.night, output.key, part))


def remove_blocks(output: NightOutput, parts: list[str]) -> None:
    """Delete the night's block files once its commit landed (until then a rerun resumes from them), a group
    of parts per Ray task. A rerun then predicts the night anew; what a run killed here leaves, vacuum deletes.
    """
    groups = [(output, parts[i : i + PARTS_PER_REMOVAL]) for i in range(0, len(parts), PARTS_PER_REMOVAL)]
    _each(_remove_parts, groups, here=len(groups) == 1)
    for table in output.tables().values():
        storage.remove_tree(blocks_root(table, output.night, output.key))
