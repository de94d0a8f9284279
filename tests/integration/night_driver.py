"""A batch-inference driver for a test to kill: it writes part files, then never reaches its commit.

``python -m tests.integration.night_driver '<InferenceConfig as JSON>' <run id>``

Runs ``ray_workloads.batch_inference.run`` in this process on the cluster of
``RAY_ADDRESS``, or on an embedded cluster of its own when that is unset, with
a predictor that writes its first block's part files (predictions and
errors) like the real one and then stalls. So the test that kills this
process knows where it stands once part files appear: after the actors
wrote, before the driver committed, without racing the commit.
"""

from __future__ import annotations

import sys
import threading

from ray_workloads import batch_inference
from ray_workloads.inference_predictor import PredictorUDF, WrittenFile
from rayline import ray_cluster


class StallingPredictor(PredictorUDF):
    """The batch-inference UDF, except that it stalls for good once it has written a block."""

    def run_block(self, uris: list[str], etags: list[str]) -> list[WrittenFile]:
        super().run_block(uris, etags)
        threading.Event().wait()  # a night still being predicted: the driver waits for this block forever
        raise AssertionError("unreachable")


def main(argv: list[str]) -> None:
    config = batch_inference.InferenceConfig.model_validate_json(argv[0])
    ray_cluster.connect()
    # the module's global, which its map_batches call reads: only this process's run stalls
    batch_inference.PredictorUDF = StallingPredictor  # type: ignore[attr-defined]
    batch_inference.run(config, run_id=argv[1])
    raise SystemExit("the run committed: it was meant to stall before its commit")


if __name__ == "__main__":
    main(sys.argv[1:])
