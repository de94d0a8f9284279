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


# What a user imports to compose rayline in a flow of their own (docs/api.md): a change here is a change of
# the public API, to be made on purpose.
PUBLIC = {
    "rayline.flows": [
        "import_labels",
        "monitor",
        "nightly_inference",
        "prepare_data",
        "queue_labels",
        "register_model",
        "serve_rollout",
        "train_model",
    ],
    "rayline.tasks": [
        "InferenceConfig",
        "InferenceResult",
        "IngestConfig",
        "IngestResult",
        "PreprocessConfig",
        "PreprocessResult",
        "RegisterModelConfig",
        "batch_inference_task",
        "ingest_objects",
        "openlineage_flow",
        "preprocess_images",
        "register_outside_model",
        "resolve_version_task",
        "vacuum_tables_task",
    ],
    "rayline.tables": ["committed_nights", "latest_night_commit", "read_night", "read_night_pair", "vacuum_tables"],
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_the_public_api_is_what_it_says_and_each_name_resolves(package: str) -> None:
    import importlib

    from prefect import Flow, Task

    module = importlib.import_module(package)
    assert sorted(module.__all__) == PUBLIC[package]
    for name in module.__all__:
        if package == "rayline.flows":  # a module each, named as its flow
            assert isinstance(getattr(importlib.import_module(f"rayline.flows.{name}"), name), Flow), name
        elif package == "rayline.tasks" and name == "openlineage_flow":  # the decorator a flow of yours takes
            assert callable(getattr(module, name)), name
        elif package == "rayline.tasks" and name[0].islower():
            assert isinstance(getattr(module, name), Task), name
        else:
            assert getattr(module, name) is not None, name
