"""The shell of rayline: the ``rayline`` command, ``up``/``down`` and the demo's orchestration.

It is the only part of ``rayline`` allowed to import ``flows`` and
``deployments``: the rest of the package is the core every layer builds on,
and imports nothing above it (``tests/unit/test_structure.py``). ``app`` is
the console script's entry point (``rayline = "rayline.cli:app"``).
"""

from rayline.cli.main import app

__all__ = ["app"]
