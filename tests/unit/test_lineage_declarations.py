"""What each stage's result declares for its lineage record, which its task turns into refs.

Each expected ref is written out as the task wrote it before results declared
their own (same URIs, content hashes and facets), so lineage records and
OpenLineage events keep their content.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from rayline import storage
from rayline.errors import StorageError
from rayline.lineage import DatasetRef, ErrorBudget
from rayline.models import registry
from rayline.ray_workloads.data import ingest
from rayline.ray_workloads.data.ingest import IngestResult
from rayline.ray_workloads.data.preprocess import PreprocessResult
from rayline.ray_workloads.nightly.batch_inference import InferenceResult
from rayline.ray_workloads.registration.outside_models import RegisterModelResult
from rayline.ray_workloads.serving import canary
from rayline.ray_workloads.serving.rollout import StepReport
from rayline.ray_workloads.training.evaluate import EvaluationResult
from rayline.ray_workloads.training.loop import TrainLoopConfig
from rayline.ray_workloads.training.promotion import PromotionResult
from rayline.ray_workloads.training.train import TrainResult
from rayline.ray_workloads.training.tune import TuneResult
from rayline.specs import ImageSpec, ModelSpec, ParentModel, WeightsSource
from rayline.storage import ObjectInfo
from rayline.storage.manifests import IngestManifest, ShardInfo
from rayline.tasks.common import record_lineage

pytestmark = pytest.mark.unit


def _ingested(skipped: dict[str, int]) -> IngestResult:
    return IngestResult(
        source_uri="s3://b/raw",
        output_uri="s3://b/ingested/x",
        manifest_uri="s3://b/ingested/x/manifest.json",
        content_hash="abc",
        object_count=5,
        total_bytes=500,
        fetch_errors=1,
        labels={"3": 2, "7": 3},
        shard_count=2,
        skipped=skipped,
    )


def test_an_ingest_declares_its_listing_and_its_manifest() -> None:
    result = _ingested({})
    assert result.lineage_inputs() == [
        DatasetRef(uri="s3://b/raw", content_hash="abc", facets={"object_count": 5, "total_bytes": 500})
    ]
    assert result.lineage_outputs() == [
        DatasetRef(
            uri="s3://b/ingested/x/manifest.json",
            content_hash="abc",
            facets={"shard_count": 2},  # not the shards: the manifest lists them
            stored_as="manifest",  # its schema and size are read back from the shards it commits
        )
    ]


def test_an_ingest_names_what_its_listing_skipped_only_when_it_skipped_some() -> None:
    skipped = {storage.SKIP_HIDDEN: 2}
    (source,) = _ingested(skipped).lineage_inputs()
    assert source.facets == {"object_count": 5, "total_bytes": 500, "skipped": skipped}
    assert list(source.facets) == ["object_count", "total_bytes", "skipped"]


def test_a_preprocess_declares_the_ingest_manifest_and_its_own() -> None:
    result = PreprocessResult(
        classes=["3", "7"],
        counts={"train": 3, "val": 1, "test": 1},
        class_counts={"train": {"3": 1, "7": 2}},
        error_count=1,
        error_types={"ImageDecodeError": 1},
        file_counts={"train": 1, "errors": 1},
        input_manifest_uri="s3://b/ingested/x/manifest.json",
        input_content_hash="abc",
        output_uri="s3://b/prepared/y",
        manifest_uri="s3://b/prepared/y/manifest.json",
        summary_uri="s3://b/prepared/y/summary.json",
        errors_uri="s3://b/prepared/y/errors",
    )
    assert result.lineage_inputs() == [
        DatasetRef(uri="s3://b/ingested/x/manifest.json", content_hash="abc", stored_as="manifest")
    ]
    assert result.lineage_outputs() == [
        DatasetRef(
            uri="s3://b/prepared/y/manifest.json",
            content_hash="abc",
            # how many files, not which: the manifest lists them
            facets={"file_counts": {"train": 1, "errors": 1}, "counts": result.counts, "error_count": 1},
            stored_as="manifest",
        )
    ]


def test_a_night_declares_its_inputs_the_weights_and_both_tables_at_its_versions() -> None:
    files = {"predictions": 2, "errors": 1}
    result = InferenceResult(
        input_uri="s3://b/incoming/dt=2026-11-28",
        weights_uri="s3://b/models/digits/v3/weights.pt",
        predictions_table="s3://b/predictions",
        errors_table="s3://b/prediction_errors",
        model_name="digits",
        dt="2026-11-28",
        run_id="task-1",
        predictions_version=4,
        errors_version=5,
        replaced=False,
        inputs=3,
        predictions=2,
        errors=1,
        error_types={"ImageDecodeError": 1},
        input_content_hash="def",
        model="digits v3",
        data_files=files,
        elapsed_s=1.0,
        plans={"eager/bf16/channels-last": {"reason": "eager/bf16/channels-last: 2.10x fp32's speed"}},
        error_budget=0.25,
    )
    night = {"model_name": "digits", "dt": "2026-11-28", "run_id": "task-1"}
    budget = ErrorBudget(rows=3, error_rows=1, budget=0.25)  # a third failed: over the night's budget
    assert (round(budget.error_fraction, 3), budget.within) == (0.333, False)
    assert result.lineage_inputs() == [
        DatasetRef(uri="s3://b/incoming/dt=2026-11-28", content_hash="def"),
        DatasetRef(uri="s3://b/models/digits/v3/weights.pt", facets={"model": "digits v3", "plans": result.plans}),
    ]
    assert result.lineage_outputs() == [
        DatasetRef(
            uri="s3://b/predictions",
            facets={**night, "version": 4, "data_files": 2},
            stored_as="delta",
            table_version=4,
            quality=budget,
        ),
        DatasetRef(
            uri="s3://b/prediction_errors",
            facets={**night, "version": 5, "data_files": 1},
            stored_as="delta",
            table_version=5,
            quality=budget,
        ),
    ]


def _trained(init_weights_uri: str | None = None) -> TrainResult:
    return TrainResult(
        run_name="digits-1",
        run_uri="s3://b/training/digits-1",
        checkpoint_uri="s3://b/training/digits-1/checkpoint_000002",
        weights_uri="s3://b/training/digits-1/checkpoint_000002/weights.pt",
        metrics={"val_accuracy": 0.9},
        history=[],
        epochs=3,
        elapsed_s=1.0,
        samples_per_s=10.0,
        data_manifest_uri="s3://b/prepared/y/manifest.json",
        init_weights_uri=init_weights_uri,
    )


def test_a_training_run_declares_its_data_a_fine_tunes_start_and_its_best_checkpoint() -> None:
    checkpoint = DatasetRef(
        uri="s3://b/training/digits-1/checkpoint_000002", facets={"metrics": {"val_accuracy": 0.9}}, stored_as="folder"
    )
    data = DatasetRef(uri="s3://b/prepared/y/manifest.json", stored_as="manifest")
    assert _trained().lineage_inputs() == [data]
    assert _trained().lineage_outputs() == [checkpoint]
    assert _trained("s3://b/models/digits/v2/weights.pt").lineage_inputs() == [
        data,
        DatasetRef(uri="s3://b/models/digits/v2/weights.pt"),
    ]


def test_an_evaluation_declares_the_weights_the_data_its_report_and_its_answers() -> None:
    result = EvaluationResult(
        split="test",
        data_manifest_uri="s3://b/prepared/y/manifest.json",
        weights_uri="s3://b/training/digits-1/checkpoint_000002/weights.pt",
        samples=10,
        accuracy=0.8,
        per_class=[],
        confusion=[],
        report_uri="s3://b/training/digits-1/evaluation-test.json",
        answers_uri="s3://b/training/digits-1/answers-test.parquet",
    )
    assert result.lineage_inputs() == [
        DatasetRef(uri="s3://b/training/digits-1/checkpoint_000002/weights.pt"),
        DatasetRef(uri="s3://b/prepared/y/manifest.json", stored_as="manifest"),
    ]
    assert result.lineage_outputs() == [
        DatasetRef(uri="s3://b/training/digits-1/evaluation-test.json", facets={"accuracy": 0.8}, stored_as="json"),
        DatasetRef(uri="s3://b/training/digits-1/answers-test.parquet", facets={"images": 10}, stored_as="parquet"),
    ]
    assert result.model_copy(update={"report_uri": None, "answers_uri": None}).lineage_outputs() == []


def test_a_search_declares_its_data_and_its_experiment_with_the_best_config() -> None:
    best = TrainLoopConfig(lr=0.004)
    result = TuneResult(
        experiment_uri="s3://b/tuning/digits-tune8",
        best_config=best,
        best_metrics={"val_accuracy": 0.9, "epochs": 3.0},
        trials=[],
        restored=False,
        elapsed_s=1.0,
        data_manifest_uri="s3://b/prepared/y/manifest.json",
    )
    assert result.lineage_inputs() == [DatasetRef(uri="s3://b/prepared/y/manifest.json", stored_as="manifest")]
    assert result.lineage_outputs() == [
        DatasetRef(uri="s3://b/tuning/digits-tune8", facets={"best": best.model_dump(mode="json")}, stored_as="folder")
    ]


def _version(number: int, **fields: object) -> registry.ModelVersion:
    return registry.ModelVersion.model_validate(
        {
            "name": "digits",
            "version": number,
            "uri": f"s3://b/models/digits/v{number}",
            "weights_uri": f"s3://b/models/digits/v{number}/weights.pt",
            "model_spec": ModelSpec(),
            "image_spec": ImageSpec(),
            "classes": [str(i) for i in range(10)],
            "metrics": {},
            "code_version": "test",
            **fields,
        }
    )


MOVED_AT = datetime(2026, 11, 28, 3, 0, tzinfo=UTC)


def _move(number: int) -> registry.AliasMove:
    return registry.AliasMove(
        name="digits", alias="challenger", version=number, previous=None, reason="why", moved_at=MOVED_AT
    )


def test_an_outside_model_declares_its_weights_file_and_its_version() -> None:
    source = WeightsSource(uri="/home/me/resnet.pt", sha256="f00d" * 16, size_bytes=1234)
    result = RegisterModelResult(version=_version(4, weights_source=source), reused=False, alias_move=_move(4))
    assert result.lineage_inputs() == [
        DatasetRef(uri="/home/me/resnet.pt", content_hash=source.sha256, facets={"size_bytes": 1234})
    ]
    assert result.lineage_outputs() == [
        DatasetRef(
            uri="s3://b/models/digits/v4",
            content_hash=source.sha256,
            facets={"moves": [_move(4).model_dump(mode="json")], "reused": False},
            stored_as="model",
        )
    ]
    again = RegisterModelResult(version=_version(4, weights_source=source), reused=True)
    assert again.lineage_outputs()[0].facets == {"moves": [], "reused": True}
    with pytest.raises(StorageError, match="names no weights source"):
        RegisterModelResult(version=_version(5), reused=False).lineage_inputs()


def test_a_gated_version_declares_its_checkpoint_data_parent_and_the_decision() -> None:
    decision = registry.GateDecision(
        promoted=True,
        reason="beats champion",
        candidate=5,
        champion=4,
        metric="test_accuracy",
        candidate_score=0.9,
        champion_score=0.8,
    )
    parent = ParentModel(name="digits", version=4, uri="s3://b/models/digits/v4")
    result = PromotionResult(
        version=_version(5),
        decision=decision,
        alias="challenger",
        moves=[_move(5)],
        champion=4,
        checkpoint_uri="s3://b/training/digits-1/checkpoint_000002",
        data_manifest_uri="s3://b/prepared/y/manifest.json",
        data_content_hash="abc",
        parent=parent,
    )
    assert result.lineage_inputs() == [
        DatasetRef(uri="s3://b/training/digits-1/checkpoint_000002", stored_as="folder"),
        DatasetRef(uri="s3://b/prepared/y/manifest.json", stored_as="manifest"),
        DatasetRef(uri="s3://b/models/digits/v4", facets={"parent": parent.model_dump()}, stored_as="model"),
    ]
    assert result.lineage_outputs() == [
        DatasetRef(
            uri="s3://b/models/digits/v5",
            content_hash="abc",
            facets={"moves": [_move(5).model_dump(mode="json")], "gate": decision.model_dump()},
            stored_as="model",
        )
    ]
    assert len(result.model_copy(update={"parent": None}).lineage_inputs()) == 2


def test_a_rollouts_outcome_declares_both_versions_and_the_candidate_with_why() -> None:
    prepared = canary.PreparedRollout(base_url="http://127.0.0.1:8000", incumbent=_version(4), candidate=_version(5))
    steps = [
        StepReport(
            weight=10.0,
            candidate=None,
            incumbent=None,
            incumbent_p95_ms=None,
            agreement=0.95,
            passed=True,
            reason="ok",
        )
    ]
    move = _move(5).model_copy(update={"alias": "champion"})
    promoted = canary.Promotion(prepared=prepared, steps=steps, reason="passed every step", alias_move=move)
    rolled_back = canary.RolloutOutcome(outcome=canary.ROLLED_BACK, prepared=prepared, steps=steps, reason="5xx")
    both = [DatasetRef(uri=f"s3://b/models/digits/v{n}", stored_as="model") for n in (4, 5)]
    assert promoted.lineage_inputs() == rolled_back.lineage_inputs() == both
    assert promoted.lineage_outputs() == [
        DatasetRef(
            uri="s3://b/models/digits/v5",
            facets={"outcome": "promoted", "reason": "passed every step", "alias_move": move.model_dump(mode="json")},
            stored_as="alias",  # an alias moved to it: the rollout wrote nothing into the version
        )
    ]
    assert rolled_back.lineage_outputs() == [
        DatasetRef(uri="s3://b/models/digits/v5", facets={"outcome": "rolled back", "reason": "5xx"}, stored_as="alias")
    ]


def _ingest_committed(root: str, source: str, digest: str, keys_and_etags: list[tuple[str, str]]) -> IngestResult:
    """An ingest of ``source`` committed under ``root`` and recorded in the ingest stage's lineage."""
    output = storage.join(root, "ingested", digest)
    objects = [ObjectInfo(storage.join(source, k), k, 1, etag, "") for k, etag in keys_and_etags]
    shard = storage.join(output, "shards", "part-00000.parquet")
    storage.write_parquet_atomic(shard, ingest.pack_shard(objects, [b"x"] * len(objects)))
    manifest = IngestManifest(
        source_uri=source,
        content_hash=digest,
        object_count=len(objects),
        total_bytes=len(objects),
        fetch_errors=0,
        labels={},
        shards=[ShardInfo(uri=shard, rows=len(objects), bytes=1, fetch_errors=0)],
    )
    manifest_uri = storage.join(output, "manifest.json")
    storage.write_json_atomic(manifest_uri, manifest.model_dump(mode="json"))
    result = ingest.read_manifest(manifest_uri)
    record_lineage("ingest", result, parameters={})
    return result


def test_arrivals_are_counted_against_the_latest_earlier_ingest_of_other_content(local_storage: str) -> None:
    source = storage.join(local_storage, "raw")
    first = _ingest_committed(local_storage, source, "h1", [("3/a.png", "e1")])
    assert ingest.previous_ingest(first) is None
    assert ingest.arrivals_since_previous(first).new_objects == 1, "a first ingest: everything arrived"
    _ingest_committed(local_storage, storage.join(local_storage, "elsewhere"), "h9", [("3/z.png", "e9")])
    second = _ingest_committed(local_storage, source, "h2", [("3/a.png", "e1"), ("7/b.png", "e2")])
    again = ingest.previous_ingest(second.model_copy(update={"cached": True}))
    assert again is not None and again.manifest_uri == first.manifest_uri, "the same content is no earlier ingest"
    third = _ingest_committed(local_storage, source, "h3", [("3/a.png", "e1"), ("7/b.png", "e3"), ("c.png", "e4")])

    previous = ingest.previous_ingest(third)
    assert previous is not None and previous.manifest_uri == second.manifest_uri
    news = ingest.arrivals_since_previous(third)  # b.png has a new etag, c.png is new (and unlabelled)
    assert (news.source_uri, news.new_objects, news.new_labelled, news.labels) == (source, 2, 1, {"7": 1})
