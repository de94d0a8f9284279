"""The nights of the Delta tables in the lineage graph (:mod:`rayline.lineage.graph`).

Batch inference records each table it committed as an output whose facets name the night (``model_name``, ``dt``), the
run id and the table ``version`` holding the commit. Such an output is keyed by the night's partition folder,
``<table>/model_name=<m>/dt=<d>``, so each night of each model is a node of its own; a rerun's record replaces the
earlier one (the latest record of a key wins). ``build_graph(table, dt=…)`` picks the nights of one day (of one model,
or a folder node of every model's); the partition folder, or a file in it, finds its night too.
"""

from __future__ import annotations

import posixpath
from collections.abc import Collection
from typing import Any

from deltalake import DeltaTable

from rayline import storage
from rayline.errors import InputDataError, NoLineageError
from rayline.lineage import DatasetRef, is_storage_uri, lineage_dir, normalize_uri
from rayline.storage.layout import ERRORS_TABLE
from rayline.tables.delta_tables import PARTITION_COLUMNS, Night, open_table, storage_options

# What a night of each table is, when the table is not the predictions one.
_NIGHT_KINDS = {ERRORS_TABLE: "prediction errors"}


def night_of(ref: DatasetRef) -> Night | None:
    """The night a ref of a night table names in its facets, if any."""
    if "model_name" in ref.facets and "dt" in ref.facets:
        return Night(str(ref.facets["model_name"]), str(ref.facets["dt"]))
    return None


def night_uri(table: str, model_name: str, dt: str) -> str:
    """``<table>/model_name=<m>/dt=<d>``: the partition folder of a night, where its files live."""
    return storage.join(normalize_uri(table), Night(model_name, dt).relative_dir)


def ref_uri(ref: DatasetRef) -> str:
    """What a ref names: a night's partition folder when its facets name a night, else its URI."""
    night = night_of(ref)
    return normalize_uri(ref.uri) if night is None else night_uri(ref.uri, night.model_name, night.dt)


def night_kind(table: str) -> str:
    """What a night of ``table`` holds: predictions, or prediction errors."""
    return _NIGHT_KINDS.get(posixpath.basename(normalize_uri(table)), "predictions")


def night_details(ref: DatasetRef, night: Night) -> dict[str, Any]:
    """Which commit of which table the night is: the Delta version a reader time-travels to, and the run."""
    return {
        "table": normalize_uri(ref.uri),
        "model_name": night.model_name,
        "dt": night.dt,
        "delta_version": ref.facets.get("version"),
        "run_id": ref.facets.get("run_id"),
        # a count since nights compact to a few files; records before that listed the files
        "files": int(ref.facets.get("data_files", len(ref.facets.get("files") or []))),
    }


def pick_nights(
    candidates: list[str], outputs: Collection[DatasetRef], dt: str, model_name: str | None = None
) -> tuple[str, list[str]]:
    """The first candidate that is a table of nights, and the partition folders of its recorded nights of ``dt``
    (of ``model_name`` only, when given), sorted. Raises :class:`InputDataError` when no candidate is a table of
    nights and :class:`~rayline.errors.NoLineageError` when no recorded output is such a night.
    """
    table = _night_table(candidates, outputs)
    if model_name is not None:
        Night(model_name, dt)  # a name no partition can have fails here, naming itself
    uri = normalize_uri(table)
    nights = {
        ref_uri(ref)
        for ref in outputs
        if (night := night_of(ref)) is not None
        and normalize_uri(ref.uri) == uri
        and night.dt == dt
        and model_name in (None, night.model_name)
    }
    if not nights:
        which = f"{model_name}'s night" if model_name else "any model's night"
        raise NoLineageError(
            f"no lineage for {which} of {dt} in {uri}: no record under {lineage_dir()} "
            "names it (nights are recorded by nightly-inference)"
        )
    return table, sorted(nights)


def _night_table(candidates: list[str], outputs: Collection[DatasetRef]) -> str:
    """The first candidate a recorded output names as a table of nights, or that is a Delta table partitioned as
    the night tables are (one not yet named by any record)."""
    recorded = {normalize_uri(ref.uri) for ref in outputs if night_of(ref) is not None}
    for candidate in candidates:
        if normalize_uri(candidate) in recorded or _is_night_delta_table(candidate):
            return candidate
    raise InputDataError(
        f"{candidates[0]} is not a table of nights (a Delta table partitioned by {', '.join(PARTITION_COLUMNS)}, "
        "such as <storage>/predictions or <storage>/prediction_errors): a date picks a night of one"
    )


def _is_night_delta_table(uri: str) -> bool:
    if not is_storage_uri(uri):
        return False
    uri = normalize_uri(uri)
    if not DeltaTable.is_deltatable(uri, storage_options(uri)):
        return False
    return tuple(open_table(uri).metadata().partition_columns) == PARTITION_COLUMNS
