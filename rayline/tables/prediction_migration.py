"""Legacy manifest nights into the night tables: what ``rayline migrate-predictions`` does.

Before the Delta tables, a night was a folder committed by a manifest::

    <storage>/predictions/<model>/dt=<day>/run-<id>/{predictions,errors}/part-*.parquet
    <storage>/predictions/<model>/dt=<day>/manifest.json   the commit: run id, input, model, files
    <storage>/predictions/<model>/dt=<day>/_SUCCESS

Those folders sit inside the ``predictions`` table's folder, next to its own
Hive folders (``model_name=<m>/dt=<d>``; a legacy model folder never starts
with ``model_name=``). No Delta reader sees them, and a full vacuum would
delete them as files the log does not reference, so
:func:`rayline.tables.prediction_reads.vacuum` refuses while :func:`legacy_nights`
finds any.

Migrating a night copies the files its manifest names (not leftovers of
other runs) into the night's partition of each table, drops the old
``model_name`` data column (partition columns live in the Delta log), casts
the columns to the table's schema, and commits them like a nightly run:
``prediction_errors`` first, then ``predictions``, with the manifest's
metadata in the commit info, under run id ``migrated-<old run id>``. Only
then is the legacy folder removed. So a rerun after a crash resumes (a
table that already holds the run's commit is not written again) and a rerun
after success finds nothing. A night the ``predictions`` table already has
from another run (a newer nightly run) is superseded: the table wins and the
legacy folder is removed, as the old layout's own rerun would have done (a
rerun switched the manifest, then deleted the replaced run). A night that
cannot be read keeps its folder, and vacuum keeps refusing until someone
looks.

Each migrated night is handed to the caller's ``record`` (a
:class:`MigratedNight`) after its commits and before its folder goes:
``rayline migrate-predictions`` passes
:func:`rayline.lineage.nights.record_migrated_night`, which writes a lineage
record (stage ``migrate_predictions``) whose input is the legacy manifest, so
``rayline lineage`` still walks from the night through the old batch
inference record to the model and the data. The tables sit below lineage
(whose graph reads them), so the lineage writer comes in as a parameter.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

import pyarrow as pa
from deltalake import DeltaTable
from pydantic import BaseModel, ValidationError

from rayline import storage
from rayline.errors import InputDataError, NightCommittedElsewhere, RaylineError
from rayline.storage.layout import ERRORS_TABLE, PREDICTIONS_TABLE, table_uri
from rayline.tables.delta_tables import (
    PARTITION_COLUMNS,
    Night,
    NightCommit,
    find_commit,
    night_commit,
    open_table,
    storage_options,
)
from rayline.tables.predictions_table import (
    ERRORS_SCHEMA,
    PREDICTIONS_SCHEMA,
    commit_night,
    data_file_uri,
    night_seq,
    write_data_file,
)

LEGACY_MANIFEST = "manifest.json"
MIGRATED_RUN_PREFIX = "migrated-"
# the table's own folders: Delta's log (and anything hidden), and its Hive partition folders
_TABLE_FOLDER = re.compile(r"^(_|\.|model_name=)")
_LEGACY_NIGHT = re.compile(r"^dt=([^/]+)/" + re.escape(LEGACY_MANIFEST) + "$")


class _LegacyModel(BaseModel):
    name: str
    version: int
    weights_uri: str


class _LegacyFiles(BaseModel):
    predictions: list[str]
    errors: list[str]


class LegacyManifest(BaseModel):
    """The fields of a legacy night's ``manifest.json`` that a migration needs (others are ignored)."""

    run_id: str
    input_uri: str
    input_content_hash: str
    inputs: int
    predictions: int
    errors: int
    model: _LegacyModel
    code_version: str = "unknown"
    flow_run_id: str | None = None
    files: _LegacyFiles


@dataclass(frozen=True)
class LegacyNight:
    """A committed legacy night folder: ``<predictions table>/<model>/dt=<day>/`` holding a manifest."""

    folder: str
    model_name: str
    dt: str

    @property
    def manifest_uri(self) -> str:
        return storage.join(self.folder, LEGACY_MANIFEST)

    @property
    def model_folder(self) -> str:
        return self.folder.rsplit("/", 1)[0]


class Outcome(StrEnum):
    MIGRATED = "migrated"
    WOULD_MIGRATE = "would migrate"
    SUPERSEDED = "superseded"
    SKIPPED = "skipped"
    FAILED = "failed"


@dataclass(frozen=True)
class NightMigration:
    """What happened to one legacy night."""

    legacy: LegacyNight
    outcome: Outcome
    message: str
    predictions_version: int | None = None
    errors_version: int | None = None


@dataclass(frozen=True)
class MigratedNight:
    """A legacy night now committed to both tables, told to ``record`` before its folder is removed."""

    legacy: LegacyNight
    night: Night
    run_id: str
    versions: dict[str, tuple[int, list[str]]]  # table URI → (its version, the data files committed)
    started: datetime


NightRecorder = Callable[[MigratedNight], None]


def legacy_nights(table: str) -> list[LegacyNight]:
    """The committed legacy night folders inside ``table``'s folder (a manifest each), sorted by model and day.

    One listing of the table's top level, then one of each legacy model
    folder: the table's own data files are never listed.
    """
    table = storage.normalize(table)
    found = []
    for model in storage.list_folders(table):
        if _TABLE_FOLDER.match(model):
            continue
        model_folder = storage.join(table, model)
        for obj in storage.list_objects(model_folder):
            match = _LEGACY_NIGHT.match(obj.key)
            if match:
                found.append(LegacyNight(storage.join(model_folder, f"dt={match.group(1)}"), model, match.group(1)))
    return found


def read_manifest(legacy: LegacyNight) -> LegacyManifest:
    try:
        manifest = LegacyManifest.model_validate(storage.read_json(legacy.manifest_uri))
    except ValidationError as exc:
        raise InputDataError(f"{legacy.manifest_uri} is not a legacy predictions manifest: {exc}") from exc
    if manifest.model.name != legacy.model_name:
        raise InputDataError(
            f"{legacy.manifest_uri} names model {manifest.model.name!r}, but its folder is {legacy.model_name!r}"
        )
    return manifest


def migrate_predictions(root: str, *, record: NightRecorder, dry_run: bool = False) -> list[NightMigration]:
    """Move every legacy night under ``<root>/predictions`` into the night tables (module docstring).

    ``record`` is called with each migrated night after its commits and
    before its legacy folder is removed (a failure there keeps the folder).

    A night the table already has from another run is superseded: its legacy
    folder is removed. A night that cannot be read or copied is reported as
    failed and the others go on; its legacy folder stays.
    """
    results = []
    for legacy in legacy_nights(table_uri(root, PREDICTIONS_TABLE)):
        try:
            results.append(_migrate_night(root, legacy, dry_run, record))
        except RaylineError as exc:
            results.append(NightMigration(legacy, Outcome.FAILED, f"{type(exc).__name__}: {exc}; legacy folder kept"))
    return results


def _migrate_night(root: str, legacy: LegacyNight, dry_run: bool, record: NightRecorder) -> NightMigration:
    manifest = read_manifest(legacy)
    night = Night(legacy.model_name, legacy.dt)
    run_id = MIGRATED_RUN_PREFIX + manifest.run_id
    predictions_uri, errors_uri = table_uri(root, PREDICTIONS_TABLE), table_uri(root, ERRORS_TABLE)
    # read before looking at the night: a nightly commit after this makes our commit fail rather than replace it
    seen = {uri: night_seq(uri, night) for uri in (errors_uri, predictions_uri)}
    current = _current_commit(predictions_uri, night)
    if current is not None and current.run_id != run_id:
        # found in the log (its commit info and app transaction): the table has the night, the folder is stale
        if not dry_run:
            _remove_legacy(legacy)
        done = "would be removed" if dry_run else "removed"
        return NightMigration(
            legacy,
            Outcome.SUPERSEDED,
            f"by run {current.run_id} (table version {current.version}): {legacy.folder} {done}",
        )
    counts = f"{manifest.predictions} predictions, {manifest.errors} errors"
    if dry_run:
        done = f" (committed by an earlier migration, version {current.version})" if current else ""
        return NightMigration(legacy, Outcome.WOULD_MIGRATE, f"{counts} from {legacy.folder} as run {run_id}{done}")
    started = datetime.now(UTC)
    metadata = _commit_metadata(legacy, manifest)
    versions: dict[str, tuple[int, list[str]]] = {}
    try:
        # the predictions commit is the night's done marker: errors first, as nightly runs do
        for uri, files, schema in (
            (errors_uri, manifest.files.errors, ERRORS_SCHEMA),
            (predictions_uri, manifest.files.predictions, PREDICTIONS_SCHEMA),
        ):
            versions[uri] = _copy_and_commit(uri, legacy, night, files, run_id, schema, seen[uri], metadata)
    except NightCommittedElsewhere as exc:
        return NightMigration(legacy, Outcome.SKIPPED, f"{exc}; {legacy.folder} kept for a rerun")
    record(MigratedNight(legacy, night, run_id, versions, started))
    _remove_legacy(legacy)
    predictions_version, errors_version = versions[predictions_uri][0], versions[errors_uri][0]
    return NightMigration(
        legacy,
        Outcome.MIGRATED,
        f"{counts} → predictions v{predictions_version}, prediction_errors v{errors_version} as run {run_id}; "
        f"{legacy.folder} removed",
        predictions_version=predictions_version,
        errors_version=errors_version,
    )


def _remove_legacy(legacy: LegacyNight) -> None:
    storage.remove_tree(legacy.folder)
    if not storage.list_objects(legacy.model_folder):
        storage.remove_tree(legacy.model_folder)  # local storage keeps empty folders; S3 has none to remove


def _current_commit(uri: str, night: Night) -> NightCommit | None:
    if not DeltaTable.is_deltatable(uri, storage_options(uri)):
        return None
    return night_commit(uri, night.model_name, night.dt)


def _commit_metadata(legacy: LegacyNight, manifest: LegacyManifest) -> dict[str, str | int]:
    """The keys a nightly run puts in its commit info (``batch_inference.run``), from the manifest."""
    return {
        "rayline.input_uri": manifest.input_uri,
        "rayline.input_content_hash": manifest.input_content_hash,
        "rayline.inputs": manifest.inputs,
        "rayline.model_version": manifest.model.version,
        "rayline.weights_uri": manifest.model.weights_uri,
        "rayline.code_version": manifest.code_version,
        "rayline.flow_run_id": manifest.flow_run_id or "",
        "rayline.migrated_from": legacy.folder,
        "rayline.legacy_run_id": manifest.run_id,
    }


def _copy_and_commit(
    uri: str,
    legacy: LegacyNight,
    night: Night,
    files: list[str],
    run_id: str,
    schema: pa.Schema,
    seen_seq: int,
    metadata: dict[str, str | int],
) -> tuple[int, list[str]]:
    """The table version holding the run's commit of the night, and the files it committed."""
    # file names are numbered, not random: a rerun writes (or finds) the same names
    targets = [data_file_uri(uri, night, run_id, part) for part in range(len(files))]
    earlier = _earlier_commit(uri, night, run_id)
    if earlier is not None:
        # an earlier attempt committed here and stopped before removing the legacy folder: the log
        # references its files, so they are not written again
        return earlier.version, targets
    for part, named in enumerate(files):
        source = _legacy_file(legacy, named)
        write_data_file(uri, night, run_id, part, conform(storage.read_parquet([source]), schema, source))
    result = commit_night(uri, targets, night, run_id, schema, expected_seq=seen_seq, metadata=metadata)
    return result.version, targets


def _earlier_commit(uri: str, night: Night, run_id: str) -> NightCommit | None:
    if not DeltaTable.is_deltatable(uri, storage_options(uri)):
        return None
    return find_commit(uri, open_table(uri), night, run_id)


def _legacy_file(legacy: LegacyNight, uri: str) -> str:
    """Where a file the manifest names is now: under the night's folder, even if the storage root moved since."""
    marker = f"/{legacy.model_name}/dt={legacy.dt}/"
    normalized = storage.normalize(uri)
    if marker not in normalized:
        raise InputDataError(f"{legacy.manifest_uri} names {uri}, which is not under the night's folder")
    return storage.join(legacy.folder, normalized.split(marker, 1)[1])


def conform(data: pa.Table, schema: pa.Schema, source: str) -> pa.Table:
    """``data`` as the table stores it: no partition columns, the schema's columns and types, nulls where absent.

    A column the schema lacks is refused rather than dropped: migrating must not lose data.
    """
    data = data.drop_columns([c for c in PARTITION_COLUMNS if c in data.column_names])
    fields = [f for f in schema if f.name not in PARTITION_COLUMNS]
    extra = sorted(set(data.column_names) - {f.name for f in fields})
    if extra:
        raise InputDataError(f"{source} has columns {extra} that the table does not have")
    columns = []
    for field in fields:
        if field.name not in data.column_names:
            columns.append(pa.nulls(data.num_rows, field.type))  # a column added after this night was written
            continue
        try:
            columns.append(data.column(field.name).cast(field.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise InputDataError(f"{source}: column {field.name!r} does not convert to {field.type}: {exc}") from exc
    return pa.table(columns, schema=pa.schema(fields))
