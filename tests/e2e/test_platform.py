"""The operated system on loopback: `rayline up` on PostgreSQL, the demo against it, the Prefect UI, event-driven
retraining, cancellation reaching Ray, `down` and `up` again keeping the runs, and `rayline down` leaving no process
behind.

One `up` for the module (it costs a Prefect server, a Ray head and a Prefect worker); the tests run in
file order, each on what the previous ones left, as a user's session would.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from rayline.cli.platform import SERVICES
from rayline.lineage.openlineage_events import dataset_id, dataset_uri
from rayline.lineage.openlineage_facets import ERROR_BUDGET_FACET
from rayline.ray_workloads.architectures.build import imagenet_classes
from tests.e2e.platform_support import (
    AUTH,
    password_shown,
    program_output,
    run_program,
    run_rayline,
    service_records,
    up_env,
)
from tests.e2e.programs import (
    burst_of_arrivals,
    cancel_training_run,
    deployment_run_states,
    newest_completed_run,
    ray_lines_in_prefect_logs,
)
from tests.lineage_support import assert_drawable, stored_events, wait_for_materializations
from tests.monitoring_configs import dashboard_queries, scraped_series, series_in
from tests.postgres_support import ROLE, PostgresServer
from tests.support import REPO_ROOT, debian_tool

pytestmark = pytest.mark.e2e

SCREENSHOTS = Path(os.environ.get("RAYLINE_TEST_ARTIFACTS", REPO_ROOT / "test-artifacts"))


def test_up_twice_starts_nothing_new(platform: dict[str, str]) -> None:
    root = Path(platform["RAYLINE_STORAGE"])
    before = service_records(root)
    again = run_rayline(["up"], platform)
    assert again.returncode == 0, again.stderr
    assert all(f"{name:<12} running" in again.stdout for name in SERVICES), again.stdout
    assert service_records(root) == before
    assert f"Prefect UI       http://127.0.0.1:{platform['RAYLINE_PREFECT_PORT']}" in again.stdout
    assert f"Ray metrics      http://127.0.0.1:{platform['RAYLINE_RAY_METRICS_PORT']}/metrics" in again.stdout
    assert f"MLflow UI        {platform['MLFLOW_TRACKING_URI']}" in again.stdout
    assert httpx.get(f"{platform['MLFLOW_TRACKING_URI']}/health").status_code == 200


def test_the_prefect_api_asks_for_basic_auth(platform: dict[str, str]) -> None:
    api = platform["PREFECT_API_URL"]
    assert httpx.post(f"{api}/flows/filter", json={}).status_code == 401
    assert httpx.post(f"{api}/flows/filter", json={}, auth=tuple(AUTH.split(":", 1))).status_code == 200  # type: ignore[arg-type]
    assert httpx.get(f"{api}/health").status_code == 200, "probes stay open"


def test_a_burst_of_labelled_arrivals_starts_exactly_one_retraining(platform: dict[str, str]) -> None:
    # a prefix with nothing under it: the triggered run fails at once instead of training for minutes
    prefix = str(Path(platform["RAYLINE_STORAGE"]) / "arrivals-for-the-burst-test")
    done = run_program(burst_of_arrivals, [prefix], platform, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "below 0" in done.stdout, done.stdout
    assert f"burst {[prefix]!r}" in done.stdout, "one run, on the prefix that arrived: " + done.stdout


def test_demo_runs_on_the_platform(platform: dict[str, str]) -> None:
    """`rayline demo` against `up` (docs/operations.md): the whole lifecycle on its cluster, recorded by its
    Prefect server."""
    done = run_rayline(["demo"], platform, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    # a quiet terminal: rayline's progress and summaries; Ray's and Prefect's lines went to the named log file
    printed = (done.stdout + done.stderr).splitlines()
    assert len(printed) <= 80, "\n".join(printed)
    log_file = Path(done.stderr.split("Prefect task lines: ")[1].split(" (--verbose")[0])  # a note: stderr
    assert log_file.parent == Path(platform["RAYLINE_STORAGE"]) / "state" / "logs" and log_file.stat().st_size > 0
    assert "  done preprocess" in out and "  done tune" in out and "12/12 epochs" in out, out
    assert "prepare-data finished" in out
    assert "objects ingested   1801" in out
    assert "train 1447, val 175, test 175" in out
    assert "errors             4" in out
    assert "train-model finished" in out
    assert "4 trials" in out and "stopped early" in out
    accuracy = float(out.split("test accuracy")[1].split()[0])
    assert accuracy >= 0.95, out
    assert "baseline: first champion" in out
    # the tuned model beats the first champion on the same 175 test images, image by image, beyond chance
    registered = out.split("registered         digits v2: ")[1].splitlines()[0]
    assert registered.startswith("v2 beats champion v1 on 175 test images: ") and " ≤ 0.05; " in registered, registered
    assert "alias              challenger" in out
    data = Path(platform["RAYLINE_STORAGE"])
    assert (data / "models" / "digits" / "v2" / "weights.pt").is_file()
    assert f"serving v1 at http://127.0.0.1:{platform['RAYLINE_SERVE_PORT']}" in out
    assert "rolling out v2 under load" in out
    # v2 became champion under load: by the demo's own rollout, or by the serve-rollout deployment that
    # registering the challenger triggered (one rollout per model at a time: the other waits, then finds it done)
    assert "serve-rollout finished" in out, out
    assert "v2 passed 3 steps and is champion" in out or "v2 already serves all traffic (another rollout" in out, out
    load = out.split("load during the rollout: ")[1].splitlines()[0]
    sent = int(load.split()[0])
    assert sent > 50 and f"(200: {sent})" in load and load.endswith("connection errors: 0"), load
    assert "nightly-inference finished" in out
    assert "1803 inputs → 1799 predictions + 4 errors with digits v2" in out
    # v1, no longer champion, scored in the night's shadow: the same images, decoded once
    shadow = out.split("  shadow             ")[1].splitlines()[0]
    assert shadow.startswith("v1: agreement ") and " on 1,799 images" in shadow, shadow
    # the quality loop's first turn: a quarter of the night's 1797 digits labelled, back, measured
    assert "  labels back        450 labels imported" in out, out
    quality = out.split("  labelled accuracy  ")[1].splitlines()[0]
    assert " digits v2: right on " in quality and " of 450 (" in quality, quality
    assert float(quality.split("(")[1].split("%")[0]) >= 90, quality
    shadowed = out.split("  shadow's accuracy  ")[1].splitlines()[0]
    assert " digits v1: right on " in shadowed and " of 450 (" in shadowed, shadowed
    assert len(list(data.glob("predictions/model_name=digits/dt=*/part-*.parquet"))) >= 1
    assert list(data.glob("predictions/_delta_log/*.json")) and list(data.glob("prediction_errors/_delta_log/*.json"))
    # the outside model's walk: the user's ResNet-18 registered, a night of photos, one photo served
    assert "bring your own model" in out
    assert "registered         photos v1: resnet18, 1000 ImageNet classes, resize 256, centre crop 224" in out, out
    night = out.split("night of photos    ")[1].splitlines()[0]
    assert night.startswith("103 inputs → 100 predictions + 3 errors"), night
    assert len(list(data.glob("predictions/model_name=photos/dt=*/part-*.parquet"))) >= 1
    served = out.split("/models/photos/predict  a real photo → ")[1].splitlines()[0]
    assert served.rsplit(" (", 1)[0] in imagenet_classes(), served
    assert f"the Prefect UI of {platform['PREFECT_API_URL']}" in out
    # the triggered rollout ended well too, whichever of the two did the work
    deadline = time.monotonic() + 120
    while (states := _deployment_run_states("serve-rollout", platform)) != ["COMPLETED"]:
        assert time.monotonic() < deadline and len(states) <= 1, states
        time.sleep(2)


def test_the_demos_openlineage_events_draw_its_runs(platform: dict[str, str]) -> None:
    """The demo's events read back from the file transport (docs/lineage.md): its flow runs parent their tasks',
    the subflow its caller's, the triggered rollout its trigger's run, and every output has its facets."""
    events = stored_events(platform["RAYLINE_STORAGE"])
    flows = ("train-model", "prepare-data", "serve-rollout", "nightly-inference", "import-labels", "register-model")
    assert_drawable(events, flows)
    parents = {
        (e["job"]["name"], e["run"]["facets"]["parent"]["job"]["name"])
        for e in events
        if "parent" in e["run"]["facets"]
    }
    assert ("prepare-data", "train-model") in parents and ("batch-inference", "nightly-inference") in parents
    assert any(job == "serve-rollout" and "/trigger/" in parent for job, parent in parents), sorted(parents)
    budgets = [
        o["facets"][ERROR_BUDGET_FACET] for e in events for o in e["outputs"] if ERROR_BUDGET_FACET in o["facets"]
    ]
    assert {(b["rows"], b["errorRows"]) for b in budgets} >= {(1803, 4), (103, 3)}, budgets


def test_the_demos_tables_and_registry_versions_are_prefect_assets(platform: dict[str, str]) -> None:
    """What the OpenLineage events say each night wrote, Prefect's API holds as asset events under the same URI."""
    root = platform["RAYLINE_STORAGE"]
    table, *versions = (str(Path(root) / name) for name in ("predictions", "models/digits/v2", "models/photos/v1"))
    keys = {dataset_uri(uri) for uri in (table, *versions)}
    user, password = AUTH.split(":", 1)
    found = wait_for_materializations(platform["PREFECT_API_URL"], lambda made: keys <= set(made), (user, password))
    outputs = [o for e in stored_events(root) if e["eventType"] == "COMPLETE" for o in e["outputs"]]
    written = {
        (o["facets"]["version"]["datasetVersion"], o["outputFacets"]["outputStatistics"]["rowCount"])
        for o in outputs if o["name"] == dataset_id(table)[1]
    }  # fmt: skip
    made = {(str(m["payload"]["version"]), m["payload"]["rows"]) for m in found[dataset_uri(table)]}
    assert made == written and len(made) >= 2, (made, written)


def test_ray_metrics_port_exports_serves_own_metrics(platform: dict[str, str]) -> None:
    """Prometheus' stable target (docs/monitoring.md): Ray's fixed metrics port carries Serve's
    per-deployment series."""
    url = f"http://127.0.0.1:{platform['RAYLINE_RAY_METRICS_PORT']}/metrics"
    serve_port = platform["RAYLINE_SERVE_PORT"]
    deadline = time.monotonic() + 120  # Ray's agents export every few seconds; Serve's series appear after traffic
    while True:
        # traffic of our own: the test must not depend on what an earlier test left behind
        httpx.get(f"http://127.0.0.1:{serve_port}/healthz", timeout=10)
        httpx.get(f"http://127.0.0.1:{serve_port}/models", timeout=10)
        serve_lines = [line for line in httpx.get(url, timeout=10).text.splitlines() if line.startswith("ray_serve_")]
        if any(line.startswith("ray_serve_deployment_request_counter") for line in serve_lines):
            break
        assert time.monotonic() < deadline, f"no Serve request counter at {url}: {serve_lines[:20]}"
        time.sleep(3)
    assert any('deployment="' in line for line in serve_lines), serve_lines[:20]
    # the shipped dashboard names only series found here: Ray Serve's on this scrape, rayline's in the file the
    # demo's monitor run wrote (serving checked, labels imported)
    found = scraped_series(httpx.get(url, timeout=10).text)
    found |= scraped_series((Path(platform["RAYLINE_STORAGE"]) / "monitoring" / "digits.prom").read_text())
    missing = series_in(dashboard_queries()) - found
    assert not missing, f"the dashboard queries series no real scrape has: {sorted(missing)}"


def _deployment_run_states(deployment: str, env: dict[str, str]) -> list[str]:
    done = run_program(deployment_run_states, [deployment], env, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


# Chromium on its own asks Google's services (updates, safe browsing, secure DNS probes of 8.8.8.8 over
# HTTPS, domain reliability): a browser that only looks at the loopback asks nothing else.
CHROMIUM_LOOPBACK_ONLY = [
    "--no-sandbox",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-domain-reliability",
    "--disable-sync",
    "--no-pings",
    "--dns-prefetch-disable",
    "--disable-features=AsyncDns,DnsOverHttps,OptimizationHints,MediaRouter,AutofillServerCommunication,Translate",
    # no name is looked up; Chromium maps IP literals too unless excluded, and the UI is at 127.0.0.1
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
]


def test_the_prefect_ui_shows_the_runs(platform: dict[str, str]) -> None:
    """Headless Chromium logs into the UI with the auth string and finds the demo's runs on the runs page."""
    from playwright.sync_api import expect, sync_playwright

    count, newest = program_output(newest_completed_run, platform).split()
    assert int(count) >= 4, "prepare-data, train-model, serve-rollout, nightly-inference at least"
    ui = f"http://127.0.0.1:{platform['RAYLINE_PREFECT_PORT']}"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shot = SCREENSHOTS / "prefect-ui-runs.png"
    with sync_playwright() as driver:
        browser = driver.chromium.launch(
            executable_path=debian_tool("chromium", "chromium"), args=CHROMIUM_LOOPBACK_ONLY
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{ui}/runs")
            password = page.locator("input[type=password]")
            expect(password).to_be_visible(timeout=30_000)  # the API asks for auth: the UI shows its login
            password.fill(AUTH)
            password.press("Enter")
            page.goto(f"{ui}/runs")
            expect(page.get_by_text(newest).first).to_be_visible(timeout=60_000)
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000


def test_ray_stats_epochs_and_trials_reach_the_prefect_task_logs(platform: dict[str, str]) -> None:
    """What Ray's workers log stays in Ray's files; rayline's tasks put the essentials into Prefect's logs."""
    seen = json.loads(program_output(ray_lines_in_prefect_logs, platform).strip().splitlines()[-1])
    assert seen == sorted(["Ray Data execution stats:", "Ray Tune trials (best first):", "epoch 11: train loss"])


def test_cancelling_a_flow_run_stops_its_ray_work(platform: dict[str, str]) -> None:
    out = program_output(cancel_training_run, platform, timeout=420)
    assert "training ['" in out and "RayTrainWorker" in out, out
    assert "after cancel []" in out, "Ray Train actors outlived the cancelled flow run: " + out
    assert "state CANCELLED" in out, out


def test_down_then_up_again_keeps_the_runs_and_the_mlflow_mirror(
    platform: dict[str, str], postgres: PostgresServer
) -> None:
    """The Prefect server and MLflow keep their tables on the platform's PostgreSQL (RAYLINE_DATABASE_URL):
    after `down` and `up` again the demo's runs and the registry's MLflow mirror are as they were. Last of the
    module: test_work_pool.py goes on on the platform this `up` started."""
    root = Path(platform["RAYLINE_STORAGE"])
    runs, mirror = _completed_runs(platform), _mlflow_mirror(platform["MLFLOW_TRACKING_URI"])
    deployed = _deployments_updated(platform)
    # the demo's: digits v1 and v2, the champion among them
    assert len(runs) >= 4 and len(mirror["digits"][0]) >= 2 and "champion" in mirror["digits"][1], (runs, mirror)
    stopped = run_rayline(["down"], up_env(platform), timeout=120)
    assert stopped.returncode == 0 and all(f"{n:<12} stopped" in stopped.stdout for n in SERVICES), stopped.stdout
    # nothing runs: what is kept is on PostgreSQL, none of it in SQLite files of the state folder
    assert _count(postgres, "prefect", "SELECT count(*) FROM flow_run WHERE state_type = 'COMPLETED'") >= len(runs)
    assert _count(postgres, "mlflow", "SELECT count(*) FROM model_versions") == sum(len(v) for v, _ in mirror.values())
    assert not list((root / "state").glob("**/*.db"))
    again = run_rayline(["up"], up_env(platform))
    assert again.returncode == 0, again.stdout + again.stderr
    assert all(f"{name:<12} started" in again.stdout for name in SERVICES), again.stdout
    server = f"postgresql://{ROLE}:***@127.0.0.1:{postgres.port}"
    assert f"Prefect database {server}/prefect" in again.stdout and f"MLflow database  {server}/mlflow" in again.stdout
    assert password_shown(root, platform["RAYLINE_DATABASE_URL"], stopped.stdout, again.stdout, again.stderr) == []
    assert runs <= _completed_runs(platform)
    assert _mlflow_mirror(platform["MLFLOW_TRACKING_URI"]) == mirror
    # the same file, pool and flows: `up` again kept the deployments rather than deploying them again
    assert len(deployed) == 6 and _deployments_updated(platform) == deployed


def _deployments_updated(platform: dict[str, str]) -> dict[str, str]:
    """Each deployment's name and when the server last changed it."""
    user, password = AUTH.split(":", 1)
    answer = httpx.post(f"{platform['PREFECT_API_URL']}/deployments/filter", json={}, auth=(user, password), timeout=30)
    answer.raise_for_status()
    return {deployment["name"]: deployment["updated"] for deployment in answer.json()}


def _completed_runs(platform: dict[str, str]) -> set[str]:
    done = {"flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}}
    user, password = AUTH.split(":", 1)
    answer = httpx.post(f"{platform['PREFECT_API_URL']}/flow_runs/filter", json=done, auth=(user, password), timeout=30)
    answer.raise_for_status()
    return {run["id"] for run in answer.json()}


def _mlflow_mirror(tracking_uri: str) -> dict[str, tuple[list[tuple[str, str | None]], dict[str, str]]]:
    """Each registered model's versions (MLflow's number, the ``rayline.version`` tag) and its aliases."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    return {
        model.name: (
            sorted(
                (v.version, v.tags.get("rayline.version")) for v in client.search_model_versions(f"name='{model.name}'")
            ),
            dict(model.aliases),
        )
        for model in client.search_registered_models()
    }


def _count(postgres: PostgresServer, database: str, query: str) -> int:
    import psycopg

    with psycopg.connect(postgres.url(database), connect_timeout=10) as connection:
        row = connection.execute(query).fetchone()
    assert row is not None
    return int(row[0])
