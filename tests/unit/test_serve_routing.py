"""Pure parts of serving: request paths, multipart bounds, ``since``, the routing table, the gate's stats,
the stats windows, the routers a table change waits for, the ``/stats`` rate limit."""

from __future__ import annotations

import time

import numpy as np
import pytest

from rayline.errors import HttpError
from rayline.ray_workloads.serving.http_api import (
    MAX_MULTIPART_PARTS,
    RateLimit,
    multipart_image,
    parse_since,
    route,
)
from rayline.ray_workloads.serving.routing import (
    ModelRoutes,
    RouterSync,
    RoutingTable,
    routers_behind,
    routers_not_synced_since,
)
from rayline.ray_workloads.serving.stats import BUCKET_S, ERROR, OK, REJECTED, WINDOW_S, StatsBook

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
    from rayline.errors import ConfigError
    from rayline.ray_workloads.serving.config import config_from_settings

    assert config_from_settings().default_model is None
    monkeypatch.setenv("RAYLINE_SERVE_DEFAULT_MODEL", "photos")
    cfg = config_from_settings()
    assert cfg.default_model == "photos" and "default_model" not in cfg.router_config()
    monkeypatch.setenv("RAYLINE_SERVE_DEFAULT_MODEL", "Photos!")
    with pytest.raises(ConfigError, match="RAYLINE_SERVE_DEFAULT_MODEL: String should match pattern .* 'Photos!'"):
        config_from_settings()


def test_serving_is_sized_by_the_settings_the_docs_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from rayline.ray_workloads.serving.config import config_from_settings

    sizes = {"REPLICAS": "2", "CPUS_PER_REPLICA": "0.1", "ROUTER_REPLICAS": "2", "MAX_REPLICAS_PER_NODE": "1"}
    for name, value in sizes.items():
        monkeypatch.setenv(f"RAYLINE_SERVE_{name}", value)
    cfg = config_from_settings()
    assert (cfg.replicas, cfg.cpus_per_replica, cfg.router_replicas) == (2, 0.1, 2)
    assert cfg.placement() == {"max_replicas_per_node": 1}


def _form(*parts: bytes, boundary: bytes = b"XyZ") -> bytes:
    return b"".join(b"--" + boundary + b"\r\n" + part + b"\r\n" for part in parts) + b"--" + boundary + b"--\r\n"


def _field(name: str, content: bytes, extra: bytes = b"") -> bytes:
    return f'Content-Disposition: form-data; name="{name}"'.encode() + extra + b"\r\n\r\n" + content


def test_multipart_within_the_bounds_finds_the_image() -> None:
    fields = [_field(f"f{i}", b"x") for i in range(MAX_MULTIPART_PARTS - 1)]
    body = _form(*fields, _field("file", b"\x89PNG\r\n\x00--XyZ-ish\r\n"))
    assert multipart_image(body, "multipart/form-data; boundary=XyZ") == b"\x89PNG\r\n\x00--XyZ-ish\r\n"
    padded = _field("file", b"img", extra=b"\r\nX-Pad: " + b"p" * (8 * 1024 - 200))
    assert multipart_image(_form(padded), "multipart/form-data; boundary=XyZ") == b"img"


def test_multipart_past_the_bounds_is_400_and_stops_early() -> None:
    many = _form(*[_field("f", b"")] * 200_000)  # ~10 MiB of tiny parts
    started = time.perf_counter()
    with pytest.raises(HttpError, match=f"more than {MAX_MULTIPART_PARTS} parts") as caught:
        multipart_image(many, "multipart/form-data; boundary=XyZ")
    assert caught.value.status == 400 and caught.value.error == "BadMultipart"
    assert time.perf_counter() - started < 0.5, "the parts were parsed before they were counted"
    assert len(many) > 9 * 1024 * 1024

    huge_headers = _form(_field("file", b"img", extra=b"\r\nX-Pad: " + b"p" * 9000))
    with pytest.raises(HttpError, match="headers are over 8192 bytes"):
        multipart_image(huge_headers, "multipart/form-data; boundary=XyZ")
    no_end = _form(b"X-Pad: " + b"p" * 9000)  # headers never end
    with pytest.raises(HttpError, match="headers are over 8192 bytes"):
        multipart_image(no_end, "multipart/form-data; boundary=XyZ")
    with pytest.raises(HttpError, match="more than 2 parts"):
        multipart_image(_form(*[_field("f", b"")] * 3), "multipart/form-data; boundary=XyZ", max_parts=2)


@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "-inf", "Infinity", "1e999", "soon", ""])
def test_since_must_be_a_finite_number(raw: str) -> None:
    with pytest.raises(HttpError) as caught:
        parse_since(raw)
    assert caught.value.status == 400 and caught.value.error == "BadRequest" and repr(raw) in caught.value.detail


def test_since_accepts_unix_times() -> None:
    assert parse_since(None) is None and parse_since("1700000000.5") == 1700000000.5 and parse_since("0") == 0.0


def test_pinned_requests_and_4xx_do_not_count_toward_the_gate() -> None:
    book = StatsBook(started=0.0)
    routed_ok = [("m", 2, 10.0 + i, 5.0, OK, True) for i in range(3)]
    routed_error = [("m", 2, 20.0, 9.0, ERROR, True)]
    junk = [("m", 2, 30.0 + i, 1.0, REJECTED, True) for i in range(50)]  # 4xx: bad input, routed
    pinned = [("m", 2, 40.0 + i, 1.0, outcome, False) for i in range(50) for outcome in (OK, REJECTED)]
    late = [("m", 2, 50.0, 5.0, OK, True)]  # a routed answer after the junk
    book.record([*routed_ok, *routed_error, *junk, *pinned, *late])

    everything = book.stats("m")[2]
    assert (everything["requests"], everything["errors"], everything["rejected"]) == (155, 1, 100)
    for since in (None, 0.0):
        gate = book.stats("m", since=since, gated=True)[2]
        assert (gate["requests"], gate["errors"], gate["rejected"]) == (5, 1, 0), since
        assert gate["p50_ms"] == 5.0, "pinned answers' latencies are out of the gate too"
    assert book.stats("m", since=35.0, gated=True)[2]["requests"] == 1
    assert book.stats("other") == {}

    book.reset("m", now=100.0)
    book.record([("m", 2, 99.0, 5.0, OK, True), ("m", 2, 101.0, 5.0, OK, True)])
    assert book.stats("m", gated=True)[2]["requests"] == 1, "a sample from before the reset came back"


def test_stats_answer_from_windows_whatever_the_samples_kept() -> None:
    """``GET /stats?since=0`` on a full book must not scan it: the control actor that answers is the
    one every router syncs with."""
    book = StatsBook(started=0.0)
    book.record(("m", v, 1000.0 + i * 1e-3, 5.0 + i % 50, OK, True) for v in (1, 2) for i in range(100_000))
    for since in (None, 0.0, 1050.0):
        started = time.perf_counter()
        for _ in range(10):
            answer = book.stats("m", since=since)
        each_ms = (time.perf_counter() - started) * 100
        assert each_ms < 5.0, f"since={since}: {each_ms:.1f} ms an answer over 200,000 samples"
        assert answer[1]["requests"] == (100_000 if since != 1050.0 else 50_000), since


def test_stats_windows_count_each_answer_in_its_second_late_ones_included() -> None:
    book = StatsBook(started=0.0)
    book.record([("m", 1, 10.2, 4.0, OK, True), ("m", 1, 11.5, 6.0, ERROR, True)])
    book.record([("m", 1, 13.1, 8.0, OK, True)])
    book.record([("m", 1, 10.9, 5.0, OK, True), ("m", 1, 12.0, 7.0, REJECTED, True)])  # a slow router's flush
    counts = {
        since: (s["requests"], s["errors"], s["rejected"], s["p50_ms"])
        for since in (None, 10.0, 11.0, 12.0, 13.0, 13.9, 14.0)
        for s in [book.stats("m", since=since)[1]]
    }
    assert counts == {
        None: (5, 1, 1, 5.0),
        10.0: (5, 1, 1, 5.0),
        11.0: (3, 1, 1, 8.0),  # the second holding ``since`` counts whole
        12.0: (2, 0, 1, 8.0),
        13.0: (1, 0, 0, 8.0),
        13.9: (1, 0, 0, 8.0),
        14.0: (0, 0, 0, None),
    }
    assert book.stats("m", since=12.0, gated=True)[1]["requests"] == 1


def test_stats_percentiles_from_windows_are_close_to_the_exact_ones() -> None:
    rng = np.random.default_rng(0)
    latencies = rng.lognormal(mean=3.0, sigma=0.6, size=5_000)
    book = StatsBook(started=0.0)
    book.record(("m", 1, 100.0 + i * 0.01, float(ms), OK, True) for i, ms in enumerate(latencies))
    for since in (None, 120.0):
        exact = np.percentile(latencies[2_000:] if since else latencies, [50, 95, 99])
        got = book.stats("m", since=since)[1]
        for q, want in zip(("p50_ms", "p95_ms", "p99_ms"), exact, strict=True):
            assert abs(got[q] / want - 1) < 0.08, (since, q, got[q], want)


def test_stats_windows_older_than_kept_count_from_the_oldest_kept() -> None:
    book = StatsBook(started=0.0)
    seconds = int(2 * WINDOW_S)
    book.record(("m", 1, float(t), 5.0, OK, True) for t in range(seconds))  # an answer every second
    assert book.windows_kept() <= WINDOW_S / BUCKET_S + 1, "windows older than WINDOW_S are dropped"
    assert book.stats("m")[1]["requests"] == seconds, "totals since the reset stay whole"
    assert book.stats("m", since=0.0)[1]["requests"] == seconds, "since the reset: the totals"
    assert book.stats("m", since=seconds - 10.0)[1]["requests"] == 10
    oldest_kept = book.stats("m", since=1.0)[1]["requests"]  # its window is gone: from the oldest kept
    assert WINDOW_S / BUCKET_S - 1 <= oldest_kept <= WINDOW_S / BUCKET_S + 1


def test_routers_behind_are_the_serve_replicas_that_have_not_acked() -> None:
    seen = {"a": RouterSync(at=100.0, generation=7), "b": RouterSync(at=50.0, generation=5)}
    # b silent for a long time is still waited for while Serve counts it; c never synced; d is gone
    assert routers_behind(seen, ["a", "b", "c"], generation=7) == ["b", "c"]
    assert routers_behind(seen, ["a"], generation=7) == []
    assert routers_behind({**seen, "d": RouterSync(at=1.0, generation=0)}, ["a"], generation=8) == ["a"]
    assert routers_not_synced_since(seen, ["a", "b", "c"], mark=60.0) == ["b", "c"]
    assert routers_not_synced_since(seen, ["a"], mark=60.0) == []


def test_stats_rate_limit_answers_how_long_to_wait() -> None:
    limit = RateLimit(per_s=2.0, burst=3)
    assert [limit.retry_after("10.0.0.1", now=0.0) for _ in range(3)] == [None, None, None]
    assert limit.retry_after("10.0.0.1", now=0.0) == pytest.approx(0.5)
    assert limit.retry_after("10.0.0.2", now=0.0) is None, "each client has its own budget"
    assert limit.retry_after("10.0.0.1", now=0.25) == pytest.approx(0.25)
    assert limit.retry_after("10.0.0.1", now=0.5) is None
    assert limit.retry_after("10.0.0.1", now=100.0) is None and limit.retry_after("10.0.0.1", now=100.0) is None


def test_stats_rate_limit_tracks_a_bounded_number_of_clients() -> None:
    limit = RateLimit(per_s=1.0, burst=1, max_clients=100)
    for i in range(1_000):
        limit.retry_after(f"10.0.{i // 256}.{i % 256}", now=0.0)
    assert limit.clients() <= 100
    assert limit.retry_after("10.0.3.231", now=0.0) is not None, "the newest client is still limited"


def test_stats_rate_limit_still_holds_for_a_client_past_a_flood_of_addresses() -> None:
    limit = RateLimit(per_s=1.0, burst=1, max_clients=100)
    assert limit.retry_after("10.9.9.9", now=0.0) is None
    for i in range(1_000):  # more addresses than tracked, within one second
        limit.retry_after(f"10.0.{i // 256}.{i % 256}", now=0.5)
    assert limit.retry_after("10.9.9.9", now=0.5) is not None, "an address the flood pushed out starts full again"
    assert limit.clients() <= 100


def test_stats_rate_limit_lets_untracked_addresses_share_one_bucket_when_full() -> None:
    limit = RateLimit(per_s=1.0, burst=2, max_clients=10)
    admitted = [limit.retry_after(f"10.0.0.{i}", now=0.0) is None for i in range(200)]
    assert sum(admitted) == 10 + 2, "ten tracked addresses, then one shared burst of 2 for the other 190"
    # buckets that refilled are forgotten (a full bucket is what a new address starts with): room again
    assert limit.retry_after("10.0.1.1", now=10.0) is None and limit.clients() <= 10
