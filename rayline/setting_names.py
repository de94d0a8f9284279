"""The names of rayline's environment variables: the ones read outside Settings, and refusing the others.

Settings ignores unknown names (other tools' variables share its environment), so a misspelt setting would
leave its default silently in force. rayline.config refuses any RAYLINE_* variable that is neither a field of
Settings nor listed in :data:`OUTSIDE_SETTINGS`, naming the close match; tests/unit/test_config_and_errors.py
fails on a RAYLINE_* name of the code base that is neither.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping

from rayline.errors import ConfigError

ENV_PREFIX = "RAYLINE_"

# The RAYLINE_* variables that are no field of Settings, each read by something else.
OUTSIDE_SETTINGS: frozenset[str] = frozenset(
    {
        "RAYLINE_CONFIG",  # the settings file (config_file): read before the settings it holds
        "RAYLINE_HOME",  # prefect.yaml's pull step, {{ $RAYLINE_HOME }}: resolved by `prefect deploy`
        "RAYLINE_FACTORY_CODE_SHA256",  # a Ray worker's runtime env: the shipped model code it imports
        "RAYLINE_AZURITE",  # the Azure emulator's program (rayline.testing.azurite), for the tests
        "RAYLINE_TEST_ARTIFACTS",  # where the e2e tests save their screenshots
        "RAYLINE_TEST_STALL_AFTER",  # the stalling predictor of tests/integration/night_driver.py, in a night
        "RAYLINE_BENCH_CACHE",  # bench/'s generated inputs
        "RAYLINE_BENCH_RESULTS",  # the folder a bench saves its result file in (bench/results/README.md)
        # envsubst's variables for deployments/cluster/*.yaml and the image's tags (deployments/cluster/README.md),
        # exported in the shell that may also run rayline
        "RAYLINE_CLUSTER_NAME",
        "RAYLINE_ADMIN_CIDR",
        "RAYLINE_HEAD_INSTANCE_PROFILE",
        "RAYLINE_WORKER_INSTANCE_PROFILE",
        "RAYLINE_NAMESPACE",
        "RAYLINE_IMAGE",
        "RAYLINE_GPU_IMAGE",
        "RAYLINE_SERVICE_ACCOUNT",
    }
)


def refuse_unknown_variables(environ: Mapping[str, str], known: Collection[str]) -> None:
    """A :class:`ConfigError` naming each RAYLINE_* variable of ``environ`` not in ``known`` and its likely
    meaning. Names are compared ignoring case, as pydantic-settings reads them."""
    unknown = sorted(k for k in environ if k.upper().startswith(ENV_PREFIX) and k.upper() not in known)
    if unknown:
        problems = "; ".join(no_such_setting(name, known, ENV_PREFIX) for name in unknown)
        raise ConfigError(f"invalid rayline settings: {problems}; rayline's variables: docs/configuration.md")


def no_such_setting(name: str, known: Collection[str], prefix: str = "") -> str:
    """Why ``name`` is refused, with the known name it most likely misspells, if one is close. Compared without
    the prefix every name shares, which alone would make any two look alike, and ignoring case."""

    def stem(text: str) -> str:
        return text.lower().removeprefix(prefix.lower())

    stems = {stem(k): k for k in known}
    close = difflib.get_close_matches(stem(name), list(stems), n=1)
    return f"{name} is no rayline setting" + (f" (did you mean {stems[close[0]]}?)" if close else "")
