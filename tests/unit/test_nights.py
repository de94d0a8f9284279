"""Backfill ranges: which nights, how many at once, how each night's outcome is judged and printed."""

from __future__ import annotations

import pickle
from datetime import date

import pytest
from typer.testing import CliRunner

from rayline.cli.main import NIGHT_OPTIONS
from rayline.errors import ConfigError, InputDataError, NightsFailed
from rayline.ray_workloads.execution.plan import PlanPolicy
from rayline.ray_workloads.nightly.request import MAX_NIGHTS, BackfillResult, NightOutcome, NightRequest, NightShape

pytestmark = pytest.mark.unit

# the CLI's names for the fields, as it passes them to the model (the rest are the fields' own, dashed)
CLI = {"date": "--date", **NIGHT_OPTIONS}


def _nights(
    date: str | None, date_from: str | None, date_to: str | None, labels: dict[str, str] | None = None
) -> list[date] | None:
    """The request's range, or None for the single-night path."""
    asked = NightRequest.model_validate({"date": date, "date_from": date_from, "date_to": date_to}, context=labels)
    return asked.nights() if asked.is_range else None


def test_no_range_is_the_single_night_path() -> None:
    assert _nights(None, None, None) is None
    assert _nights("2026-11-28", None, None) is None
    assert NightRequest(date="2026-11-28").nights() == [date(2026, 11, 28)]


def test_a_range_is_every_night_inclusive_in_order() -> None:
    days = _nights(None, "2026-12-30", "2027-01-02")
    assert days == [date(2026, 12, 30), date(2026, 12, 31), date(2027, 1, 1), date(2027, 1, 2)]
    assert _nights(None, "2026-11-28", "2026-11-28") == [date(2026, 11, 28)]


def test_date_and_a_range_exclude_each_other_naming_both() -> None:
    with pytest.raises(ConfigError, match="date and date_from/date_to exclude each other"):
        _nights("2026-11-28", "2026-11-01", "2026-11-02")
    with pytest.raises(ConfigError, match="--date and --from/--to exclude each other"):
        _nights("2026-11-28", None, "2026-11-02", CLI)


def test_a_range_needs_both_ends() -> None:
    with pytest.raises(ConfigError, match="--from needs --to"):
        _nights(None, "2026-11-01", None, CLI)
    with pytest.raises(ConfigError, match="date_to needs date_from"):
        _nights(None, None, "2026-11-01")


def test_a_backwards_range_is_refused() -> None:
    with pytest.raises(ConfigError, match="--from 2026-11-03 is after --to 2026-11-01"):
        _nights(None, "2026-11-03", "2026-11-01", CLI)


def test_a_bad_day_names_its_option() -> None:
    with pytest.raises(InputDataError, match="--to must look like 2026-11-28, got '2026-13-01'"):
        _nights(None, "2026-11-01", "2026-13-01", CLI)
    with pytest.raises(InputDataError, match="date_from must look like"):
        _nights(None, "yesterday", "2026-11-01")


def test_an_over_long_range_is_refused() -> None:
    assert len(_nights(None, "2024-01-01", "2024-12-31") or []) == MAX_NIGHTS  # a leap year
    with pytest.raises(ConfigError, match="is 367 nights; at most 366 at once: split the range"):
        _nights(None, "2024-01-01", "2025-01-01")


def test_a_range_input_prefix_needs_the_day_placeholder() -> None:
    def asked(input_uri: str | None, labels: dict[str, str] | None = None) -> NightRequest:
        values = {"date_from": "2026-11-01", "date_to": "2026-11-02", "input_uri": input_uri}
        return NightRequest.model_validate(values, context=labels)

    asked(None)
    asked("s3://b/incoming-photos/dt={dt}")
    with pytest.raises(ConfigError, match="--source 's3://b/in/dt=2026-11-28' is one prefix for every night"):
        asked("s3://b/in/dt=2026-11-28", CLI)


def test_night_input_uri() -> None:
    day = date(2026, 11, 28)
    assert NightRequest().input_for(day, "/data") == "/data/incoming/dt=2026-11-28"
    assert NightRequest(input_uri="s3://b/p/dt={dt}/").input_for(day, "/data") == "s3://b/p/dt=2026-11-28/"
    assert NightRequest(input_uri="s3://b/one").input_for(day, "/data") == "s3://b/one"


@pytest.mark.parametrize(
    ("cpus", "actors", "per_actor", "count", "expected"),
    [
        (4.0, 2, 0.5, 10, 4),  # 1 CPU a night
        (4.0, 2, 0.5, 3, 3),  # never more than there are nights
        (1.0, 4, 0.5, 10, 1),  # one night is more than the cluster: still one at a time
        (0.0, 2, 0.5, 5, 1),
        (16.0, 3, 1.0, 30, 5),  # floor: a sixth night's actors would wait
    ],
)
def test_nights_at_once(cpus: float, actors: int, per_actor: float, count: int, expected: int) -> None:
    assert NightShape(actors=actors, cpus_per_actor=per_actor).nights_at_once(cpus, count) == expected


def _result() -> BackfillResult:
    return BackfillResult(
        model_name="digits",
        model="digits v2",
        date_from="2026-11-26",
        date_to="2026-11-28",
        max_concurrent_nights=2,
        nights=[
            NightOutcome(
                dt="2026-11-26",
                state="committed",
                inputs=5,
                predictions=4,
                errors=1,
                predictions_version=3,
                errors_version=2,
            ),
            NightOutcome(dt="2026-11-27", state="failed", message="InputDataError: no input objects under /x"),
            NightOutcome(dt="2026-11-28", state="skipped", message="another run committed that night"),
        ],
    )


def test_failure_message_names_each_failed_night() -> None:
    result = _result()
    assert [n.dt for n in result.failed] == ["2026-11-27"]
    assert result.failure_message() == (
        "1 of 3 nights of digits failed (2026-11-27: InputDataError: no input objects under /x)"
    )


def test_nights_failed_keeps_its_outcomes_when_copied() -> None:
    error = NightsFailed("1 of 3 nights failed", _result())
    copied = pickle.loads(pickle.dumps(error))
    assert str(copied) == "1 of 3 nights failed" and copied.result == error.result


def test_backfill_summary_prints_a_line_per_night() -> None:
    import typer

    from rayline.cli.summaries import print_backfill_summary

    app = typer.Typer()
    app.command()(lambda: print_backfill_summary(_result()))
    out = CliRunner().invoke(app, []).output
    assert "digits v2, 2026-11-26 to 2026-11-28 (3 nights, 2 at a time): 1 committed, 1 skipped, 1 failed" in out
    lines = [line.strip() for line in out.splitlines() if line.startswith("  2026-")]
    assert lines == [
        "2026-11-26  committed  5 inputs → 4 predictions + 1 errors  (Delta versions: predictions 3, errors 2)",
        "2026-11-27  FAILED     InputDataError: no input objects under /x",
        "2026-11-28  skipped    another run committed that night",
    ]


def test_a_backfill_line_names_the_listed_objects_a_night_skipped() -> None:
    from rayline.cli.summaries import backfill_night_line

    night = NightOutcome(
        dt="2026-11-26",
        state="committed",
        inputs=5,
        predictions=5,
        errors=0,
        predictions_version=3,
        errors_version=2,
        skipped_objects={"folder marker": 1, "hidden or underscore name": 2},
    )
    assert backfill_night_line(night).strip() == (
        "2026-11-26  committed  5 inputs → 5 predictions + 0 errors; skipped 3 (folder marker 1, hidden or "
        "underscore name 2)  (Delta versions: predictions 3, errors 2)"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--date", "2026-11-28", "--from", "2026-11-01", "--to", "2026-11-02"], "--date and --from/--to exclude"),
        (["--from", "2026-11-02", "--to", "2026-11-01"], "--from 2026-11-02 is after --to 2026-11-01"),
        (["--from", "2026-11-01", "--to", "11/02/2026"], "--to must look like 2026-11-28"),
        (["--from", "2026-11-01"], "--from needs --to"),
        (["--from", "2026-11-01", "--to", "2026-11-02", "--source", "/in/x"], "put {dt} where the day goes"),
    ],
)
def test_cli_refuses_a_bad_range_before_starting_anything(args: list[str], message: str) -> None:
    from rayline.cli import app

    done = CliRunner().invoke(app, ["nightly-inference", *args])
    assert done.exit_code == 3, done.output
    assert message in " ".join(done.output.split())


def test_the_cli_passes_the_flow_one_request_of_its_options(
    local_storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each option is a field of the request (a nested model's too), parsed and checked once, by the model."""
    from rayline.cli import app
    from rayline.flows import nightly_inference as flow_module
    from rayline.ray_workloads.nightly.batch_inference import NightSkipped

    asked: list[NightRequest] = []

    def flow(request: NightRequest) -> NightSkipped:
        asked.append(request)
        return NightSkipped(model_name="photos", dt="2026-11-01", committed_by=None, message="fake")

    monkeypatch.setattr(flow_module, "nightly_inference", flow)
    options = ["--from", "2026-11-01", "--to", "2026-11-02", "--model", "photos@v2", "--source", "/in/dt={dt}"]
    options += ["--actors", "3", "--plan", "off", "--min-plan-agreement", "0.9", "--json"]
    done = CliRunner().invoke(app, ["nightly-inference", *options])
    assert done.exit_code == 0, done.output
    assert asked == [
        NightRequest(
            date_from="2026-11-01",
            date_to="2026-11-02",
            model="v2",
            model_name="photos",
            input_uri="/in/dt={dt}",
            shape=NightShape(actors=3),
            plan=PlanPolicy(mode="off", min_agreement=0.9),
        )
    ]


def test_every_field_of_the_request_is_an_option_of_the_command() -> None:
    """A night option is written once, on the model: the command's options are its fields, nested ones too."""
    import typer

    from rayline.cli import app

    command = typer.main.get_group(app).commands["nightly-inference"]
    fields = {*NightRequest.model_fields, *NightShape.model_fields, *PlanPolicy.model_fields} - {"shape", "plan"}
    assert {p.name for p in command.params} == fields | {"as_json"}
