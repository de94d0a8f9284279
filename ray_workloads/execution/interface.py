"""One interface to a registered model, whatever it was saved as: load, input spec, predict probabilities.

Batch inference, serving, evaluation and MLflow's pyfunc all hold a :class:`LoadedModel`: a float32 batch
(N, 3, S, S) decoded by the version's :class:`~rayline.specs.ImageSpec` in, class probabilities out. Behind
it is a module rayline built (:attr:`LoadedModel.module`, which fine-tuning needs) or a code-free file run
as it is (:mod:`rayline.ray_workloads.architectures.model_files`). torch is imported when a model is
loaded, never at import: the night's driver and Serve's router import this module without it.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from rayline import storage
from rayline.config import get_settings
from rayline.errors import InputDataError
from rayline.hardware import Hardware, detect
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.architectures import factory_models
from rayline.ray_workloads.execution import onnx_backend, openvino_backend
from rayline.ray_workloads.execution.decoding import choose_decode
from rayline.ray_workloads.execution.fallback import PlanUse
from rayline.ray_workloads.execution.plan import (
    REFERENCE,
    Backend,
    Logits,
    Plan,
    PlanChoice,
    PlanPolicy,
    Probe,
    choose,
    finite_rows,
    probe_images,
    softmax,
    torch_run,
)
from rayline.specs import ImageSpec, ModelSpec

if TYPE_CHECKING:
    from torch import nn

Converted = openvino_backend.OpenVinoModel | onnx_backend.OnnxModel
# the backends that run a module converted once (per version and machine) and stored beside its plan
CONVERTERS: dict[Backend, type[openvino_backend.OpenVinoModel] | type[onnx_backend.OnnxModel]] = {
    "openvino": openvino_backend.OpenVinoModel,
    "onnxruntime": onnx_backend.OnnxModel,
}


class LoadedModel:
    """A model ready to predict: ``probabilities(batch)`` for a batch decoded with :attr:`image_spec`."""

    def __init__(
        self,
        spec: ModelSpec,
        image_spec: ImageSpec | None,
        logits: Callable[[np.ndarray], np.ndarray],
        module: nn.Module | None = None,
    ) -> None:
        self.spec = spec
        self.image_spec = image_spec
        self._logits = logits
        self.module = module  # the torch module, for formats rayline builds (None for a code-free file)
        self.plan: PlanChoice | None = None  # how it runs, once chosen (choose_plan); fp32 until then
        self.converted: Converted | None = None  # the module as the chosen plan's backend runs it (OpenVINO, ONNX)
        self._fp32: Logits | None = None  # the reference, while another plan runs: for batches it cannot answer
        self.use = PlanUse()  # the calls so far, and those the reference answered (execution.fallback)
        self._known: dict[bytes, np.ndarray] = {}  # scores already computed (a plan's probe), by image digest

    def logits(self, batch: np.ndarray) -> np.ndarray:
        """Raw scores (N, classes) for a float32 batch (N, 3, S, S); under a plan other than fp32 eager, a batch
        whose scores are not all finite is predicted again in fp32, counted in :attr:`use` (execution.fallback).
        Images whose scores a plan's measurement computed (:meth:`remember`) are not predicted again."""
        batch = np.asarray(batch, dtype=np.float32)
        if not batch.flags.writeable:  # Ray Data's read-only views: torch.from_numpy warns on them
            batch = batch.copy()
        known = [self._known.pop(_digest(image), None) for image in batch] if self._known else [None] * len(batch)
        todo = [i for i, row in enumerate(known) if row is None]
        out, fell_back = self._computed(batch if len(todo) == len(batch) else batch[todo]) if todo else (None, False)
        if out is None or len(todo) < len(batch):
            computed = iter(() if out is None else out)
            out = np.stack([row if row is not None else next(computed) for row in known])
        self.use = self.use.called(len(batch), fell_back)
        return out

    def _computed(self, batch: np.ndarray) -> tuple[np.ndarray, bool]:
        """The batch's scores, and whether fp32 answered them for a plan whose scores were not finite."""
        out = self._shaped(self._logits(batch), batch)
        if self._fp32 is not None and not finite_rows(out).all():
            return self._shaped(self._fp32(batch), batch), True
        return out, False

    def remember(self, images: np.ndarray, logits: np.ndarray) -> None:
        """Scores computed while measuring the plan: the night's :meth:`logits` use them for these images."""
        self._known = {_digest(image): row for image, row in zip(images, logits, strict=True)}

    def forget(self) -> None:
        """Drop remembered scores no batch asked for (the probe's photos were all predicted, or never will be)."""
        self._known = {}

    def judge_decode(self, photos: list[bytes], policy: PlanPolicy) -> PlanChoice:
        """Choose how JPEGs are decoded under the adopted plan, by its answers on ``photos`` (execution.decoding);
        where no decode passes in the plan's precision, fp32 eager runs instead. Remembers the probe's scores."""
        assert self.plan is not None and self.image_spec is not None
        reference = self._fp32 or self._logits
        outcome = choose_decode(photos, self.image_spec, self._logits, reference, policy)
        choice = self.plan
        if not outcome.keeps_precision and choice.plan != REFERENCE:
            fp32 = PlanChoice(REFERENCE, choice.hardware, f"fp32 eager: {outcome.judged.reason}", key=choice.key)
            choice = self.adopt(fp32)
        self.plan = replace(choice, decode=outcome.judged)
        self.remember(outcome.images, outcome.logits)
        return self.plan

    def _shaped(self, out: np.ndarray, batch: np.ndarray) -> np.ndarray:
        """``out``, once it is one row of scores per image of ``batch``."""
        if out.ndim != 2 or out.shape[0] != len(batch):
            raise InputDataError(
                f"{self.spec.describe()} returned scores of shape {tuple(out.shape)} for a batch of shape "
                f"{tuple(batch.shape)}; expected ({len(batch)}, {self.spec.num_classes})"
            )
        return out

    def probabilities(self, batch: np.ndarray) -> np.ndarray:
        """Class probabilities (N, classes), each row summing to 1."""
        return softmax(self.logits(batch)).astype(np.float32)

    def choose_plan(self, probe: Probe, policy: PlanPolicy, hardware: Hardware | None = None) -> PlanChoice:
        """Measure the plans this model may run with on ``probe`` (decoded images, or what makes them, called
        only where there is something to measure), adopt the chosen one.

        Only a module rayline built has candidates: a code-free file runs as saved, in fp32, unmeasured. An
        OpenVINO candidate converts the module once; :attr:`converted` keeps it, if chosen, for the cache.
        """
        hardware = hardware or detect()
        if self.module is None:
            plan = Plan(backend="onnxruntime") if self.spec.format == "onnx" else REFERENCE
            return self.adopt(PlanChoice(plan, hardware, f"fp32: a {self.spec.format} file runs as it was saved"))
        module, backends = self.module, backends_at_hand(self.device, policy)
        converted: dict[Backend, Converted] = {}

        def make_run(plan: Plan) -> Logits:
            if plan.backend not in CONVERTERS:
                return torch_run(module, plan)
            if plan.backend not in converted:  # once per backend, whatever precisions it is measured in
                converted[plan.backend] = CONVERTERS[plan.backend].convert(module, images())
            return converted[plan.backend].run(plan.precision)

        images = probe_images(probe)
        choice = choose(make_run, images, hardware, self.device, policy, backends)
        if choice.plan.backend in converted:
            self.converted = converted[choice.plan.backend]
            choice = replace(choice, prepare_s=self.converted.prepare_s)
        return self.adopt(choice)

    def adopt(self, choice: PlanChoice, artifact_uri: str | None = None) -> PlanChoice:
        """Run with ``choice`` from now on: one just measured, or one cached for this version and machine
        (an OpenVINO plan's model then read from ``artifact_uri``; fp32 eager, saying why, if it cannot be)."""
        if self.module is None:
            self.plan = choice
            return choice
        if choice.plan.backend in CONVERTERS:
            try:
                if self.converted is None:
                    if artifact_uri is None:
                        raise ValueError("the plan names no stored model")
                    self.converted = CONVERTERS[choice.plan.backend].load(artifact_uri)
                self._logits = self.converted.run(choice.plan.precision)
                choice = replace(choice, prepare_s=self.converted.prepare_s)
            except Exception as exc:  # a plan that cannot run here is no plan: the reference, saying why
                reason = (
                    f"fp32 eager: the {choice.plan.name} plan's model could not be loaded ({type(exc).__name__}: {exc})"
                )
                choice = PlanChoice(REFERENCE, choice.hardware, reason[:500])
        if choice.plan.backend not in CONVERTERS:
            self._logits = torch_run(self.module, choice.plan)
        self._fp32 = None if choice.plan == REFERENCE else torch_run(self.module, REFERENCE)
        self.plan = choice
        return choice

    @property
    def device(self) -> str:
        """Where the module's weights are: ``cpu`` or ``cuda`` (``cpu`` for a code-free file)."""
        if self.module is None:
            return "cpu"
        return next((p.device.type for p in self.module.parameters()), "cpu")


def _digest(image: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(image).tobytes(), digest_size=16).digest()


def load(
    spec: ModelSpec,
    model_uri: str,
    image_spec: ImageSpec | None = None,
    *,
    device: Any = None,
    optimize: bool = True,
    threads: int | None = None,
) -> LoadedModel:
    """Load what ``model_uri`` holds as ``spec`` says; ``optimize`` prepares a module for inference.

    ``device``: a torch device for the formats torch runs (default: CUDA when present, else CPU).
    ``threads``: ONNX Runtime's intra-op threads (torch's are the process's, set by the caller).
    """
    if spec.inference_only:
        from rayline.ray_workloads.architectures.model_files import load_file_model

        loaded = load_file_model(spec.format, storage.read_bytes(model_uri), model_uri, threads)
        return LoadedModel(spec, image_spec, loaded.logits)
    import torch

    from rayline.ray_workloads.architectures.build import load_model, prepare_for_inference

    if spec.factory is not None:
        factory_models.ensure_importable(spec.factory)
    target = device if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    module = load_model(spec, model_uri).to(target)
    if optimize:
        module = prepare_for_inference(module)
    return LoadedModel(spec, image_spec, torch_run(module, Plan(channels_last=optimize)), module)


def backends_at_hand(device: str, policy: PlanPolicy) -> tuple[Backend, ...]:
    """The backends a plan may use on ``device``: eager, and on a CPU OpenVINO and ONNX Runtime where each is
    installed and wanted (a pin overrides the setting)."""
    if device != "cpu":
        return ("eager",)
    settings = get_settings()
    wanted: dict[Backend, bool] = {"openvino": settings.plan_openvino, "onnxruntime": settings.plan_onnxruntime}
    at_hand: list[Backend] = ["eager"]
    at_hand += [b for b, kind in CONVERTERS.items() if (wanted[b] or policy.backend == b) and _installed(kind.PACKAGE)]
    return tuple(at_hand)


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def torch_threads(assigned_cpus: float) -> int:
    """Intra-op threads for an actor granted ``assigned_cpus`` logical CPUs: the whole CPUs, at least one.

    A fractional share (the default 0.5) gets one thread: two single-thread actors match one with two
    threads on a compute-bound model, each one's decode overlapping the other's forward pass.
    """
    return max(1, int(assigned_cpus))


def assigned_cpus() -> float:
    """The CPUs Ray granted the calling actor or task; 0 outside one (a UDF built in a driver or a test)."""
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_task_id() is None:
        return 0.0  # a driver has no assigned resources (Ray asserts on asking)
    assigned = ray.get_runtime_context().get_assigned_resources()  # type: ignore[no-untyped-call]
    return float(assigned.get("CPU", 0.0))


def load_version(version: ModelVersion, **options: Any) -> LoadedModel:
    """A registered version, loaded with its own image spec (see :func:`load` for ``options``)."""
    return load(version.model_spec, version.weights_uri, version.image_spec, **options)


def runtime_env(spec: ModelSpec) -> dict[str, Any] | None:
    """What a Ray worker loading ``spec`` needs shipped (a factory's code), or None."""
    return factory_models.runtime_env(spec.factory)


def remote_options(spec: ModelSpec) -> dict[str, Any]:
    """Ray options for an actor that loads ``spec``: its ``runtime_env`` when a factory's code ships with it."""
    env = runtime_env(spec)
    return {"runtime_env": env} if env else {}
