"""Every command's options are its stage's request, handed whole to the flow: declared once, on the model."""

from __future__ import annotations

from datetime import date
from typing import Any

import pytest
import typer
from pydantic import BaseModel
from typer.testing import CliRunner

from rayline.cli import app
from rayline.ray_workloads.data.request import PrepareRequest
from rayline.ray_workloads.monitoring.monitor import DriftThresholds
from rayline.ray_workloads.monitoring.request import MonitorRequest
from rayline.ray_workloads.quality.requests import LabelQueueRequest, LabelsImportRequest, Selection
from rayline.ray_workloads.serving.request import RolloutRequest
from rayline.ray_workloads.serving.rollout import GateConfig

pytestmark = pytest.mark.unit


class _Asked(Exception):
    """Raised by the stand-in flow: the command got as far as the flow, with this request."""

    def __init__(self, request: BaseModel) -> None:
        self.request = request


CASES = [
    (
        ["serve", "rollout", "--candidate", "photos@v3", "--step", "50", "--step", "100", "--min-requests", "5",
         "--no-require-labelled-win"],
        "serve_rollout", "serve_rollout",
        RolloutRequest(candidate="v3", model_name="photos", steps=[50.0, 100.0], gates=GateConfig(min_requests=5),
                       require_labelled_win=False),
    ),
    (
        ["monitor", "--model", "photos", "--no-check-serving", "--reference-date", "2026-11-01", "--psi", "0.3"],
        "monitor", "monitor",
        MonitorRequest(model_name="photos", check_serving=False, reference_date=date(2026, 11, 1),
                       thresholds=DriftThresholds(psi=0.3)),
    ),
    (
        ["prepare-data", "--source", "/data/raw", "--like", "photos@champion"],
        "prepare_data", "prepare_data",
        PrepareRequest(source_uri="/data/raw", like="photos@champion"),
    ),
    (
        ["labels", "import", "back.csv", "--model", "photos", "--selection", "random"],
        "import_labels", "import_labels",
        LabelsImportRequest(file="back.csv", model_name="photos", selection=Selection.random),
    ),
    (
        ["labels", "queue", "--night", "2026-11-01", "--budget", "40"],
        "queue_labels", "queue_labels",
        LabelQueueRequest(night=date(2026, 11, 1), budget=40),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("args", "module", "flow", "expected"), CASES, ids=[" ".join(c[0][:2]) for c in CASES])
def test_a_command_hands_its_flow_one_request_of_its_options(
    args: list[str], module: str, flow: str, expected: BaseModel, local_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    def stand_in(request: BaseModel, **_: Any) -> None:
        raise _Asked(request)

    monkeypatch.setattr(importlib.import_module(f"rayline.flows.{module}"), flow, stand_in)
    done = CliRunner().invoke(app, args)
    assert isinstance(done.exception, _Asked), done.output
    assert done.exception.request == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["monitor", "--reference-date", "2026-13-01"], "--reference-date"),
        (["monitor", "--vacuum-retention-hours", "1"], "retention of 1 h"),
        (["serve", "rollout", "--step", "50"], "100"),
        (["serve", "rollout", "--candidate", "photos@v3", "--model-name", "digits"], "--model-name is 'digits'"),
        (["labels", "queue", "--night", "2026-11-01", "--random-share", "2"], "--random-share 2.0"),
        (["prepare-data", "--image-size", "2"], "--image-size 2"),
    ],
)
def test_a_refused_option_exits_3_naming_it(args: list[str], message: str, local_storage: str) -> None:
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 3, done.output
    assert message in " ".join(done.output.split())


@pytest.mark.parametrize(
    ("command", "model", "hidden"),
    [
        (("serve", "rollout"), RolloutRequest, set()),
        (("monitor",), MonitorRequest, set()),
        (("prepare-data",), PrepareRequest, {"image", "announce_retrain"}),
        (("labels", "import"), LabelsImportRequest, set()),
        (("labels", "queue"), LabelQueueRequest, set()),
    ],
)
def test_every_field_of_a_request_is_an_option_of_its_command(
    command: tuple[str, ...], model: type[BaseModel], hidden: set[str]
) -> None:
    click: Any = typer.main.get_group(app)
    for word in command:
        click = click.commands[word]
    nested = {
        n
        for n, f in model.model_fields.items()
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)
    }
    fields = set(model.model_fields) - nested - hidden
    for name in nested:
        fields |= set(model.model_fields[name].annotation.model_fields)  # type: ignore[union-attr]
    assert {p.name for p in click.params} == fields | {"as_json"}
