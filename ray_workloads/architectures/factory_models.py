"""The user's own ``nn.Module`` class: ``--factory package.module:build`` and its state dict.

The factory is called with ``--factory-kwargs`` (and ``num_classes`` when it takes one they do not give).
Its code comes from a package installed on the cluster, or from a ``--code`` folder zipped into the registry
(content-addressed: the version pins it), imported from that zip, verified (``shipped_code``) and first on
``sys.path``, so a same-named package elsewhere (the driver's working folder, first on Ray workers' path;
another version's code) never builds it. Fine-tuning needs the classifier: timm's ``reset_classifier``
when the module has one, else the last ``nn.Linear`` (or 1×1 convolution), where classifiers end in practice.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
import io
import os
import sys
import threading
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rayline import storage
from rayline.errors import ConfigError, InputDataError
from rayline.ray_workloads.architectures import shipped_code
from rayline.specs import FactoryRef
from rayline.storage.layout import CODE_DIR

if TYPE_CHECKING:
    from torch import nn


def parse_target(target: str) -> tuple[str, str]:
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr or not all(p.isidentifier() for p in [*module.split("."), *attr.split(".")]):
        raise ConfigError(f"--factory {target!r}: expected 'package.module:callable', e.g. mynet.models:build")
    return module, attr


# One load at a time puts its code on the path and imports it: two versions' code of one package in one
# process (a Serve replica's threads, a notebook) must not interleave.
_loading = threading.RLock()


def import_factory(ref: FactoryRef) -> Any:
    """The callable ``ref`` names, imported from the version's registered code when it ships its code."""
    module_name, attr = parse_target(ref.target)
    with _loading:
        archive = ensure_importable(ref)
        try:
            found: Any = importlib.import_module(module_name)
        except Exception as exc:  # importing runs the user's module: it may raise anything
            raise InputDataError(
                f"factory {ref.target}: module {module_name} cannot be imported ({type(exc).__name__}: {exc}); "
                "install its package on the cluster or ship its folder with --code"
            ) from exc
        if archive is not None:
            _check_imported_from(ref, archive)
    for part in attr.split("."):
        found = getattr(found, part, None)
        if found is None:
            raise InputDataError(f"factory {ref.target}: module {module_name} has no {attr}")
    if not callable(found):
        raise InputDataError(f"factory {ref.target} is a {type(found).__name__}, not a callable")
    return found


def build(ref: FactoryRef, num_classes: int) -> nn.Module:
    """Call the factory; a module whose classifier has another class count gets a new head."""
    from torch import nn

    factory = import_factory(ref)
    kwargs = dict(ref.build_kwargs)
    if "num_classes" not in kwargs and _accepts(factory, "num_classes"):
        kwargs["num_classes"] = num_classes
    try:
        model = factory(**kwargs)
    except Exception as exc:  # the user's factory may raise anything
        raise InputDataError(f"factory {ref.target}(**{kwargs}) failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise InputDataError(f"factory {ref.target} returned a {type(model).__name__}; expected a torch nn.Module")
    if head_classes(model) != num_classes:
        replace_head(model, num_classes)
    return model


def _accepts(factory: Any, name: str) -> bool:
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _last_classifier(model: nn.Module) -> tuple[nn.Module, str, nn.Linear | nn.Conv2d] | None:
    from torch import nn

    found = None
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear) or (isinstance(module, nn.Conv2d) and module.kernel_size == (1, 1)):
            found = (path, module)
    if found is None:
        return None
    path, layer = found
    parent_path, _, child = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    return parent, child, layer


def head_classes(model: nn.Module) -> int | None:
    """The class count of the module's classifier, when one is found."""
    from torch import nn

    if hasattr(model, "get_classifier"):
        head = getattr(model, "get_classifier")()  # noqa: B009  # a timm-style module's own head
        return int(head.out_features) if isinstance(head, nn.Linear) else None
    found = _last_classifier(model)
    if found is None:
        return None
    layer = found[2]
    return int(layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels)


def replace_head(model: nn.Module, num_classes: int) -> nn.Module:
    """A fresh classifier for ``num_classes``; returns it."""
    from torch import nn

    if hasattr(model, "reset_classifier") and hasattr(model, "get_classifier"):
        getattr(model, "reset_classifier")(num_classes)  # noqa: B009  # timm's convention, on any class
        head: nn.Module = getattr(model, "get_classifier")()  # noqa: B009
        return head
    found = _last_classifier(model)
    if found is None:
        raise InputDataError(
            "cannot find the module's classifier (no nn.Linear or 1x1 Conv2d) to give it a new head; "
            "add reset_classifier(num_classes) and get_classifier() to the class"
        )
    parent, child, layer = found
    if isinstance(layer, nn.Linear):
        new: nn.Linear | nn.Conv2d = nn.Linear(layer.in_features, num_classes, bias=layer.bias is not None)
    else:
        new = nn.Conv2d(layer.in_channels, num_classes, 1, bias=layer.bias is not None)
    setattr(parent, child, new)
    return new


def installed_package(module_name: str) -> tuple[str | None, str | None]:
    """(distribution, version) that installs ``module_name``'s top-level package here, if any."""
    top = module_name.partition(".")[0]
    for dist in importlib.metadata.packages_distributions().get(top, []):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


def zip_code(folder: str, top_level: str) -> bytes:
    """The package folder as a zip whose root is the package (``py_modules``' layout); caches left out."""
    root = Path(folder).resolve()
    if not (root / "__init__.py").is_file():
        raise ConfigError(f"--code {folder}: expected a package folder (one with __init__.py)")
    if root.name != top_level:
        raise ConfigError(
            f"--code {folder}: the folder is package {root.name!r}, but the factory imports {top_level!r}"
        )
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                info = zipfile.ZipInfo(f"{top_level}/{path.relative_to(root).as_posix()}", (1980, 1, 1, 0, 0, 0))
                archive.writestr(info, path.read_bytes())  # fixed dates: the same code, the same hash
    return buffer.getvalue()


def store_code(model_root: str, code: bytes) -> tuple[str, str]:
    """Write the zip once under the model's ``code/`` folder, named by its SHA-256; (uri, sha256)."""
    digest = hashlib.sha256(code).hexdigest()
    uri = storage.join(model_root, CODE_DIR, f"{digest}.zip")
    if not storage.exists(uri):
        storage.write_bytes_atomic(uri, code)
    return uri, digest


# In the runtime env of the Ray workers that load a version: Ray starts workers per runtime env, so two versions'
# code of one package never share a process, whose imports a later version's could not undo.
CODE_ENV_VAR = "RAYLINE_FACTORY_CODE_SHA256"


def runtime_env(ref: FactoryRef | None) -> dict[str, Any] | None:
    """``runtime_env`` for the Ray workers that load a version shipping its code (None: nothing shipped):
    an environment variable Ray merges into the job's own; each worker imports via :func:`ensure_importable`."""
    if ref is None or ref.code_sha256 is None:
        return None
    return {"env_vars": {CODE_ENV_VAR: ref.code_sha256}}


def ensure_importable(ref: FactoryRef) -> str | None:
    """Make the next import of ``ref``'s module read the version's registered code; that zip, or None
    (a factory installed on the cluster). The verified zip goes first on ``sys.path`` (the only one of
    rayline's cached zips there), and the package's modules imported from anywhere else leave
    ``sys.modules``: models already built keep theirs, the next import reads the zip."""
    if ref.code_uri is None:
        return None
    with _loading:
        archive = str(shipped_code.verified_zip(ref))
        cache = str(shipped_code.code_cache_path()) + os.sep
        sys.path[:] = [archive, *(e for e in sys.path if not (isinstance(e, str) and e.startswith(cache)))]
        for name in _package_modules(ref.top_level):
            if not _imported_from(sys.modules[name], archive):
                del sys.modules[name]
        return archive


def _package_modules(top_level: str) -> list[str]:
    return [name for name in list(sys.modules) if name == top_level or name.startswith(top_level + ".")]


def _imported_from(module: Any, archive: str) -> bool:
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None) or getattr(module, "__file__", None)
    return isinstance(origin, str) and origin.startswith(archive + os.sep)


def _check_imported_from(ref: FactoryRef, archive: str) -> None:
    """Refuse a load whose package came from elsewhere than the version's zip (an import hook ahead of sys.path)."""
    for name in _package_modules(ref.top_level):
        module = sys.modules[name]
        if not _imported_from(module, archive):
            where = getattr(module, "__file__", None) or "an import hook"
            raise InputDataError(
                f"factory {ref.target}: {name} was imported from {where}, not from the version's registered code "
                f"({archive}); something ahead of sys.path serves package {ref.top_level}: remove it"
            )


def declared_version(folder: str) -> str | None:
    """The ``__version__ = "…"`` a shipped package's ``__init__.py`` declares, read without importing it."""
    import re

    text = (Path(folder) / "__init__.py").read_text(encoding="utf-8", errors="replace")
    found = re.search(r"^__version__\s*(?::[^=\n]*)?=\s*[\"']([^\"']+)[\"']", text, re.MULTILINE)
    return found.group(1) if found else None


def _import_error(ref_json: str) -> str | None:
    """Run on a node: None when the factory imports there (its shipped code, when it has some), else the error."""
    ref = FactoryRef.model_validate_json(ref_json)
    try:
        import_factory(ref)
    except Exception as exc:  # importing runs the user's module: it may raise anything
        return f"{type(exc).__name__}: {exc}"
    return None


def _build_and_probe(spec_json: str, state: bytes, side: int, uri: str) -> str | None:
    """Run in a Ray task: build the factory's module, load ``state``, probe it; None, or what failed."""
    import numpy as np
    import torch

    from rayline.ray_workloads.architectures.build import check_state_dict, state_dict_from_bytes
    from rayline.specs import ModelSpec

    spec = ModelSpec.model_validate_json(spec_json)
    try:
        model = build(spec.factory, spec.num_classes)  # type: ignore[arg-type]
        loaded = state_dict_from_bytes(state, uri)
        check_state_dict(spec, loaded, uri, model)
        model.load_state_dict(loaded)
        batch = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 3, side, side)).astype(np.float32))
        with torch.no_grad():
            out = model.eval()(batch)
    except Exception as exc:  # the user's module may raise anything: it is the answer
        return f"{type(exc).__name__}: {exc}"
    if tuple(out.shape) != (2, spec.num_classes):
        return (
            f"a probe forward pass on input (2, 3, {side}, {side}) returned scores of shape {tuple(out.shape)}; "
            f"expected (2, {spec.num_classes}): one score per class"
        )
    if not bool(torch.isfinite(out).all()):
        return f"a probe forward pass on input (2, 3, {side}, {side}) gave non-finite scores"
    return None


def check_on_cluster(spec: Any, state: bytes, side: int, uri: str) -> None:
    """Import the factory on every alive node, then build, load and probe it in one task: refuse with the node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ref: FactoryRef = spec.factory
    env = runtime_env(ref)
    options: dict[str, Any] = {"num_cpus": 0, "max_retries": 0}
    if env:
        options["runtime_env"] = env
    importer = ray.remote(_import_error)
    nodes = [node for node in ray.nodes() if node.get("Alive")]  # type: ignore[no-untyped-call]
    pinned = [NodeAffinitySchedulingStrategy(node["NodeID"], soft=False) for node in nodes]
    found = ray.get([importer.options(**options, scheduling_strategy=p).remote(ref.model_dump_json()) for p in pinned])
    shipped = f"shipped from {ref.code_uri}" if ref.code_uri else "no --code given: it must be installed there"
    for node, error in zip(nodes, found, strict=True):
        if error is not None:
            raise InputDataError(
                f"factory {ref.target} cannot be imported on the cluster's node {node['NodeManagerAddress']} "
                f"(node {node['NodeID'][:12]}; {shipped}): {error}"
            )
    failed = ray.get(ray.remote(_build_and_probe).options(**options).remote(spec.model_dump_json(), state, side, uri))
    if failed is not None:
        raise InputDataError(f"factory {ref.describe()} with the weights at {uri}: {failed}")
