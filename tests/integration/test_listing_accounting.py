"""Every listed object is an input (one row) or skipped with a reason that ingest and a night report.

Next to good images: a hidden key, two underscore keys and, on a cloud store
(S3, GCS, Azure), a zero-byte folder marker (local disk has none: an empty
folder is no object) and good images at keys with doubled slashes (each an
object of its own). On GCS the ingest runs and the night is refused before any
work: its Delta commits go through delta-rs's XML-API client, which no GCS
emulator serves (docs/storage.md, ``rayline.tables.delta_probe``).
"""

from __future__ import annotations

import os
from itertools import islice

import pytest

from rayline import storage
from rayline.cli.summaries import print_inference_summary
from rayline.errors import DeltaWritesUnsupported
from rayline.ray_workloads.data import ingest
from rayline.ray_workloads.nightly import batch_inference
from rayline.seed import digit_objects
from rayline.skipped import skipped_text
from rayline.storage import layout
from rayline.tables.prediction_reads import read_night_pair
from tests.integration.helpers import register_untrained
from tests.integration.prediction_tables_support import outside_reads

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session")]

DAY = "2026-11-28"
GOOD = 6
HIDDEN = [".x/a.png", "_tmp/b.png", "c/_d.png"]
# On S3, relative to the night's prefix: at its start (a careless join), in the middle, at the end of a folder
SLASHED = ["//lead.png", "7//mid/a.png", "7//b.png"]


@pytest.fixture(params=["local", "s3", "gcs", "azure"])
def root(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_storage"))


def _seed(source: str) -> tuple[set[str], dict[str, int]]:
    """Good images, hidden and underscore keys, a folder marker: (the good keys, the expected skips)."""
    images = dict(islice(digit_objects(32), GOOD))
    for key, data in images.items():
        storage.write_bytes_atomic(storage.join(source, key), data)
    some_image = next(iter(images.values()))
    for key in HIDDEN:
        storage.write_bytes_atomic(storage.join(source, key), some_image)
    expected = {storage.SKIP_HIDDEN: len(HIDDEN)}
    if storage.is_remote(source):
        # what a console's "Create folder" writes: a zero-byte key ending in "/" (the day's own, one inside)
        store = storage.store(source)
        for marker in ("", "photos/"):
            store.put(f"{source}/{marker}", b"")
        expected[storage.SKIP_FOLDER_MARKER] = 2
        for key in SLASHED:  # at exactly these keys: storage.join would strip the leading slash
            store.put(storage.object_uri(source, key), some_image)
            images[key] = some_image
    else:
        os.makedirs(storage.join(source, "photos"))  # an empty folder: not listed, so nothing to skip
    return set(images), expected


def test_ingest_and_a_night_account_for_every_listed_object(root: str, capsys: pytest.CaptureFixture[str]) -> None:
    source = storage.join(root, "incoming", f"dt={DAY}")
    good, skipped = _seed(source)

    config = ingest.IngestConfig(source_uri=source, output_root=storage.join(root, "ingested"))
    ingested = ingest.run(config)
    assert (ingested.object_count, ingested.fetch_errors, ingested.skipped) == (len(good), 0, skipped)
    manifest = storage.read_json(ingested.manifest_uri)
    assert manifest["skipped"] == skipped
    assert manifest["skipped_examples"][storage.SKIP_HIDDEN] == sorted(HIDDEN)
    rows = storage.read_parquet(ingested.read_shard_uris(), columns=["key", "error_type"]).to_pylist()
    assert sorted(r["key"] for r in rows) == sorted(good) and not any(r["error_type"] for r in rows)  # one row each
    reused = ingest.run(config)
    assert reused.cached and reused.skipped == skipped
    if root.startswith("gs://"):  # the night's Delta commits: refused before any work (module docstring)
        with pytest.raises(DeltaWritesUnsupported, match="which no GCS emulator serves"):
            batch_inference.run(
                batch_inference.InferenceConfig(
                    input_uri=source, tables_root=root, dt=DAY, model=register_untrained(), actors=1
                )
            )
        assert not {"predictions", "prediction_errors"} & set(storage.list_folders(root)), "no table was begun"
        assert "nights" not in storage.list_folders(storage.join(root, "_staging")), "no night's lease was taken"
        return

    night = batch_inference.run(
        batch_inference.InferenceConfig(
            input_uri=source, tables_root=root, dt=DAY, model=register_untrained(), actors=1
        )
    )
    assert (night.inputs, night.predictions, night.errors, night.skipped) == (len(good), len(good), 0, skipped)
    pair = read_night_pair(root, "digits", DAY)
    assert pair.errors.num_rows == 0, pair.errors.to_pylist()  # no NoSuchKey row for the folder marker
    # one row per object, under its own key: not join(), which would strip the leading slash of "//lead.png"
    assert sorted(pair.predictions.column("uri").to_pylist()) == sorted(f"{source}/{k}" for k in good)
    table = layout.table_uri(root, layout.PREDICTIONS_TABLE)
    (outside,) = outside_reads([{"table": table, "model_name": "digits", "dt": DAY, "version": None}])
    assert outside["pyarrow"]["uri"] == outside["pandas"]["uri"] == sorted(f"{source}/{k}" for k in good)

    print_inference_summary(night)
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert f"skipped            {skipped_text(skipped)}" in lines
