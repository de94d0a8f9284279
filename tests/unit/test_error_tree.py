"""One error tree: every rayline exception derives from RaylineError, lives in rayline/errors.py and is drawn
in its docstring, and each broad except says why nothing narrower will do."""

from __future__ import annotations

import ast
import builtins
import functools
import re
from dataclasses import dataclass

import pytest

from tests.support import REPO_ROOT
from tests.unit.source_walk import nodes as _nodes
from tests.unit.source_walk import sources as _sources
from tests.unit.source_walk import tree as _tree
from tests.unit.source_walk import within as _within

pytestmark = pytest.mark.unit

ERRORS = "rayline.errors"


@dataclass(frozen=True)
class DefinedClass:
    module: str
    name: str
    line: int
    bases: tuple[str, ...]  # each base by its last name: `errors.InputDataError` → InputDataError

    def __str__(self) -> str:
        return f"{self.module}.{self.name} (line {self.line}, bases {', '.join(self.bases) or 'none'})"


@functools.cache
def _package_classes() -> tuple[DefinedClass, ...]:
    """Every class of rayline and its layers, nested ones too."""
    return tuple(
        DefinedClass(module, node.name, node.lineno, tuple(filter(None, (_last_name(b) for b in node.bases))))
        for module in _sources()
        if _within(module, "rayline")
        for node in _nodes(module)
        if isinstance(node, ast.ClassDef)
    )


def _last_name(node: ast.expr) -> str | None:
    node = node.value if isinstance(node, ast.Subscript) else node  # Generic[T]
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None


@functools.cache
def _exception_classes() -> tuple[tuple[DefinedClass, bool], ...]:
    """Each exception class of the package, and whether it derives from RaylineError.

    A base is an exception when it is a builtin exception, an exception class of
    the package, or another library's class named like one (``…Error``, ``…Exception``).
    """
    classes = _package_classes()
    by_name: dict[str, list[DefinedClass]] = {}
    for c in classes:
        by_name.setdefault(c.name, []).append(c)

    @functools.cache
    def kind(name: str) -> tuple[bool, bool]:  # (is an exception, derives from RaylineError)
        if name == "RaylineError":
            return True, True
        builtin = getattr(builtins, name, None)
        if isinstance(builtin, type) and issubclass(builtin, BaseException):
            return True, False
        if name not in by_name:
            return name.endswith(("Error", "Exception")), False
        bases = [kind(b) for c in by_name[name] for b in c.bases if b != name]
        return any(e for e, _ in bases), any(r for _, r in bases)

    return tuple((c, kind(c.name)[1]) for c in classes if kind(c.name)[0])


def _the_tree() -> tuple[set[str], set[str]]:
    """The class names drawn in rayline/errors.py's docstring, and the stage ``errors`` modules it names."""
    doc = ast.get_docstring(_tree(ERRORS)) or ""
    drawing = doc.partition("::\n\n")[2].partition("\n\n")[0]
    stage_modules = set(re.findall(r"``(rayline\.[\w.]+\.errors)``", doc))
    return set(re.findall(r"\b[A-Z]\w+", drawing)), stage_modules


def test_every_error_derives_from_rayline_error_and_lives_in_the_tree_module() -> None:
    found = _exception_classes()
    _, stage_modules = _the_tree()
    assert any(c.name == "HttpError" and c.module == ERRORS for c, _ in found), "the walk must see errors.py"
    outside = [c for c, ours in found if not ours]
    assert not outside, "every exception rayline defines derives from RaylineError:\n" + "\n".join(
        f"  {c}" for c in outside
    )
    elsewhere = [c for c, _ in found if c.module not in {ERRORS, *stage_modules}]
    assert not elsewhere, (
        "every exception lives in rayline/errors.py, or in a stage's errors.py that errors.py's docstring names "
        "(``rayline.ray_workloads.<stage>.errors``):\n" + "\n".join(f"  {c}" for c in elsewhere)
    )


def test_the_drawn_tree_names_every_error_and_only_those() -> None:
    drawn, stage_modules = _the_tree()
    defined = {c.name for c, _ in _exception_classes() if c.module in {ERRORS, *stage_modules}}
    assert drawn == defined, (
        f"rayline/errors.py's drawing lacks {sorted(defined - drawn)} and draws no such error as "
        f"{sorted(drawn - defined)}"
    )


_PRAGMAS = re.compile(r"noqa(:\s*[A-Z]+\d+(,\s*[A-Z]+\d+)*)?|type:\s*ignore(\[[^\]]*\])?|pragma:\s*no cover")


def _why(lines: list[str], handler: ast.ExceptHandler) -> str:
    """The comment on the handler's line, or on a line of its own just above, less pragmas (``noqa``, …)."""
    own, above = lines[handler.lineno - 1], lines[handler.lineno - 2].strip()
    comment = own.partition("#")[2] if "#" in own else above[1:] if above.startswith("#") else ""
    return _PRAGMAS.sub("", comment).strip(" -:;")


def _catches_everything(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(_last_name(c) in ("Exception", "BaseException") for c in caught)


def test_each_broad_except_says_why_nothing_narrower_will_do() -> None:
    """An ``except Exception`` (``BaseException``, a bare ``except:``) carries a comment, on its line or the one
    above, saying why: a library that raises many classes, a user's code that may raise anything, a re-raise."""
    unexplained, seen = [], 0
    for module, path in _sources().items():
        handlers = [n for n in _nodes(module) if isinstance(n, ast.ExceptHandler) and _catches_everything(n)]
        lines = path.read_text().splitlines() if handlers else []
        seen += len(handlers)
        unexplained += [
            f"  {path.relative_to(REPO_ROOT)}:{h.lineno}" for h in handlers if len(_why(lines, h).split()) < 3
        ]
    assert seen > 10, "the walk must see the broad excepts"
    assert not unexplained, "say why nothing narrower than Exception will do, in a comment:\n" + "\n".join(unexplained)
