"""The labelled photos exported as training data (``training_set``): each photo copied at the version it was
labelled, under exactly one class, by one export at a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayline import storage
from rayline.ray_workloads.quality import labels_import, training_set
from tests.unit.test_quality import CLASSES, MODEL, commit_night

pytestmark = pytest.mark.unit

DAY = "2026-12-01"


def _photos_predicted(root: str, count: int) -> list[str]:
    """``count`` photos on local disk under ``<root>/incoming``, predicted by v1 in one night; their URIs."""
    incoming = storage.join(root, "incoming", f"dt={DAY}")
    for i in range(count):
        storage.write_bytes_atomic(storage.join(incoming, f"img-{i:03d}.jpg"), f"photo {i}".encode())
    listed = storage.list_objects(incoming)
    commit_night(root, DAY, 1, [(o.uri, o.etag, i % len(CLASSES), 0.9) for i, o in enumerate(listed)])
    return [o.uri for o in listed]


def _label(root: str, tmp_path: Path, labels: dict[str, str], name: str) -> None:
    """Import ``labels`` (photo URI → class) as the labels file ``name``."""
    path = tmp_path / name
    path.write_text("uri,label\n" + "".join(f"{uri},{label}\n" for uri, label in labels.items()))
    cfg = labels_import.LabelsImportConfig(
        file_uri=str(path), root=root, model_name=MODEL, classes=CLASSES, key_base=storage.join(root, "incoming")
    )
    assert labels_import.run(cfg).imported == len(labels)


def _copies(folder: str) -> dict[str, list[str]]:
    """The exported folder as training reads it: each class's copies (``<class>/<file>``)."""
    found: dict[str, list[str]] = {}
    for listed in storage.list_objects(folder):
        label, name = listed.key.split("/")
        found.setdefault(label, []).append(name)
    return found


def test_a_photo_replaced_on_local_disk_after_its_label_is_left_out_of_the_export_and_counted_as_changed(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "storage")
    x, y = _photos_predicted(root, 2)
    _label(root, tmp_path, {x: "cat", y: "dog"}, "labels.csv")
    storage.write_bytes_atomic(x, b"another photo, saved under the labelled one's name")

    exported = training_set.run(training_set.ExportConfig(root=root, model_name=MODEL))

    assert (exported.photos, exported.copied, exported.changed) == (1, 1, 1)
    assert _copies(exported.folder) == {"dog": [training_set.copy_name(y, "dog").split("/")[1]]}
    assert storage.read_bytes(storage.join(exported.folder, training_set.copy_name(y, "dog"))) == b"photo 1"
