"""A factory package written by a test, in as many copies as the test needs, each saying which copy it is.

Every copy defines the same package name with a ``build`` whose model carries
the copy's ``origin``: the registered code, a planted same-named package, or
another version's code. What a load built says which copy was imported.
"""

from __future__ import annotations

from pathlib import Path

from rayline.ray_workloads.architectures import factory_models
from rayline.specs import FactoryRef

MODELS = """
from torch import nn

ORIGIN = {origin!r}


def build(width: int = 4, num_classes: int = 3) -> nn.Module:
    model = nn.Sequential(nn.Conv2d(3, width, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))
    model.origin = ORIGIN
    return model
"""


def write_package(folder: Path, package: str, origin: str) -> Path:
    """``folder/package``: the package whose ``models.build`` makes models saying ``origin``."""
    root = folder / package
    root.mkdir(parents=True)
    (root / "__init__.py").write_text('__version__ = "1.0"\n')
    (root / "models.py").write_text(MODELS.format(origin=origin))
    return root


def package_zip(folder: Path, package: str, origin: str) -> bytes:
    """The zip ``--code`` would make of such a package (written under ``folder``)."""
    return factory_models.zip_code(str(write_package(folder, package, origin)), package)


def ship(model_root: str, folder: Path, package: str, origin: str) -> FactoryRef:
    """A version's factory reference whose code (saying ``origin``) is zipped into ``model_root``, as --code does."""
    uri, digest = factory_models.store_code(model_root, package_zip(folder / origin, package, origin))
    return FactoryRef(target=f"{package}.models:build", code_uri=uri, code_sha256=digest)


def built_origin(ref: FactoryRef) -> str:
    """Which copy of the package built ``ref``'s model."""
    return str(factory_models.build(ref, 3).origin)
