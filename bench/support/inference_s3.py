"""The S3 side of the batch-inference bench: images on a loopback moto server, and that server's ceiling."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BUCKET = "rayline-bench-inference"


@contextlib.contextmanager
def loopback_s3(env: dict[str, str], bucket: str) -> Iterator[tuple[str, int]]:
    """A moto server holding ``bucket``, its credentials set here and in the children's ``env``; yields its
    endpoint and PID."""
    from rayline.testing.s3_server import S3_ENV, create_bucket, s3_server

    os.environ.update(S3_ENV)
    env.update(S3_ENV)
    server: list[int] = []
    with s3_server(server) as endpoint:
        create_bucket(endpoint, bucket)
        yield endpoint, server[0]


def upload(endpoint: str, bucket: str, prefix: str, files: list[Path], root: Path) -> str:
    """``files`` under ``prefix`` at their paths below ``root``, 16 PUTs at a time; the prefix's URI."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")

    def put(source: Path) -> None:
        client.put_object(Bucket=bucket, Key=f"{prefix}/{source.relative_to(root)}", Body=source.read_bytes())

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, files))
    return f"s3://{bucket}/{prefix}"


def server_ceiling(endpoint: str, uri: str, server_pid: int) -> tuple[float, float]:
    """GET/s of the S3 server under 32 concurrent GETs (no decoding), and its CPU milliseconds per GET."""
    import boto3
    from botocore.config import Config

    from rayline.testing.s3_server import process_cpu_seconds

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", config=Config(max_pool_connections=32))
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    keys = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
        for o in page.get("Contents", [])
    ]
    cpu_before, began = process_cpu_seconds(server_pid), time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda k: client.get_object(Bucket=bucket, Key=k)["Body"].read(), keys))
    seconds = time.perf_counter() - began
    return len(keys) / seconds, (process_cpu_seconds(server_pid) - cpu_before) * 1000 / len(keys)
