"""Nights at scale, on a small night: a night killed at 60 % resumes with only its
unfinished blocks, a night whose cutters list the sub-prefixes the driver left, a result that stays
small however many parts and blocks, written files that no longer match the listing refused, and a block an
earlier attempt left past a shorter listing not read.

The same inputs, config and outside readers as ``test_prediction_tables.py``
(``prediction_tables_support``), on the session's Ray cluster.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path

import pytest

from rayline.errors import StorageError
from rayline.ray_workloads.nightly import batch_inference
from rayline.ray_workloads.nightly.batch_inference import new_run_id
from rayline.ray_workloads.nightly.holding import night_listings
from rayline.storage import listing
from rayline.tables.delta_tables import Night, table_version
from rayline.tables.prediction_reads import read_night_pair, vacuum
from tests.integration.helpers import PlantExtraRow, PlantMissingRow
from tests.integration.night_driver import kill_once_written
from tests.integration.prediction_tables_support import (
    Inputs,
    assert_readers_see,
    make_inputs,
    night_config,
    run_dying_before_compaction,
    seed_inputs,
    tables_of,
    written_files,
)

D1 = "2026-11-26"

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]


@pytest.fixture(scope="module", name="inputs")
def _inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    return make_inputs(tmp_path_factory)


def test_a_night_killed_at_60_percent_resumes_predicting_only_the_blocks_it_had_not_finished(
    inputs: Inputs, tmp_path: Path
) -> None:
    root = str(tmp_path / "tables")
    # the killed driver's lease stops being renewed: the rerun takes the night over after this ttl
    config = night_config(inputs, root, D1, "killed", per_task=4).model_copy(update={"lease_ttl_s": 2.0})
    blocks = math.ceil(len(inputs.expected) / 4)
    finished = round(blocks * 0.6)
    killed = new_run_id()
    left = kill_once_written(config, killed, written_files, blocks=finished)
    assert len([p for p in left["predictions"] if "/blocks-" in p]) == finished
    assert table_version(tables_of(root)["predictions"]) is None, "the killed run committed"

    rerun = batch_inference.run(config.model_copy(update={"flow_run_id": "rerun"}))
    # the killed run's finished blocks are reused; only the rest (the one in flight, those not started) predicted
    assert (rerun.blocks, rerun.reused_blocks) == (blocks, finished)
    assert rerun.inputs == len(inputs.expected) and rerun.predictions + rerun.errors == rerun.inputs
    assert_readers_see(root, "digits", D1, inputs.expected, "rerun")  # one row per input, named by its committer
    # what the killed attempt left is what a vacuum removes: the rerun took its blocks and removed them once
    # committed, and cleared its listing; nothing else is in the night's folders
    leftover = written_files(root, Night("digits", D1), killed)
    for kind, uri in tables_of(root).items():
        removed = vacuum(uri, retention_hours=0, allow_short_retention=True, dry_run=True)
        assert sorted(os.path.join(uri, path) for path in removed) == leftover[kind] == []
    assert night_listings(root, Night("digits", D1)) == {}


def test_a_block_an_earlier_attempt_left_past_a_shorter_listing_is_not_read_and_the_rerun_commits(
    inputs: Inputs, tmp_path: Path
) -> None:
    """An attempt that died between its blocks and its commit leaves a tail block under the night's key that
    no block of a shorter listing overwrites: the rerun reads only its own blocks, commits, and removes it.

    The attempt dies in this process (what a killed driver leaves on disk, less the lease that
    ``test_a_night_killed_at_60_percent…`` lets expire).
    """
    incoming = str(tmp_path / "incoming")
    uris = seed_inputs(incoming, digits=12, corrupt=2)  # 14 inputs in blocks of 13: b0 (13 rows), b13 (1 row)
    config = night_config(replace(inputs, uri=incoming, expected=uris), str(tmp_path / "tables"), D1, "", per_task=13)
    run_dying_before_compaction(config.model_copy(update={"flow_run_id": "died"}))
    stray = written_files(config.tables_root, Night("digits", D1), "died")["predictions"][-1]
    assert stray.endswith("/b000000013.parquet"), stray
    first = min(uris)
    Path(first).unlink()  # the listing shifts by one: b0 holds the 13 left, and b13 is no block of it
    result = batch_inference.run(config.model_copy(update={"flow_run_id": "rerun"}))
    assert (result.inputs, result.blocks, result.predictions + result.errors) == (13, 1, 13)
    pair = read_night_pair(config.tables_root, "digits", D1)
    rows = pair.predictions.column("uri").to_pylist() + pair.errors.column("uri").to_pylist()
    assert sorted(rows) == sorted(uris - {first})  # one row per remaining input
    assert set(pair.predictions.column("flow_run_id").to_pylist()) == {"rerun"}
    assert not os.path.exists(stray), "the stray block outlived the commit"


def test_a_night_predicts_while_its_cutters_list_the_sub_prefixes_the_driver_left(
    inputs: Inputs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past INLINE_OBJECTS the driver lists no further, inside a label folder: the rest of it and the other
    folders are listed by the night's cutters, part by part, while the first blocks are predicted; the
    committed night is the same."""
    monkeypatch.setattr(listing, "INLINE_OBJECTS", 5)  # the driver lists 5 objects, of 40 in 10 folders
    monkeypatch.setattr(listing, "LISTERS", 2)  # two cutters, as a small machine's night would have
    begun = listing.begin_listing(inputs.uri, str(tmp_path / "begun"))
    assert begun.own.count <= 5 and len(begun.groups) > 1
    root = str(tmp_path / "tables")
    result = batch_inference.run(night_config(inputs, root, D1, "streamed", per_task=4))
    assert result.inputs == len(inputs.expected) and result.predictions + result.errors == result.inputs
    # g00000, then a part a group (none for a group whose sub-prefixes hold no more objects)
    assert 1 < result.listing_parts <= 1 + len(begun.groups)
    assert result.data_files == {"predictions": 1, "errors": 1}
    whole = listing.list_to_parts(inputs.uri, str(tmp_path / "whole"))
    assert result.input_content_hash == whole.content_hash and result.input_digest == whole.uris.encode()
    assert_readers_see(root, "digits", D1, inputs.expected, "streamed")
    assert night_listings(root, Night("digits", D1)) == {}, "the listing's parts were left"


def test_the_result_of_a_night_stays_small_however_many_parts_and_blocks_it_has(inputs: Inputs, tmp_path: Path) -> None:
    # a part per input and a block per input: what grows with N at scale, here at N = 40
    config = night_config(inputs, str(tmp_path / "tables"), D1, "small", per_task=1)
    result = batch_inference.run(config.model_copy(update={"listing_part_objects": 1}))
    assert result.listing_parts == result.blocks == len(inputs.expected)
    assert result.data_files == {"predictions": 1, "errors": 1}  # compacted: one file per table
    size = len(result.model_dump_json())
    assert size < 64 * 1024, size
    fields = result.model_dump()
    # no field holds a list that grows with the night: only counts, digests and versions
    assert all(len(v) <= 5 for examples in fields["skipped_examples"].values() for v in [examples])
    assert not [name for name, value in fields.items() if isinstance(value, list)]


# a duplicated row is refused by the same digest check (tests/unit/test_streamed_listing.py)
@pytest.mark.parametrize("planted", [PlantMissingRow, PlantExtraRow])
def test_a_row_missing_or_extra_in_the_written_files_refuses_the_commit(
    inputs: Inputs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: type
) -> None:
    root = str(tmp_path / "tables")
    monkeypatch.setattr(batch_inference, "PredictorUDF", planted)
    with pytest.raises(StorageError, match="refusing to commit: the compacted files hold"):
        batch_inference.run(night_config(inputs, root, D1, "planted"))
    assert {kind: table_version(uri) for kind, uri in tables_of(root).items()} == {"predictions": None, "errors": None}
