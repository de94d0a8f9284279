"""The labelled photos as training data: each labelled photo copied to ``labelled/<model>/<class>/``.

That folder is laid out as training input always is (``<label>/<file>``), so ``train-model`` ingests it like
``raw/``: a retraining on labels fine-tunes the champion on it (``train_model(labelled=True)``). It is
rayline's own prefix, never the producers' ``raw/``. Each export copies the newest label of every photo at
the version it was labelled (its ETag: a photo replaced since is left out and counted), removes the copies
of photos whose label changed class, and writes ``_export.json`` last: the labels table version and the
imports it holds, which is the lineage from the folder back to each labels import, and what
:func:`pending_labels` counts new labels against.
"""

from __future__ import annotations

import hashlib
import json
import posixpath

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, Field

from rayline import storage
from rayline.errors import InputDataError
from rayline.lineage import DatasetRef
from rayline.storage import fetching
from rayline.storage.layout import LABELLED_DIR
from rayline.tables import labels as labels_table

EXPORT_MANIFEST = "_export.json"
FETCH_BATCH = 256


class ExportConfig(BaseModel):
    root: str = Field(description="The storage root: the labels table and the labelled folder live there.")
    model_name: str
    io_concurrency: int = Field(32, ge=1)
    classes: list[str] = Field(
        default_factory=list, description="Classes the labelled photos must all cover: the model's (its champion's)."
    )


class ExportResult(BaseModel):
    model_name: str
    folder: str = Field(description="labelled/<model>/: a training source (<class>/<file>).")
    labels_table: str
    labels_version: int | None = Field(description="The labels table version exported.")
    import_ids: list[str] = Field(description="The labels imports that version holds for the model.")
    photos: int = Field(description="Labelled photos in the folder after the export.")
    copied: int = Field(description="Photos copied by this export (the rest were there already).")
    removed: int = Field(0, description="Copies removed: their photo's label changed class.")
    changed: int = Field(0, description="Labelled photos replaced (another ETag) or gone since: left out.")

    def lineage_inputs(self) -> list[DatasetRef]:
        facets = {"version": self.labels_version, "model_name": self.model_name, "import_ids": self.import_ids}
        return [DatasetRef(uri=self.labels_table, facets=facets)]

    def lineage_outputs(self) -> list[DatasetRef]:
        return [DatasetRef(uri=self.folder, facets={"photos": self.photos})]


def labelled_folder(root: str, model_name: str) -> str:
    return storage.join(storage.normalize(root), LABELLED_DIR, model_name)


def copy_name(uri: str, label: str) -> str:
    """``<label>/<16 hex of the URI's SHA-256><suffix>``: one copy per photo, under its class."""
    suffix = posixpath.splitext(uri)[1].lower()[:8]
    return f"{label}/{hashlib.sha256(uri.encode()).hexdigest()[:16]}{suffix}"


def _exported(folder: str) -> dict[str, dict[str, str]]:
    uri = storage.join(folder, EXPORT_MANIFEST)
    if not storage.exists(uri):
        return {}
    copies: dict[str, dict[str, str]] = json.loads(storage.read_bytes(uri))["copies"]
    return copies


def exported_imports(root: str, model_name: str) -> set[str]:
    """The labels imports the model's last export held (none before the first)."""
    uri = storage.join(labelled_folder(root, model_name), EXPORT_MANIFEST)
    return set(json.loads(storage.read_bytes(uri))["import_ids"]) if storage.exists(uri) else set()


def pending_labels(root: str, model_name: str) -> int:
    """Photos whose newest label came with an import the last export did not hold: new to training."""
    labels = labels_table.read_labels(root, model_name)
    if labels.num_rows == 0:
        return 0
    done = pa.array(sorted(exported_imports(root, model_name)), pa.string())
    return int(pc.sum(pc.invert(pc.is_in(labels["import_id"], value_set=done))).as_py() or 0)


def run(cfg: ExportConfig) -> ExportResult:
    """Copy every labelled photo the folder lacks, drop the copies whose class changed, then the manifest."""
    folder = labelled_folder(cfg.root, cfg.model_name)
    version = labels_table.current_version(cfg.root)
    labels = labels_table.read_labels(cfg.root, cfg.model_name, version)
    _check_covers(cfg, set(labels["label"].to_pylist()))
    before = _exported(folder)
    wanted = {
        copy_name(uri, label): {"uri": uri, "etag": etag, "label": label}
        for uri, etag, label in zip(
            labels["uri"].to_pylist(), labels["etag"].to_pylist(), labels["label"].to_pylist(), strict=True
        )
    }
    todo = [name for name, row in wanted.items() if before.get(name) != row]
    changed = _copy(folder, {name: wanted[name] for name in todo}, cfg.io_concurrency)
    copies = {name: row for name, row in wanted.items() if name not in changed}
    stale = [name for name in before if name not in copies]
    for name in stale:
        storage.remove_tree(storage.join(folder, name))
    imports = sorted(set(labels["import_id"].to_pylist()))
    manifest = {"labels_version": version, "import_ids": imports, "copies": copies}
    storage.write_bytes_atomic(storage.join(folder, EXPORT_MANIFEST), json.dumps(manifest, sort_keys=True).encode())
    return ExportResult(
        model_name=cfg.model_name,
        folder=folder,
        labels_table=labels_table.labels_uri(cfg.root),
        labels_version=version,
        import_ids=imports,
        photos=len(copies),
        copied=len(todo) - len(changed),
        removed=len(stale),
        changed=len(changed),
    )


def _check_covers(cfg: ExportConfig, labelled: set[str]) -> None:
    """A model trained on the labelled photos predicts the classes they hold: refused unless they hold all."""
    missing = [c for c in cfg.classes if c not in labelled]
    if missing:
        shown = ", ".join(missing[:10]) + (", …" if len(missing) > 10 else "")
        raise InputDataError(
            f"{cfg.model_name}'s labelled photos cover {len(cfg.classes) - len(missing)} of its {len(cfg.classes)} "
            f"classes (none labelled: {shown}): a model trained on them would lose the rest; label at least one "
            "photo of each class (rayline labels queue picks photos to label)"
        )


def _copy(folder: str, rows: dict[str, dict[str, str]], concurrency: int) -> set[str]:
    """Copy ``rows`` (copy name → photo) into ``folder``; the names of photos no longer as labelled."""
    changed: set[str] = set()
    names = list(rows)
    for start in range(0, len(names), FETCH_BATCH):
        batch = names[start : start + FETCH_BATCH]
        fetched = fetching.fetch_many([rows[name]["uri"] for name in batch], concurrency)
        for name, item in zip(batch, fetched, strict=True):
            read = fetching.as_listed(item, rows[name]["etag"])
            if read.error is not None or read.data is None:
                changed.add(name)
                continue
            storage.write_bytes_atomic(storage.join(folder, name), read.data)
    return changed
