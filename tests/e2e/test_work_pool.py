"""`rayline up`'s work pool: deployments run by a Prefect worker, and killed flow runs end `Crashed`.

Runs after test_platform.py on the same platform (tests/e2e/conftest.py); the `digits`
champion is the demo's, or an untrained one registered here when this module runs alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from rayline import storage
from rayline.seed import digit_objects
from rayline.storage.layout import INCOMING_DIR, partition_for
from tests.e2e.platform_support import AUTH, BIN, ZOMBIE_WINDOW_S

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("champions")]

# The promise: a killed run is Crashed within 3 minutes, 90 s past the zombie window of 90 s. The platform's
# window is shorter (platform_support.platform_env), the slack the same.
CRASH_DEADLINE_S = float(ZOMBIE_WINDOW_S) + 90
# One actor, small model calls: a night long enough (tens of seconds) to be killed while it runs on Ray.
SLOW_NIGHT = ["--actors", "1", "--batch-size", "4"]


@pytest.fixture(scope="module")
def champions(platform: dict[str, str]) -> Iterator[None]:
    """A `digits` champion in the platform's registry: the demo's, or an untrained one registered here."""
    from rayline.errors import RaylineError
    from rayline.models import registry
    from tests.integration.helpers import register_untrained_champion

    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAYLINE_STORAGE", platform["RAYLINE_STORAGE"])
        try:
            registry.resolve("digits", registry.CHAMPION)
        except RaylineError:  # this module runs without test_platform.py
            register_untrained_champion("digits")
        yield


@contextmanager
def _api(platform: dict[str, str]) -> Iterator[httpx.Client]:
    user, password = AUTH.split(":", 1)
    with httpx.Client(base_url=platform["PREFECT_API_URL"], auth=(user, password), timeout=30) as client:
        yield client


def _drop_night(platform: dict[str, str], day: str, count: int, size: int = 32) -> None:
    """``count`` digits under incoming/dt=<day>/, as a night's arrivals."""
    night = storage.join(platform["RAYLINE_STORAGE"], INCOMING_DIR, partition_for(date.fromisoformat(day)))
    for index, (key, data) in enumerate(digit_objects(size)):
        if index == count:
            break
        # not fsynced: arrivals a test reads at once (3,594 fsyncs took 25 s of a loaded machine)
        storage.write_bytes_atomic(storage.join(night, key), data, durable=False)


def _flow_run(client: httpx.Client, run_id: str) -> dict[str, Any]:
    answer = client.get(f"/flow_runs/{run_id}")
    answer.raise_for_status()
    return dict(answer.json())


def _state(client: httpx.Client, run_id: str) -> str:
    return str((_flow_run(client, run_id).get("state") or {}).get("type"))


def _run_deployment(client: httpx.Client, name: str, parameters: dict[str, Any]) -> str:
    deployment = client.get(f"/deployments/name/{name}")
    deployment.raise_for_status()
    created = client.post(f"/deployments/{deployment.json()['id']}/create_flow_run", json={"parameters": parameters})
    created.raise_for_status()
    return str(created.json()["id"])


def _ray_list(kind: str, platform: dict[str, str], *filters: str) -> list[dict[str, Any]]:
    """`ray list <kind>` as an operator would run it, as JSON."""
    args = [a for f in filters for a in ("--filter", f)]
    done = subprocess.run(
        [str(BIN / "ray"), "list", kind, *args, "--format", "json", "--limit", "10000"],
        env=platform, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    listed = done.stdout.strip()
    return list(json.loads(listed)) if listed.startswith("[") else []  # else "No resource in the cluster"


def _jobs_of(platform: dict[str, str], pid: int) -> list[dict[str, Any]]:
    """The Ray jobs whose driver had pid ``pid``: this process's, and those of earlier processes with that pid.

    A test session goes through the 32,768 pids more than once (Ray starts many workers), so an older,
    ended driver may have had the same pid. (`ray list jobs` gives driver jobs no start time to tell them
    apart by; a RUNNING one is this process's, as no two living processes share a pid.)
    """
    return [j for j in _ray_list("jobs", platform) if str((j.get("driver_info") or {}).get("pid")) == str(pid)]


def _alive_actors_of(platform: dict[str, str], job_id: str) -> list[str]:
    return [str(a["class_name"]) for a in _ray_list("actors", platform, "state=ALIVE", f"job_id={job_id}")]


def _wait_for(predicate: Any, timeout_s: float, what: str, context: Any = lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}\n{context()}"
        time.sleep(1)


def test_up_deployed_prefect_yaml_into_its_work_pool(platform: dict[str, str]) -> None:
    """Every deployment of prefect.yaml is in `up`'s process pool, as `prefect deploy --all` registered it."""
    import yaml  # type: ignore[import-untyped]

    from tests.support import REPO_ROOT

    committed = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())
    with _api(platform) as client:
        pool = client.get("/work_pools/rayline").json()
        assert pool["type"] == "process"
        deployments = client.post("/deployments/filter", json={}).json()
    found = {d["name"]: d for d in deployments}
    assert set(found) == {d["name"] for d in committed["deployments"]}
    for spec in committed["deployments"]:
        deployment = found[spec["name"]]
        assert deployment["work_pool_name"] == "rayline" and deployment["entrypoint"] == spec["entrypoint"]
        # prefect deploy resolved {{ $RAYLINE_HOME }}: the worker's runs start in this checkout
        (step,) = deployment["pull_steps"]
        assert step == {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO_ROOT)}}


def test_nightly_inference_runs_through_the_worker(platform: dict[str, str]) -> None:
    """A deployment run is picked up by `up`'s worker, runs as its own process, and commits its night."""
    from rayline.tables.prediction_reads import read_night_pair

    day = "2026-01-05"
    _drop_night(platform, day, count=40)
    with _api(platform) as client:
        run_id = _run_deployment(client, "nightly-inference/nightly-inference", {"request": {"date": day}})
        _wait_for(lambda: _state(client, run_id) in {"COMPLETED", "FAILED", "CRASHED"}, 420, "the run ending")
        run = _flow_run(client, run_id)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["work_pool_name"] == "rayline" and run["infrastructure_pid"], "started by the pool's worker"
    night = read_night_pair(platform["RAYLINE_STORAGE"], "digits", day)
    assert night.predictions.num_rows + night.errors.num_rows == 40
    assert night.commit.run_id, night.commit


# How a flow-run process is stepped until its run is Running (_step_until)
_STARTING = {"run_s": 0.5, "stopped_s": 0.0}


def _step_until(
    pid: int, group: bool, ready: Any, what: str, said: Any = lambda: "", run_s: float = 0.2, stopped_s: float = 0.8
) -> None:
    """Step ``pid`` (SIGCONT, ``run_s``, SIGSTOP, stopped ``stopped_s`` in all) from now until ``ready()``
    holds, asked while it is stopped; returns with ``pid`` stopped.

    The process is stopped before this is called, as soon as it exists. Until its flow run is
    Running it is still starting (imports, Prefect's client, the run's creation), and is stepped
    0.5 s at a time with no pause (``run_s=0.5, stopped_s=0``): stepped a fifth of the time from its
    first instant, its start-up took 80 s of a loaded machine. After that it never runs more than
    one 0.2 s step unobserved, so its flow run is mid-way when it is killed however fast the night goes.
    (A night of 1,797 digits takes 3 s of the process's time on an idle machine: killing a process
    that ran free until it was seen on Ray raced the night, and a run that committed first ended
    Completed, never Crashed.)
    """
    send = os.killpg if group else os.kill
    deadline = time.monotonic() + 300
    while True:
        stopped = time.monotonic()
        if ready():
            return
        assert time.monotonic() < deadline, f"not within 300 s: {what}\n{said()}"
        # Stopped at least 4× as long as it runs (the defaults): what ``ready`` waits for on the server's
        # side (the heartbeat's way through the events pipeline takes seconds of wall time) arrives while
        # the process has advanced a fifth as far, not while it finishes its night.
        time.sleep(max(0.0, stopped_s - (time.monotonic() - stopped)))
        send(pid, signal.SIGCONT)
        time.sleep(run_s)
        send(pid, signal.SIGSTOP)


def _running_job(platform: dict[str, str], pid: int) -> str | None:
    """The id of the RUNNING Ray job whose driver is ``pid``, if there is one."""
    running = [j for j in _jobs_of(platform, pid) if j["status"] == "RUNNING"]
    return str(running[-1]["job_id"]) if running else None


def _heartbeat_arrived(client: httpx.Client, run_id: str) -> bool:
    """Whether the API has a heartbeat of the run: the zombie automation watches a run from its first one."""
    answer = client.post(
        "/events/filter",
        json={
            "filter": {
                "event": {"name": ["prefect.flow-run.heartbeat"]},
                "resource": {"id": [f"prefect.flow-run.{run_id}"]},
            },
            "limit": 1,
        },
    )
    answer.raise_for_status()
    return bool(answer.json()["events"])


def _kill_frozen(pid: int, group: bool) -> None:
    """SIGKILL a stopped process (or group): it dies at once, as under kill -9 mid-run."""
    (os.killpg if group else os.kill)(pid, signal.SIGKILL)


def _assert_ray_job_ended(platform: dict[str, str], job_id: str) -> None:
    """Ray sees the dead driver: its job stops running and none of its actors stays alive."""

    def ended() -> bool:
        job = next((j for j in _ray_list("jobs", platform) if j["job_id"] == job_id), None)
        return job is not None and job["status"] != "RUNNING" and not _alive_actors_of(platform, job_id)

    _wait_for(ended, 60, f"Ray ending job {job_id} and removing its actors")


def _flow_run_process(run_id: str) -> int | None:
    """The process a worker started for ``run_id`` (its environment names the run)."""
    marker = f"PREFECT__FLOW_RUN_ID={run_id}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    return int(entry.name)
            except OSError:
                continue
    return None


def _started_process(run_id: str, said: Any) -> int:
    """The worker's process for ``run_id``, stopped (SIGSTOP) within ~0.1 s of its start."""
    deadline = time.monotonic() + 300
    while (pid := _flow_run_process(run_id)) is None:
        assert time.monotonic() < deadline, f"no process of flow run {run_id} within 300 s\n{said()}"
        time.sleep(0.1)
    os.kill(pid, signal.SIGSTOP)
    return pid


def _newest_cli_run(client: httpx.Client, launched: datetime) -> dict[str, Any] | None:
    """The newest nightly-inference run of no deployment, if it was created after ``launched``
    (earlier tests of the module leave runs of their own)."""
    newest = client.post(
        "/flow_runs/filter",
        json={
            "flows": {"name": {"any_": ["nightly-inference"]}},
            "flow_runs": {"deployment_id": {"is_null_": True}},
            "sort": "EXPECTED_START_TIME_DESC",
            "limit": 1,
        },
    ).json()
    fresh = newest and datetime.fromisoformat(newest[0]["created"]) >= launched
    return dict(newest[0]) if fresh else None


def _is_running(run: dict[str, Any] | None) -> bool:
    return run is not None and (run.get("state") or {}).get("type") == "RUNNING"


def _worker_log(platform: dict[str, str]) -> str:
    log = Path(platform["RAYLINE_STORAGE"]) / "state" / "logs" / "worker.log"
    return log.read_text(errors="replace")[-4000:] if log.exists() else "(no worker log)"


def test_killed_flow_runs_end_crashed_and_their_ray_actors_go(platform: dict[str, str]) -> None:
    """kill -9 of a CLI run (zombie automation, heartbeats) and of a worker's run (the worker sees it exit)."""
    for day in ("2026-01-06", "2026-01-07"):
        _drop_night(platform, day, count=1797, size=64)
    env = {**platform, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}
    output = Path(platform["RAYLINE_STORAGE"]) / "killed-cli-run.out"
    said = lambda: output.read_text(errors="replace")[-3000:]  # noqa: E731
    launched = datetime.now(UTC)
    with _api(platform) as client, output.open("wb") as out:
        cli = subprocess.Popen(
            [str(BIN / "rayline"), "nightly-inference", "--date", "2026-01-06", *SLOW_NIGHT], env=env,
            cwd=platform["RAYLINE_STORAGE"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        os.killpg(cli.pid, signal.SIGSTOP)  # stepped from its first instant (_step_until)
        try:
            found: dict[str, str] = {}

            def cli_running() -> bool:
                run = _newest_cli_run(client, launched)
                if run is not None:
                    found["run"] = str(run["id"])
                return _is_running(run)

            _step_until(cli.pid, True, cli_running, "the CLI's flow run Running", said, **_STARTING)

            def cli_on_ray() -> bool:
                """Its flow run Running, that run's first heartbeat at the API (the zombie automation
                watches a run from its first one, as in Prefect's guide), and its Ray job running."""
                run = found.get("run") or str((_newest_cli_run(client, launched) or {}).get("id") or "")
                if not run or not _is_running(_flow_run(client, run)) or not _heartbeat_arrived(client, run):
                    return False
                found["run"], job = run, _running_job(platform, cli.pid)
                if job is not None:
                    found["job"] = job
                return job is not None

            _step_until(cli.pid, True, cli_on_ray, "the CLI's flow run running on Ray after a heartbeat", said)
            cli_run, cli_job = found["run"], found["job"]
            assert _state(client, cli_run) == "RUNNING", said()
            _kill_frozen(cli.pid, group=True)
            cli_killed = time.monotonic()
        finally:
            if cli.poll() is None:
                os.killpg(cli.pid, signal.SIGKILL)
            cli.wait(timeout=60)
        _assert_ray_job_ended(platform, cli_job)

        night = {"request": {"date": "2026-01-07", "shape": {"actors": 1, "batch_size": 4}}}
        worker_run = _run_deployment(client, "nightly-inference/nightly-inference", night)
        worker_said = lambda: _worker_log(platform)  # noqa: E731
        pid = _started_process(worker_run, worker_said)
        running = lambda: _state(client, worker_run) == "RUNNING"  # noqa: E731
        _step_until(pid, False, running, "the worker's flow run Running", worker_said, **_STARTING)
        seen: dict[str, str] = {}

        def worker_on_ray() -> bool:
            """Its flow run Running and its Ray job running."""
            job = _running_job(platform, pid) if _state(client, worker_run) == "RUNNING" else None
            if job is not None:
                seen["job"] = job
            return job is not None

        _step_until(pid, False, worker_on_ray, "the worker's flow run running on Ray", worker_said)
        worker_job = seen["job"]
        assert _state(client, worker_run) == "RUNNING", worker_said()
        _kill_frozen(pid, group=False)
        worker_killed = time.monotonic()
        _assert_ray_job_ended(platform, worker_job)

        for run_id, killed in ((worker_run, worker_killed), (cli_run, cli_killed)):
            left = CRASH_DEADLINE_S - (time.monotonic() - killed)
            _wait_for(
                lambda run_id=run_id: _state(client, run_id) == "CRASHED", left, f"flow run {run_id} Crashed",
                lambda run_id=run_id: f"{_flow_run(client, run_id)['state']}\n{worker_said()}",
            )  # fmt: skip
