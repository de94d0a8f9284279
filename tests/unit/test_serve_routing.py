"""Pure parts of multi-model serving: request paths and the routing table's default model and snapshots."""

from __future__ import annotations

import pytest

from ray_workloads.serve_http import HttpError, route
from ray_workloads.serve_state import ModelRoutes, RoutingTable

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/predict", (None, "predict")),
        ("/stats", (None, "stats")),
        ("/healthz", (None, "healthz")),
        ("/models", (None, "models")),
        ("/models/photos/predict", ("photos", "predict")),
        ("/models/digits/stats", ("digits", "stats")),
    ],
)
def test_routes(path: str, expected: tuple[str | None, str]) -> None:
    assert route(path) == expected


@pytest.mark.parametrize(
    "path", ["/", "/nope", "/models/photos", "/models/photos/models", "/models//predict", "/a/b/c"]
)
def test_unknown_paths_are_404_listing_the_routes(path: str) -> None:
    with pytest.raises(HttpError, match="/models/<name>/predict") as caught:
        route(path)
    assert caught.value.status == 404 and caught.value.error == "NotFound"


def test_the_default_model_is_the_configured_one_else_the_first_served() -> None:
    routes = ModelRoutes(weights={1: 1.0}, apps={1: "rayline-x-v1"})
    table = RoutingTable(models={"digits": routes, "photos": routes})
    assert table.default_model == "digits" and table.routes(None) is routes
    configured = RoutingTable(models={"digits": routes}, configured_default="photos")
    assert configured.default_model == "photos" and configured.routes(None) == ModelRoutes()
    assert RoutingTable().default_model is None and RoutingTable().routes(None) == ModelRoutes()


def test_snapshots_round_trip_and_a_one_model_snapshot_still_loads() -> None:
    table = RoutingTable(
        generation=7,
        models={"photos": ModelRoutes(weights={2: 100.0}, apps={2: "rayline-photos-v2"})},
        configured_default="photos",
    )
    assert RoutingTable.from_json(table.to_json()) == table
    old = {"generation": 3, "model": "digits", "weights": {"1": 90.0, "2": 10.0}, "apps": {"1": "a1", "2": "a2"}}
    restored = RoutingTable.from_json(old)
    assert restored.generation == 3 and restored.default_model == "digits"
    assert restored.models["digits"] == ModelRoutes(weights={1: 90.0, 2: 10.0}, apps={1: "a1", 2: "a2"})
    assert RoutingTable.from_json({"generation": 1, "model": None, "weights": {}, "apps": {}}).models == {}


def test_the_default_model_comes_from_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray_workloads.serve_control import config_from_settings
    from rayline.errors import ConfigError

    assert config_from_settings().default_model is None
    monkeypatch.setenv("RAYLINE_SERVE_DEFAULT_MODEL", "photos")
    cfg = config_from_settings()
    assert cfg.default_model == "photos" and "default_model" not in cfg.router_config()
    monkeypatch.setenv("RAYLINE_SERVE_DEFAULT_MODEL", "Photos!")
    with pytest.raises(ConfigError, match="RAYLINE_SERVE_DEFAULT_MODEL: String should match pattern .* 'Photos!'"):
        config_from_settings()
