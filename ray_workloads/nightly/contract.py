"""What a night of batch inference is asked (:class:`InferenceConfig`) and answers (:class:`InferenceResult`,
:class:`NightSkipped`): the typed contract between ``rayline.ray_workloads.nightly.batch_inference`` and its callers.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, computed_field, model_validator

from rayline.config import lease_ttl
from rayline.errors import ConfigError
from rayline.lineage import DatasetRef, ErrorBudget
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.execution.plan import PlanPolicy
from rayline.ray_workloads.nightly.request import NightShape
from rayline.ray_workloads.quality.shadow import ShadowSummary, committed_summary
from rayline.storage.folders import LeasedOutput
from rayline.storage.layout import ERRORS_TABLE, PREDICTIONS_TABLE, table_uri
from rayline.tables.delta_tables import NightCommit

SMALL_IMAGE_SIDE = 64
COMPUTE_BOUND_OBJECTS_PER_TASK = 32
# Blocks per night, at most: past it blocks grow instead (batch_inference.objects_per_task).
MAX_BLOCKS_PER_NIGHT = 100_000


def block_size(image_side: int, count: int, chosen: int | None = None) -> int:
    """Objects per block of a night of ``count`` objects at ``image_side`` px (``chosen``: the user's)."""
    if chosen is not None:
        return chosen
    base = 256 if image_side <= SMALL_IMAGE_SIDE else COMPUTE_BOUND_OBJECTS_PER_TASK
    return max(base, -(-count // MAX_BLOCKS_PER_NIGHT))


class InferenceConfig(LeasedOutput, NightShape):
    """A night of batch inference in the shape its request asked for; the lease fields are the night's (one live run
    predicts a night at a time)."""

    input_uri: str
    tables_root: str = Field(description="Where the predictions and prediction_errors tables live: the storage root.")
    dt: str = Field(description="The night, an ISO date: with the model's name, the partition the run replaces.")
    model: ModelVersion
    shadow: ModelVersion | None = Field(
        None,
        description="A second version scored on the same decoded images, its rows in shadow_predictions; "
        "the night's budget, rows and guarantees stay the champion's.",
    )
    gpus_per_actor: float = Field(0.0, ge=0)
    objects_per_task: int | None = Field(
        None,
        ge=1,
        description="Objects per actor call; each call writes one file. Default: 256 for small images, "
        f"{COMPUTE_BOUND_OBJECTS_PER_TASK} for images over {SMALL_IMAGE_SIDE} px (compute-bound models), "
        f"more for nights past {MAX_BLOCKS_PER_NIGHT:,} such blocks.",
    )
    io_concurrency: int = Field(64, ge=1, description="Concurrent object reads per actor call.")
    listing_part_objects: int = Field(
        100_000, ge=1, description="Objects per Parquet part of the night's listing (rayline.storage.listing)."
    )
    min_file_rows: int = Field(
        100_000, ge=1, description="Rows a committed data file reaches, unless min_file_bytes comes first."
    )
    min_file_bytes: int = Field(64 * 2**20, ge=1, description="Bytes a committed data file reaches, at most.")
    top_k: int = Field(3, ge=1)
    max_error_fraction: float = Field(
        0.05,
        ge=0,
        le=1,
        description="The night's error budget (its request's), stated in its lineage: the flow judges it.",
    )
    code_version: str = "unknown"
    flow_run_id: str | None = None
    plan: PlanPolicy = Field(
        default_factory=PlanPolicy,
        description="How the actors choose their execution plan (rayline.ray_workloads.execution).",
    )
    # the night's lease: a dead holder blocks the night's next run this long at most
    lease_ttl_s: float = Field(
        default_factory=lambda: lease_ttl(60.0),
        gt=0,
        description="Lease expiry after the last renewal (renewed every ttl/3); default RAYLINE_LEASE_TTL_S or 60 s.",
    )

    @model_validator(mode="after")
    def _shadow_compares_with_the_model(self) -> InferenceConfig:
        """A shadow is another version of the same model, taking the same input: its pixels are decoded once."""
        shadow, model = self.shadow, self.model
        if shadow is None:
            return self
        problems = []
        if (shadow.name, shadow.version) == (model.name, model.version):
            problems.append(f"it is the version the night predicts with ({model.name} v{model.version})")
        if shadow.classes != model.classes:
            problems.append(f"its classes {shadow.classes[:5]}… differ from {model.classes[:5]}…")
        if shadow.image_spec != model.image_spec:
            problems.append(f"its input {shadow.image_spec} differs from {model.image_spec}")
        if problems:
            raise ConfigError(
                f"cannot shadow {model.name} v{model.version} with {shadow.name} v{shadow.version}: "
                + "; ".join(problems)
                + " (a shadow is another version of the same classes and input, scored on the same images)"
            )
        return self


class InferenceResult(BaseModel):
    input_uri: str = Field(description="The prefix the night's inputs were listed under, as the config named it.")
    weights_uri: str = Field(description="The weights of the model version that predicted.")
    predictions_table: str
    errors_table: str
    model_name: str
    dt: str
    run_id: str
    predictions_version: int = Field(description="The predictions table's version holding this run's commit.")
    errors_version: int = Field(description="The prediction_errors table's version holding this run's commit.")
    replaced: bool = Field(description="Whether the commit replaced an earlier run's night.")
    already_committed: bool = Field(False, description="This run id had committed the night before (a retry).")
    inputs: int
    predictions: int
    errors: int
    error_types: dict[str, int]
    error_budget: float = Field(0.05, description="The share of inputs the night allows to fail (max_error_fraction).")
    skipped: dict[str, int] = Field(default_factory=dict, description="Listed objects that are no inputs, by reason.")
    skipped_examples: dict[str, list[str]] = Field(default_factory=dict, description="The first keys of each reason.")
    input_content_hash: str
    input_digest: str = Field("", description="Count and order-independent digest of the listed URIs.")
    model: str
    data_files: dict[str, int] = Field(description="How many data files the night's commit holds, per table.")
    listing_parts: int = Field(0, description="Parquet parts the listing was streamed into.")
    blocks: int = Field(0, description="Blocks of objects_per_task objects the actors took.")
    reused_blocks: int = Field(0, description="Blocks an earlier attempt of the same night wrote: not predicted again.")
    delta_log_bytes: dict[str, int] = Field(
        default_factory=dict, description="Bytes each table's commit added to its _delta_log."
    )
    elapsed_s: float
    phase_s: dict[str, float] = Field(default_factory=dict, description="Wall-clock seconds per phase of the run.")
    ray_data_stats: str = Field("", description="Ray Data's execution stats of the predict-and-write stage.")
    plans: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="The execution plans the actors predicted with: each plan's name, with how it was chosen on "
        "which hardware (the first actor's record of it), the night's model calls under it (batches), those "
        "predicted again in fp32 for outputs that were not finite (fallback_batches, fallback_images) and, when "
        "that demoted it for later nights, the fp32 reason cached in its place (demoted).",
    )
    shadow: ShadowSummary | None = Field(None, description="The shadow version's night, when one was scored.")
    core_seconds: float | None = Field(
        None,
        description="CPU seconds the night took: its predictor actors' (set-up and plan included) and its driver "
        "process's. What a night costs: core-seconds × the price of a core-second (docs/capacity.md).",
    )

    @computed_field  # type: ignore[prop-decorator]  # pydantic's documented use
    @property
    def images_per_core_second(self) -> float | None:
        """The night's inputs per core-second: its throughput per unit of what it is billed for."""
        return round(self.inputs / self.core_seconds, 3) if self.core_seconds else None

    @classmethod
    def from_commit(cls, cfg: InferenceConfig, commits: dict[str, NightCommit], **run: Any) -> InferenceResult:
        """The result a night's commits (per kind of rows: predictions, errors, the shadow's) describe, alike
        for the run that just made them and for a retry that finds them made; ``run`` adds ``elapsed_s`` and
        what only the run that made them saw (its listing's parts and skipped objects, blocks, phases, plans)."""
        predictions, errors, shadow = commits["predictions"], commits["errors"], commits.get("shadow")
        shared = predictions.model_dump(include={"run_id", "model_name", "dt", "inputs", "input_content_hash"})
        return cls.model_validate(
            {
                **shared,
                "input_uri": cfg.input_uri,
                "weights_uri": cfg.model.weights_uri,
                "predictions_table": table_uri(cfg.tables_root, PREDICTIONS_TABLE),
                "errors_table": table_uri(cfg.tables_root, ERRORS_TABLE),
                "predictions_version": predictions.version,
                "errors_version": errors.version,
                "replaced": predictions.replaced,
                "already_committed": predictions.already_committed,
                "predictions": predictions.rows,
                "errors": errors.rows,
                "error_types": errors.error_types or {},
                "error_budget": cfg.max_error_fraction,
                "input_digest": predictions.input_digest or "",
                "model": f"{cfg.model.name} v{cfg.model.version}",
                "data_files": {
                    kind: commits[kind].files for kind in ("predictions", "errors", "shadow") if kind in commits
                },
                "shadow": None if shadow is None else committed_summary(shadow),
                "core_seconds": predictions.core_seconds,
                **run,
            }
        )

    @property
    def error_fraction(self) -> float:
        return self.errors / self.inputs if self.inputs else 0.0

    def cost_text(self) -> str:
        """What the night cost in CPU: ``412.3 core-seconds (1.2 images per core-second)``."""
        if not self.core_seconds:
            return "not recorded"
        return f"{self.core_seconds:.1f} core-seconds ({self.images_per_core_second} images per core-second)"

    @property
    def night(self) -> str:
        """``<model>/dt=<day>``: the partition, as people name it."""
        return f"{self.model_name}/dt={self.dt}"

    def lineage_inputs(self) -> list[DatasetRef]:
        """The night's inputs, pinned to their listing's hash, and the model's weights."""
        return [
            DatasetRef(uri=self.input_uri, content_hash=self.input_content_hash),
            DatasetRef(uri=self.weights_uri, facets={"model": self.model, "plans": self.plans}),
            *([DatasetRef(uri=self.shadow.weights_uri, facets={"shadow": True})] if self.shadow else []),
        ]

    def lineage_outputs(self) -> list[DatasetRef]:
        """Both tables, at the versions holding this run's commit of the night, with how many files it has; the
        night's rows against its error budget on each."""
        night: dict[str, Any] = {"model_name": self.model_name, "dt": self.dt, "run_id": self.run_id}
        budget = ErrorBudget(rows=self.inputs, error_rows=self.errors, budget=self.error_budget)
        refs = [
            DatasetRef(
                uri=uri,
                facets={**night, "version": version, "data_files": self.data_files[kind]},
                stored_as="delta",
                table_version=version,
                quality=budget,
            )
            for kind, uri, version in (
                ("predictions", self.predictions_table, self.predictions_version),
                ("errors", self.errors_table, self.errors_version),
            )
        ]
        if self.shadow is not None:
            shadow = self.shadow
            facets = {**night, "version": shadow.table_version, "model_version": shadow.model_version}
            refs.append(
                DatasetRef(uri=shadow.table, facets=facets, stored_as="delta", table_version=shadow.table_version)
            )
        return refs


class NightSkipped(BaseModel):
    """A run that found its night committed by another run while it worked: it committed nothing."""

    model_name: str
    dt: str
    committed_by: str | None = Field(description="The run id that committed the night, when known.")
    message: str

    @property
    def night(self) -> str:
        return f"{self.model_name}/dt={self.dt}"
