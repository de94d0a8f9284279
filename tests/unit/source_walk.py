"""The package's modules read from their source with ``ast``, each parsed and walked once, for the tests of the
project's shape (test_structure, test_error_tree)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from tests.support import REPO_ROOT

LAYERS = ("ray_workloads", "tasks", "flows", "deployments")  # folders at the top, imported as rayline.<layer>
FOLDERS = ["rayline", *LAYERS]
WALKED = [*FOLDERS, "bench"]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    if parts[0] in LAYERS:
        parts = ("rayline", *parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def sources() -> dict[str, Path]:
    """Every module of the walked folders, by name (rglob does not descend rayline/'s links to the layers)."""
    return {module_name(p): p for folder in WALKED for p in sorted((REPO_ROOT / folder).rglob("*.py"))}


@functools.cache
def tree(module: str) -> ast.Module:
    return ast.parse(sources()[module].read_text())


@functools.cache
def nodes(module: str) -> tuple[ast.AST, ...]:
    """Every node of ``module``, parsed and walked once for all the rules below."""
    return tuple(ast.walk(tree(module)))


def within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)
