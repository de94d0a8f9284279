"""Ingests from before the listing's content hash changed form, recognised so that their shards are reused.

Until ``rayline-listing-v2`` an ingest folder was named by the sha256 of the
sorted (key, ETag) listing, a hash that needs the whole listing in one
process. The hash is now of the listing's set digest
(:mod:`rayline.storage.listing`), so an unchanged input gets a new folder name. Rather
than fetch every object again, :func:`legacy_ingest` finds an older ingest of
the same source in the ingest stage's lineage records whose shards hold
exactly the listed (key, ETag) pairs, and :func:`migrated` commits its
manifest again under the new name, naming the same shards.
"""

from __future__ import annotations

import logging

from rayline import lineage, storage
from rayline.errors import InputDataError, StorageError
from rayline.storage import leases, manifests
from rayline.storage.digests import SetDigest
from rayline.storage.listing import LISTING_VERSION, StreamedListing, content_digest
from rayline.storage.manifests import IngestManifest

log = logging.getLogger(__name__)


def legacy_ingest(source: str, listing: StreamedListing) -> tuple[str, IngestManifest] | None:
    """An ingest of ``source`` from before the listing's hash changed form, holding exactly these objects.

    Its folder is named by the old hash (of the sorted listing), so the new
    one does not find it. The ingest stage's lineage records name it; it is
    the same input when its shards hold the same (key, etag) pairs, checked
    by their set digest one shard at a time.
    """
    records = [r for r in lineage.read_records("ingest") if r.inputs and r.inputs[0].uri == source and r.outputs]
    for record in sorted(records, key=lambda r: r.ended_at, reverse=True):
        uri = record.outputs[0].uri
        try:
            manifest = manifests.read(uri, IngestManifest)
        except (InputDataError, StorageError):
            continue  # removed since, or not an ingest manifest
        if manifest.listing_version >= LISTING_VERSION or manifest.object_count != listing.count:
            continue
        contents = SetDigest()
        for shard in manifest.shards:
            table = storage.read_parquet([shard.uri], columns=["key", "etag"])
            keys, etags = table.column("key").to_pylist(), table.column("etag").to_pylist()
            contents = contents + SetDigest.of(content_digest(k, e) for k, e in zip(keys, etags, strict=True))
        if contents == listing.contents:
            return uri, manifest
    return None


def migrated(earlier: tuple[str, IngestManifest], listing: StreamedListing, lease: leases.HeldLease) -> IngestManifest:
    """The manifest of an ingest recognised from before (:func:`legacy_ingest`), under the new hash: same shards."""
    uri, manifest = earlier
    log.info("recognised %s as an ingest of the same objects from before the listing hash changed: reused", uri)
    return manifest.model_copy(
        update={
            "content_hash": listing.content_hash,
            "listing_version": LISTING_VERSION,
            "skipped": listing.skipped,
            "skipped_examples": listing.skipped_examples,
            "committed_by": lease.lease.holder,
        }
    )
