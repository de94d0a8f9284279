"""The shape of the project: one-way layers, and no side effects at import (the error tree: test_error_tree).

Imports run one way::

    rayline/cli (the shell) → deployments → flows → tasks → ray_workloads → core (the rest of rayline/)

The four upper layers keep their folders at the top of the checkout and are
imported as subpackages of ``rayline`` (``rayline/flows`` links to ``flows/``),
so an installed rayline leaves the names ``flows`` and ``tasks`` to the user.

Every module's imports are read from its source with ``ast``: those inside
functions and under ``TYPE_CHECKING`` too, since a hidden import is still a
dependency (it only hides a cycle). Each rule is its own test, and a failure
names the module, the import and its line.
"""

from __future__ import annotations

import ast
import functools
import importlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import REPO_ROOT
from tests.unit.source_walk import LAYERS, WALKED
from tests.unit.source_walk import nodes as _nodes
from tests.unit.source_walk import sources as _sources
from tests.unit.source_walk import tree as _tree
from tests.unit.source_walk import within as _within

pytestmark = pytest.mark.unit

SHELL = "rayline.cli"
WORKLOADS, TASKS, FLOWS, DEPLOYMENTS = (f"rayline.{layer}" for layer in LAYERS)


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # an absolute module name
    line: int
    bound: str = ""  # `import target` / `from pkg import target`: the name the module is bound to
    names: tuple[tuple[str, str], ...] = ()  # `from target import name as bound`: (name, bound) pairs

    def __str__(self) -> str:
        return f"{self.importer} imports {self.target} (line {self.line})"


def _modules(package: str) -> list[str]:
    """The package's modules, subpackages included; not ``__main__`` (importing it runs the command)."""
    return [m for m in _sources() if _within(m, package) and not m.endswith(".__main__")]


def _layer(module: str) -> str:
    if _within(module, SHELL):
        return "shell"
    parts = module.split(".")
    if parts[0] == "rayline":
        return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "core"
    return parts[0]


def _absolute(importer: str, node: ast.ImportFrom) -> str:
    """The module a ``from … import`` reads, relative forms resolved against the importer's package."""
    if node.level == 0:
        return node.module or ""
    is_package = _sources()[importer].name == "__init__.py"
    package = importer if is_package else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _imports_in(importer: str) -> list[Import]:
    found: list[Import] = []
    for node in _nodes(importer):
        if isinstance(node, ast.Import):
            found += [Import(importer, a.name, node.lineno, bound=a.asname or a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base, names = _absolute(importer, node), []
            for alias in node.names:
                if f"{base}.{alias.name}" in _sources():  # `from rayline.flows import prepare_data`: a module
                    found.append(
                        Import(importer, f"{base}.{alias.name}", node.lineno, bound=alias.asname or alias.name)
                    )
                else:
                    names.append((alias.name, alias.asname or alias.name))
            if names:
                found.append(Import(importer, base, node.lineno, names=tuple(names)))
    return found


@functools.cache
def _all_imports() -> tuple[Import, ...]:
    return tuple(i for module in _sources() for i in _imports_in(module))


def _imports_of(layer: str) -> list[Import]:
    return [i for i in _all_imports() if _layer(i.importer) == layer]


def _report(rule: str, offending: list[Import]) -> str:
    return rule + ":\n" + "\n".join(f"  {i}" for i in offending)


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _dotted(node.value)
        return f"{owner}.{node.attr}" if owner else None
    return None


@functools.cache
def _called(module: str) -> frozenset[str]:
    """What ``module`` calls, by name as written: ``prepare_data``, ``prepare_data.prepare_data``."""
    return frozenset(name for n in _nodes(module) if isinstance(n, ast.Call) and (name := _dotted(n.func)))


@functools.cache
def _flows_defined(module: str) -> frozenset[str]:
    """The functions of ``module`` decorated as Prefect flows (``@flow``, ``@flow(...)``, ``@prefect.flow``)."""
    return frozenset(
        fn.name
        for fn in _tree(module).body
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for d in fn.decorator_list
        if _dotted(d.func if isinstance(d, ast.Call) else d) in ("flow", "prefect.flow")
    )


def _calls_a_subflow(imp: Import) -> bool:
    """The import takes a flow of ``imp.target`` that the importer calls: a subflow."""
    flows, called = _flows_defined(imp.target), _called(imp.importer)
    if imp.names:
        return any(name in flows and bound in called for name, bound in imp.names)
    return any(f"{imp.bound}.{flow}" in called for flow in flows)


def test_the_walk_reads_every_layer_and_imports_inside_functions() -> None:
    assert {_layer(m) for m in _sources()} >= {"core", "shell", "ray_workloads", "tasks", "flows", "deployments"}
    hidden = [i for i in _imports_of("deployments") if i.target == "rayline.flows.monitor"]
    assert hidden, "deployment_table() imports the monitor flow inside the function: the walk must see it"


def test_core_imports_no_higher_layer() -> None:
    bad = [i for i in _imports_of("core") if _within(i.target, WORKLOADS, TASKS, FLOWS, DEPLOYMENTS)]
    assert not bad, _report("core (rayline/ but rayline/cli/) imports nothing above it", bad)


# The core's subpackages, each with those it may import: one way, storage at the bottom, lineage on top.
CORE_SUBPACKAGES: dict[str, frozenset[str]] = {
    "rayline.storage": frozenset(),
    "rayline.tables": frozenset({"rayline.storage"}),
    "rayline.models": frozenset({"rayline.storage"}),
    "rayline.lineage": frozenset({"rayline.storage", "rayline.tables", "rayline.models"}),
}
# The cross-cutting modules at the top of the core import no subpackage, but the demo's seed, which writes
# its images into storage (and no subpackage imports the seed).
TOP_MODULES_MAY_IMPORT: dict[str, frozenset[str]] = {"rayline.seed": frozenset({"rayline.storage"})}


def _core_subpackage(module: str) -> str | None:
    return next((p for p in CORE_SUBPACKAGES if _within(module, p)), None)


def _against_one_way(layer: str, allowed: dict[str, frozenset[str]]) -> list[Import]:
    """The imports of ``layer`` from one of ``allowed``'s packages into another it may not import."""

    def package_of(module: str) -> str | None:
        return next((p for p in allowed if _within(module, p)), None)

    def wrong(i: Import) -> bool:
        own, target = package_of(i.importer), package_of(i.target)
        return own is not None and target is not None and own != target and target not in allowed[own]

    assert set(allowed) <= set(_sources()), f"a package of {sorted(allowed)} was renamed: name it here"
    return [i for i in _imports_of(layer) if wrong(i)]


def test_the_core_subpackages_import_each_other_one_way() -> None:
    bad = _against_one_way("core", CORE_SUBPACKAGES)
    assert not bad, _report(
        "rayline.storage imports no other subpackage; tables and models import storage only; lineage may "
        "import all three",
        bad,
    )


def test_the_top_modules_of_the_core_import_no_subpackage() -> None:
    def wrong(i: Import) -> bool:
        top = i.importer.count(".") == 1 and _core_subpackage(i.importer) is None
        target = _core_subpackage(i.target)
        return top and target is not None and target not in TOP_MODULES_MAY_IMPORT.get(i.importer, frozenset())

    bad = [i for i in _imports_of("core") if wrong(i)]
    bad += [i for i in _imports_of("core") if i.target in TOP_MODULES_MAY_IMPORT and _core_subpackage(i.importer)]
    assert not bad, _report(
        "the cross-cutting modules at the top of rayline/ (errors, config, specs, the Ray connection, …) sit "
        "below its subpackages: they import none (the seed only storage), and no subpackage imports the seed",
        bad,
    )


def test_only_the_tests_and_the_benches_import_the_drill_tools() -> None:
    bad = [
        i
        for i in _all_imports()
        if _within(i.target, "rayline.testing") and not _within(i.importer, "rayline.testing", "bench")
    ]
    assert not bad, _report("rayline.testing (the S3 server and fault proxy) is for tests and benches only", bad)


def test_bench_helpers_import_no_entry_point() -> None:
    entry_points = {m for m in _sources() if m.count(".") == 1 and _within(m, "bench")}
    bad = [i for i in _all_imports() if _within(i.importer, "bench.support") and i.target in entry_points]
    assert entry_points >= {"bench.night_scale", "bench.ingest"}, entry_points
    assert not bad, _report("bench/support/ holds what the entry points build on: it imports none of them", bad)


def test_each_core_subpackage_says_what_it_holds_and_may_import() -> None:
    for package in CORE_SUBPACKAGES:
        doc = ast.get_docstring(_tree(package)) or ""
        assert "import" in doc and len(doc.splitlines()) >= 3, f"{package}'s __init__ docstring says what it holds"


def _lines_of_code(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def test_no_folder_holds_more_than_a_quarter_of_the_package_code() -> None:
    folders: dict[Path, int] = {}
    for module in _modules("rayline"):
        path = _sources()[module]
        folders[path.parent] = folders.get(path.parent, 0) + _lines_of_code(path)
    total = sum(folders.values())
    big = {str(f.relative_to(REPO_ROOT)): n for f, n in folders.items() if n > total / 4}
    assert not big, f"a folder (without its subfolders) holds over a quarter of {total} lines: {big}; split it"


def test_only_the_shell_imports_the_shell() -> None:
    below = ("core", "ray_workloads", "tasks", "flows", "deployments")
    bad = [i for i in _all_imports() if _layer(i.importer) in below and _within(i.target, SHELL)]
    assert not bad, _report("only rayline/cli/ imports rayline.cli: it is the top of the house", bad)


# The stages' packages, each with those it may import (as its __init__ says): one way, data at the bottom.
WORKLOAD_PACKAGES: dict[str, frozenset[str]] = {
    f"{WORKLOADS}.{package}": frozenset(f"{WORKLOADS}.{below}" for below in may_import)
    for package, may_import in {
        "data": (),
        "architectures": (),
        "quality": (),
        "execution": ("data", "architectures"),
        "training": ("data", "architectures", "execution", "quality"),
        "nightly": ("data", "execution", "quality"),
        "registration": ("data", "architectures", "execution"),
        "monitoring": ("data", "quality"),
        "serving": ("data", "execution", "monitoring", "quality"),
    }.items()
}


def test_the_stages_packages_import_each_other_one_way() -> None:
    loose = [m for m in _modules(WORKLOADS) if m != WORKLOADS and not _within(m, *WORKLOAD_PACKAGES)]
    assert not loose, f"every stage lives in a package of ray_workloads/: {loose}"
    bad = _against_one_way("ray_workloads", WORKLOAD_PACKAGES)
    assert not bad, _report("the stage packages import one way (WORKLOAD_PACKAGES, as each __init__ says)", bad)


def test_each_stage_package_says_what_it_holds_and_may_import() -> None:
    for package in WORKLOAD_PACKAGES:
        doc = ast.get_docstring(_tree(package)) or ""
        assert "mport" in doc and len(doc.splitlines()) >= 3, f"{package}'s __init__ docstring says what it holds"


def test_workloads_never_import_prefect() -> None:
    bad = [i for i in _imports_of("ray_workloads") if _within(i.target, "prefect")]
    assert not bad, _report("ray_workloads are plain Ray code: no Prefect", bad)


def test_workloads_import_no_tasks_flows_or_deployments() -> None:
    bad = [i for i in _imports_of("ray_workloads") if _within(i.target, TASKS, FLOWS, DEPLOYMENTS)]
    assert not bad, _report("ray_workloads import only core", bad)


def test_tasks_import_no_flows_and_no_other_task_but_the_common_base() -> None:
    def wrong(i: Import) -> bool:
        other_task = _within(i.target, TASKS) and i.target not in (TASKS, f"{TASKS}.common", i.importer)
        return other_task or _within(i.target, FLOWS, DEPLOYMENTS)

    bad = [i for i in _imports_of("tasks") if wrong(i)]
    assert not bad, _report("a task module imports no flow and no other task module, only rayline.tasks.common", bad)


def test_flows_import_another_flow_only_as_a_subflow_they_call() -> None:
    def wrong(i: Import) -> bool:
        if _within(i.target, DEPLOYMENTS):
            return True
        other_flow = _within(i.target, FLOWS) and i.target not in (FLOWS, i.importer)
        # a flows module that defines no flow (flows/nightly_backfill.py) is a helper of the layer
        return other_flow and bool(_flows_defined(i.target)) and not _calls_a_subflow(i)

    bad = [i for i in _imports_of("flows") if wrong(i)]
    assert not bad, _report("a flow imports another flow's module only to call that flow as a subflow", bad)


# The modules below the tasks that read or write storage, the registry, MLflow, leases, Delta tables or
# Ray Serve, each with the names a flow may still take from it: types and constants, a check of a
# parameter, the code version (no I/O). Flows reach the rest only through tasks, where the retry
# policy is; a flow that needs another pure name adds it here.
FLOW_SAFE_NAMES_OF_IO_MODULES: dict[str, frozenset[str]] = {
    "rayline.models.registry": frozenset({"ModelVersion", "TrainingLabels", "CHAMPION", "CHALLENGER", "GATE_ALPHA"}),
    "rayline.storage": frozenset(),
    "rayline.models.mlflow_mirror": frozenset(),
    "rayline.ray_workloads.registration.mlflow_models": frozenset(),
    "rayline.storage.leases": frozenset({"HeldLease"}),
    "rayline.lineage": frozenset({"code_version"}),
    "rayline.tables.prediction_reads": frozenset({"DEFAULT_RETENTION_HOURS", "check_retention"}),
    "rayline.tables.delta_tables": frozenset(),
    "rayline.tables.delta_log": frozenset(),
    "rayline.storage.conditional": frozenset(),
    "rayline.storage.conditional_probe": frozenset(),
    "rayline.tables.predictions_table": frozenset(),
    "rayline.storage.manifests": frozenset(),
    "rayline.storage.folders": frozenset(),
    "rayline.storage.fetching": frozenset(),
    "rayline.models.tracking": frozenset(),
    "rayline.lineage.graph": frozenset(),
    "rayline.lineage.nights": frozenset(),
    "rayline.seed": frozenset(),
    "rayline.ray_workloads.serving.control": frozenset(),
}


def test_flows_reach_storage_and_the_registry_only_through_tasks() -> None:
    def wrong(i: Import) -> bool:
        safe = FLOW_SAFE_NAMES_OF_IO_MODULES.get(i.target)
        if safe is None:
            return False
        # the module itself (`from rayline import storage`): any of its functions could be called
        return not i.names or any(name not in safe for name, _ in i.names)

    assert set(FLOW_SAFE_NAMES_OF_IO_MODULES) <= set(_sources()), "a listed module was renamed: list its new name"
    bad = [i for i in _imports_of("flows") if wrong(i)]
    assert not bad, _report(
        "a flow reads and writes storage, the registry, MLflow, leases, Delta tables and Ray Serve only through "
        "tasks; from these modules it takes only the names FLOW_SAFE_NAMES_OF_IO_MODULES lists",
        bad,
    )


def test_bench_imports_no_tests() -> None:
    bad = [i for i in _imports_of("bench") if _within(i.target, "tests")]
    assert not bad, _report("bench/ runs from a checkout without the tests: it imports none", bad)


def test_importing_everything_starts_no_ray_and_writes_nothing(tmp_path: object) -> None:
    modules = _modules("rayline")
    code = (
        "import importlib, os, ray\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "assert not ray.is_initialized(), 'ray.init at import'\n"
        "assert os.listdir('.') == [], os.listdir('.')\n"
    )
    # this checkout's code first, not whichever checkout the environment was installed from
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_flow_is_a_prefect_flow() -> None:
    from prefect import Flow

    flows = [
        obj
        for module in _modules(FLOWS)
        for obj in vars(importlib.import_module(module)).values()
        if isinstance(obj, Flow)
    ]
    assert {f.name for f in flows} >= {"prepare-data"}


def _top_level_layer_imports(path: Path) -> list[str]:
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        found += [
            f"{path.relative_to(REPO_ROOT)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in LAYERS
        ]
    return found


def test_nothing_imports_a_layer_by_its_top_level_name() -> None:
    """Installed, rayline has no top-level ``flows`` or ``tasks``: those names are the user's own packages'."""
    users_project = REPO_ROOT / "docs" / "examples" / "my_project"  # its own flows and tasks: the point
    paths = [p for folder in [*WALKED, "tests", "docs"] for p in sorted((REPO_ROOT / folder).rglob("*.py"))]
    paths = [p for p in paths if not p.is_relative_to(users_project)]
    bad = [found for p in paths for found in _top_level_layer_imports(p)]
    assert not bad, "import the layers as rayline.flows, rayline.tasks, …:\n" + "\n".join(bad)


def test_the_distribution_installs_one_top_level_package(tmp_path: Path) -> None:
    """From outside the checkout only ``rayline`` is importable: the layers live under it."""
    code = (
        "import importlib.util as u\n"
        "print(sorted(n for n in ('rayline', 'rayline.flows', 'rayline.tasks', 'flows', 'tasks', 'ray_workloads',"
        " 'deployments') if u.find_spec(n)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[0] == "['rayline', 'rayline.flows', 'rayline.tasks']"
