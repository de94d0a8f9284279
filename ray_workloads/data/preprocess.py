"""Preprocess: ingest shards → decoded, normalised train/val/test shards.

Ray Data decodes every image in its own try/except (one bad image is one error row, never a failed job
nor a dropped block), and a datasink routes rows to ``<split>/`` and ``errors/`` files. The split is a hash
of the object key, so an image keeps its split when new objects arrive.

Output layout (committed by ``manifest.json``, written last: a
:class:`rayline.storage.manifests.PreprocessManifest`)::

    <output>/train/part-*.parquet  val/…  test/…   uri, key, etag, label, label_index, image
    <output>/errors/part-*.parquet                   uri, key, stage, error_type, error_message
    <output>/summary.json                            counts per split and class, error count
    <output>/manifest.json                           files + summary: the commit point

:class:`PreprocessResult` counts the files per split rather than listing them, so it stays small at any N.
A run fills the folder only while it holds its lease (:mod:`rayline.storage.folders`): a concurrent run on
the same input and parameters waits, then reuses what the first committed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import ray
from pydantic import Field
from ray.data.block import BlockAccessor
from ray.data.datasource import Datasink, WriteResult

from rayline import progress, ray_work, storage
from rayline.errors import StorageError
from rayline.lineage import DatasetRef
from rayline.ray_workloads.data import ingest
from rayline.ray_workloads.data.images import ImageSpec, decode_rows
from rayline.specs import SplitFractions
from rayline.storage import folders, leases, manifests
from rayline.storage.manifests import PreprocessCounts, PreprocessManifest, PreprocessParameters, PreprocessSummary

SPLITS = ("train", "val", "test")
ERRORS = "errors"
SUMMARY = "summary.json"


class PreprocessConfig(folders.LeasedOutput):
    ingest_manifest_uri: str
    output_root: str
    image: ImageSpec = Field(default_factory=ImageSpec)
    splits: SplitFractions = Field(default_factory=SplitFractions)
    batch_size: int = Field(128, ge=1)
    num_cpus_per_task: float = Field(0.5, gt=0)
    force: bool = False


class PreprocessResult(PreprocessCounts):
    """The folder's summary (counts, errors: the manifest's), with where it is and how it was made: how many
    files per split, never which (:meth:`read_files` reads them from the manifest), so its size does not grow."""

    file_counts: dict[str, int] = Field(
        description="Parquet files per split (and errors) that the manifest commits (read_files lists them)."
    )
    input_manifest_uri: str
    input_content_hash: str
    output_uri: str
    manifest_uri: str
    summary_uri: str
    errors_uri: str
    image: ImageSpec = Field(default_factory=ImageSpec, description="How the images were decoded.")
    cached: bool = False
    waited_s: float = Field(0.0, description="How long this run waited for another run filling the same folder.")
    elapsed_s: float = 0.0
    ray_data_stats: str = Field("", description="Ray Data's execution stats of this run (empty when reused).")

    @property
    def total_rows(self) -> int:
        return sum(self.counts.values()) + self.error_count

    def read_files(self) -> dict[str, list[str]]:
        """Every Parquet file by split (and ``errors``), as the manifest committed at ``manifest_uri`` now lists
        them (I/O): a forced run since may have committed another generation of the same input in its place."""
        return manifests.read(self.manifest_uri, PreprocessManifest).summary.files

    def lineage_inputs(self) -> list[DatasetRef]:
        """The ingest manifest, pinned to its input's version."""
        return [DatasetRef(uri=self.input_manifest_uri, content_hash=self.input_content_hash, stored_as="manifest")]

    def lineage_outputs(self) -> list[DatasetRef]:
        """The manifest of the splits: derived from that version, with its counts (the manifest lists the files)."""
        facets = {"file_counts": self.file_counts, "counts": self.counts, "error_count": self.error_count}
        return [
            DatasetRef(uri=self.manifest_uri, content_hash=self.input_content_hash, facets=facets, stored_as="manifest")
        ]


def split_for_key(key: str, fractions: SplitFractions) -> str:
    """Stable split from a hash of the key: independent of what else is in the dataset."""
    point = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    if point < fractions.train:
        return "train"
    if point < fractions.train + fractions.val:
        return "val"
    return "test"


def ordered_classes(labels: Iterable[str]) -> list[str]:
    """Class names in a stable order: numeric when every label is a number."""
    unique = sorted(set(labels))
    if all(label.lstrip("-").isdigit() for label in unique):
        return sorted(unique, key=int)
    return unique


def decode_batch(
    batch: dict[str, np.ndarray], spec: ImageSpec, fractions: SplitFractions, classes: list[str]
) -> dict[str, np.ndarray]:
    """Decode one batch; every input row yields exactly one output row (ok or error)."""
    class_index = {name: i for i, name in enumerate(classes)}
    # a fetch that failed in ingest is already an error row
    failed = [None if t is None else (t, m) for t, m in zip(batch["error_type"], batch["error_message"], strict=True)]
    labels = batch["label"]
    return {
        "uri": batch["uri"],
        "key": batch["key"],
        "etag": batch["etag"],
        "label": labels,
        "label_index": np.array([class_index.get(lbl, -1) if lbl else -1 for lbl in labels], dtype=np.int64),
        "split": np.array([split_for_key(k, fractions) for k in batch["key"]], dtype=object),
        **decode_rows(batch["data"], failed, spec),
    }


_SAMPLE_COLUMNS = ["uri", "key", "etag", "label", "label_index", "image"]
_ERROR_COLUMNS = ["uri", "key", "stage", "error_type", "error_message"]


class SplitShardSink(Datasink[dict[str, Any]]):
    """Writes each task's rows to ``<split>/part-<task>.parquet`` and ``errors/``; returns per-file facts."""

    def __init__(self, output_uri: str, shown: progress.Stage | None = None) -> None:
        self.output_uri = output_uri
        self.shown = shown or progress.Stage()  # counts the rows each write task finishes
        self.result: WriteResult[dict[str, Any]] | None = None

    def get_name(self) -> str:
        return "RaylineSplitShards"

    def write(self, blocks: Iterable[Any], ctx: Any) -> dict[str, Any]:
        tables = [BlockAccessor.for_block(b).to_arrow() for b in blocks]
        tables = [t for t in tables if t.num_rows]
        report: dict[str, Any] = {"files": {}, "rows": 0, "class_counts": {}, "error_types": {}}
        if not tables:
            return report
        table = pa.concat_tables(tables, promote_options="default")
        report["rows"] = table.num_rows
        ok = table.column("ok").to_numpy(zero_copy_only=False)
        split = np.asarray(table.column("split").to_pylist(), dtype=object)
        name = f"part-{ctx.task_idx:05d}.parquet"
        for part in SPLITS:
            mask = ok & (split == part)
            if mask.any():
                rows = table.filter(pa.array(mask)).select(_SAMPLE_COLUMNS)
                uri = storage.join(self.output_uri, part, name)
                storage.write_parquet_atomic(uri, rows)
                report["files"][part] = {"uri": uri, "rows": rows.num_rows}
                report["class_counts"][part] = dict(Counter(rows.column("label").to_pylist()))
        if (~ok).any():
            errors = table.filter(pa.array(~ok)).select(_ERROR_COLUMNS)
            uri = storage.join(self.output_uri, ERRORS, name)
            storage.write_parquet_atomic(uri, errors)
            report["files"][ERRORS] = {"uri": uri, "rows": errors.num_rows}
            report["error_types"] = dict(Counter(errors.column("error_type").to_pylist()))
        self.shown.add(table.num_rows)
        return report

    def on_write_complete(self, write_result: WriteResult[dict[str, Any]]) -> None:
        self.result = write_result


def _params_hash(cfg: PreprocessConfig, classes: list[str]) -> str:
    params = {"image": cfg.image.model_dump(), "splits": cfg.splits.model_dump(), "classes": classes}
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:8]


def _summarise(reports: list[dict[str, Any]], classes: list[str]) -> PreprocessSummary:
    files: dict[str, list[str]] = defaultdict(list)
    counts: Counter[str] = Counter()
    class_counts: dict[str, Counter[str]] = {s: Counter() for s in SPLITS}
    error_types: Counter[str] = Counter()
    for report in reports:
        for part, info in report["files"].items():
            files[part].append(info["uri"])
            counts[part] += info["rows"]
        for part, per_class in report["class_counts"].items():
            class_counts[part].update({k: v for k, v in per_class.items() if k is not None})
        error_types.update(report["error_types"])
    error_count = counts.pop(ERRORS, 0)
    return PreprocessSummary(
        classes=classes,
        counts={s: counts.get(s, 0) for s in SPLITS},
        class_counts={s: {c: class_counts[s].get(c, 0) for c in classes} for s in SPLITS},
        error_count=error_count,
        error_types=dict(sorted(error_types.items())),
        files={k: sorted(v) for k, v in sorted(files.items())},
    )


def _result(
    manifest: PreprocessManifest, manifest_uri: str, cached: bool, elapsed: float, waited: float = 0.0
) -> PreprocessResult:
    summary = manifest.summary
    files = manifests.files_folder(manifest_uri, manifest)  # the committed generation's
    return PreprocessResult(
        **manifest.model_dump(include={"input_manifest_uri", "input_content_hash", "output_uri"}),
        manifest_uri=manifest_uri,
        summary_uri=storage.join(files, SUMMARY),
        errors_uri=storage.join(files, ERRORS),
        **summary.model_dump(include=set(PreprocessCounts.model_fields) - {"counts"}),
        counts={s: summary.counts.get(s, 0) for s in SPLITS},
        file_counts={part: len(uris) for part, uris in summary.files.items()},
        image=manifest.parameters.image,
        cached=cached,
        waited_s=waited,
        elapsed_s=elapsed,
    )


def read_manifest(manifest_uri: str) -> PreprocessResult:
    return _result(manifests.read(manifest_uri, PreprocessManifest), manifest_uri, cached=True, elapsed=0.0)


def source_of(manifest_uri: str) -> str:
    """The prefix a committed preprocess output was ingested from."""
    return ingest.read_manifest(read_manifest(manifest_uri).input_manifest_uri).source_uri


def run(cfg: PreprocessConfig) -> PreprocessResult:
    """Decode, normalise and split every ingested object; commit with a manifest."""
    started = time.perf_counter()
    source = ingest.read_manifest(cfg.ingest_manifest_uri)
    classes = ordered_classes(source.labels)
    dataset_name = f"{source.output_uri.rstrip('/').rsplit('/', 1)[-1]}-{_params_hash(cfg, classes)}"
    output = storage.join(storage.normalize(cfg.output_root), dataset_name)
    stats = ""  # Ray Data's stats of this run's decoding; none when the folder is reused

    def decode(lease: leases.HeldLease, files: str) -> PreprocessManifest:
        nonlocal stats
        manifest, stats = _decode_and_commit(cfg, source, classes, output, files)
        return manifest

    done = folders.fill_once(
        output,
        cfg,
        f"the preprocessed folder {dataset_name}",
        PreprocessManifest,
        reusable=lambda manifest: manifest.input_content_hash == source.content_hash,
        force=cfg.force,
        fill=decode,
    )
    result = _result(done.manifest, done.uri, done.cached, time.perf_counter() - started, done.waited_s)
    # the workers' own stats never reach the caller's logs by themselves
    return result.model_copy(update={"ray_data_stats": stats})


def _decode_and_commit(
    cfg: PreprocessConfig, source: ingest.IngestResult, classes: list[str], output: str, files: str
) -> tuple[PreprocessManifest, str]:
    """Decode and split into ``files`` (``output``'s generation); the manifest that commits it (written after,
    by ``folders.fill_once``), and Ray Data's stats."""
    shard_uris = source.read_shard_uris()  # the ingest's manifest lists them
    fs, _ = storage.arrow_filesystem(shard_uris[0])
    paths = [storage.arrow_filesystem(uri)[1] for uri in shard_uris]
    decoded = ray.data.read_parquet(paths, filesystem=fs, override_num_blocks=len(paths)).map_batches(
        functools.partial(decode_batch, spec=cfg.image, fractions=cfg.splits, classes=classes),
        batch_size=cfg.batch_size,
        batch_format="numpy",
        num_cpus=cfg.num_cpus_per_task,
    )
    ray_work.stop_with_scope(decoded.context)  # an interrupted attempt stops its decoding before a retry clears
    with progress.stage("preprocess", total=source.object_count, unit="images", remote=True) as shown:
        sink = SplitShardSink(files, shown)
        decoded.write_datasink(sink, ray_remote_args={"num_cpus": cfg.num_cpus_per_task})
    if sink.result is None:
        raise StorageError(f"preprocess wrote nothing for {cfg.ingest_manifest_uri}")
    summary = _summarise(list(sink.result.write_returns), classes)
    written = sum(summary.counts.values()) + summary.error_count
    if written != source.object_count:
        raise StorageError(f"preprocess wrote {written} rows for {source.object_count} ingested objects")

    storage.write_json_atomic(storage.join(files, SUMMARY), summary.model_dump(mode="json", exclude={"files"}))
    manifest = PreprocessManifest(
        input_manifest_uri=cfg.ingest_manifest_uri,
        input_content_hash=source.content_hash,
        output_uri=output,
        parameters=PreprocessParameters(image=cfg.image, splits=cfg.splits),
        summary=summary,
    )
    return manifest, decoded.stats()


def error_sample(result: PreprocessResult, limit: int = 20) -> list[dict[str, Any]]:
    """The first ``limit`` error rows (uri, stage, type, message) for reports: reads the manifest when there are any."""
    rows: list[dict[str, Any]] = []
    if not result.file_counts.get(ERRORS):
        return rows
    for uri in result.read_files().get(ERRORS, []):
        rows.extend(storage.read_parquet([uri]).to_pylist())
        if len(rows) >= limit:
            break
    return rows[:limit]
