"""Who asks the cloud's metadata address: run in a network namespace of its own, where 169.254.169.254 is on the
loopback and a recorder answers there, so that a request to it lands here instead of failing unseen.

``python -m tests.integration.metadata_watch`` (by ``test_no_metadata_requests``, inside ``unshare --net``):
prints one JSON line, the requests the recorder saw during each step. Two steps are controls, proving the
recorder sees what it must: delta-rs writing to the GCS emulator with the options it was given before rayline
refused it, and google-auth's own credential search. The others are rayline's own paths.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa

METADATA_IP = "169.254.169.254"
BUCKET = "rayline-watch"
seen: list[str] = []


class Recorder(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        seen.append(f"{self.command} {self.path}")
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        return


def requests_during(step: Callable[[], None]) -> list[str]:
    before = len(seen)
    try:
        step()
    except Exception as exc:  # each step's own outcome is not the point: what it asked on the way is
        print(f"# {step.__name__}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    return seen[before:]


def delta_rs_as_configured_before() -> None:
    from deltalake import write_deltalake

    endpoint = os.environ["STORAGE_EMULATOR_HOST"]
    options = {"google_base_url": endpoint, "google_skip_signature": "true", "allow_http": "true", "max_retries": "0"}
    write_deltalake(f"gs://{BUCKET}/control/t", pa.table({"a": [1]}), storage_options=options)


def rayline_on_the_emulator() -> None:
    from deltalake import DeltaTable

    from rayline import storage
    from rayline.errors import DeltaWritesUnsupported
    from rayline.tables import delta_probe, delta_tables

    root = f"gs://{BUCKET}/root"
    storage.write_bytes_atomic(storage.join(root, "incoming", "a.txt"), b"photo")
    assert storage.read_bytes(storage.join(root, "incoming", "a.txt")) == b"photo"
    table = storage.join(root, "predictions")
    DeltaTable.is_deltatable(table, storage.delta_options(table))
    for refused in (lambda: delta_probe.require_delta_writes(root),
                    lambda: delta_tables.open_or_create(table, pa.schema([("a", pa.int64())]), [])):  # fmt: skip
        try:
            refused()
        except DeltaWritesUnsupported:
            continue
        raise AssertionError("delta-rs was let write on the GCS emulator")


def google_auth_default() -> None:
    import google.auth

    google.auth.default()


def rayline_without_credentials() -> None:
    from rayline.errors import ConfigError
    from rayline.storage.backends import store_for

    try:
        store_for("gs://a-private-bucket/photos")
    except ConfigError:
        return
    raise AssertionError("gs:// storage was opened with no credentials")


def main() -> None:
    from rayline.testing.gcs_server import fake_gcs_server

    server = ThreadingHTTPServer((METADATA_IP, 80), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    found: dict[str, list[str]] = {}
    with fake_gcs_server([BUCKET]) as endpoint:
        os.environ["STORAGE_EMULATOR_HOST"] = endpoint
        found["control_delta_rs"] = requests_during(delta_rs_as_configured_before)
        found["rayline_on_the_emulator"] = requests_during(rayline_on_the_emulator)
    del os.environ["STORAGE_EMULATOR_HOST"]
    with tempfile.TemporaryDirectory() as no_gcloud:
        os.environ["CLOUDSDK_CONFIG"] = no_gcloud
        os.environ.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
        found["control_google_auth"] = requests_during(google_auth_default)
        found["rayline_without_credentials"] = requests_during(rayline_without_credentials)
    server.shutdown()
    print(json.dumps(found))


if __name__ == "__main__":
    main()
