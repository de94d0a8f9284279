"""The upstream graph of any stored output, built from the lineage records.

Every stage run wrote a record naming its inputs and outputs by URI (:mod:`rayline.lineage`). Walking from an
output back through the records that produced each input gives, for a night of predictions::

    night (Delta version, run) → model version → training run → preprocessed shards
                               → ingested shards → raw prefix → raw objects with etags

and, for a model registered from outside weights: night → model version → outside weights (URI, sha256).

Three things are not in the records and are read where they are, typed: a model version's ``version.json`` (its training
run and data manifest, or its weights source), and an ingest manifest's shards
(:class:`rayline.storage.manifests.IngestManifest`), whose rows pin every raw object to its etag. A night's output is
keyed by its partition folder, so each night of each model is a node of its own (:mod:`rayline.lineage.nights`).

URIs match by folder as well as exactly: ``ingested/<id>`` finds the record whose output is its
``manifest.json``; a file inside a recorded output (a shard, ``weights.pt``, a night's part file) finds that
output's record; a folder holding several outputs (``<storage>/predictions``) is a folder node with each of
them upstream. URIs that are not storage (an outside model's ``https://`` weights) are kept as they are.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeGuard

from pydantic import BaseModel, Field

from rayline import lineage, storage
from rayline.errors import ConfigError, InputDataError, NoLineageError
from rayline.lineage import DatasetRef, LineageRecord, is_storage_uri, normalize_uri
from rayline.lineage.nights import night_details, night_kind, night_of, pick_nights, ref_uri
from rayline.models import registry
from rayline.storage import fetching, layout, manifests
from rayline.storage.layout import parse_day
from rayline.storage.manifests import MANIFEST, IngestManifest
from rayline.tables.delta_tables import Night

# What a stage's output is, for people reading the tree.
STAGE_KINDS = {
    "ingest": "ingested shards",
    "preprocess": "preprocessed shards",
    "train": "training run",
    "tune": "tuning experiment",
    "evaluate": "evaluation",
    "registry": "model version",
    "batch_inference": "predictions",
}
_MODEL_VERSION = re.compile(rf"^(.*/{layout.MODELS_DIR}/[a-z0-9][a-z0-9-]*/v\d+)(?:/.*)?$")
# What a model version's node shows of its version.json.
_VERSION_DETAILS = set("name version code_version flow_run_id data_content_hash metrics weights_source parent".split())
_RECORD_READS = 32  # concurrent record reads: many small JSON objects on S3


class LineageNode(BaseModel):
    """One dataset in the upstream graph and what it came from."""

    uri: str
    kind: str
    stage: str | None = Field(None, description="The stage whose run produced it; None for external inputs.")
    record_uri: str | None = None
    produced_at: datetime | None = None
    content_hash: str | None = None
    etag: str | None = None
    details: dict[str, Any] = Field(default_factory=dict)
    upstream: list[LineageNode] = Field(default_factory=list)
    omitted: int = Field(0, description="Upstream entries left out (raw objects beyond the limit).")
    repeated: bool = Field(False, description="Expanded elsewhere in this tree; not repeated here.")
    cycle: bool = Field(False, description="Its own ancestor; not expanded again.")


@dataclass(frozen=True)
class _Produced:
    """One output of one record, under the key it is matched by."""

    key: str
    ref: DatasetRef
    record: LineageRecord
    record_uri: str

    @property
    def night(self) -> Night | None:
        return night_of(self.ref)


def _key(uri: str) -> str:
    """A committed folder is matched by the folder, not by its manifest."""
    uri = normalize_uri(uri)
    return posixpath.dirname(uri) if posixpath.basename(uri) == MANIFEST else uri


def _inside(uri: str, folder: str) -> bool:
    return uri.startswith(folder.rstrip("/") + "/")


class LineageIndex:
    """Every recorded output by key; the latest record wins when several produced the same output."""

    def __init__(self, produced: Iterable[_Produced]) -> None:
        self.by_key: dict[str, _Produced] = {}
        for item in produced:
            current = self.by_key.get(item.key)
            if current is None or item.record.ended_at > current.record.ended_at:
                self.by_key[item.key] = item

    @classmethod
    def from_records(cls, records: Iterable[tuple[str, LineageRecord]]) -> LineageIndex:
        """Index (record URI, record) pairs. An output that is also an input was annotated, not produced."""
        produced = []
        for record_uri, record in records:
            inputs = {ref_uri(r) for r in record.inputs}
            for ref in record.outputs:
                uri = ref_uri(ref)
                if uri not in inputs:
                    produced.append(_Produced(_key(uri), ref, record, record_uri))
        return cls(produced)

    @classmethod
    def load(cls) -> LineageIndex:
        """Read every stage's records under ``<storage>/lineage/`` (OpenLineage events excluded)."""
        objects = [
            o
            for o in storage.list_objects(lineage.lineage_dir())
            if o.key.endswith(".json") and not o.key.startswith(f"{layout.OPENLINEAGE_DIR}/")
        ]
        fetched = fetching.fetch_many([o.uri for o in objects], _RECORD_READS)
        records = []
        for obj, item in zip(objects, fetched, strict=True):
            if item.error is not None or item.data is None:
                raise InputDataError(f"reading lineage record {obj.uri}: {item.error}") from item.error
            records.append((obj.uri, LineageRecord.model_validate(json.loads(item.data))))
        return cls.from_records(records)

    def producers(self, uri: str) -> list[_Produced]:
        """The record outputs ``uri`` names: the closest output containing it, else the outputs inside it."""
        key = _key(uri)
        containing = [p for k, p in self.by_key.items() if k == key or _inside(key, k)]
        if containing:
            return [max(containing, key=lambda p: len(p.key))]
        return sorted((p for k, p in self.by_key.items() if _inside(k, key)), key=lambda p: p.key)


def _model_version_root(uri: str) -> str | None:
    if not is_storage_uri(uri):
        return None
    match = _MODEL_VERSION.match(storage.normalize(uri))
    if match and storage.exists(storage.join(match.group(1), layout.VERSION_FILE)):
        return match.group(1)
    return None


def _is_uri(value: str | None) -> TypeGuard[str]:
    """Version fields may hold placeholders ("-") where nothing upstream is known."""
    return bool(value) and (storage.is_remote(str(value)) or str(value).startswith(("/", "file://")))


def _version(version_root: str) -> registry.ModelVersion:
    return registry.ModelVersion.model_validate(storage.read_json(storage.join(version_root, layout.VERSION_FILE)))


def _most_specific(refs: list[DatasetRef]) -> list[DatasetRef]:
    """Drop repeats and any URI that is a folder of another (a training run and its checkpoint)."""
    unique = {ref_uri(r): r for r in reversed(refs)}
    return [r for u, r in reversed(unique.items()) if not any(_inside(other, u) for other in unique)]


def _record_details(item: _Produced) -> dict[str, Any]:
    run = item.record.run
    details = {
        "record_id": item.record.record_id,
        "code_version": item.record.code_version,
        "flow": run.flow_name,
        "flow_run_id": run.flow_run_id,
        "task_run_id": run.task_run_id,
        "ray_job_id": run.ray_job_id,
        "cached": item.record.cached or None,
    }
    return {k: v for k, v in details.items() if v is not None}


class _Builder:
    def __init__(self, index: LineageIndex, max_objects: int | None) -> None:
        self.index = index
        self.max_objects = max_objects
        self.expanded: set[str] = set()

    def node(self, ref: DatasetRef, ancestors: frozenset[str] = frozenset()) -> LineageNode:
        uri = ref_uri(ref)
        version_root = _model_version_root(uri)
        producers = [] if version_root else self.index.producers(uri)
        key = version_root or (producers[0].key if len(producers) == 1 else _key(uri))
        node = self._shell(ref, version_root, producers)
        if key in ancestors:
            return node.model_copy(update={"cycle": True})
        if key in self.expanded:
            return node.model_copy(update={"repeated": True})
        self.expanded.add(key)
        inner = ancestors | {key}
        if version_root:
            node.upstream = [self._weights_source(self.node(r, inner), node) for r in self._model_inputs(version_root)]
        elif len(producers) == 1:
            node.upstream = self._record_inputs(producers[0], inner)
        else:
            node.upstream = [self.node(p.ref, inner) for p in producers]
        return node

    def _shell(self, ref: DatasetRef, version_root: str | None, producers: list[_Produced]) -> LineageNode:
        """The node without its upstream."""
        if version_root:
            version = _version(version_root)
            made = self.index.by_key.get(version_root)
            return LineageNode(
                uri=version_root,
                kind="model version",
                stage=made.record.stage if made else None,
                record_uri=made.record_uri if made else None,
                produced_at=version.registered_at,
                details=version.model_dump(include=_VERSION_DETAILS),
            )
        if len(producers) == 1:
            item = producers[0]
            night = item.night
            kind = STAGE_KINDS.get(item.record.stage, item.record.stage)
            if night is not None:
                kind = night_kind(item.ref.uri)
            return LineageNode(
                uri=item.ref.uri if night is None else item.key,
                kind=kind,
                stage=item.record.stage,
                record_uri=item.record_uri,
                produced_at=item.record.ended_at,
                content_hash=item.ref.content_hash,
                etag=item.ref.etag,
                details={**(night_details(item.ref, night) if night else {}), **_record_details(item)},
            )
        kind = "folder" if producers else "external input"
        return LineageNode(uri=ref_uri(ref), kind=kind, content_hash=ref.content_hash, etag=ref.etag)

    def nights(self, table: str, dt: str, nights: list[str]) -> LineageNode:
        """A folder node of a day's nights (their partition folders) in ``table``, each expanded upstream."""
        upstream = [self.node(DatasetRef(uri=night)) for night in nights]
        return LineageNode(uri=normalize_uri(table), kind="folder", details={"dt": dt}, upstream=upstream)

    def _model_inputs(self, version_root: str) -> list[DatasetRef]:
        """What the registry record read, and the training run and data (or outside weights) version.json names:
        the version is the truth, as its registration's lineage record may be missing (written by hand, say)."""
        version = _version(version_root)
        made = self.index.by_key.get(version_root)
        refs = list(made.record.inputs) if made else []
        refs += [DatasetRef(uri=u) for u in (version.training_run_uri, version.data_manifest_uri) if _is_uri(u)]
        source = version.weights_source
        if source:  # last: the registry record's own ref of the same URI, if any, is the one kept
            refs.append(DatasetRef(uri=source.uri, content_hash=source.sha256))
        return _most_specific(refs)

    @staticmethod
    def _weights_source(child: LineageNode, model: LineageNode) -> LineageNode:
        """Mark the node of an outside model's weights as such, pinned by the sha256 the registry checked."""
        source = model.details.get("weights_source")
        if not source or normalize_uri(child.uri) != normalize_uri(str(source["uri"])) or child.stage is not None:
            return child
        return child.model_copy(
            update={
                "kind": "outside weights",
                "content_hash": source["sha256"],
                "details": {**child.details, "sha256": source["sha256"], "size_bytes": source["size_bytes"]},
            }
        )

    def _record_inputs(self, item: _Produced, ancestors: frozenset[str]) -> list[LineageNode]:
        nodes = [self.node(ref, ancestors) for ref in _most_specific(list(item.record.inputs))]
        if item.record.stage == "ingest":
            for node in nodes:
                if node.kind == "external input" and not node.upstream:
                    node.upstream, node.omitted = self._raw_objects(item.ref.uri)
                    node.kind = "raw objects"
        return nodes

    def _raw_objects(self, manifest_uri: str) -> tuple[list[LineageNode], int]:
        """The objects an ingest read, each pinned to its etag by the shard rows."""
        shards = [s.uri for s in manifests.read(manifest_uri, IngestManifest).shards]
        table = storage.read_parquet(shards, columns=["uri", "etag"])
        # by URI: shards follow the listing's order, which on local disk is each folder's own
        rows = sorted(table.to_pylist(), key=lambda row: str(row["uri"])) if table.num_rows else []
        shown = rows if self.max_objects is None else rows[: self.max_objects]
        nodes = [LineageNode(uri=r["uri"], kind="raw object", etag=r["etag"]) for r in shown]
        return nodes, len(rows) - len(shown)


def build_graph(
    uri: str,
    max_objects: int | None = None,
    index: LineageIndex | None = None,
    *,
    dt: str | None = None,
    model_name: str | None = None,
) -> LineageNode:
    """The upstream graph of ``uri`` as a tree; a relative path is tried against the storage root too.

    With ``dt`` (YYYY-MM-DD), ``uri`` is a night table and the graph is that day's night of ``model_name``, or without
    it a folder node holding every model's night of that day. ``max_objects`` limits the raw objects listed per ingest
    (None: all). Raises :class:`NoLineageError` when nothing recorded produced ``uri`` (or a night of ``dt``).
    """
    if model_name is not None and dt is None:
        raise ConfigError(f"model {model_name!r} picks a night: give the night's date (dt) too")
    index = index or LineageIndex.load()
    candidates = [uri]
    if not storage.is_remote(uri) and not uri.startswith(("/", "file://", "~")):
        candidates.append(storage.join(storage.storage_root(), uri))
    if dt is not None:
        day = parse_day(dt, "dt").isoformat()
        table, nights = pick_nights(candidates, [p.ref for p in index.by_key.values()], day, model_name)
        builder = _Builder(index, max_objects)
        if model_name is not None:
            return builder.node(DatasetRef(uri=nights[0]))
        return builder.nights(table, day, nights)
    for candidate in candidates:
        if _model_version_root(candidate) or index.producers(candidate):
            return _Builder(index, max_objects).node(DatasetRef(uri=candidate))
    raise NoLineageError(
        f"no lineage for {uri}: no record under {lineage.lineage_dir()} names it (or a folder of it) as an output"
    )


def _label(node: LineageNode) -> str:
    facts = []
    if node.details.get("delta_version") is not None:  # first: what a reader time-travels to
        facts.append(f"Delta version {node.details['delta_version']}, run {node.details.get('run_id')}")
    if node.kind == "folder" and node.details.get("dt"):
        facts.append(f"nights of {node.details['dt']}")
    if node.details.get("name") and node.kind == "model version":
        facts.append(f"{node.details['name']} v{node.details['version']}")
    if node.stage:
        facts.append(f"{node.stage} run")
    if node.produced_at:
        facts.append(node.produced_at.strftime("%Y-%m-%d %H:%M:%SZ"))
    if node.details.get("flow"):
        facts.append(f"flow {node.details['flow']} {str(node.details.get('flow_run_id', ''))[:8]}".rstrip())
    if node.kind == "outside weights" and node.details.get("sha256"):
        facts.append(f"sha256 {node.details['sha256']}")  # in full: it is what a download is checked against
    elif node.content_hash:
        facts.append(f"content {node.content_hash[:12]}")
    if node.etag:
        facts.append(f"etag {node.etag}")
    if node.repeated:
        facts.append("shown above")
    if node.cycle:
        facts.append("cycle: its own ancestor")
    return f"{node.kind}  {node.uri}" + (f"  ({', '.join(facts)})" if facts else "")


def render_text(node: LineageNode) -> str:
    """An indented tree, one line per dataset, root first."""
    lines = [_label(node)]
    _render_children(node, "", lines)
    return "\n".join(lines)


def _render_children(node: LineageNode, prefix: str, lines: list[str]) -> None:
    entries: list[LineageNode | str] = [*node.upstream]
    if node.omitted:
        entries.append(f"… {node.omitted} more")
    for i, entry in enumerate(entries):
        last = i == len(entries) - 1
        branch, indent = ("└── ", "    ") if last else ("├── ", "│   ")
        lines.append(prefix + branch + (entry if isinstance(entry, str) else _label(entry)))
        if isinstance(entry, LineageNode):
            _render_children(entry, prefix + indent, lines)
