"""A version's shipped factory code (``--code``), kept for import in a folder only this user can write.

The registered zip is copied into ``$TMPDIR/rayline-code-<uid>/<sha256>.zip`` and imported from there as it
is (``zipimport``). The folder must be this user's alone (owned by this uid, mode 0700, not a link), else it
is refused. The zip is hashed again on every use and a copy that differs is replaced from the registry;
between that check and the import only this user (or root) can change it. A zip, not an unpacked folder:
hashing it is one read, and Python writes no bytecode into it to import instead of the sources; the price
is that a new process compiles the sources it imports (bench/README.md, "Shipped factory code").
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import stat
import tempfile
import uuid
from pathlib import Path

from rayline import storage
from rayline.errors import ConfigError, InputDataError
from rayline.specs import FactoryRef

log = logging.getLogger(__name__)

PRIVATE_MODE = 0o700


def code_cache_path() -> Path:
    """This user's folder of verified code zips (not created here)."""
    return Path(tempfile.gettempdir()) / f"rayline-code-{os.getuid()}"


def private_cache() -> Path:
    """:func:`code_cache_path`, created 0700; refused unless only this user can have put anything in it."""
    folder = code_cache_path()
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=PRIVATE_MODE)
    problem = _not_private(folder)
    if problem is not None:
        raise ConfigError(
            f"the code cache {folder} {problem}: shipped factory code is imported only from a folder that only this "
            f"user can write (owned by uid {os.getuid()}, mode 0700, not a link). Nothing was imported from it; "
            "remove it, or point TMPDIR at a folder of your own, and load again"
        )
    return folder


def _not_private(folder: Path) -> str | None:
    found = os.lstat(folder)
    if stat.S_ISLNK(found.st_mode):
        return f"is a link (to {os.readlink(folder)})"
    if not stat.S_ISDIR(found.st_mode):
        return "is not a folder"
    if found.st_uid != os.getuid():
        return f"is owned by uid {found.st_uid}"
    if stat.S_IMODE(found.st_mode) & 0o077:
        return f"has mode {oct(stat.S_IMODE(found.st_mode))}"
    return None


def verified_zip(ref: FactoryRef) -> Path:
    """The version's code zip in :func:`private_cache`, its SHA-256 checked now; fetched from the registry if needed."""
    if ref.code_uri is None or ref.code_sha256 is None:
        raise InputDataError(f"factory {ref.target}: its version names no code or no SHA-256; register it with --code")
    path = private_cache() / f"{ref.code_sha256}.zip"
    problem = _cached_problem(path, ref.code_sha256)
    if problem is None:
        return path
    data = storage.read_bytes(ref.code_uri)
    if hashlib.sha256(data).hexdigest() != ref.code_sha256:
        raise InputDataError(
            f"factory code {ref.code_uri} changed since registration: its SHA-256 is not the {ref.code_sha256} "
            "the version records; register the code again as a new version"
        )
    if problem != "absent":
        log.warning("cached factory code %s %s; replaced with the registered bytes of %s", path, problem, ref.code_uri)
    _write_private(path, data)
    return path


def _cached_problem(path: Path, sha256: str) -> str | None:
    """None when ``path`` is this user's own file with the registered bytes, else what is wrong with it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return "absent"
    except OSError as exc:  # a link (ELOOP) or a folder planted under the name
        return f"could not be read as a file ({exc.strerror})"
    with os.fdopen(fd, "rb") as file:
        found = os.fstat(file.fileno())
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.getuid():
            return "is not this user's file"
        if hashlib.file_digest(file, "sha256").hexdigest() != sha256:
            return "differed from the registered bytes"
    return None


def _write_private(path: Path, data: bytes) -> None:
    """``data`` at ``path``, written whole under a temporary name first (readers see the old file or the new one)."""
    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    os.replace(staging, path)
