"""What ``rayline up`` sets up in Prefect, the way Prefect's own docs do it: a ``process`` work pool
(``RAYLINE_WORK_POOL``, default ``rayline``); every deployment of ``deployments/catalog.py``, registered by
``prefect deploy --all`` of the generated ``prefect.yaml`` (the file a team deploys by hand: a test keeps the
committed one equal to the rendering); a ``prefect worker`` polling the pool; and the automation of Prefect's
"detect zombie flows" guide (a run whose heartbeats stop for ``RAYLINE_ZOMBIE_WINDOW_S`` is marked ``Crashed``).

The table is rendered in a child process while the services start: rendering imports every flow (Prefect,
Ray, torch), which the ``up`` process itself never needs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from rayline.config import CONFIG_FILE_ENV, config_file, get_settings
from rayline.errors import ClusterError, ConfigError

POOL_TYPE = "process"
ZOMBIE_AUTOMATION = "rayline: crash zombie flow runs"
_DEPLOY_TIMEOUT_S = 600.0
DEPLOY_STAMP = "prefect.yaml.deployed"


def project_root() -> Path:
    """The folder holding ``flows/`` and ``deployments/`` (a checkout, or the installed package), found without
    importing them (``rayline/deployments`` links to the checkout's folder, so resolving it finds the checkout)."""
    spec = importlib.util.find_spec("rayline.deployments")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the rayline deployments package is not importable here: reinstall rayline")
    return Path(list(spec.submodule_search_locations)[0]).resolve().parent


def _prefect(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "prefect"), "--no-prompt", *args]


def _start(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    pipe = subprocess.PIPE  # no stdin: nothing here may wait for an answer from the terminal
    return subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=pipe, stderr=pipe, text=True)


def _output(proc: subprocess.Popen[str], what: str) -> str:
    """The child's stdout once it exits 0 (waiting at most ``_DEPLOY_TIMEOUT_S``); else a ClusterError."""
    try:
        out, err = proc.communicate(timeout=_DEPLOY_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        proc.communicate()
        raise ClusterError(f"{what} did not finish within {_DEPLOY_TIMEOUT_S:.0f} s") from exc
    if proc.returncode != 0:
        raise ClusterError(f"{what} failed (exit {proc.returncode}):\n{(out + err)[-3000:]}")
    return out


def _run(command: list[str], env: dict[str, str], cwd: Path, what: str) -> str:
    return _output(_start(command, env, cwd), what)


def create_pool(pool: str, env: dict[str, str]) -> None:
    """``prefect work-pool create <pool> --type process`` (``--overwrite``: ``up`` again keeps one pool)."""
    _run(_prefect("work-pool", "create", pool, "--type", POOL_TYPE, "--overwrite"), env, project_root(), "work pool")


class PrefectYamlRendering:
    """``python -m rayline.deployments.prefect_yaml`` in a child process, started before the services."""

    def __init__(self, env: dict[str, str]) -> None:
        # it renders in the checkout: the deployments' requests come from this process's settings file
        if (settings_file := config_file()) is not None:
            env = {**env, CONFIG_FILE_ENV: str(settings_file.resolve())}
        self._proc = _start([sys.executable, "-m", "rayline.deployments.prefect_yaml"], env, project_root())

    def result(self) -> str:
        """The rendered file; waits for the child, at most ``_DEPLOY_TIMEOUT_S``."""
        return _output(self._proc, "rendering prefect.yaml")

    def close(self) -> None:
        """End the child if it still runs (``up`` failed or was interrupted before it needed the file)."""
        if self._proc.returncode is None:
            self._proc.kill()
            self._proc.communicate()


def deploy_all(pool: str, env: dict[str, str], state: Path, rendered: str) -> bool:
    """``prefect deploy --all`` the ``rendered`` ``prefect.yaml`` into ``pool``; False when that was not needed.

    ``up`` again after ``down`` finds its deployments in the server's database: when the file, the pool, the
    project's folder and the flows' code are those of the last deploy (a stamp in the state folder) and the
    server holds every deployment the file names, deploying again (about a minute of Prefect building each
    flow's parameter schema) would change nothing.
    """
    root = project_root()
    prefect_file, stamp_file = state / "prefect.yaml", state / DEPLOY_STAMP
    stamp = deploy_stamp(pool, root, rendered)
    if stamp_file.is_file() and stamp_file.read_text() == stamp and _all_deployed(rendered, pool, env):
        return False
    stamp_file.unlink(missing_ok=True)  # a deploy that fails half-way leaves no stamp for the next `up`
    prefect_file.write_text(rendered)
    # prefect deploy resolves both placeholders now: the pool, and where the worker's runs start
    deploy_env = {**env, "RAYLINE_WORK_POOL": pool, "RAYLINE_HOME": str(root)}
    _run(_prefect("deploy", "--all", "--prefect-file", str(prefect_file)), deploy_env, root, "prefect deploy")
    stamp_file.write_text(stamp)
    return True


def deploy_stamp(pool: str, root: Path, rendered: str) -> str:
    """What a deploy depends on: the file, the pool, the folder runs start in, the flows' and deployments'
    code (their parameter schemas), and the Prefect and rayline versions that deployed them."""
    from prefect import __version__ as prefect_version

    from rayline import __version__ as rayline_version

    digest = hashlib.sha256()
    for part in (rendered, pool, str(root), prefect_version, rayline_version):
        digest.update(part.encode() + b"\0")
    for package in ("flows", "tasks", "deployments"):
        for source in sorted((root / package).rglob("*.py")):
            digest.update(str(source.relative_to(root)).encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


def _all_deployed(rendered: str, pool: str, env: dict[str, str]) -> bool:
    """Whether the Prefect server of ``env`` holds, in ``pool``, every deployment ``rendered`` names."""
    import yaml  # type: ignore[import-untyped]  # no stubs installed; only safe_load is used
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    wanted = {deployment["name"] for deployment in yaml.safe_load(rendered).get("deployments") or []}
    in_pool = WorkPoolFilter(name=WorkPoolFilterName(any_=[pool]))
    updates = {PREFECT_API_URL: env["PREFECT_API_URL"], PREFECT_API_AUTH_STRING: env.get("PREFECT_API_AUTH_STRING")}
    with temporary_settings(updates=updates), get_client(sync_client=True) as client:
        held = {deployment.name for deployment in client.read_deployments(work_pool_filter=in_pool)}
    return bool(wanted) and wanted <= held


def worker_command(pool: str) -> list[str]:
    """The worker ``up`` keeps running: it polls ``pool`` and starts each flow run as a process."""
    return _prefect("worker", "start", "--pool", pool, "--type", POOL_TYPE, "--name", f"rayline-{os.getpid()}")


def worker_env(env: dict[str, str], ray_address: str, ray_tmpdir: Path) -> dict[str, str]:
    """What every flow-run process the worker starts inherits: the cluster to join (heartbeats come from
    ``PROCESS_DEFAULTS``, applied by the CLI before ``up``)."""
    return {**env, "RAY_ADDRESS": ray_address, "RAY_AUTH_MODE": "token", "RAY_TMPDIR": str(ray_tmpdir)}


def install_zombie_automation(api_url: str, auth_string: str | None) -> bool:
    """Create the "crash zombie flows" automation unless it exists; True when it was created.

    Its window, how long a run may go without a heartbeat, is ``RAYLINE_ZOMBIE_WINDOW_S`` (90 s as in Prefect's
    guide for heartbeats every 30 s). An existing automation keeps the window it was created with.
    """
    from prefect.automations import Automation
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    crash = ChangeFlowRunState(state=StateType.CRASHED, message="Flow run marked as crashed: its heartbeats stopped.")
    updates = {PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth_string}
    with temporary_settings(updates=updates):
        with get_client(sync_client=True) as client:
            if client.read_automations_by_name(ZOMBIE_AUTOMATION):
                return False
        Automation(
            name=ZOMBIE_AUTOMATION,
            description="Marks a flow run Crashed when its heartbeats stop (Prefect's 'detect zombie flows' guide).",
            trigger=EventTrigger(
                after={"prefect.flow-run.heartbeat"},
                expect={
                    "prefect.flow-run.heartbeat",
                    "prefect.flow-run.Completed",
                    "prefect.flow-run.Failed",
                    "prefect.flow-run.Cancelled",
                    "prefect.flow-run.Crashed",
                },
                match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
                for_each={"prefect.resource.id"},
                posture=Posture.Proactive,
                threshold=1,
                within=timedelta(seconds=get_settings().zombie_window_s),
            ),
            actions=[crash],
        ).create()
    return True
