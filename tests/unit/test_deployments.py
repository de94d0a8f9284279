"""Every deployment builds from the one table, with the schedules and triggers the lifecycle relies on."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from rayline import events
from rayline.config import get_settings
from rayline.deployments.catalog import RETRAIN_DEBOUNCE, build_deployments, deployment_table
from rayline.errors import ConfigError
from rayline.ray_workloads.serving.request import RolloutRequest

pytestmark = pytest.mark.unit


def test_every_deployment_builds_with_its_schedule() -> None:
    built = {d.name: d for d in build_deployments()}
    assert set(built) == {"nightly-inference", "prepare-data", "train-model", "retrain", "serve-rollout", "monitor"}
    (nightly,) = built["nightly-inference"].schedules
    assert nightly.schedule.cron == "0 2 * * *" and nightly.schedule.timezone == "UTC"
    (monitoring,) = built["monitor"].schedules
    assert monitoring.schedule.interval == timedelta(minutes=15)
    (monitor_request,) = built["monitor"].parameters.values()
    assert monitor_request["vacuum_retention_hours"] == 168, "the monitor vacuums the night tables"
    (hourly,) = built["prepare-data"].schedules
    assert hourly.schedule.interval == timedelta(hours=1)
    assert not built["train-model"].schedules and not built["retrain"].schedules


def test_nightly_inference_accepts_a_range_the_schedule_leaves_unset() -> None:
    from prefect.utilities.callables import parameter_schema

    from rayline.ray_workloads.nightly.request import NightRequest

    built = {d.name: d for d in build_deployments()}
    (parameter,) = built["nightly-inference"].parameters
    scheduled = NightRequest.model_validate(built["nightly-inference"].parameters[parameter])
    assert scheduled == NightRequest() and not scheduled.is_range, "the scheduled run predicts yesterday: no range"
    (spec,) = [s for s in deployment_table() if s.name == "nightly-inference"]
    schema = parameter_schema(spec.flow)  # what the deployment registers as its parameter schema
    request = schema.definitions["NightRequest"]  # one form: the request's fields
    assert {"date", "date_from", "date_to", "max_concurrent_nights"} <= set(request["properties"])
    assert not schema.required and not request.get("required"), "every parameter has a default: the schedule sets none"


def test_a_scheduled_deployment_s_request_is_set_in_rayline_toml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``[deployments.nightly-inference]`` of the settings file: the scheduled runs' request, in prefect.yaml too."""
    from rayline.deployments.prefect_yaml import render_dict

    (tmp_path / "rayline.toml").write_text(
        '[deployments.nightly-inference]\nmodel = "photos@champion"\nshape = { actors = 4 }\n'
    )
    monkeypatch.chdir(tmp_path)
    get_settings()  # the file's deployment tables are no settings: not refused as unknown ones
    (nightly,) = [d for d in render_dict()["deployments"] if d["name"] == "nightly-inference"]
    request = nightly["parameters"]["request"]
    assert (request["model_name"], request["model"], request["shape"]["actors"]) == ("photos", "champion", 4)
    assert request["shape"]["batch_size"] == 64 and request["date"] is None, "the rest: the request's defaults"
    (tmp_path / "misnamed.toml").write_text("[deployments.nightly-inference]\nactors = 4\n")  # actors: a shape's
    monkeypatch.setenv("RAYLINE_CONFIG", str(tmp_path / "misnamed.toml"))
    with pytest.raises(ConfigError, match=r"\[deployments.nightly-inference\] of .*misnamed.toml"):
        build_deployments()


def test_retraining_and_rollout_are_event_triggered() -> None:
    built = {d.name: d for d in build_deployments()}
    retrain = built["retrain"]
    searched = {"tune_samples": 4, "promote_to": "challenger"}  # a trigger's request replaces the deployment's
    assert retrain.parameters == {"request": searched}
    by_event = {next(iter(t.expect)): t for t in retrain.triggers}
    assert set(by_event) == {events.DATA_ARRIVED, events.LABELS_ARRIVED, events.DRIFT_DETECTED}
    arrived = by_event[events.DATA_ARRIVED]
    assert arrived.match.model_dump() == {events.RETRAIN_LABEL: "true"}, "only arrivals above the threshold"
    assert arrived.parameters == {"request": {**searched, "source_uri": "{{ event.payload.source_uri }}"}}, (
        "trains on the prefix that arrived"
    )
    labels = by_event[events.LABELS_ARRIVED]
    assert labels.match.model_dump() == {events.RETRAIN_LABEL: "true"}, "only once enough labels came back"
    on_labels = {**searched, "model_name": "{{ event.payload.model }}", "labelled": True}
    assert labels.parameters == {"request": on_labels}, "on its labelled photos"
    assert labels.for_each == {"rayline.model"}, "one model's labels don't swallow another's"
    drift = by_event[events.DRIFT_DETECTED]
    assert drift.parameters == {"request": {**searched, "model_name": "{{ event.payload.model }}"}}, (
        "retrains the model that drifted"
    )
    for trigger in retrain.triggers:  # debounced: the first event fires, the rest of the window is ignored
        assert trigger.posture.value == "Reactive" and trigger.threshold == 1 and trigger.within == RETRAIN_DEBOUNCE

    (rollout,) = built["serve-rollout"].triggers
    assert rollout.expect == {events.ALIAS_MOVED}
    assert rollout.match.model_dump() == {"rayline.alias": "challenger"}, "only a challenger is canaried"
    asked = rollout.parameters["request"]  # the whole request: a trigger's parameters replace the deployment's
    assert (asked["candidate"], asked["model_name"]) == ("v{{ event.payload.version }}", "{{ event.payload.model }}")
    assert RolloutRequest.model_validate({**asked, "candidate": "v3", "model_name": "digits"}) == RolloutRequest(
        candidate="v3", model_name="digits"
    ), "the rest: the deployment's request"


def test_prefect_yaml_is_the_table_and_valid_for_prefect_deploy() -> None:
    import yaml
    from prefect.cli.deploy._models import PrefectYamlModel
    from prefect.events.schemas.deployment_triggers import DeploymentTriggerTypes
    from pydantic import TypeAdapter

    from rayline.deployments.prefect_yaml import ROOT, render

    committed = (ROOT / "prefect.yaml").read_text()
    assert committed == render(), (
        "prefect.yaml is stale: run `python -m rayline.deployments.prefect_yaml > prefect.yaml`"
    )
    model = PrefectYamlModel.model_validate(yaml.safe_load(committed))
    assert {d.name for d in model.deployments} == {d.name for d in build_deployments()}
    triggers = TypeAdapter(DeploymentTriggerTypes)
    for deployment in model.deployments:
        assert deployment.entrypoint and (ROOT / deployment.entrypoint.split(":")[0]).is_file()
        for trigger in deployment.triggers or []:
            triggers.validate_python(trigger)


def test_train_model_takes_one_request_and_each_retrain_trigger_carries_a_whole_one() -> None:
    from prefect.utilities.callables import parameter_schema

    from rayline.ray_workloads.training.request import TrainRequest

    for spec in deployment_table():  # each flow's form is its request, and a deployment's parameters are one
        schema = parameter_schema(spec.flow)
        assert set(schema.properties) == {"request"} and not schema.required, spec.name
        assert set(spec.parameters) <= {"request"}, spec.name
    (retrain,) = [s for s in deployment_table() if s.name == "retrain"]
    for trigger in retrain.triggers:  # Prefect replaces the deployment's request with the trigger's, whole
        asked = {k: "digits" if "{{" in str(v) else v for k, v in trigger.parameters["request"].items()}
        request = TrainRequest(**asked)
        assert (request.tune_samples, request.promote_to) == (4, "challenger"), trigger.name


def test_up_deploys_again_when_the_file_pool_folder_or_flows_code_changed(tmp_path: Path) -> None:
    """`up` again skips `prefect deploy` only on an unchanged stamp: any of its inputs changed deploys again."""
    from rayline.cli.work_pool import deploy_stamp

    for package in ("flows", "tasks", "deployments"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "one.py").write_text("def one(request: int) -> None: ...\n")
    stamp = deploy_stamp("rayline", tmp_path, "deployments: []\n")
    assert deploy_stamp("rayline", tmp_path, "deployments: []\n") == stamp, "the same inputs, the same stamp"
    assert deploy_stamp("other-pool", tmp_path, "deployments: []\n") != stamp
    assert deploy_stamp("rayline", tmp_path, "deployments: [x]\n") != stamp
    (tmp_path / "flows" / "one.py").write_text("def one(request: str) -> None: ...\n")  # a parameter's schema
    assert deploy_stamp("rayline", tmp_path, "deployments: []\n") != stamp
