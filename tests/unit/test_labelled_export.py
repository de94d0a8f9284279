"""The labelled photos exported as training data (``training_set``): each photo copied at the version it was
labelled, under exactly one class, by one export at a time."""

from __future__ import annotations

import json
import posixpath
import threading
from pathlib import Path
from typing import Any

import pytest

from rayline import storage
from rayline.ray_workloads.quality import labels_import, training_set
from rayline.storage import fetching, leases
from rayline.tables import labels as labels_table
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


class _TwoExports:
    """Two exports, in threads ``A`` and ``B``, each stopped when it starts copying photos until let go.

    ``B`` is also stopped when it finds the folder's lease held (it waits for ``A`` then): either way the
    test knows ``B`` has gone as far as it can before ``A`` commits, without sleeping on a guess.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cfg: training_set.ExportConfig) -> None:
        self.cfg = cfg
        self.copying = {name: threading.Event() for name in "AB"}
        self.go = {name: threading.Event() for name in "AB"}
        self.b_stopped = threading.Event()
        self.results: dict[str, training_set.ExportResult | BaseException] = {}
        self.threads = {name: threading.Thread(target=self._export, name=name) for name in "AB"}
        fetch_many, try_acquire = fetching.fetch_many, leases.try_acquire

        def paused_fetch(uris: list[str], concurrency: int) -> list[fetching.Fetched]:
            name = threading.current_thread().name
            if name in self.go:
                self.copying[name].set()
                self.b_stopped.set() if name == "B" else None
                assert self.go[name].wait(30), f"export {name} was never let go"
            return fetch_many(uris, concurrency)

        def watched_try_acquire(*args: Any, **kwargs: Any) -> leases.Lease | None:
            taken = try_acquire(*args, **kwargs)
            if taken is None and threading.current_thread().name == "B":
                self.b_stopped.set()
            return taken

        monkeypatch.setattr(fetching, "fetch_many", paused_fetch)
        monkeypatch.setattr(leases, "try_acquire", watched_try_acquire)

    def _export(self) -> None:
        try:
            self.results[threading.current_thread().name] = training_set.run(self.cfg)
        except BaseException as exc:
            self.results[threading.current_thread().name] = exc

    def finish(self, name: str) -> training_set.ExportResult:
        self.go[name].set()
        self.threads[name].join(30)
        result = self.results[name]
        assert isinstance(result, training_set.ExportResult), result
        return result


def test_two_exports_racing_around_a_relabel_leave_each_photo_under_exactly_one_class(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = str(tmp_path / "storage")
    x, y = _photos_predicted(root, 2)
    _label(root, tmp_path, {x: "cat", y: "dog"}, "first.csv")
    race = _TwoExports(monkeypatch, training_set.ExportConfig(root=root, model_name=MODEL))

    race.threads["A"].start()
    assert race.copying["A"].wait(30)  # A has read the labels: x is a cat
    _label(root, tmp_path, {x: "fox"}, "relabel.csv")
    race.threads["B"].start()
    assert race.b_stopped.wait(30)  # B has read the relabel, or waits for A's lease
    a = race.finish("A")
    b = race.finish("B")
    third = training_set.run(training_set.ExportConfig(root=root, model_name=MODEL))

    classes_of: dict[str, list[str]] = {}
    for label, names in _copies(third.folder).items():
        for name in names:
            classes_of.setdefault(name, []).append(label)
    assert classes_of == {
        training_set.copy_name(x, "fox").split("/")[1]: ["fox"],
        training_set.copy_name(y, "dog").split("/")[1]: ["dog"],
    }
    manifest = training_set.committed_export(root, MODEL)
    assert manifest is not None and manifest.labels_version == third.labels_version
    assert {o.key for o in storage.list_objects(third.folder)} == set(manifest.copies)
    # beside the committed generation (B's) only the one B's commit replaced (A's), for a reader still inside
    # it: the next commit removes it
    assert third.cached and third.folder == b.folder != a.folder
    listed = {n for n in storage.list_names(training_set.labelled_folder(root, MODEL)) if not n.startswith(".")}
    assert listed == {"manifest.json", posixpath.basename(a.folder), posixpath.basename(b.folder)}
    assert storage.read_bytes(storage.join(third.folder, training_set.copy_name(x, "fox"))) == b"photo 0"


def test_a_folder_laid_out_without_generations_counts_its_imports_until_the_first_export_replaces_it(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "storage")
    (x,) = _photos_predicted(root, 1)
    _label(root, tmp_path, {x: "cat"}, "labels.csv")
    folder = training_set.labelled_folder(root, MODEL)
    imports = sorted(set(labels_table.read_labels(root, MODEL)["import_id"].to_pylist()))
    storage.write_bytes_atomic(storage.join(folder, "dog", "stale.jpg"), b"a copy under a class no label gives it")
    storage.write_bytes_atomic(storage.join(folder, "_export.json"), json.dumps({"import_ids": imports}).encode())
    assert training_set.pending_labels(root, MODEL) == 0

    exported = training_set.run(training_set.ExportConfig(root=root, model_name=MODEL))

    listed = {n for n in storage.list_names(folder) if not n.startswith(".")}
    assert listed == {"manifest.json", posixpath.basename(exported.folder)}
    assert _copies(exported.folder) == {"cat": [training_set.copy_name(x, "cat").split("/")[1]]}
    assert training_set.pending_labels(root, MODEL) == 0


def test_a_copy_made_by_an_earlier_export_is_carried_over_when_its_photo_is_gone_from_the_source(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "storage")
    x, y = _photos_predicted(root, 2)
    _label(root, tmp_path, {x: "cat"}, "first.csv")
    first = training_set.run(training_set.ExportConfig(root=root, model_name=MODEL))
    storage.remove_tree(x)  # the producers' retention removed it; its label and copy stay good
    _label(root, tmp_path, {y: "dog"}, "second.csv")

    second = training_set.run(training_set.ExportConfig(root=root, model_name=MODEL))

    assert (second.photos, second.copied, second.changed) == (2, 1, 0) and second.folder != first.folder
    assert storage.read_bytes(storage.join(second.folder, training_set.copy_name(x, "cat"))) == b"photo 0"
