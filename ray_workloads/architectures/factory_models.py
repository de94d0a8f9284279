"""The user's own ``nn.Module`` class: ``--factory package.module:build`` and its state dict.

The factory is called with ``--factory-kwargs`` (and ``num_classes`` when it
takes one and the kwargs do not say), then the weights are loaded into what
it returns. Its code comes either from a package installed on the cluster,
or from a folder given with ``--code``: that folder is zipped into the
registry (content-addressed, so the version pins it) and shipped to every
Ray worker that loads the model with ``runtime_env={"py_modules": [...]}``.
A process outside Ray (an MLflow pyfunc, a notebook) puts the same folder
on ``sys.path`` instead.

Fine-tuning a factory model needs its classifier: timm's ``reset_classifier``
when the module has one, else the last ``nn.Linear`` (or 1×1 convolution)
in module order, which is where classifiers end in practice.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import io
import os
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rayline import storage
from rayline.errors import ConfigError, InputDataError
from rayline.specs import FactoryRef
from rayline.storage.layout import CODE_DIR

if TYPE_CHECKING:
    from torch import nn


def parse_target(target: str) -> tuple[str, str]:
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr or not all(p.isidentifier() for p in [*module.split("."), *attr.split(".")]):
        raise ConfigError(f"--factory {target!r}: expected 'package.module:callable', e.g. mynet.models:build")
    return module, attr


def import_factory(ref: FactoryRef) -> Any:
    """The callable ``ref`` names; its code is put on ``sys.path`` first when the version ships it."""
    ensure_importable(ref)
    module_name, attr = parse_target(ref.target)
    try:
        found: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise InputDataError(
            f"factory {ref.target}: module {module_name} cannot be imported ({type(exc).__name__}: {exc}); install "
            "its package on the cluster or ship its folder with --code"
        ) from exc
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
    except Exception as exc:
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


def local_code_folder(ref: FactoryRef) -> str | None:
    """The shipped code, unzipped into a local cache keyed by its hash; the folder holding the package."""
    if ref.code_uri is None or ref.code_sha256 is None:
        return None
    base = Path(tempfile.gettempdir()) / "rayline-code" / ref.code_sha256
    if not (base / ref.top_level).is_dir():
        data = storage.read_bytes(ref.code_uri)
        if hashlib.sha256(data).hexdigest() != ref.code_sha256:
            raise InputDataError(f"factory code {ref.code_uri} changed since registration (SHA-256 differs)")
        base.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{ref.code_sha256[:12]}-", dir=base.parent))
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            archive.extractall(staging)
        try:
            os.replace(staging, base)
        except OSError:
            pass  # another process unpacked the same code first
    return str(base)


def runtime_env(ref: FactoryRef | None) -> dict[str, Any] | None:
    """``runtime_env`` shipping a version's factory code to Ray workers (None: nothing to ship).

    Call it on a driver connected to Ray. A task's or actor's ``py_modules``
    must be URIs (a local folder is taken at ``ray.init`` only), and they
    replace the job's own rather than add to them: the job's (rayline's
    packages, on a remote cluster) are kept beside the factory's.
    """
    if ref is None or ref.code_uri is None:
        return None
    return {"py_modules": [*_job_py_modules(), _code_package(ref)]}


def _job_py_modules() -> list[str]:
    import ray

    return list(ray.get_runtime_context().runtime_env.get("py_modules") or [])


def _code_package(ref: FactoryRef) -> str:
    """The stored zip, pushed to the cluster's GCS as a Ray package (its layout: the package at the root).

    Named by the code's hash, pushed once while the cluster keeps it, and
    pinned so that it outlives the gap until the task or actor using it
    starts; every node unpacks it from there, whatever storage the registry is on.
    """
    from ray._private.runtime_env.packaging import package_exists, pin_runtime_env_uri, upload_package_to_gcs

    assert ref.code_sha256 is not None  # recorded with code_uri
    uri = f"gcs://_ray_pkg_{ref.code_sha256[:32]}.zip"
    if not package_exists(uri):
        data = storage.read_bytes(str(ref.code_uri))
        if hashlib.sha256(data).hexdigest() != ref.code_sha256:
            raise InputDataError(f"factory code {ref.code_uri} changed since registration (SHA-256 differs)")
        upload_package_to_gcs(uri, data)
    pin_runtime_env_uri(uri)
    return uri


def ensure_importable(ref: FactoryRef) -> None:
    """Outside a runtime_env (a driver, an MLflow pyfunc): put the shipped code on ``sys.path``."""
    if importlib.util.find_spec(ref.top_level) is not None:
        return
    folder = local_code_folder(ref)
    if folder is not None and folder not in sys.path:
        sys.path.insert(0, folder)
        importlib.invalidate_caches()


def declared_version(folder: str) -> str | None:
    """The ``__version__ = "…"`` a shipped package's ``__init__.py`` declares, read without importing it."""
    import re

    text = (Path(folder) / "__init__.py").read_text(encoding="utf-8", errors="replace")
    found = re.search(r"^__version__\s*(?::[^=\n]*)?=\s*[\"']([^\"']+)[\"']", text, re.MULTILINE)
    return found.group(1) if found else None


def _import_error(target: str) -> str | None:
    """Run on a node: None when ``target``'s module imports there, else the error (no sys.path fallback)."""
    module_name, _ = parse_target(target)
    try:
        importlib.import_module(module_name)
    except Exception as exc:
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
    except Exception as exc:
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
    found = ray.get(
        [
            importer.options(
                **options, scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            ).remote(ref.target)
            for node in nodes
        ]
    )
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
