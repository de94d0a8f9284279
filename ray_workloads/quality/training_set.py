"""The labelled photos as training data: each labelled photo copied under its class, ``<class>/<file>``, in
rayline's own ``labelled/<model>/`` (never the producers' ``raw/``), so ``train-model`` ingests them like
``raw/`` (``train_model(labelled=True)``).

The folder is filled as every committed folder is (:func:`rayline.storage.folders.fill_once`): one export at
a time holds its lease, reads the labels under it, writes a new generation and commits its manifest
(:class:`LabelledExportManifest`) by a compare-and-swap fenced by the lease. So two exports never
interleave: a photo relabelled between their reads ends under its newest class only. Each copy is of the
photo at the ETag labelled (a photo replaced since is left out and counted); a copy the previous generation
holds for the same label is carried over, so a photo removed from its source keeps training. The
manifest's imports are what :func:`pending_labels` counts new labels against (docs/quality.md).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, Field

from rayline import storage
from rayline.errors import InputDataError
from rayline.lineage import DatasetRef
from rayline.storage import fetching, folders, leases, manifests
from rayline.storage.layout import LABELLED_DIR
from rayline.storage.manifests import LabelledCopy, LabelledExportManifest
from rayline.tables import labels as labels_table

# a folder laid out without generations keeps its imports here until the first generation's commit
LEGACY_EXPORT_MANIFEST = "_export.json"
FETCH_BATCH = 256


class ExportConfig(folders.LeasedOutput):
    root: str = Field(description="The storage root: the labels table and the labelled folder live there.")
    model_name: str
    io_concurrency: int = Field(32, ge=1)
    classes: list[str] = Field(default_factory=list, description="Classes the labelled photos must all cover.")
    # below the export task's five-minute limit, so a run that waits too long fails naming the holder instead
    lease_wait_s: float = Field(240.0, ge=0, description="How long to wait for another export of the model.")


class ExportResult(BaseModel):
    model_name: str
    folder: str = Field(description="The committed generation of labelled/<model>/: <class>/<file>.")
    manifest_uri: str = Field(description="labelled/<model>/manifest.json, which commits that generation.")
    labels_table: str
    labels_version: int | None = Field(description="The labels table version exported.")
    import_ids: list[str] = Field(description="The labels imports that version holds for the model.")
    photos: int = Field(description="Labelled photos in the folder after the export.")
    copied: int = Field(description="Photos copied from their source by this export (the rest were exported before).")
    removed: int = Field(0, description="Copies of the previous export left out: their photo's label changed class.")
    changed: int = Field(0, description="Labelled photos replaced (another ETag) or gone since: left out.")
    cached: bool = Field(False, description="The folder already held this labels version: nothing was copied.")

    def lineage_inputs(self) -> list[DatasetRef]:
        facets = {"version": self.labels_version, "model_name": self.model_name, "import_ids": self.import_ids}
        version = self.labels_version
        return [
            DatasetRef(
                uri=self.labels_table,
                facets=facets,
                stored_as="delta" if version is not None else None,
                table_version=version,
            )
        ]

    def lineage_outputs(self) -> list[DatasetRef]:
        return [DatasetRef(uri=self.folder, facets={"photos": self.photos}, stored_as="folder")]


def labelled_folder(root: str, model_name: str) -> str:
    return storage.join(storage.normalize(root), LABELLED_DIR, model_name)


def copy_name(uri: str, label: str) -> str:
    """``<label>/<16 hex of the URI's SHA-256><suffix>``: one copy per photo, under its class."""
    suffix = posixpath.splitext(uri)[1].lower()[:8]
    return f"{label}/{hashlib.sha256(uri.encode()).hexdigest()[:16]}{suffix}"


def committed_export(root: str, model_name: str) -> LabelledExportManifest | None:
    """The model's committed export (None before the first)."""
    return manifests.read_committed(labelled_folder(root, model_name), LabelledExportManifest)


def exported_imports(root: str, model_name: str) -> set[str]:
    """The labels imports the model's last export held (none before the first)."""
    committed = committed_export(root, model_name)
    if committed is not None:
        return set(committed.import_ids)
    legacy = storage.join(labelled_folder(root, model_name), LEGACY_EXPORT_MANIFEST)
    return set(json.loads(storage.read_bytes(legacy))["import_ids"]) if storage.exists(legacy) else set()


def pending_labels(root: str, model_name: str) -> int:
    """Photos whose newest label came with an import the last export did not hold: new to training."""
    labels = labels_table.read_labels(root, model_name)
    if labels.num_rows == 0:
        return 0
    done = pa.array(sorted(exported_imports(root, model_name)), pa.string())
    return int(pc.sum(pc.invert(pc.is_in(labels["import_id"], value_set=done))).as_py() or 0)


@dataclass
class _Counts:
    """What a fill did: photos copied from their source, copies of the previous export left out."""

    copied: int = 0
    removed: int = 0


def run(cfg: ExportConfig) -> ExportResult:
    """The model's labelled photos committed as one generation of its folder, or the one that holds them already
    (committed at the labels version read); else it fills one under the folder's lease (:func:`_fill`)."""
    folder = labelled_folder(cfg.root, cfg.model_name)
    seen = labels_table.current_version(cfg.root)
    counts = _Counts()

    def reusable(found: LabelledExportManifest) -> bool:
        return found.labels_version == seen and not _uncovered(cfg.classes, {c.label for c in found.copies.values()})

    def fill(lease: leases.HeldLease, generation_folder: str) -> LabelledExportManifest:
        manifest, filled = _fill(cfg, folder, generation_folder)
        counts.copied, counts.removed = filled.copied, filled.removed
        return manifest.model_copy(update={"committed_by": lease.lease.holder})

    what = f"the labelled photos of {cfg.model_name}"
    done = folders.fill_once(folder, cfg, what, LabelledExportManifest, reusable=reusable, force=False, fill=fill)
    manifest = done.manifest
    return ExportResult(
        model_name=cfg.model_name,
        folder=manifests.files_folder(done.uri, manifest),
        manifest_uri=done.uri,
        labels_table=labels_table.labels_uri(cfg.root),
        labels_version=manifest.labels_version,
        import_ids=manifest.import_ids,
        photos=len(manifest.copies),
        copied=counts.copied,
        removed=counts.removed,
        changed=manifest.changed,
        cached=done.cached,
    )


def _fill(cfg: ExportConfig, folder: str, generation_folder: str) -> tuple[LabelledExportManifest, _Counts]:
    """Copy the newest label of every photo into ``generation_folder``; its manifest, uncommitted. Run under
    the folder's lease: the labels are read after any export before this one committed."""
    version = labels_table.current_version(cfg.root)
    labels = labels_table.read_labels(cfg.root, cfg.model_name, version)
    _check_covers(cfg, set(labels["label"].to_pylist()))
    wanted = {
        copy_name(uri, label): LabelledCopy(uri=uri, etag=etag, label=label)
        for uri, etag, label in zip(
            labels["uri"].to_pylist(), labels["etag"].to_pylist(), labels["label"].to_pylist(), strict=True
        )
    }
    previous = manifests.read_committed(folder, LabelledExportManifest)
    earlier = previous.copies if previous is not None else {}
    carried = [name for name, photo in wanted.items() if earlier.get(name) == photo]
    if previous is not None and carried:  # copies of the same label and version: read back, not from the source
        before = manifests.generation_folder(folder, previous.generation)
        sources = {name: (storage.join(before, name), None) for name in carried}
        unreadable = _copy(generation_folder, sources, cfg.io_concurrency)
    else:
        unreadable = set()
    fresh = [name for name in wanted if name not in carried or name in unreadable]
    changed = _copy(generation_folder, {n: (wanted[n].uri, wanted[n].etag) for n in fresh}, cfg.io_concurrency)
    copies = {name: photo for name, photo in wanted.items() if name not in changed}
    manifest = LabelledExportManifest(
        model_name=cfg.model_name,
        labels_version=version,
        import_ids=sorted(set(labels["import_id"].to_pylist())),
        copies=copies,
        changed=len(changed),
    )
    return manifest, _Counts(copied=len(fresh) - len(changed), removed=len(set(earlier) - set(copies)))


def _uncovered(classes: list[str], labelled: set[str]) -> list[str]:
    return [c for c in classes if c not in labelled]


def _check_covers(cfg: ExportConfig, labelled: set[str]) -> None:
    """A model trained on the labelled photos predicts the classes they hold: refused unless they hold all."""
    missing = _uncovered(cfg.classes, labelled)
    if missing:
        shown = ", ".join(missing[:10]) + (", …" if len(missing) > 10 else "")
        raise InputDataError(
            f"{cfg.model_name}'s labelled photos cover {len(cfg.classes) - len(missing)} of its {len(cfg.classes)} "
            f"classes (none labelled: {shown}): a model trained on them would lose the rest; label at least one "
            "photo of each class (rayline labels queue picks photos to label)"
        )


def _copy(folder: str, sources: Mapping[str, tuple[str, str | None]], concurrency: int) -> set[str]:
    """Copy each source (copy name → its URI, and the version it must be read at; None: any) into ``folder``;
    the names not copied: their source was replaced (another version) or cannot be read."""
    failed: set[str] = set()
    names = list(sources)
    for start in range(0, len(names), FETCH_BATCH):
        batch = names[start : start + FETCH_BATCH]
        fetched = fetching.fetch_many([sources[name][0] for name in batch], concurrency)
        for name, item in zip(batch, fetched, strict=True):
            version = sources[name][1]
            read = item if version is None else fetching.as_listed(item, version)
            if read.error is not None or read.data is None:
                failed.add(name)
                continue
            storage.write_bytes_atomic(storage.join(folder, name), read.data)
    return failed
