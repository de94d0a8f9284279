"""Environment settings: where data lives, which Ray and Prefect to talk to.

Per-stage parameters (image size, shard size …) are pydantic models next to each workload; this module holds only what
depends on the environment. Secrets are never fields here: credentials come from each cloud SDK's standard variables
(``AWS_*``, ``GOOGLE_APPLICATION_CREDENTIALS``, ``AZURE_STORAGE_*``) or the machine's identity, read by the SDK itself.
The one exception is the password a PostgreSQL URL may carry, as Prefect's and MLflow's own URLs do: a ``SecretStr``,
masked wherever it is shown (or left out, for libpq's ``PGPASSWORD`` / ``~/.pgpass``).
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from functools import cache, lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rayline.errors import ConfigError
from rayline.setting_names import ENV_PREFIX, OUTSIDE_SETTINGS, no_such_setting, refuse_unknown_variables

DEFAULT_STORAGE = "./rayline-data"

# The object stores a URI may name, and the form each URI must take.
CLOUD_SCHEMES = {"s3": "s3://bucket[/prefix]", "gs": "gs://bucket[/prefix]", "az": "az://container[/prefix]"}
STORAGE_FORMS = "a local path, " + ", ".join(CLOUD_SCHEMES.values())
_CLOUD_URI = re.compile(r"(s3|gs|az)://[^/\s]+(/.*)?", re.DOTALL)


def malformed_store_uri(uri: str) -> str | None:
    """Why ``uri`` is a mistyped cloud URI (``s3:``, ``gs:`` or ``az:`` but not ``<scheme>://bucket[/prefix]``).

    Anything without ``://`` is a local path to the rest of rayline: ``s3:/bucket/raw`` would become
    ``<cwd>/s3:/bucket/raw`` and ``gs://`` (stripped of its slashes) ``<cwd>/gs:``, so that a seed or
    an ingest silently wrote to, or read, a local folder.
    """
    scheme = uri[:3].lower()
    if scheme[:2] not in CLOUD_SCHEMES or scheme[2:] != ":" or _CLOUD_URI.fullmatch(uri):
        return None
    return f"malformed {scheme[:2].upper()} URI {uri!r}: expected {CLOUD_SCHEMES[scheme[:2]]}"


def unsupported_scheme(uri: str) -> str | None:
    """Why ``uri`` names a store rayline has no backend for (``hdfs://``, ``abfs://`` …), else None."""
    head, sep, _ = uri.partition("://")
    if not sep or head in CLOUD_SCHEMES or head == "file":
        return None
    return f"unsupported storage URI {uri!r}: use {STORAGE_FORMS}"


class Settings(BaseSettings):
    """rayline's environment, read from ``RAYLINE_*`` and standard variables."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    storage: str = Field(
        DEFAULT_STORAGE,
        description="Storage root URI: a local folder, s3://bucket/prefix, gs://bucket/prefix or "
        "az://container/prefix.",
    )
    checkpoints: str | None = Field(
        None,
        description="Where the state rayline reads back lives: Ray Train checkpoints and Tune experiments (whose "
        "state Tune unpickles on resume). A prefix only rayline may write, apart from the input prefixes "
        "(<storage>/raw, <storage>/incoming): an overlap is refused. Unset: <storage>/checkpoints.",
    )
    aws_endpoint_url: str | None = Field(
        None,
        validation_alias=AliasChoices("RAYLINE_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL"),
        description="S3 endpoint for S3-compatible stores (standard AWS_ENDPOINT_URL).",
    )
    aws_region: str | None = Field(
        None,
        validation_alias=AliasChoices("AWS_REGION", "AWS_DEFAULT_REGION"),
        description="S3 region (standard AWS_REGION / AWS_DEFAULT_REGION).",
    )
    ray_address: str | None = Field(
        None,
        validation_alias=AliasChoices("RAYLINE_RAY_ADDRESS", "RAY_ADDRESS"),
        description="Ray cluster to join; unset starts an embedded local cluster.",
    )
    ray_connect_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="How long joining RAY_ADDRESS may wait for its head to accept a connection."
    )
    ray_cpu_oversubscription: float = Field(
        2.0,
        gt=0,
        description="Logical CPUs per physical core for the embedded cluster, so that Data, Train and Serve do not "
        "starve each other on small machines.",
    )
    io_concurrency: int = Field(64, ge=1, le=1024, description="Concurrent object reads per task.")
    storage_max_attempts: int = Field(
        6,
        ge=1,
        le=20,
        description="Attempts of one request to the object store, by every client rayline uses (listings, reads, "
        "conditional writes, readers, delta-rs's commits): throttling, 5xx, resets and timeouts are retried with "
        "exponential backoff.",
    )
    storage_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="How long one request to the object store may wait for its answer."
    )
    storage_connect_timeout_s: float = Field(
        10.0, gt=0, le=600, description="How long connecting to the object store may take."
    )
    fetch_retries: int = Field(
        3,
        ge=0,
        le=10,
        description="Rounds in which a stage fetches again the objects whose reads still failed transiently "
        "after the client's own attempts (throttling, 5xx, resets); then the stage fails as transient.",
    )
    fetch_retry_delay_s: float = Field(
        0.5, ge=0, le=60, description="Wait before the first of those rounds; it doubles each round (with jitter)."
    )
    lease_ttl_s: float | None = Field(
        None,
        gt=0,
        description="Expiry of the data leases (a night, an ingest or preprocess folder) after their last renewal: "
        "how long a run that died blocks the next run. Unset: 60 s for a night, 120 s for a folder.",
    )
    shadow_challenger: bool = Field(
        False,
        description="Nightly inference also scores the model's challenger (alias), whenever it has one, in the same "
        "pass as the champion: its rows go to shadow_predictions (nightly-inference --shadow names one instead).",
    )
    require_labelled_win: bool = Field(
        False,
        description="The champion moves only when the labels say the new version is better (the paired test "
        "passed): train-model makes a candidate challenger until then, serve-rollout waits for it.",
    )
    retrain_min_new_labels: int = Field(
        200,
        ge=1,
        description="Labels imported since a model last trained on its labels that make it worth fine-tuning on "
        "them (rayline.labels.arrived, labelled rayline.retrain=true).",
    )
    retrain_min_new_labelled: int = Field(
        100, ge=1, description="New labelled objects in one arrival that make it worth retraining."
    )
    zombie_window_s: float = Field(
        90.0,
        gt=30,
        description="How long `rayline up`'s zombie automation waits for a flow run's next heartbeat (sent every "
        "30 s) before it marks the run Crashed; read when `up` installs the automation (once per Prefect server).",
    )
    state_dir: str | None = Field(
        None, description="Local folder of `rayline up` (PID files, logs, SQLite); default <storage>/state."
    )
    database_url: SecretStr | None = Field(
        None,
        description="PostgreSQL of `rayline up`, postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE: the Prefect "
        "server's database; MLflow's backend store is RAYLINE_MLFLOW_DATABASE on the same server, as the same user. "
        "Unset: SQLite in the state folder.",
    )
    mlflow_database: str = Field(
        "mlflow", min_length=1, description="Database of MLflow's backend store on RAYLINE_DATABASE_URL's server."
    )
    prefect_port: int = Field(4200, ge=1, le=65535, description="Port of the Prefect server `rayline up` starts.")
    ray_port: int = Field(6379, ge=1, le=65535, description="GCS port of the Ray head `rayline up` starts.")
    dashboard_host: str = Field("127.0.0.1", description="Interface of the Ray dashboard (loopback by default).")
    dashboard_port: int = Field(8265, ge=1, le=65535)
    work_pool: str = Field("rayline", min_length=1, description="Prefect work pool `rayline up` creates and polls.")
    ray_metrics_port: int = Field(
        8080, ge=1, le=65535, description="Port where the Ray head `rayline up` starts exports Prometheus metrics."
    )
    mlflow_port: int = Field(5000, ge=1, le=65535, description="Port of the MLflow server `rayline up` starts.")
    serve_host: str = Field("127.0.0.1", description="Interface of the Serve HTTP proxy (loopback by default).")
    serve_port: int = Field(8000, ge=1, le=65535, description="Port of the Serve HTTP proxy.")
    serve_default_model: str | None = Field(
        None,
        description="Model answering POST /predict (no model name in the path); unset: the first model served.",
    )
    plan_openvino: bool = Field(
        True,
        description="Measure OpenVINO as a CPU execution plan where it is installed (rayline[openvino]); its "
        "first measurement per version and machine converts the model (seconds).",
    )
    plan_onnxruntime: bool = Field(
        True,
        description="Measure ONNX Runtime in fp32 as a CPU execution plan where it is installed (rayline[onnx]); "
        "its first measurement per version and machine exports the model (a second or two for a ResNet-50).",
    )
    serve_plan: Literal["auto", "off"] = Field(
        "auto", description="auto: each model replica runs the fastest plan that passes the gate; off: fp32 eager."
    )
    serve_precision: Literal["fp32", "bf16", "fp16"] | None = Field(
        None, description="Pin the model replicas' precision (still gated against fp32); unset: measured."
    )
    serve_replicas: int = Field(1, ge=1, description="Model replicas of each served version.")
    serve_cpus_per_replica: float = Field(0.25, gt=0, description="Logical CPUs each model replica holds.")
    serve_router_replicas: int = Field(1, ge=1, description="Replicas of the router in front of the models.")
    serve_max_replicas_per_node: int | None = Field(
        None, ge=1, description="ServeConfig.max_replicas_per_node: 1 spreads each deployment's replicas over nodes."
    )
    serve_graceful_shutdown_wait_loop_s: float = Field(
        2.0,
        gt=0,
        description="How often a stopping Serve replica checks that its requests have drained: every deletion "
        "of a version (a rollback, a retired incumbent, `serve stop`) waits at least this long.",
    )
    prefect_api_url: str | None = Field(
        None,
        validation_alias=AliasChoices("PREFECT_API_URL"),
        description="Prefect API; unset uses Prefect's ephemeral API.",
    )

    @field_validator("storage", "checkpoints")
    @classmethod
    def _scheme_is_supported(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip()
        if not value:
            raise ValueError("must not be empty")
        head, sep, rest = value.partition("://")
        if sep and head in CLOUD_SCHEMES and not rest.strip("/"):
            raise ValueError(f"{value!r} names no bucket")
        if (problem := unsupported_scheme(value) or malformed_store_uri(value)) is not None:
            raise ValueError(problem)
        return value.rstrip("/") if value != "/" else value

    @property
    def embedded_num_cpus(self) -> int:
        """Logical CPUs to declare when rayline starts its own Ray cluster."""
        cores = os.cpu_count() or 1
        return max(2, round(cores * self.ray_cpu_oversubscription))


@cache
def setting_variables() -> frozenset[str]:
    """The RAYLINE_* variables Settings reads: each field's prefixed name, or its aliases that carry the prefix
    (``RAYLINE_S3_ENDPOINT_URL``). Settings has no nested model (no ``env_nested_delimiter``), so there are no
    others."""
    names: set[str] = set()
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        if alias is None:
            names.add(f"{ENV_PREFIX}{name}".upper())
        elif isinstance(alias, str):
            names.add(alias.upper())
        else:
            choices = alias.choices if isinstance(alias, AliasChoices) else []
            names.update(choice.upper() for choice in choices if isinstance(choice, str))
    return frozenset(n for n in names if n.startswith(ENV_PREFIX))


def check_variables(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a RAYLINE_* variable that nothing reads (rayline.setting_names), naming the likely setting."""
    refuse_unknown_variables(os.environ if environ is None else environ, setting_variables() | OUTSIDE_SETTINGS)


PROCESS_DEFAULTS = {
    # Prefect's ephemeral API can miss its 20 s start-up on a fresh database.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    # No phoning home (docs/configuration.md, "What rayline sends"): each tool's own switch for its usage
    # telemetry. The Prefect server's telemetry writer also contends for the SQLite lock.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    # with usage stats off, a cluster started by `ray start` (rayline up's) still posts a "disabled" report
    # to usage-stats.ray.io; Ray reads its address from this variable: a closed port on the loopback
    "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    # the convention Prefect's and MLflow's client-side telemetry both honour ("true": MLflow's only spelling)
    "DO_NOT_TRACK": "true",
    # Flow runs send a heartbeat every 30 s (Prefect's minimum; its default is 180 s), so that a killed
    # run is marked Crashed by `rayline up`'s zombie automation within about two minutes.
    "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
}


def apply_process_defaults() -> None:
    """Environment defaults for entry points (CLI, served deployments), never applied at import; explicit values
    win."""
    for key, value in PROCESS_DEFAULTS.items():
        os.environ.setdefault(key, value)


def load_settings() -> Settings:
    """Read settings from the environment, failing with a readable message (an unknown RAYLINE_* variable too)."""
    check_variables()
    try:
        return Settings()
    except ValidationError as exc:
        problems = "; ".join(f"{_variable(err['loc'])}: {err['msg']}" for err in exc.errors())
        raise ConfigError(f"invalid rayline settings: {problems}") from exc


def _variable(loc: tuple[int | str, ...]) -> str:
    """The environment variable a settings error is about, as the user set it (RAYLINE_LEASE_TTL_S)."""
    field = ".".join(str(p) for p in loc)
    if not field:
        return "settings"
    return field if field.isupper() else f"RAYLINE_{field.upper()}"


@lru_cache(maxsize=1)
def _cached_settings(_key: tuple[tuple[str, str], ...]) -> Settings:
    return load_settings()


def labelled_win_required(asked: bool | None) -> bool:
    """Whether a promotion needs a labelled win: as ``asked`` by a flow's parameter, else by the settings."""
    return get_settings().require_labelled_win if asked is None else asked


def lease_ttl(default_s: float) -> float:
    """The data leases' ttl: ``RAYLINE_LEASE_TTL_S`` when set, else the lease kind's own default."""
    return get_settings().lease_ttl_s or default_s


CONFIG_FILE_ENV = "RAYLINE_CONFIG"
DEFAULT_CONFIG_FILE = "rayline.toml"
# The file's table of what each scheduled deployment's runs are asked: [deployments.<name>], a request's fields.
DEPLOYMENTS_TABLE = "deployments"


def config_file() -> Path | None:
    """The settings file: ``RAYLINE_CONFIG`` (which must exist), else ``./rayline.toml`` when there is one."""
    named = os.environ.get(CONFIG_FILE_ENV, "").strip()
    if named:
        path = Path(named).expanduser()
        if not path.is_file():
            raise ConfigError(f"{CONFIG_FILE_ENV}={named}: no such file (a TOML file of rayline settings)")
        return path
    default = Path(DEFAULT_CONFIG_FILE)
    return default if default.is_file() else None


def apply_config_file() -> None:
    """The settings file's values as ``RAYLINE_<NAME>`` variables, under those already set: the environment
    wins. Variables, not a settings source of their own, because Ray's workers get rayline's settings from the
    variables the driver forwards (``rayline.ray_cluster``), and a worker node has no such file.

    The file holds the settings' names in lowercase (``storage = "s3://bucket/rayline"``); a name that is no
    setting is refused, naming the file. Its ``[deployments.<name>]`` tables are :func:`deployment_request`'s.
    """
    for name, value in _file_values().items():
        if name != DEPLOYMENTS_TABLE:
            os.environ.setdefault(f"RAYLINE_{name.upper()}", _as_variable(value))


def deployment_request(deployment: str, model: type[BaseModel]) -> dict[str, Any]:
    """The request a deployment's runs take: ``model``'s defaults under what the settings file's
    ``[deployments.<deployment>]`` sets, every field written out (prefect.yaml and Prefect's UI show each)."""
    try:
        request = model.model_validate(_file_values().get(DEPLOYMENTS_TABLE, {}).get(deployment, {}))
    except ValidationError as exc:
        raise ConfigError(f"[{DEPLOYMENTS_TABLE}.{deployment}] of {config_file()}: {exc}") from exc
    return request.model_dump(mode="json")


def _file_values() -> dict[str, Any]:
    path = config_file()
    return {} if path is None else _read_file(str(path.resolve()), path.stat().st_mtime_ns)


@lru_cache(maxsize=4)
def _read_file(path: str, _mtime_ns: int) -> dict[str, Any]:
    """The file's checked values, read once per version of the file: get_settings runs on every storage call."""
    try:
        values = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable TOML file of rayline settings: {exc}") from exc
    known = {name for name, field in Settings.model_fields.items() if field.validation_alias is None}
    unknown = sorted(set(values) - known - {DEPLOYMENTS_TABLE})
    if unknown:
        problems = "; ".join(no_such_setting(name, known) for name in unknown)
        raise ConfigError(f"{path}: {problems}; known: {', '.join(sorted(known))}")
    return values


def _as_variable(value: object) -> str:
    """A TOML value as pydantic-settings reads it from a variable: JSON for lists, tables and booleans."""
    return json.dumps(value) if isinstance(value, list | dict | bool) else str(value)


def get_settings() -> Settings:
    """Settings for the current environment (and the settings file, under it), re-read when they change."""
    apply_config_file()
    prefixes = ("RAYLINE_", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "RAY_ADDRESS", "PREFECT_API_URL")
    key = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(prefixes)))
    return _cached_settings(key)
