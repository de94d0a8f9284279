"""Reading a Delta table's ``_delta_log`` directly, for what delta-rs answers only one key at a time.

delta-rs gives one app transaction by id (``DeltaTable.transaction_version``) and commit infos newest
first (``DeltaTable.history``, which reads every commit file it returns). These questions must not cost the
table's whole history:

* every app transaction as of a version (:func:`app_transactions`): the newest checkpoint at or before it
  (Delta keeps every ``txn`` there) and the commit files after it (at most a checkpoint interval, 100);
* the commit info of one version (:func:`commit_info`), or the files it added (:func:`commit_files`): that one
  commit file;
* the version that set an app transaction (:func:`version_setting`): a binary search over the checkpoints,
  then the commit files after the last checkpoint before it, instead of loading the table at a version per
  step (each load lists the log and replays it from the checkpoint before that version).

Only the classic checkpoint layout delta-rs writes is read (one file, or numbered parts); for any other
(a v2 checkpoint) these answer None and the caller falls back to delta-rs.
"""

from __future__ import annotations

import bisect
import json
import re
from typing import Any

import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rayline import storage

LOG_DIR = "_delta_log"
_CHECKPOINT = re.compile(r"^(?P<version>\d{20})\.checkpoint(\.(?P<part>\d{10})\.(?P<parts>\d{10}))?\.parquet$")


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
        raise storage.storage_error(exc, "read", uri) from exc


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


def commit_files(uri: str, version: int) -> list[dict[str, Any]] | None:
    """The ``add`` actions of commit ``version``: each data file it wrote, with its ``size`` and ``stats`` (JSON
    text naming ``numRecords``); None when its commit file is gone (Delta's log cleanup)."""
    text = _read_text(_log_uri(uri, f"{version:020d}.json"))
    if text is None:
        return None
    return [action["add"] for action in _actions(text) if "add" in action]


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


def _checkpoint_transactions(files: list[str], app_id: str | None = None) -> dict[str, int] | None:
    """Every app transaction a checkpoint (its files) holds, or only ``app_id``'s; None when a file is missing."""
    found: dict[str, int] = {}
    for file_uri in files:
        fs, path = storage.arrow_filesystem(file_uri)
        try:
            parquet = pq.ParquetFile(path, filesystem=fs)
            if "txn" not in parquet.schema_arrow.names:
                continue
            txn = parquet.read(columns=["txn"]).column("txn").combine_chunks()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise storage.storage_error(exc, "read", file_uri) from exc
        txn = txn.filter(txn.is_valid())  # rows of other actions
        apps, versions = txn.field("appId"), txn.field("version")
        if app_id is not None:
            chosen = pc.equal(apps, app_id)
            apps, versions = apps.filter(chosen), versions.filter(chosen)
        found.update(zip(apps.to_pylist(), versions.to_pylist(), strict=True))
    return found


def _commit_transactions(uri: str, version: int) -> dict[str, int] | None:
    """The app transactions commit ``version`` set; None when its file is gone."""
    text = _read_text(_log_uri(uri, f"{version:020d}.json"))
    if text is None:
        return None
    return {str(a["txn"]["appId"]): int(a["txn"]["version"]) for a in _actions(text) if "txn" in a}


def app_transactions(uri: str, version: int) -> dict[str, int] | None:
    """Every app id's transaction version as of table ``version``; None when the log's layout is not one
    read here (the caller falls back to the history)."""
    files = _checkpoint_files(uri, version)
    if files is None:
        return None
    found = _checkpoint_transactions(files) if files else {}
    if found is None:
        return None
    checkpoint_version = int(files[0].rsplit("/", 1)[1][:20]) if files else -1
    for at in range(checkpoint_version + 1, version + 1):
        committed = _commit_transactions(uri, at)
        if committed is None:
            return None  # a commit the snapshot holds is unreadable here: let delta-rs answer
        found.update(committed)
    return found


def _checkpoints(uri: str, latest: int) -> list[tuple[int, list[str]]] | None:
    """The complete classic checkpoints up to ``latest``, oldest first, with their files; None for a v2 one."""
    log = storage.join(storage.normalize(uri), LOG_DIR)
    fs, path = storage.arrow_filesystem(log)
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except OSError as exc:
        raise storage.storage_error(exc, "list", log) from exc
    parts: dict[int, list[str]] = {}
    expected: dict[int, int] = {}
    for info in infos:
        name = info.base_name
        if ".checkpoint." not in name:
            continue  # a commit file: most of the log
        found = _CHECKPOINT.match(name)
        if found is None:
            return None  # a v2 (uuid-named) checkpoint: its actions are in sidecars
        if int(found["version"]) > latest:
            continue
        version = int(found["version"])
        parts.setdefault(version, []).append(storage.join(log, name))
        expected[version] = int(found["parts"] or 1)
    return [(v, sorted(files)) for v, files in sorted(parts.items()) if len(files) == expected[v]]


def version_setting(uri: str, app_id: str, at_least: int, latest: int) -> int | None:
    """The first version up to ``latest`` whose commit set ``app_id``'s transaction to ``at_least`` or
    above; None when the log cannot tell (a v2 checkpoint, a commit file gone)."""
    checkpoints = _checkpoints(uri, latest)
    if checkpoints is None:
        return None

    def reached(index: int) -> bool:
        held = _checkpoint_transactions(checkpoints[index][1], app_id)
        if held is None:
            raise FileNotFoundError(checkpoints[index][1][0])
        return held.get(app_id, 0) >= at_least

    try:  # the first checkpoint that holds it: the commit lies after the one before
        first = bisect.bisect_left(range(len(checkpoints)), True, key=reached)
    except FileNotFoundError:
        return None
    start = checkpoints[first - 1][0] + 1 if first > 0 else 0
    end = checkpoints[first][0] if first < len(checkpoints) else latest
    for version in range(start, end + 1):
        committed = _commit_transactions(uri, version)
        if committed is None:
            return None
        if committed.get(app_id, 0) >= at_least:
            return version
    return None
