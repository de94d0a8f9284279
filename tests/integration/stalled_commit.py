"""A forced folder commit in a process of its own, for the drill that stalls it before its manifest lands.

``python -m tests.integration.stalled_commit <folder> <tag> <ttl_s>``

Runs ``folders.fill_once`` over ``folder`` with force, holding the folder's
lease for ``ttl_s`` (renewed every ttl/3, as a stage holds it); its fill
writes two shards tagged ``tag``. The test points this process at a proxy
that holds its manifest PUT (sent after its last lease check), stops the
process (SIGSTOP) past the ttl while another run takes the lease and
commits, then lets the PUT go. Prints ``{"committed": <generation>}`` or
``{"refused": "<why>"}``.

Also the fill the tests of ``tests/integration/test_forced_generations.py`` use.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import pyarrow as pa

from rayline import storage
from rayline.errors import LeaseLost
from rayline.storage import folders, leases
from rayline.storage.manifests import IngestManifest, ShardInfo


def write_shards(files: str, tag: str, count: int = 2) -> list[ShardInfo]:
    shards = []
    for i in range(count):
        uri = storage.join(files, "shards", f"part-{i:05d}.parquet")
        size = storage.write_parquet_atomic(uri, pa.table({"tag": [tag] * 3}))
        shards.append(ShardInfo(uri=uri, rows=3, bytes=size, fetch_errors=0))
    return shards


def manifest_of(shards: list[ShardInfo], tag: str) -> IngestManifest:
    return IngestManifest(
        source_uri=f"s3://nowhere/{tag}",
        content_hash=tag,
        object_count=3 * len(shards),
        total_bytes=sum(s.bytes for s in shards),
        fetch_errors=0,
        labels={},
        shards=shards,
    )


def fill_with(tag: str, midway: Callable[[], None] | None = None) -> Callable[[leases.HeldLease, str], IngestManifest]:
    """A fill writing two shards tagged ``tag``, calling ``midway()`` between them."""

    def fill(lease: leases.HeldLease, files: str) -> IngestManifest:
        first = write_shards(files, tag, count=1)
        if midway is not None:
            midway()
        return manifest_of(first + write_shards(files, tag)[1:], tag)

    return fill


def main(folder: str, tag: str, ttl_s: float) -> None:
    cfg = folders.LeasedOutput(lease_wait_s=30, lease_ttl_s=ttl_s)
    try:
        done = folders.fill_once(
            folder, cfg, "a test folder", IngestManifest, reusable=lambda m: True, force=True, fill=fill_with(tag)
        )
    except LeaseLost as exc:
        print(json.dumps({"refused": str(exc)}), flush=True)
        return
    print(json.dumps({"committed": done.manifest.generation}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
