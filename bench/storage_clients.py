"""Object-store clients compared on a loopback S3-protocol server: today's path, fsspec's family, obstore.

The candidates for rayline's one storage seam, each doing what a night and an ingest do on one moto server:
**today** (boto3's pages, threads and conditional puts), **fsspec** (the seam, ``rayline.storage.backends.s3``:
s3fs's aiobotocore client, one event loop for every thread) and **obstore** (Apache Arrow's ``object_store``).
Each part is the best of ``--repeats`` with the server's and this process's CPU; moto is the ceiling of every
figure, so a ratio says which client asks the least of a server and of the node, not what real S3 would
give. The parts and the JSON keys: bench/README.md. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rayline.testing.s3_server import S3_ENV, create_bucket, process_cpu_seconds, s3_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.support, run as a script

from bench.support.results import emit  # noqa: E402

BUCKET = "rayline-clients"
GET_COUNT, GET_BYTES, IN_FLIGHT, CONDITIONAL = 1000, 64 * 1024, 64, 200
SHARDS, SHARD_ROWS = 20, 2000  # rows of 4 KiB: about 8 MB a shard, like a night's ingested shards


def _timed(name: str, run: Callable[[], int], server_pid: int, repeats: int) -> dict[str, float]:
    """Best wall time of ``repeats`` runs of ``run`` (which returns how many items it handled), with CPU shares."""
    best: dict[str, float] = {}
    for _ in range(repeats):
        server_cpu, own_cpu, started = process_cpu_seconds(server_pid), time.process_time(), time.perf_counter()
        count = run()
        elapsed = time.perf_counter() - started
        figures = {
            "seconds": round(elapsed, 3),
            "items": count,
            "server_cpu_s": round(process_cpu_seconds(server_pid) - server_cpu, 2),
            "client_cpu_s": round(time.process_time() - own_cpu, 2),
        }
        print(
            f"  {name}: {count} in {elapsed:.2f} s (server CPU {figures['server_cpu_s']} s, "
            f"client CPU {figures['client_cpu_s']} s)"
        )
        if not best or figures["seconds"] < best["seconds"]:
            best = figures
    return best


def _boto3(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    config = Config(max_pool_connections=IN_FLIGHT, retries={"mode": "standard", "total_max_attempts": 3})
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", config=config)


def _seam(endpoint: str) -> Any:
    """rayline's own S3 backend (s3fs's aiobotocore client) with its default policy: what the stages use."""
    from rayline.storage.backends.base import StoragePolicy
    from rayline.storage.backends.s3 import S3Store

    return S3Store(endpoint, "us-east-1", StoragePolicy(max_attempts=3, timeout_s=60, connect_timeout_s=10))


def _obstore(endpoint: str) -> Any:
    from obstore.store import S3Store

    return S3Store(
        BUCKET,
        endpoint=endpoint,
        region="us-east-1",
        access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
        secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
        client_options={"allow_http": True, "pool_max_idle_per_host": str(IN_FLIGHT)},
        conditional_put="etag",
    )


def _populate(endpoint: str, keys: int) -> None:
    """``keys`` tiny objects under ``many/`` and ``GET_COUNT`` 64 KiB ones under ``big/`` (obstore writes them)."""
    import obstore as obs

    store = _obstore(endpoint)
    payload = os.urandom(GET_BYTES)

    async def put_all() -> None:
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def put(path: str, data: bytes) -> None:
            async with gate:
                await obs.put_async(store, path, data)

        await asyncio.gather(*(put(f"many/{i // 1000:03d}/{i:06d}.jpg", b"x") for i in range(keys)))
        await asyncio.gather(*(put(f"big/{i:04d}.jpg", payload) for i in range(GET_COUNT)))

    started = time.perf_counter()
    asyncio.run(put_all())
    for i in range(SHARDS):
        obs.put(store, f"shards/{i:03d}.parquet", _shard())
    print(f"populated {keys:,} keys and {GET_COUNT} x 64 KiB objects in {time.perf_counter() - started:.0f} s")


def _shard() -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pa.table(
        {"uri": [f"s3://b/{i}.jpg" for i in range(SHARD_ROWS)], "data": [os.urandom(4096) for _ in range(SHARD_ROWS)]}
    )
    buffer = io.BytesIO()
    pq.write_table(rows, buffer, compression="none", use_dictionary=False)
    return buffer.getvalue()


def _read_parts(endpoint: str) -> dict[str, Callable[[], int]]:
    """Each pyarrow filesystem reading every shard whole, one after another (``storage.read_parquet``'s way)."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq
    from obstore.fsspec import FsspecStore

    paths = [f"{BUCKET}/shards/{i:03d}.parquet" for i in range(SHARDS)]
    default = pafs.S3FileSystem(endpoint_override=endpoint, region="us-east-1", scheme="http")
    wrapped_s3fs = pafs.PyFileSystem(pafs.FSSpecHandler(_seam(endpoint).filesystem()))
    obstore_fs = FsspecStore("s3", endpoint=endpoint, region="us-east-1", client_options={"allow_http": True})

    def reading(fs: pafs.FileSystem) -> Callable[[], int]:
        return lambda: sum(pq.read_table(path, filesystem=fs).num_rows == SHARD_ROWS for path in paths)

    return {
        "today (pyarrow S3FileSystem)": reading(default),
        "fsspec (rayline's S3Store readers: pyarrow's client, the policy)": reading(_seam(endpoint).arrow_filesystem()),
        "s3fs (wrapped for pyarrow, as GCS's and Azure's readers are)": reading(wrapped_s3fs),
        "obstore (its fsspec adapter, wrapped)": reading(pafs.PyFileSystem(pafs.FSSpecHandler(obstore_fs))),
    }


def _list_parts(endpoint: str) -> dict[str, Callable[[], int]]:
    import obstore as obs

    client, fs, store = _boto3(endpoint), _seam(endpoint), _obstore(endpoint)

    def boto3_pages() -> int:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="many/")
        return sum(len(page.get("Contents", [])) for page in pages)

    def seam_pages() -> int:
        return sum(len(page.objects) for page in fs.list_pages(f"s3://{BUCKET}/many"))

    def obstore_arrow() -> int:
        return sum(batch.num_rows for batch in obs.list(store, "many/", chunk_size=1000, return_arrow=True))

    return {
        "today (boto3 pages)": boto3_pages,
        "fsspec (rayline's S3Store pages)": seam_pages,
        "obstore (Arrow batches)": obstore_arrow,
    }


def _get_parts(endpoint: str) -> dict[str, Callable[[], int]]:
    import obstore as obs

    client, fs, store = _boto3(endpoint), _seam(endpoint), _obstore(endpoint)
    keys = [f"big/{i:04d}.jpg" for i in range(GET_COUNT)]

    def threads(get: Callable[[str], int]) -> Callable[[], int]:
        def run() -> int:
            with ThreadPoolExecutor(IN_FLIGHT) as pool:
                return sum(1 for size in pool.map(get, keys) if size == GET_BYTES)

        return run

    def boto3_get(key: str) -> int:
        return len(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())

    def seam_get(key: str) -> int:
        # the stages' pattern: a pool of threads, each request on the store's one event loop and session
        found = fs.get(f"s3://{BUCKET}/{key}")
        return len(found.data) if found is not None else 0

    def obstore_gather() -> int:
        async def get_all() -> list[int]:
            gate = asyncio.Semaphore(IN_FLIGHT)

            async def get(key: str) -> int:
                async with gate:
                    result = await obs.get_async(store, key)
                    return len(await result.bytes_async())

            return await asyncio.gather(*(get(key) for key in keys))

        return sum(1 for size in asyncio.run(get_all()) if size == GET_BYTES)

    return {
        "today (boto3, 64 threads)": threads(boto3_get),
        "fsspec (rayline's S3Store)": threads(seam_get),
        "obstore (get_async)": obstore_gather,
    }


def _conditional_parts(endpoint: str) -> dict[str, Callable[[], int]]:
    import obstore as obs

    client, fs, store = _boto3(endpoint), _seam(endpoint), _obstore(endpoint)
    run_id = iter(range(1_000_000))

    def boto3_cas() -> int:
        n = next(run_id)
        for i in range(CONDITIONAL):
            key = f"cas/boto3-{n}-{i}.json"
            created = client.put_object(Bucket=BUCKET, Key=key, Body=b"1", IfNoneMatch="*")
            client.put_object(Bucket=BUCKET, Key=key, Body=b"2", IfMatch=created["ETag"])
        return CONDITIONAL

    def seam_cas() -> int:
        n = next(run_id)
        for i in range(CONDITIONAL):
            uri = f"s3://{BUCKET}/cas/seam-{n}-{i}.json"
            created = fs.put_if_absent(uri, b"1")
            assert created is not None and fs.put_if_match(uri, b"2", created) is not None
        return CONDITIONAL

    def obstore_cas() -> int:
        n = next(run_id)
        for i in range(CONDITIONAL):
            path = f"cas/obstore-{n}-{i}.json"
            created = obs.put(store, path, b"1", mode="create")
            obs.put(store, path, b"2", mode={"e_tag": created["e_tag"]})
        return CONDITIONAL

    return {"today (boto3)": boto3_cas, "fsspec (rayline's S3Store)": seam_cas, "obstore (put mode)": obstore_cas}


# Keys S3 stores as objects of their own (and users' uploaders write): empty and dot segments, a trailing slash
ODD_KEYS = ("odd/a//b.jpg", "odd//x.jpg", "odd/a/b//", "odd/a/../c.jpg", "odd/./d.jpg", "odd/sp ace.jpg", "odd/%41.jpg")


def _odd_keys(endpoint: str) -> dict[str, str]:
    """Whether each client lists the odd keys exactly and reads each back: 'all', or what failed."""
    import obstore as obs

    client, fs, store = _boto3(endpoint), _seam(endpoint), _obstore(endpoint)
    for key in ODD_KEYS:
        client.put_object(Bucket=BUCKET, Key=key, Body=key.encode())

    def boto3_check() -> list[str]:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="odd/")
        listed = sorted(o["Key"] for page in pages for o in page.get("Contents", []))
        read = [k for k in ODD_KEYS if client.get_object(Bucket=BUCKET, Key=k)["Body"].read() == k.encode()]
        return listed + read

    def seam_check() -> list[str]:
        listed = sorted("odd/" + stat.key for page in fs.list_pages(f"s3://{BUCKET}/odd") for stat in page.objects)
        found = (fs.get(f"s3://{BUCKET}/{k}") for k in ODD_KEYS)
        return listed + [k for k, f in zip(ODD_KEYS, found, strict=True) if f is not None and f.data == k.encode()]

    def obstore_check() -> list[str]:
        listed = sorted(m["path"] for batch in obs.list(store, "odd/") for m in batch)
        return listed + [k for k in ODD_KEYS if bytes(obs.get(store, k).bytes()) == k.encode()]

    expected = sorted(ODD_KEYS) + list(ODD_KEYS)
    verdicts = {}
    for name, check in (("today", boto3_check), ("fsspec", seam_check), ("obstore", obstore_check)):
        try:
            found = check()
            verdicts[name] = "all" if found == expected else f"mismatch: {found}"
        except Exception as exc:  # what the client raised is the finding
            verdicts[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        print(f"  odd keys, {name}: {verdicts[name]}")
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="5,000 keys, one repeat: a smoke test")
    args = parser.parse_args()
    keys, repeats = (5_000, 1) if args.quick else (args.keys, args.repeats)
    os.environ.update(S3_ENV)
    pids: list[int] = []
    results: dict[str, dict[str, dict[str, float]]] = {}
    with s3_server(pids) as endpoint:
        create_bucket(endpoint, BUCKET)
        _populate(endpoint, keys)
        for part, parts in (
            ("list", _list_parts),
            ("get", _get_parts),
            ("conditional", _conditional_parts),
            ("read", _read_parts),
        ):
            print(f"{part}:")
            results[part] = {name: _timed(name, run, pids[0], repeats) for name, run in parts(endpoint).items()}
        print("odd keys:")
        odd = _odd_keys(endpoint)
    summary: dict[str, Any] = {"keys": keys, "gets": GET_COUNT, "conditional_puts": CONDITIONAL, "shards": SHARDS}
    for part, figures in results.items():
        today = next(f for name, f in figures.items() if name.startswith("today"))
        for name, f in figures.items():
            family = name.split(" ")[0]
            if family == "today" and f is not today:
                continue
            summary[f"{part}_s_{family}"] = f["seconds"]
            summary[f"{part}_speedup_{family}"] = round(today["seconds"] / f["seconds"], 2)
            summary[f"{part}_client_cpu_s_{family}"] = f["client_cpu_s"]
            summary[f"{part}_server_cpu_s_{family}"] = f["server_cpu_s"]
    summary.update({f"odd_keys_{name}": verdict == "all" for name, verdict in odd.items()})
    emit("storage_clients", summary)


if __name__ == "__main__":
    main()
