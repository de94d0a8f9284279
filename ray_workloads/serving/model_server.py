"""The model replicas: each live version of each model is its own Serve application ``<name>-<model>-v<N>``
(no HTTP route: only the router calls it), so deploying or removing one never touches the others. An image
it cannot decode is an answer with the HTTP status to give (``http_api.DECODE_STATUS``); a broken model raises.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
from ray import serve

from rayline.errors import ImageDecodeError, ModelOutputError
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.data.images import decode_image
from rayline.ray_workloads.execution.cache import plan_for, probe_set
from rayline.ray_workloads.execution.interface import remote_options
from rayline.ray_workloads.execution.plan import PlanPolicy
from rayline.ray_workloads.serving.config import ServeConfig
from rayline.ray_workloads.serving.http_api import DECODE_STATUS

MODEL_DEPLOYMENT = "ModelServer"
HEALTH_PROBE_IDLE_S = 30.0  # a model replica idle this long proves itself with a forward pass


class ModelServer:
    """One registered model version: weights read once per replica, requests batched."""

    def __init__(self, model: ModelVersion, top_k: int, max_pixels: int, plan: dict[str, Any] | None = None) -> None:
        # torch only here: router replicas and the control actor never pay for importing it
        import torch

        from rayline.ray_workloads.execution.interface import load_version

        torch.set_num_threads(1)
        self.model = model
        spec = model.image_spec
        self.image_spec = spec.model_copy(update={"max_pixels": max_pixels})
        # any registered format, through the one model interface; nothing is unpickled beyond tensors
        self.net = load_version(model, device=torch.device("cpu"), optimize=False, threads=1)
        self.top_k = min(top_k, len(self.model.classes))
        # the version's plan on this machine: the one a night cached, else measured here on its sample images
        policy = PlanPolicy.model_validate(plan or {})
        self._probe = np.zeros((1, 3, spec.size, spec.size), dtype=np.float32)
        probe = probe_set(model, self.image_spec)
        if probe is None:  # nothing to judge a faster plan on: the reference
            policy, probe = policy.model_copy(update={"mode": "off"}), self._probe
        choice = plan_for(self.net, model.uri, probe, policy)
        # a night's judged decode, so that a photo gets the same answer served as predicted at night
        self.plan, self.decode = choice.name, choice.decode.decode if choice.decode else None
        self._last_forward = 0.0

    async def reconfigure(self, config: dict[str, Any]) -> None:
        """``user_config``: batching parameters change without restarting the replica."""
        batcher: Any = self._forward
        batcher.set_max_batch_size(int(config["max_batch_size"]))
        batcher.set_batch_wait_timeout_s(float(config["batch_wait_timeout_s"]))

    async def check_health(self) -> None:
        """The model must run: a recent batch, else a forward pass on a blank image; else Serve replaces us."""
        if time.monotonic() - self._last_forward > HEALTH_PROBE_IDLE_S:
            await asyncio.to_thread(self._run, self._probe)

    async def predict(self, data: bytes) -> dict[str, Any]:
        """Bytes → prediction; bad input is an answer (``ok`` False), a broken model raises."""
        try:
            image = await asyncio.to_thread(decode_image, data, self.image_spec, self.decode)
        except Exception as exc:  # whatever the decoder raised, it is this input's fault
            if isinstance(exc, ImageDecodeError):
                status, detail = DECODE_STATUS.get(type(exc), 422), str(exc)
            else:
                status, detail = 422, f"undecodable image: {exc}"
            return {"ok": False, "status": status, "error": type(exc).__name__, "detail": detail}
        probs: np.ndarray = await self._forward(image)
        if not np.isfinite(probs).all():
            raise ModelOutputError(f"model {self.model.name} v{self.model.version} produced non-finite scores")
        top = np.argsort(-probs, kind="stable")[: self.top_k]
        classes = self.model.classes
        return {
            "ok": True,
            "class_index": int(top[0]),
            "class_name": classes[int(top[0])],
            "confidence": float(probs[top[0]]),
            "top_k": [{"index": int(i), "name": classes[int(i)], "prob": float(probs[i])} for i in top],
            "model": self.model.name,
            "version": self.model.version,
            "plan": self.plan,
        }

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.005)
    async def _forward(self, images: list[np.ndarray]) -> list[np.ndarray]:
        # off the event loop, so requests keep queueing (into the next batch) meanwhile
        return list(await asyncio.to_thread(self._run, np.stack(images)))

    def _run(self, batch: np.ndarray) -> np.ndarray:
        probs = self.net.probabilities(batch)
        self._last_forward = time.monotonic()
        return probs


def model_app(model: ModelVersion, cfg: ServeConfig) -> Any:
    """The Serve application of one version (bound, not yet run)."""
    deployment = serve.deployment(
        name=MODEL_DEPLOYMENT,
        num_replicas=cfg.replicas,
        **cfg.placement(),
        ray_actor_options={"num_cpus": cfg.cpus_per_replica, **remote_options(model.model_spec)},
        max_ongoing_requests=max(cfg.max_ongoing_requests, cfg.max_batch_size),
        user_config={"max_batch_size": cfg.max_batch_size, "batch_wait_timeout_s": cfg.batch_wait_timeout_s},
        health_check_period_s=cfg.model_health_check_period_s,
        health_check_timeout_s=30,
        graceful_shutdown_wait_loop_s=cfg.graceful_shutdown_wait_loop_s,
        max_constructor_retry_count=3,
        max_surge_percent=100,  # a restart (new config) starts replacements before stopping old replicas
        logging_config={"enable_access_log": cfg.access_log},
    )(ModelServer)
    return deployment.bind(model, cfg.top_k, cfg.max_pixels, cfg.plan.model_dump(mode="json"))
