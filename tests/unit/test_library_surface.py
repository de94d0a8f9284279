"""What a user's own project sees of rayline as a library: its version and its type information."""

from __future__ import annotations

from importlib.metadata import version
from importlib.resources import files

import pytest
from typer.testing import CliRunner

import rayline
from rayline.cli import app

pytestmark = pytest.mark.unit


def test_the_version_is_the_installed_distributions_and_the_cli_prints_it() -> None:
    assert rayline.__version__ == version("rayline")
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"rayline {rayline.__version__}\n"


def test_the_package_says_it_is_typed() -> None:
    """PEP 561: mypy and pyright read rayline's annotations in a user's project only with this marker."""
    assert files("rayline").joinpath("py.typed").is_file()
