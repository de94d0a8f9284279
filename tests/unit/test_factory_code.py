"""A version's shipped factory code (``--code``) is the code that was registered, whatever else is around.

A same-named package earlier on the path or already imported, another
version's code under the same package name, a cached copy changed after it
was fetched, a cache folder someone else could have filled: none of them
builds the version's model. Each copy of the package says which it is
(:mod:`tests.factory_code_support`). The Ray side, where Ray puts the driver's
working folder first on its workers' path, is in
tests/integration/test_factory_code.py.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import stat
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import pytest

from rayline import storage
from rayline.errors import ConfigError, InputDataError
from rayline.ray_workloads.architectures.factory_models import zip_code
from tests.factory_code_support import built_origin, package_zip, ship, write_package

pytestmark = pytest.mark.unit

PACKAGE = "ownnet_pinned"  # written by these tests only: importable nowhere else


def _forget_package() -> None:
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]


@pytest.fixture(autouse=True)
def own_path_and_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This test's own temporary folder (where the code cache lives) and its own sys.path; the package forgotten."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield temp
    _forget_package()


@pytest.fixture
def model_root(local_storage: str) -> str:
    return storage.join(local_storage, "models", "own")


def _documented_cache(temp: Path) -> Path:
    """Where docs/models.md says a user's verified code zips are kept."""
    return temp / f"rayline-code-{os.getuid()}"


@pytest.mark.parametrize("planted", ["first on the path", "already imported"])
def test_a_same_named_package_elsewhere_does_not_build_the_version(
    model_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    ref = ship(model_root, tmp_path, PACKAGE, "registered")
    write_package(tmp_path / "project", PACKAGE, "planted")  # the user's own checkout, an older install
    monkeypatch.syspath_prepend(str(tmp_path / "project"))
    if planted == "already imported":
        __import__(f"{PACKAGE}.models")
    assert built_origin(ref) == "registered"
    assert built_origin(ref) == "registered", "a second load in the same process"


class PlantedFinder(importlib.abc.MetaPathFinder):
    """An import hook ahead of ``sys.path`` (as some tools install) serving the package from another folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = str(folder)

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name.partition(".")[0] != PACKAGE:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path if name != PACKAGE else [self.folder])


def test_an_import_hook_serving_a_same_named_package_is_refused(
    model_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = ship(model_root, tmp_path, PACKAGE, "registered")
    write_package(tmp_path / "hooked", PACKAGE, "planted")
    monkeypatch.setattr(sys, "meta_path", [PlantedFinder(tmp_path / "hooked"), *sys.meta_path])
    with pytest.raises(
        InputDataError, match=f"{PACKAGE} was imported from .*hooked.*not from the version's registered"
    ):
        built_origin(ref)


def test_two_versions_shipping_different_code_of_one_package_each_build_with_their_own(
    model_root: str, tmp_path: Path
) -> None:
    first = ship(model_root, tmp_path, PACKAGE, "version 1")
    second = ship(model_root, tmp_path, PACKAGE, "version 2")
    assert [built_origin(ref) for ref in (first, second, first)] == ["version 1", "version 2", "version 1"]


def test_a_cached_copy_of_the_code_changed_after_it_was_fetched_is_not_imported(
    model_root: str, tmp_path: Path, own_path_and_temp: Path
) -> None:
    ref = ship(model_root, tmp_path, PACKAGE, "registered")
    assert built_origin(ref) == "registered"
    planted = write_package(tmp_path / "planted", PACKAGE, "planted")
    cached = [p for p in own_path_and_temp.rglob("*") if p.name == "models.py" or p.suffix == ".zip"]
    assert cached, "the first load keeps a copy of the code under the temporary folder"
    for path in cached:  # what a disk error, or anyone who could write there, left
        path.write_bytes(
            zip_code(str(planted), PACKAGE) if path.suffix == ".zip" else (planted / path.name).read_bytes()
        )
    _forget_package()  # as a new process would start
    assert built_origin(ref) == "registered"


def _another_users(folder: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a folder another user owns needs root")
    folder.mkdir(mode=0o700)
    os.chown(folder, 65534, 65534)


def _writable_by_others(folder: Path) -> None:
    folder.mkdir()
    folder.chmod(0o777)


def _a_link(folder: Path) -> None:
    target = folder.with_name("elsewhere")
    target.mkdir(mode=0o700)
    folder.symlink_to(target)


PLANTINGS = {
    "another user's folder": (_another_users, "is owned by uid 65534"),
    "a folder others can write": (_writable_by_others, "has mode 0o777"),
    "a link": (_a_link, "is a link"),
}


@pytest.mark.parametrize("planting", list(PLANTINGS))
def test_a_code_cache_folder_not_this_users_alone_is_refused_and_nothing_in_it_is_imported(
    model_root: str, tmp_path: Path, own_path_and_temp: Path, planting: str
) -> None:
    ref = ship(model_root, tmp_path, PACKAGE, "registered")
    assert ref.code_sha256 is not None
    plant, reason = PLANTINGS[planting]
    cache = _documented_cache(own_path_and_temp)
    plant(cache)
    (cache / f"{ref.code_sha256}.zip").write_bytes(package_zip(tmp_path / "planted", PACKAGE, "planted"))
    with pytest.raises(ConfigError, match=reason) as refused:
        built_origin(ref)
    message = " ".join(str(refused.value).split())
    assert str(cache) in message and "only this user" in message, message
    assert PACKAGE not in sys.modules, "nothing was imported"
    assert stat.S_ISDIR(os.stat(cache).st_mode), "the folder is left as it was found"
