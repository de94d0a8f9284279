"""The facets of a dataset in rayline's OpenLineage events, from what its lineage ref says was read back.

Standard facets where OpenLineage has one: ``version`` (the content hash or ETag a ref is pinned to),
``schema`` (the columns as written), ``outputStatistics`` (rows, bytes and files the run wrote). A night's
error budget has no standard facet (``dataQualityAssertions`` is an input facet, for a checker that reads
a dataset): it is the custom ``rayline_errorBudget``, whose JSON schema is ``docs/openlineage/`` in the
repository and whose ``_schemaURL`` is that schema's ``$id``.
"""

from __future__ import annotations

from typing import ClassVar

import attr
from openlineage.client.facet_v2 import (
    DatasetFacet,
    OutputDatasetFacet,
    dataset_version_dataset,
    output_statistics_output_dataset,
    schema_dataset,
)

from rayline.lineage.records import Column, DatasetRef, ErrorBudget

ERROR_BUDGET_FACET = "rayline_errorBudget"
ERROR_BUDGET_SCHEMA_URL = "urn:rayline:openlineage:facets:1-0-0:ErrorBudgetDatasetFacet.json"


@attr.define
class ErrorBudgetDatasetFacet(DatasetFacet):
    """A night's rows against its error budget: ``errorFraction`` = ``errorRows`` / ``rows``, judged against
    ``budget`` (the share of inputs allowed to fail); a night over budget is committed, then its run fails."""

    rows: int
    errorRows: int  # noqa: N815  # OpenLineage's field names are camelCase
    errorFraction: float  # noqa: N815
    budget: float
    withinBudget: bool  # noqa: N815

    _additional_skip_redact: ClassVar[list[str]] = ["rows", "errorRows", "errorFraction", "budget", "withinBudget"]

    @staticmethod
    def _get_schema() -> str:
        return ERROR_BUDGET_SCHEMA_URL


def _schema_fields(columns: list[Column]) -> list[schema_dataset.SchemaDatasetFacetFields]:
    return [
        schema_dataset.SchemaDatasetFacetFields(
            name=c.name, type=c.type, description=c.description, ordinal_position=i, fields=_schema_fields(c.fields)
        )
        for i, c in enumerate(columns, start=1)
    ]


def error_budget_facet(quality: ErrorBudget, producer: str) -> ErrorBudgetDatasetFacet:
    return ErrorBudgetDatasetFacet(
        rows=quality.rows,
        errorRows=quality.error_rows,
        errorFraction=round(quality.error_fraction, 6),
        budget=quality.budget,
        withinBudget=quality.within,
        producer=producer,
    )


def dataset_facets(ref: DatasetRef, producer: str) -> dict[str, DatasetFacet]:
    """``version``, ``schema`` and (a night's tables) ``rayline_errorBudget``, each where the ref knows it."""
    facets: dict[str, DatasetFacet] = {}
    pinned = ref.content_hash or ref.etag or (str(ref.table_version) if ref.table_version is not None else None)
    if pinned:
        facets["version"] = dataset_version_dataset.DatasetVersionDatasetFacet(datasetVersion=pinned, producer=producer)
    if ref.written is not None:
        facets["schema"] = schema_dataset.SchemaDatasetFacet(
            fields=_schema_fields(ref.written.columns), producer=producer
        )
    if ref.quality is not None:
        facets[ERROR_BUDGET_FACET] = error_budget_facet(ref.quality, producer)
    return facets


def output_facets(ref: DatasetRef, producer: str) -> dict[str, OutputDatasetFacet]:
    """``outputStatistics``: rows, bytes and files the run wrote, as far as they were read back."""
    if ref.written is None:
        return {}
    written = ref.written
    statistics = output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet(
        rowCount=written.rows, size=written.bytes, fileCount=written.files, producer=producer
    )
    return {"outputStatistics": statistics}
