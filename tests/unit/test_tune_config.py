"""The search's concurrency limit reaches Ray Tune: where it sits decides whether Ray honours it."""

from __future__ import annotations

import pytest
from ray.tune.search.basic_variant import BasicVariantGenerator

from rayline.ray_workloads.training.tune import TuneJobConfig, tune_config

pytestmark = pytest.mark.unit


def _job(limit: int | None) -> TuneJobConfig:
    return TuneJobConfig(
        data_manifest_uri="memory://m", output_root="memory://o", experiment_name="e", max_concurrent_trials=limit
    )


def test_the_concurrency_limit_is_on_the_variant_generator_where_ray_honours_it() -> None:
    # beside a search algorithm of one's own, TuneConfig.max_concurrent_trials is ignored with a warning
    config = tune_config(_job(1))
    assert isinstance(config.search_alg, BasicVariantGenerator)
    assert config.search_alg.max_concurrent == 1
    assert config.max_concurrent_trials is None, "Ray would ignore it and log a warning"


def test_no_limit_runs_as_many_trials_at_once_as_the_cluster_fits() -> None:
    config = tune_config(_job(None))
    assert isinstance(config.search_alg, BasicVariantGenerator) and config.search_alg.max_concurrent == 0
