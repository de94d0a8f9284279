"""serve-rollout on real Serve, Prefect and storage: promote under load with no failed request; roll back a bad one.

The module serves an untrained champion (v1) on a free loopback port; each test
registers its own challenger and runs the flow while client threads keep
sending requests through the router.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.schema import ApplicationStatus

from rayline import events, lineage, storage
from rayline.errors import ClusterError
from rayline.flows.serve_rollout import serve_config, serve_rollout
from rayline.models import registry
from rayline.ray_cluster import NAMESPACE
from rayline.ray_workloads.monitoring import monitor as mon
from rayline.ray_workloads.serving import canary, rollout
from rayline.ray_workloads.serving import control as serve_control
from rayline.ray_workloads.serving.http_api import ANSWER_HEADER
from rayline.ray_workloads.serving.model_server import MODEL_DEPLOYMENT, ModelServer, model_app
from rayline.seed import digit_objects
from rayline.storage import leases
from rayline.tasks.monitoring import serving_health_task
from tests.integration.helpers import one_stored_event, stored_events
from tests.integration.rollout_support import (
    Load,
    app_status,
    fast,
    lease_expired,
    line_from,
    probe_image,
    register_digits,
    replica_ids,
    run_app,
    wait_until,
)
from tests.support import REPO_ROOT, free_port

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("ray_session", "prefect_api")]

# a stopping replica looks every 2 s (Serve's default) whether it has drained: every rollback,
# retirement and removal here waited at least that long for its replica to go
_SERVE_SETTINGS = {"RAYLINE_SERVE_GRACEFUL_SHUTDOWN_WAIT_LOOP_S": "0.1"}


@pytest.fixture(scope="module")
def champion_serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """v1 serving all traffic; storage and Serve port set for the flow through settings."""
    root = str(tmp_path_factory.mktemp("rollout") / "storage")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAYLINE_STORAGE", root)
        env.setenv("RAYLINE_SERVE_PORT", str(free_port()))
        for key, value in _SERVE_SETTINGS.items():
            env.setenv(key, value)
        probes = storage.join(root, "raw")
        for key, data in list(digit_objects(32))[:200]:
            storage.write_bytes_atomic(storage.join(probes, key), data)
        champion = register_digits(seed=0)
        registry.set_alias("digits", registry.CHAMPION, champion.version, "test")
        cfg = serve_config()
        try:
            url = serve_control.start(cfg)
            serve_control.deploy_version(champion, cfg)
            serve_control.set_weights({champion.version: 100.0}, cfg)
            yield url
        finally:
            serve_control.shutdown(cfg)


def test_rollout_under_load_promotes_with_no_failed_request(
    champion_serving: str, prefect_api: str, test_started: float
) -> None:
    incumbent = registry.resolve("digits", registry.CHAMPION)
    twin = register_digits(seed=0)  # same weights: agrees with the champion everywhere
    registry.set_alias("digits", registry.CHALLENGER, twin.version, "test")

    with Load(champion_serving, probe_image()) as load:
        result = serve_rollout(fast())

    assert result.promoted and [s.weight for s in result.steps] == [10.0, 50.0, 100.0]
    assert all(s.passed for s in result.steps) and result.steps[0].agreement == 1.0
    assert load.connection_errors == [] and set(load.statuses) == {200}, (load.statuses, load.connection_errors[:3])
    assert sum(load.statuses.values()) > 100
    assert {v for v, _ in load.by_version} == {str(incumbent.version), str(twin.version)}
    assert registry.alias_version("digits", registry.CHAMPION) == twin.version
    cfg = serve_config()
    assert serve_control.live_versions(cfg) == [twin.version], "the old version's deployment is retired"
    (record,) = [r for r in lineage.read_records("serve_rollout") if r.outputs[0].uri == twin.uri]
    assert record.outputs[0].facets["outcome"] == "promoted"
    moved = one_stored_event(
        prefect_api, events.ALIAS_MOVED, events.model_resource("digits", twin.version), since=test_started
    )
    assert moved["payload"]["alias"] == "champion" and moved["payload"]["previous"] == incumbent.version
    assert moved["resource"]["rayline.alias"] == "champion"


def test_a_broken_challenger_is_rolled_back_at_the_first_step(champion_serving: str) -> None:
    incumbent = registry.resolve("digits", registry.CHAMPION)
    broken = register_digits(seed=3, broken=True)
    registry.set_alias("digits", registry.CHALLENGER, broken.version, "test")

    with Load(champion_serving, probe_image()) as load:
        # agreement off: the live error-rate gate must catch it on its own
        state = serve_rollout(fast({"min_agreement": 0.0}), return_state=True)

    assert state.is_failed()
    message = str(state.message)
    assert f"v{broken.version} failed the gate at 10%: error rate 100.0%" in message, message
    assert f"all traffic is back on v{incumbent.version}" in message
    assert load.connection_errors == []
    answered = {(v, s) for v, s in load.by_version}
    assert all(s == 200 for v, s in answered if v == str(incumbent.version)), "the champion kept serving"
    assert all(v == str(broken.version) for v, s in answered if s != 200), answered
    cfg = serve_control.ServeConfig(port=serve_config().port)
    assert serve_control.live_versions(cfg) == [incumbent.version]
    assert serve_control.get_weights(cfg) == {incumbent.version: 100.0}
    assert registry.alias_version("digits", registry.CHAMPION) == incumbent.version
    (record,) = [r for r in lineage.read_records("serve_rollout") if r.outputs[0].uri == broken.uri]
    assert record.outputs[0].facets["outcome"] == "rolled back"


def test_a_rollout_waits_for_the_lease_and_gives_up_naming_its_holder(champion_serving: str) -> None:
    """The rollout lease (rayline.storage.leases): a second rollout waits, proceeds once it is released, and
    otherwise fails naming the run that holds it."""
    other = leases.try_acquire(registry.rollout_lease_uri("digits"), "flow run other-rollout on host-9 pid 1", 60)
    assert other is not None
    state = serve_rollout(fast(candidate="champion", lease_wait_s=1.0), return_state=True)
    assert state.is_failed()
    message = str(state.message)
    assert "another rollout of digits still holds the lease after 1 s" in message, message
    assert "holder flow run other-rollout on host-9 pid 1, expires in" in message, message

    threading.Timer(2.0, leases.release, args=(other,)).start()
    result = serve_rollout(fast(candidate="champion", lease_wait_s=30.0))
    assert "already serves all traffic (another rollout promoted it while this one waited" in result.reason
    current = leases.read(registry.rollout_lease_uri("digits"))
    assert current is not None and current.released and "flow run" in current.holder, "released at the end"


def test_a_rollout_racing_another_waits_for_its_deploys_and_reads_settled_weights(champion_serving: str) -> None:
    """Two rollouts at once (`rayline demo` and the serve-rollout its registration triggered): the second
    neither restarts what the first is deploying nor acts on weights the routers don't route by yet."""
    cfg = serve_config()
    champion = registry.resolve("digits", registry.CHAMPION)
    other = register_digits(seed=0)
    app = cfg.version_app("digits", other.version)

    first = threading.Thread(target=serve_control.deploy_version, args=(other, cfg))
    first.start()
    deadline = time.monotonic() + 60
    while not (starting := replica_ids(app)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert starting and serve.status().applications[app].status in ("NOT_STARTED", "DEPLOYING")
    serve_control.deploy_version(other, cfg)  # the second caller: waits for it, submits nothing
    first.join(timeout=120)
    assert replica_ids(app) == starting, "the version was submitted again: its replica was replaced"

    control = ray.get_actor(cfg.control_actor_name, namespace=NAMESPACE)
    ray.get(control.set_weights.remote({other.version: 1.0}))  # the first caller's move: routers not told yet
    assert rollout.incumbent_version(cfg) == other.version  # read settled: routers route by it now
    with httpx.Client(base_url=champion_serving, timeout=30) as client:
        answered = [client.post("/predict", content=probe_image()).headers.get(ANSWER_HEADER) for _ in range(5)]
    assert answered == [str(other.version)] * 5

    serve_control.set_weights({champion.version: 100.0}, cfg)
    serve_control.remove_version(other.version, cfg)


def test_a_rollout_that_raises_rolls_back_and_serving_agrees_with_the_registry(
    champion_serving: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a failed gate: the 100 % step raises after the candidate got all the traffic."""
    incumbent = registry.resolve("digits", registry.CHAMPION)
    twin = register_digits(seed=0)
    registry.set_alias("digits", registry.CHALLENGER, twin.version, "test")
    real_run_step = rollout.run_step

    def run_step_raising_at_100(
        cfg: rollout.RolloutConfig, base_url: str, inc: int, cand: int, weight: float, *args: object, **kwargs: object
    ) -> rollout.StepReport:
        if weight < 100.0:
            return real_run_step(cfg, base_url, inc, cand, weight, *args, **kwargs)  # type: ignore[arg-type]
        serve_control.set_weights({inc: 0.0, cand: 100.0}, cfg.serve, model="digits")  # the side effect landed
        raise RuntimeError("injected: the soak's client died after the weights moved")

    monkeypatch.setattr(rollout, "run_step", run_step_raising_at_100)
    # First step at 50 %, not 10 %: it must pass, and at 10 % of a few probes per second a 9 s window
    # (3 × soak_s at most) held fewer than min_requests candidate answers now and then (6 of 10 seen
    # in CI), which rolls back for "no evidence" before the injected failure is reached.
    state = serve_rollout(fast(steps=[50.0, 100.0]), return_state=True)

    assert state.is_failed() and "injected" in str(state.message), state.message
    cfg = serve_control.ServeConfig(port=serve_config().port)
    assert serve_control.get_weights(cfg) == {incumbent.version: 100.0}
    assert serve_control.live_versions(cfg) == [incumbent.version]
    assert rollout.incumbent_version(cfg, "digits") == registry.alias_version("digits", registry.CHAMPION)
    assert registry.alias_version("digits", registry.CHAMPION) == incumbent.version
    (record,) = [r for r in lineage.read_records("serve_rollout") if r.outputs[0].uri == twin.uri]
    assert record.outputs[0].facets["outcome"] == "rolled back"
    assert "raised RuntimeError: injected" in record.outputs[0].facets["reason"]


def test_a_deploy_timing_out_on_the_live_incumbent_leaves_it_serving(champion_serving: str) -> None:
    """The incumbent serves all traffic but is DEPLOYING (scaled onto a replica no node can place: it asks
    for a resource none has; Serve's surge keeps the old replica serving). A rollout's first deploy waits
    for it and times out: it fails, and the incumbent it only waited for keeps answering.

    The deploy is ``deploy_version``'s, the first a rollout makes (``rollout.serve``), called directly: a
    ServeConfig with another deploy timeout would also redeploy the router (``ServeConfig.router_config``).
    """
    cfg = serve_config()
    champion = registry.resolve("digits", registry.CHAMPION)
    app = cfg.version_app("digits", champion.version)
    unplaceable = serve.deployment(
        name=MODEL_DEPLOYMENT,
        num_replicas=cfg.replicas,
        ray_actor_options={"num_cpus": cfg.cpus_per_replica, "resources": {"rayline-test-absent": 1.0}},
        max_surge_percent=100,
    )(ModelServer).bind(champion, cfg.top_k, cfg.max_pixels)
    run_app(app, unplaceable)
    try:
        wait_until(f"{app} deploying", lambda: app_status(app) == ApplicationStatus.DEPLOYING)
        with Load(champion_serving, probe_image()) as load:
            with pytest.raises(ClusterError, match=f"{app}: DEPLOYING after 2 s"):
                serve_control.deploy_version(champion, cfg.model_copy(update={"deploy_timeout_s": 2.0}))
            answered = sum(load.statuses.values())
            # the time a deletion needs to stop the replica: long enough to see requests fail if it did
            wait_until("60 more answers", lambda: sum(load.statuses.values()) > answered + 60)
        assert load.connection_errors == [] and set(load.statuses) == {200}, (load.statuses, load.connection_errors)
        assert app_status(app) == ApplicationStatus.DEPLOYING, "the incumbent was deleted"
        assert serve_control.get_weights(cfg, model="digits") == {champion.version: 100.0}
    finally:
        run_app(app, model_app(champion, cfg))  # its own version again: the unplaceable replica goes
        wait_until(f"{app} running again", lambda: app_status(app) == ApplicationStatus.RUNNING)


def test_a_rollout_paused_past_its_lease_cannot_move_traffic_over_the_one_that_took_over(
    champion_serving: str,
) -> None:
    """Fencing: a rollout process frozen (SIGSTOP) between its lease check and its move, past the lease's
    ttl; another takes the lease over and moves the weights; resumed, the first one's move is refused by
    the control actor (its lease generation is older) and the weights stay the second one's."""
    cfg = serve_config()
    champion = registry.resolve("digits", registry.CHAMPION)
    twin = register_digits(seed=0)
    serve_control.deploy_version(twin, cfg)
    prepared = canary.PreparedRollout(base_url=champion_serving, incumbent=champion, candidate=twin)
    uri = registry.rollout_lease_uri("digits")
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "RAY_AUTH_MODE": "token"}
    args = ["-m", "tests.integration.paused_rollout", prepared.model_dump_json(), cfg.model_dump_json(), "1.5"]
    taken: leases.Lease | None = None
    try:
        paused = subprocess.Popen(
            [sys.executable, *args], cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert paused.stdin is not None
        try:
            holding = line_from(paused)
            os.kill(paused.pid, signal.SIGSTOP)  # between its check and its move: its renewer stops too
            wait_until("the paused rollout's lease expired", lambda: lease_expired(uri))
            taken = leases.try_acquire(uri, "flow run taking-over on host-9 pid 1", 60)
            assert taken is not None and taken.fence > int(str(holding["holding"]))
            serve_control.set_weights({twin.version: 100.0}, cfg, model="digits", fence=taken.fencing_token())
            os.kill(paused.pid, signal.SIGCONT)
            paused.stdin.write("move\n")
            paused.stdin.flush()
            outcome = line_from(paused)
            assert paused.wait(timeout=60) == 0
        finally:
            if paused.poll() is None:
                os.kill(paused.pid, signal.SIGCONT)
                paused.kill()
                paused.wait(timeout=30)
        refused = str(outcome.get("refused"))
        assert "refused" in outcome, outcome
        assert f"generation {holding['holding']} of lease {taken.uri}" in refused, refused
        assert f"flow run taking-over on host-9 pid 1 has since acted with generation {taken.fence}" in refused, refused
        assert serve_control.get_weights(cfg, model="digits") == {champion.version: 0.0, twin.version: 100.0}
        assert app_status(cfg.version_app("digits", twin.version)) == ApplicationStatus.RUNNING
    finally:  # serving as the module had it: the champion at 100 %, the twin gone
        fence = taken.fencing_token() if taken is not None else None
        serve_control.set_weights({champion.version: 100.0}, cfg, model="digits", fence=fence)
        serve_control.remove_version(twin.version, cfg, model="digits", fence=fence)
        if taken is not None:
            leases.release(taken)


def test_a_rollout_killed_mid_soak_is_reconciled_by_the_next_one(champion_serving: str, prefect_api: str) -> None:
    """The flow's process SIGKILLed while the candidate soaks at 100 %: serving has it at 100 % while the
    registry's champion is the old version. While the dead run's lease lasts that is a rollout under way;
    once it has expired the monitor reports serving unhealthy (gauge and event), and the next rollout
    rolls the weights back to the champion, says so, and rolls the candidate out again from there."""
    started = time.time()
    cfg = serve_config()
    champion = registry.resolve("digits", registry.CHAMPION)
    twin = register_digits(seed=0)
    registry.set_alias("digits", registry.CHALLENGER, twin.version, "test")
    uri = registry.rollout_lease_uri("digits")
    env = {
        **os.environ,
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        "RAY_AUTH_MODE": "token",
        "PREFECT_API_URL": prefect_api,
    }
    # one step at 100 % soaking far longer than the test waits: the kill lands in the last soak
    parameters = fast(steps=[100.0], soak_s=300.0, lease_ttl_s=3.0).model_dump_json()
    dying = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.paused_rollout", "flow", parameters],
        cwd=REPO_ROOT,
        env=env,
    )
    try:
        wait_until(
            "the candidate at 100 %",
            lambda: serve_control.get_weights(cfg, model="digits").get(twin.version) == 100.0,
            timeout_s=120,
        )
        os.kill(dying.pid, signal.SIGKILL)
        assert dying.wait(timeout=30) == -signal.SIGKILL
    finally:
        if dying.poll() is None:
            dying.kill()
            dying.wait(timeout=30)
    assert registry.alias_version("digits", registry.CHAMPION) == champion.version
    thresholds = mon.DriftThresholds()
    under_way = serving_health_task.fn(champion_serving, thresholds, "digits")
    assert under_way.healthy, "while the killed run's lease lasts, the candidate at 100 % is a rollout under way"

    wait_until("the killed rollout's lease expired", lambda: lease_expired(uri), timeout_s=30)
    health = serving_health_task.fn(champion_serving, thresholds, "digits")
    assert not health.healthy, health
    assert f"v{twin.version} has the most traffic (100%)" in str(health.problem), health.problem
    assert f"the registry's champion is v{champion.version}" in str(health.problem), health.problem
    families = {f.name: f for f in text_string_to_metric_families(mon.prometheus_text(health, [], "digits"))}
    (mismatch,) = families["rayline_serve_champion_mismatch"].samples
    assert mismatch.value == 1.0
    wait_until(
        "the champion-mismatch event",
        lambda: bool(stored_events(prefect_api, events.CHAMPION_NOT_SERVED, since=started)),
        timeout_s=30,
    )

    result = serve_rollout(fast(steps=[100.0], lease_ttl_s=3.0, lease_wait_s=30.0))
    assert result.reconciled is not None and "rolled all traffic back" in result.reconciled, result
    assert f"v{twin.version} at 100%" in result.reconciled and f"champion v{champion.version}" in result.reconciled
    assert result.promoted and [s.weight for s in result.steps] == [100.0], result
    assert result.incumbent == champion.version, "the reconciled champion was the incumbent, not the dead run's"
    assert registry.alias_version("digits", registry.CHAMPION) == twin.version
    assert serve_control.get_weights(cfg, model="digits") == {twin.version: 100.0}
    assert serve_control.live_versions(cfg) == [twin.version]
    assert serving_health_task.fn(champion_serving, thresholds, "digits").healthy
