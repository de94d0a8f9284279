"""The CLI's summaries name the listed objects a run skipped, and only when it skipped some."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rayline import storage
from rayline.cli.summaries import print_prepare_summary
from rayline.ray_workloads.data.ingest import IngestResult

pytestmark = pytest.mark.unit


def _prepare_summary(skipped: dict[str, int], capsys: pytest.CaptureFixture[str]) -> list[str]:
    ingested = IngestResult(
        source_uri="s3://b/raw",
        output_uri="s3://b/ingested/x",
        manifest_uri="s3://b/ingested/x/manifest.json",
        content_hash="abc",
        object_count=5,
        total_bytes=50,
        fetch_errors=0,
        labels={},
        shard_count=0,
        skipped=skipped,
    )
    prepared = SimpleNamespace(
        counts={"train": 5}, error_count=0, error_types={}, output_uri="o", summary_uri="s", errors_uri="e"
    )
    print_prepare_summary(SimpleNamespace(ingest=ingested, preprocess=prepared))
    return [line.rstrip() for line in capsys.readouterr().out.splitlines()]


def test_prepare_summary_says_what_the_listing_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _prepare_summary({storage.SKIP_FOLDER_MARKER: 1, storage.SKIP_HIDDEN: 3}, capsys)
    assert "  skipped            4 (folder marker 1, hidden or underscore name 3)" in lines
    assert lines.index("  objects ingested   5 from s3://b/raw") + 1 == lines.index(
        "  skipped            4 (folder marker 1, hidden or underscore name 3)"
    )


def test_prepare_summary_has_no_skipped_line_when_nothing_was_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    assert not [line for line in _prepare_summary({}, capsys) if "skipped" in line]


def test_the_nightly_artifact_names_the_skipped_and_their_first_keys() -> None:
    from rayline.flows.nightly_inference import _skipped
    from rayline.ray_workloads.nightly.batch_inference import InferenceResult

    night = InferenceResult.model_construct(
        skipped={storage.SKIP_FOLDER_MARKER: 1}, skipped_examples={storage.SKIP_FOLDER_MARKER: ["photos/"]}
    )
    assert _skipped(night) == "1 (folder marker 1): e.g. {'folder marker': ['photos/']}"
    assert _skipped(InferenceResult.model_construct(skipped={}, skipped_examples={})) == "0"


def test_rollout_summary_says_what_it_reconciled_first(capsys: pytest.CaptureFixture[str]) -> None:
    from rayline.cli.ops import print_rollout_summary
    from rayline.flows.serve_rollout import RolloutResult

    found = "serving disagreed with the registry at the start (v2 at 100%, …): rolled all traffic back to v1"
    result = RolloutResult(
        model="digits", candidate=2, incumbent=1, promoted=True, reason="v2 passed", steps=[], reconciled=found
    )
    print_rollout_summary(result)
    lines = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    assert f"  first: {found}" in lines, lines
    print_rollout_summary(result.model_copy(update={"reconciled": None}))
    assert not any("first:" in line for line in capsys.readouterr().out.splitlines())
