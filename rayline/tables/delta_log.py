"""Reading a Delta table's ``_delta_log`` directly, for what delta-rs answers only one key at a time.

delta-rs gives one app transaction by id (``DeltaTable.transaction_version``) and commit infos
newest first (``DeltaTable.history``), which reads every commit file it returns. Two questions
must not cost the table's whole history:

* every app transaction as of a version (:func:`app_transactions`): the newest checkpoint at or
  before it (Delta keeps every ``txn`` there) and the commit files after it, at most a
  checkpoint interval of them (100 by default);
* the commit info of one version (:func:`commit_info`): that one commit file.

Only the classic checkpoint layout delta-rs writes is read (one file, or numbered parts); for any
other (a v2 checkpoint) :func:`app_transactions` answers None and the caller falls back to the
history.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow.parquet as pq

from rayline import storage
from rayline.errors import StorageError, TransientStorageError, is_transient

LOG_DIR = "_delta_log"


def _log_uri(uri: str, name: str) -> str:
    return storage.join(storage.normalize(uri), LOG_DIR, name)


def _read_text(uri: str) -> str | None:
    """The file's text, None when it does not exist."""
    fs, path = storage.arrow_filesystem(uri)
    try:
        with fs.open_input_stream(path) as stream:
            return bytes(stream.read()).decode()
    except FileNotFoundError:
        return None
    except OSError as exc:
        message = f"read {uri}: {type(exc).__name__}: {exc}"
        raise (TransientStorageError(message) if is_transient(exc) else StorageError(message)) from exc


def _actions(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def commit_info(uri: str, version: int) -> dict[str, Any] | None:
    """The commit info of ``version`` (with ``"version"`` added, as ``DeltaTable.history`` gives it);
    None when its commit file is gone (Delta's log cleanup) or holds none."""
    text = _read_text(_log_uri(uri, f"{version:020d}.json"))
    for action in _actions(text or ""):
        if "commitInfo" in action:
            return {**action["commitInfo"], "version": version}
    return None


def _checkpoint_files(uri: str, version: int) -> list[str] | None:
    """The files of the newest checkpoint, when it is at or before ``version`` and classic; [] for none."""
    text = _read_text(_log_uri(uri, "_last_checkpoint"))
    if text is None:
        return []
    last = json.loads(text)
    at = int(last["version"])
    if at > version:
        return None  # an older snapshot: finding its own checkpoint would mean listing the log
    if "v2Checkpoint" in last:
        return None
    parts = last.get("parts")
    if parts is None:
        return [_log_uri(uri, f"{at:020d}.checkpoint.parquet")]
    return [_log_uri(uri, f"{at:020d}.checkpoint.{i:010d}.{int(parts):010d}.parquet") for i in range(1, parts + 1)]


def app_transactions(uri: str, version: int) -> dict[str, int] | None:
    """Every app id's transaction version as of table ``version``; None when the log's layout is not one
    read here (the caller falls back to the history)."""
    files = _checkpoint_files(uri, version)
    if files is None:
        return None
    found: dict[str, int] = {}
    checkpoint_version = -1
    for file_uri in files:
        fs, path = storage.arrow_filesystem(file_uri)
        try:
            column = pq.read_table(path, columns=["txn"], filesystem=fs).column("txn")
        except FileNotFoundError:
            return None
        except OSError as exc:
            message = f"read {file_uri}: {type(exc).__name__}: {exc}"
            raise (TransientStorageError(message) if is_transient(exc) else StorageError(message)) from exc
        for txn in column.to_pylist():
            if txn is not None:
                found[str(txn["appId"])] = int(txn["version"])
        checkpoint_version = int(file_uri.rsplit("/", 1)[1][:20])
    for at in range(checkpoint_version + 1, version + 1):
        text = _read_text(_log_uri(uri, f"{at:020d}.json"))
        if text is None:
            return None  # a commit the snapshot holds is unreadable here: let delta-rs answer
        for action in _actions(text):
            if "txn" in action:
                found[str(action["txn"]["appId"])] = int(action["txn"]["version"])
    return found
