"""Manifests: the commit point of a stage's output folder, as typed models.

A stage that fills a folder (ingest, preprocess, the export of labelled photos) writes its files first and
``manifest.json`` last. The manifest names every file the run wrote, so a reader trusts a folder only when
its manifest is there: a run that died half way left files nobody reads, and the next run clears them.

Each kind of manifest is a model here, so writers and readers agree on one shape instead of on string keys.
Fields added since the first layout have defaults, so folders committed long ago read as they are.
:func:`commit` is the only writer, and only while the run still holds the folder's lease
(:func:`rayline.storage.folders.fill_once`); :func:`read` is the one reader, and a manifest that does not
validate is an :class:`InputDataError` naming the file and the fields.

Generations: every run writes its files in a generation of its own, ``<folder>/gen-<fence>-<id>/``
(``fence``: the fencing token of the run's lease, higher for every later holder), and its manifest replaces
the one the run read in one compare-and-swap: the switch. A run paused past its lease's ttl finds the
manifest changed by the run that took over, and commits nothing. The switch keeps the old generation
(:mod:`rayline.storage.folders` removes it at the next commit), so a reader already inside it finishes it.
Folders committed before generations have ``generation`` None: their files are in the folder itself.
"""

from __future__ import annotations

import json
import posixpath
import re
import uuid
from typing import ClassVar, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError

from rayline import storage
from rayline.errors import InputDataError, LeaseLost
from rayline.specs import ImageSpec, SplitFractions
from rayline.storage import conditional, leases

MANIFEST = "manifest.json"
# ``gen-<id>``: no ``key=value`` (Ray Data would read it back as a partition) and no leading ``_`` (hidden)
GENERATION_PREFIX = "gen-"
# ``<fence>-<id>``; generations written before fences have only ``<id>`` (fence 0)
_FENCED = re.compile(r"^(\d+)-[0-9a-f]+$")


class Manifest(BaseModel):
    """What every manifest has: its kind (checked on reading) and the version of its layout."""

    WHAT: ClassVar[str] = "a manifest"  # in messages: "<uri> is not an ingest manifest"

    kind: str
    version: int = 1  # no layout has changed since the first: fields were only added, with defaults
    generation: str | None = Field(
        None, description="Where the files are: None, the folder itself; else its gen-<generation>/ subfolder."
    )


class ShardInfo(BaseModel):
    """One Parquet shard an ingest wrote: one row per listed object, bytes or an error."""

    uri: str
    rows: int
    bytes: int
    fetch_errors: int


class IngestManifest(Manifest):
    """An ingest folder: where the objects came from, their identity, and the shards holding them."""

    WHAT: ClassVar[str] = "an ingest manifest"

    kind: Literal["rayline.ingest"] = "rayline.ingest"
    source_uri: str
    content_hash: str = Field(description="The listing's content hash (rayline.storage.listing): the input's identity.")
    # 1 (manifests without the field): the sha256 of the sorted (key, etag) listing; 2: of its set digest
    listing_version: int = Field(1, description="The form of content_hash (rayline.storage.listing.LISTING_VERSION).")
    object_count: int
    total_bytes: int
    fetch_errors: int
    labels: dict[str, int]
    shards: list[ShardInfo]
    # manifests written before skips were counted, or before leases, have none of these
    skipped: dict[str, int] = Field(default_factory=dict)
    skipped_examples: dict[str, list[str]] = Field(default_factory=dict)
    committed_by: str | None = Field(None, description="The lease holder (a flow run) whose run committed it.")


class PreprocessParameters(BaseModel):
    """How the images were decoded and split: with the input, what names the folder."""

    image: ImageSpec
    splits: SplitFractions


class PreprocessCounts(BaseModel):
    """Counts per split and class, and the errors: a preprocess summary without its files (``summary.json``)."""

    classes: list[str]
    counts: dict[str, int]
    class_counts: dict[str, dict[str, int]]
    error_count: int
    error_types: dict[str, int]


class PreprocessSummary(PreprocessCounts):
    """The counts, and every file the run wrote by split (and ``errors``): what the manifest commits."""

    files: dict[str, list[str]]


class PreprocessManifest(Manifest):
    """A preprocessed folder: the ingest it decoded, with which parameters, and what came out."""

    WHAT: ClassVar[str] = "a preprocess manifest"

    kind: Literal["rayline.preprocess"] = "rayline.preprocess"
    input_manifest_uri: str
    input_content_hash: str
    output_uri: str
    parameters: PreprocessParameters
    summary: PreprocessSummary


class LabelledCopy(BaseModel):
    """One labelled photo as an export copied it: the photo, the version that was labelled, its class."""

    uri: str
    etag: str
    label: str


class LabelledExportManifest(Manifest):
    """A model's labelled photos as training input: the labels table version exported and each copy's photo
    (``copies`` names every file of the generation, ``<class>/<file>``: a photo is under one class)."""

    WHAT: ClassVar[str] = "a labelled-photos export manifest"

    kind: Literal["rayline.labelled-export"] = "rayline.labelled-export"
    model_name: str
    labels_version: int | None = Field(description="The labels table version exported (None: no labels yet).")
    import_ids: list[str] = Field(description="The labels imports that version holds for the model.")
    copies: dict[str, LabelledCopy] = Field(description="Copy name (<class>/<file>) → the photo it is a copy of.")
    changed: int = Field(0, description="Labelled photos left out: replaced (another version) or gone since.")
    committed_by: str | None = Field(None, description="The lease holder (a flow run) whose run committed it.")


Kind = TypeVar("Kind", bound=Manifest)


def manifest_uri(folder: str) -> str:
    """Where ``folder``'s manifest is (or will be)."""
    return storage.join(folder, MANIFEST)


def generation_folder(folder: str, generation: str | None) -> str:
    """Where the files of ``folder``'s generation ``generation`` are (None: the folder itself)."""
    return folder if generation is None else storage.join(folder, f"{GENERATION_PREFIX}{generation}")


def files_folder(manifest_uri: str, manifest: Manifest) -> str:
    """Where the files of the generation a read manifest commits are: what every reader resolves them by."""
    return generation_folder(posixpath.dirname(manifest_uri), manifest.generation)


def new_generation(fence: int) -> str:
    """A fresh generation for a run holding its folder's lease with fencing token ``fence``."""
    return f"{fence}-{uuid.uuid4().hex[:12]}"


def generation_of(name: str) -> str | None:
    """The generation whose folder is ``name`` (directly under a folder), or None when it is none's."""
    return name[len(GENERATION_PREFIX) :] if name.startswith(GENERATION_PREFIX) else None


def generation_fence(generation: str) -> int:
    """The fencing token of the lease holding that wrote ``generation`` (0: written before fences)."""
    fenced = _FENCED.match(generation)
    return int(fenced.group(1)) if fenced else 0


def belongs_to(name: str, generation: str | None) -> bool:
    """Whether ``name``, directly under a folder, is its manifest or a file of its generation ``generation``."""
    if name == MANIFEST:
        return True
    if generation is None:
        return not name.startswith(GENERATION_PREFIX)
    return name == f"{GENERATION_PREFIX}{generation}"


def read(uri: str, kind: type[Kind]) -> Kind:
    """The manifest at ``uri`` as ``kind``; :class:`InputDataError` if it is another kind or malformed."""
    return _parsed(uri, storage.read_json(uri), kind)


def _parsed(uri: str, raw: object, kind: type[Kind]) -> Kind:
    # the kind first: a manifest of another stage would otherwise fail on a list of its missing fields
    if not isinstance(raw, dict) or raw.get("kind") != kind.model_fields["kind"].default:
        raise InputDataError(f"{uri} is not {kind.WHAT}")
    try:
        return kind.model_validate(raw)
    except ValidationError as exc:
        raise InputDataError(f"{uri} is {kind.WHAT} with bad fields: {_fields(exc)}") from exc


def read_committed(folder: str, kind: type[Kind]) -> Kind | None:
    """``folder``'s manifest, or None while it is uncommitted (no manifest yet, or leftovers of a dead run)."""
    uri = manifest_uri(folder)
    return read(uri, kind) if storage.exists(uri) else None


def read_for_switch(folder: str, kind: type[Kind], *, malformed_ok: bool) -> tuple[Kind | None, str | None]:
    """``folder``'s manifest and its token, read by a run holding the lease: its commit replaces exactly this.
    ``malformed_ok``: a manifest that does not validate reads as None (a forced run rewrites it); else
    :class:`InputDataError`. The token is returned either way: the commit must still replace that object."""
    uri = manifest_uri(folder)
    found = conditional.read_versioned(uri)
    if found is None:
        return None, None
    try:
        try:
            raw = json.loads(found.data)
        except ValueError as exc:
            raise InputDataError(f"{uri} is not valid JSON: {exc}") from exc
        return _parsed(uri, raw, kind), found.token
    except InputDataError:
        if not malformed_ok:
            raise
        return None, found.token


def commit(folder: str, manifest: Manifest, lease: leases.HeldLease, replaces: str | None) -> str:
    """Write ``folder``'s manifest after its files: the commit point. Returns the manifest's URI.

    A compare-and-swap on the manifest this run read (``replaces``, its token; None: there was none), made
    only while this run still holds the folder's lease. A run paused past its lease's expiry finds the
    manifest the run that took over committed, and raises ``LeaseLost``: its files may have been cleared
    meanwhile, and a manifest naming them would be reused forever after.
    """
    lease.ensure_held()
    uri = manifest_uri(folder)
    data = json.dumps(manifest.model_dump(mode="json"), indent=2, sort_keys=True).encode() + b"\n"
    if replaces is None:
        written = conditional.create_exclusive(uri, data)
    else:
        written = conditional.replace_if_match(uri, data, replaces)
    if written is None:
        raise LeaseLost(
            f"{lease.lease.holder} did not commit {folder}: another run committed it after this run read it "
            "(this run was paused past its lease's ttl, and the lease was taken over); nothing committed"
        )
    return uri


def _fields(exc: ValidationError) -> str:
    """Each failing field by its path in the JSON (``shards.0.rows``) and what is wrong with it."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors())
