"""Reading the night tables: one night (optionally at a version), both tables paired by run, and vacuum.

Any Delta reader gets the same rows (DuckDB's ``delta_scan``, Polars' ``read_delta``, Spark,
``ray.data.read_delta``); these are rayline's own readers, used by the monitor, lineage, rollouts and the CLI.

Vacuum and time travel (docs/nights.md): :func:`vacuum` deletes replaced and never-committed files once they
are older than the retention (Delta's semantics), so every version current at some time within the retention
stays readable by number. One more rule keeps the tables paired: the errors table's version that a night's
current predictions pair with keeps its files however old (:func:`paired_errors_versions`). The retention
also protects a night still being written (its files are not committed yet), hence at least 24 h.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
from deltalake import DeltaTable

from rayline import storage
from rayline.errors import ConfigError, InputDataError
from rayline.storage.layout import ERRORS_TABLE, PREDICTIONS_TABLE, table_uri
from rayline.tables.delta_tables import (
    Night,
    NightCommit,
    current_runs,
    delta_errors,
    find_commit,
    is_table,
    night_commit,
    open_table,
)

DEFAULT_RETENTION_HOURS = 168
MIN_SAFE_RETENTION_HOURS = 24


def read_night(uri: str, model_name: str, dt: str, version: int | None = None) -> pa.Table:
    """A night's committed rows (as of ``version`` when given: time travel), partition columns included."""
    uri = storage.normalize(uri)
    night = Night(model_name, dt)
    tbl = open_table(uri, version)
    with delta_errors("read", uri):
        # single-threaded on purpose: Arrow's scanner threads from a Delta dataset sometimes outlive the
        # interpreter and abort it at exit ("terminate called without an active exception"; delta-rs #2184)
        return tbl.to_pyarrow_dataset(file_pruning_predicate=night.filters).to_table(use_threads=False)


@dataclass(frozen=True)
class NightRows:
    """One night as a reader pairs it: the predictions and the errors of the run that committed them."""

    predictions: pa.Table
    errors: pa.Table
    commit: NightCommit  # the predictions table's commit of the night
    errors_version: int


def committed_nights(root: str, model_name: str, latest: int | None = None) -> list[str]:
    """The ``dt`` of ``model_name``'s nights that have predictions committed, newest first (at most ``latest``)."""
    uri = table_uri(root, PREDICTIONS_TABLE)
    if not is_table(uri):
        return []
    with delta_errors("list the partitions of", uri):
        partitions = open_table(uri).partitions(partition_filters=[("model_name", "=", model_name)])
    return sorted({p["dt"] for p in partitions}, reverse=True)[:latest]


def nights_of_version(uri: str, model_name: str, version: int) -> list[str]:
    """The ``dt`` of the nights of ``model_name`` in the table at ``uri`` whose rows may be ``version``'s, from the
    files' statistics in the Delta log (no data file is opened); a file without them counts (it may be)."""
    if not is_table(uri):
        return []
    with delta_errors("read the file statistics of", uri):
        actions = pa.table(open_table(uri).get_add_actions(flatten=True)).to_pylist()
    found = set()
    for action in actions:
        if action.get("partition.model_name") != model_name:
            continue
        low, high = action.get("min.model_version"), action.get("max.model_version")
        if low is None or high is None or low <= version <= high:
            found.add(str(action["partition.dt"]))
    return sorted(found)


def latest_night_commit(root: str, model_name: str) -> NightCommit | None:
    """The commit of ``model_name``'s newest committed night (its info names the inputs), None before any."""
    nights = committed_nights(root, model_name, latest=1)
    if not nights:
        return None
    return night_commit(table_uri(root, PREDICTIONS_TABLE), model_name, nights[0])


def read_night_pair(root: str, model_name: str, dt: str, version: int | None = None) -> NightRows:
    """A night's predictions (as of predictions table ``version``) and the errors committed by the same run.
    The run commits its errors first and its predictions last, so the errors table may already hold a newer
    run's errors for the night; reading it at the version that carries the predictions' run id pairs them."""
    predictions_uri = table_uri(root, PREDICTIONS_TABLE)
    errors_uri = table_uri(root, ERRORS_TABLE)
    night = Night(model_name, dt)
    if not is_table(predictions_uri):
        raise InputDataError(f"no predictions table at {predictions_uri}: run nightly-inference first")
    commit = night_commit(predictions_uri, model_name, dt, version)
    if commit is None:
        raise InputDataError(f"no committed night {model_name} dt={dt} in {predictions_uri}")
    errors_commit = find_commit(errors_uri, open_table(errors_uri), night, commit.run_id)
    if errors_commit is None:
        raise InputDataError(f"{errors_uri} has no commit of run {commit.run_id} for {model_name} dt={dt}")
    return NightRows(
        predictions=read_night(predictions_uri, model_name, dt, commit.version),
        errors=read_night(errors_uri, model_name, dt, errors_commit.version),
        commit=commit,
        errors_version=errors_commit.version,
    )


def vacuum(
    uri: str,
    retention_hours: int = DEFAULT_RETENTION_HOURS,
    *,
    keep_versions: list[int] | None = None,
    dry_run: bool = True,
    allow_short_retention: bool = False,
) -> list[str]:
    """Files (relative paths) no version within the retention needs: replaced ones and never-committed ones.

    A dry run by default; ``dry_run=False`` deletes them. Less than 24 h of retention needs
    ``allow_short_retention``. ``keep_versions`` keeps older versions' files too, and so does every version of
    the errors table that a night of the predictions table pairs with (:func:`read_night_pair`), however old.
    """
    uri = storage.normalize(uri)
    check_retention(retention_hours, allow_short_retention)
    # the predictions' nights before the errors snapshot: an errors commit between the two is then seen
    # by the errors snapshot, which keeps its files as referenced, and the version it replaced as paired
    predictions_runs = current_predictions_runs(uri)
    tbl = open_table(uri)  # a fresh snapshot: a stale one would count newer commits' files as unreferenced
    keep = sorted({*(keep_versions or []), *paired_errors_versions(uri, tbl, predictions_runs)})
    with delta_errors("vacuum", uri):
        removed: list[str] = tbl.vacuum(
            retention_hours=retention_hours,
            dry_run=dry_run,
            enforce_retention_duration=False,  # our own floor above replaces Delta's 168 h one
            full=True,
            keep_versions=keep or None,
        )
    return sorted(removed)


def current_predictions_runs(uri: str) -> dict[Night, str]:
    """When ``uri`` is a night errors table: the run each night of its predictions table (its sibling, as
    :func:`read_night_pair` finds them) pairs with; else empty."""
    root, _, name = uri.rpartition("/")
    predictions_uri = table_uri(root, PREDICTIONS_TABLE)
    if name != ERRORS_TABLE or not is_table(predictions_uri):
        return {}
    with delta_errors("read the history of", predictions_uri):
        return current_runs(predictions_uri, open_table(predictions_uri))


def paired_errors_versions(uri: str, tbl: DeltaTable, predictions_runs: dict[Night, str]) -> list[int]:
    """The versions of errors table ``tbl`` that :func:`read_night_pair` reads but whose files are replaced:
    by a run whose errors commit landed and whose predictions commit did not. A vacuum would delete them once
    that commit is older than the retention, and the night would no longer read as a pair."""
    versions: list[int] = []
    with delta_errors("find the paired versions of", uri):
        errors_runs = current_runs(uri, tbl)
        for night, run_id in predictions_runs.items():
            if errors_runs.get(night) == run_id:
                continue
            paired = find_commit(uri, tbl, night, run_id)
            if paired is not None:  # None: the errors table never had it, and read_night_pair says so
                versions.append(paired.version)
    return versions


def check_retention(retention_hours: int, allow_short_retention: bool = False) -> None:
    if retention_hours < 0:
        raise ConfigError("retention_hours must not be negative")
    if retention_hours < MIN_SAFE_RETENTION_HOURS and not allow_short_retention:
        raise ConfigError(
            f"retention of {retention_hours} h could delete the files of a night still being written; "
            f"use at least {MIN_SAFE_RETENTION_HOURS} h or allow_short_retention=True"
        )


def vacuum_tables(
    root: str, retention_hours: int = DEFAULT_RETENTION_HOURS, *, dry_run: bool = True
) -> dict[str, list[str]]:
    """:func:`vacuum` of both night tables under ``root`` (those that exist): table URI → files (to be) deleted."""
    tables = [uri for uri in (table_uri(root, PREDICTIONS_TABLE), table_uri(root, ERRORS_TABLE)) if is_table(uri)]
    check_retention(retention_hours)
    return {uri: vacuum(uri, retention_hours, dry_run=dry_run) for uri in tables}
