"""How a model version runs on a machine: precision, memory layout and backend, chosen by measuring, behind a gate.

fp32 eager is the reference: what the model was trained and validated in. A narrower type the hardware
computes natively (bf16 on a CPU with AVX-512-BF16 or AMX; fp16, and bf16 where supported, on a GPU) can be
several times faster, but its outputs differ. So a candidate is used only when, on a probe set of real
images, it is faster than the reference and agrees with it: every output finite, top-1 agreement at least
:attr:`PlanPolicy.min_agreement`, the top class's probability within :attr:`PlanPolicy.max_prob_diff`.
Otherwise :attr:`PlanChoice.reason` says in one line why the reference runs. docs/execution-plans.md tells
the whole story; torch is imported only inside the functions that run a model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from rayline.hardware import Hardware
from rayline.ray_workloads.data.images import Decode
from rayline.ray_workloads.execution.fallback import PlanUse

if TYPE_CHECKING:
    from torch import nn

Precision = Literal["fp32", "bf16", "fp16"]
Backend = Literal["eager", "onnxruntime", "openvino"]
Logits = Callable[[np.ndarray], np.ndarray]
# the decoded images a plan is measured on, or what makes them: made only where there is something to measure
Probe = np.ndarray | Callable[[], np.ndarray]

# A candidate must be this much faster than the reference to be worth its different answers; below it,
# timing noise decides (a digits CNN's bf16 runs at 1.0-1.15x fp32) and versions of one model would differ.
MIN_SPEEDUP = 1.2
# A candidate in fp32 on another backend (ONNX Runtime) answers as the reference does, to float rounding: it
# needs only to pay for its conversion.
MIN_SPEEDUP_FP32 = 1.1
PROBE_IMAGES = 16
CPU_TIMED_IMAGES = 8  # a CPU night's model call at 224 px (nightly.predictor.PIXELS_PER_MODEL_CALL)


@dataclass(frozen=True)
class Plan:
    """One way to run a model: which backend, in which precision, in which memory layout."""

    backend: Backend = "eager"
    precision: Precision = "fp32"
    channels_last: bool = True

    @property
    def name(self) -> str:
        layout = "/channels-last" if self.channels_last and self.backend == "eager" else ""
        return f"{self.backend}/{self.precision}{layout}"


REFERENCE = Plan()


class PlanPolicy(BaseModel):
    """What a user asks of the choice: measure and gate (``auto``), pins, or none at all (``off``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["auto", "off"] = Field("auto", description="auto: measure the candidates; off: fp32 eager.")
    precision: Precision | None = Field(None, description="Pin the precision (still gated against fp32).")
    backend: Literal["eager", "openvino", "onnxruntime"] | None = Field(
        None,
        description="Pin the backend (openvino: CPUs, with the rayline[openvino] extra; onnxruntime: CPUs, fp32, "
        "with the rayline[onnx] extra).",
    )
    min_agreement: float = Field(0.995, gt=0, le=1, description="Top-1 agreement with fp32 a plan needs.")
    max_prob_diff: float = Field(
        0.05, ge=0, le=1, description="Largest difference in the top class's probability a plan may make."
    )


@dataclass(frozen=True)
class Gate:
    """A candidate's answers against the reference's on the probe set."""

    agreement: float
    max_prob_diff: float
    images: int
    non_finite: int = 0  # probe images on which the candidate's outputs are not all finite (inf or NaN)

    def refusal(self, policy: PlanPolicy) -> str | None:
        """Why the candidate may not be used, or None."""
        if self.non_finite:
            return f"outputs not finite (inf or NaN) on {self.non_finite} of {self.images} probe images"
        if self.agreement < policy.min_agreement:
            return f"top-1 agreement {self.agreement:.4f} < {policy.min_agreement} on {self.images} probe images"
        if self.max_prob_diff > policy.max_prob_diff:
            return (
                f"top-class probability differs by up to {self.max_prob_diff:.4f} > {policy.max_prob_diff} "
                f"on {self.images} probe images"
            )
        return None


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities of each row; a row holding inf or NaN comes out NaN (no warning: its caller decides)."""
    with np.errstate(invalid="ignore"):  # inf - inf: an overflowed row, which the callers look for
        shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
        exp = np.exp(shifted)
        return exp / exp.sum(axis=1, keepdims=True)  # type: ignore[no-any-return]


def finite_rows(logits: np.ndarray) -> np.ndarray:
    """Which rows hold only finite numbers."""
    return np.isfinite(logits).all(axis=1)  # type: ignore[no-any-return]


def gate(reference_logits: np.ndarray, candidate_logits: np.ndarray) -> Gate:
    """Top-1 agreement and the largest change of the reference's top-class probability.

    A probe image with non-finite candidate outputs also counts as a disagreement of the whole probability:
    a NaN row's argmax is class 0 and NaN compares false with any bound, so it would pass both checks.
    """
    finite = finite_rows(candidate_logits)
    reference = softmax(reference_logits)
    candidate = softmax(np.where(finite[:, None], candidate_logits, 0.0))
    top = reference.argmax(axis=1)
    rows = np.arange(len(top))
    agrees = (candidate.argmax(axis=1) == top) & finite
    diffs = np.where(finite, np.abs(reference[rows, top] - candidate[rows, top]), 1.0)
    agreement = float(agrees.mean()) if len(top) else 1.0
    diff = float(diffs.max()) if len(top) else 0.0
    return Gate(agreement, diff, len(top), int((~finite).sum()))


@dataclass(frozen=True)
class DecodeJudged:
    """The decode a plan runs with, and the evidence: its answers against full decoding in fp32."""

    decode: Decode
    reason: str
    gate: Gate | None = None  # None: not measured (the version decodes in full as registered)
    ms_per_photo: dict[str, float] = field(default_factory=dict)  # decode + transform, each way measured

    def record(self) -> dict[str, Any]:
        return {
            "decode": self.decode,
            "decode_reason": self.reason,
            "decode_top1_agreement": self.gate.agreement if self.gate else None,
            "decode_max_prob_diff": self.gate.max_prob_diff if self.gate else None,
            "decode_photos": self.gate.images if self.gate else None,
            "decode_ms_per_photo": dict(self.ms_per_photo),
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> DecodeJudged | None:
        decode = record.get("decode")
        if decode is None:
            return None
        if decode not in get_args(Decode):
            raise ValueError(f"unknown decode {decode!r}, expected one of {get_args(Decode)}")
        agreement = record.get("decode_top1_agreement")
        measured = None
        if agreement is not None:
            measured = Gate(float(agreement), float(record["decode_max_prob_diff"]), int(record["decode_photos"]))
        ms = {str(k): float(v) for k, v in (record.get("decode_ms_per_photo") or {}).items()}
        return cls(decode, str(record.get("decode_reason", "")), measured, ms)


@dataclass(frozen=True)
class PlanChoice:
    """The plan a model runs with on a machine, and what it was chosen on: for records and logs."""

    plan: Plan
    hardware: Hardware
    reason: str
    gate: Gate | None = None  # of the chosen plan (None: the reference, or not measured)
    speeds: dict[str, float] = field(default_factory=dict)  # images/s of each plan measured
    artifact: str | None = None  # where its converted model is, relative to the version (openvino)
    prepare_s: float | None = None  # converting, or loading and compiling, the backend's model
    key: str | None = None  # the cache's key of the version's plan on this machine (execution.cache), once cached
    decode: DecodeJudged | None = None  # how JPEGs are decoded, once judged on a night's photos (execution.decoding)
    # another actor is judging the decode: this one runs the unjudged decode meanwhile and looks again next chunk
    decode_pending: bool = False

    @property
    def name(self) -> str:
        """The plan and, once judged, its decode: what a night's rows and records name."""
        return self.plan.name if self.decode is None else f"{self.plan.name}+decode-{self.decode.decode}"

    def record(self) -> dict[str, Any]:
        return {
            "plan": self.name,
            "backend": self.plan.backend,
            "precision": self.plan.precision,
            "channels_last": self.plan.channels_last,
            "reason": self.reason,
            "hardware": self.hardware.as_record(),
            "top1_agreement": self.gate.agreement if self.gate else None,
            "max_prob_diff": self.gate.max_prob_diff if self.gate else None,
            "probe_images": self.gate.images if self.gate else None,
            "images_per_s": {name: round(speed, 2) for name, speed in self.speeds.items()},
            "artifact": self.artifact,
            "prepare_s": None if self.prepare_s is None else round(self.prepare_s, 2),
            "key": self.key,
            **(self.decode.record() if self.decode else {}),
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> PlanChoice:
        """The choice :meth:`record` wrote (a cached plan): ``ValueError`` naming what is missing or wrong."""
        try:
            plan = Plan(record["backend"], record["precision"], bool(record["channels_last"]))
            if plan.backend not in get_args(Backend) or plan.precision not in get_args(Precision):
                raise ValueError(f"unknown plan {plan}")
            agreement, artifact, key = record.get("top1_agreement"), record.get("artifact"), record.get("key")
            measured = None
            if agreement is not None:
                measured = Gate(float(agreement), float(record["max_prob_diff"]), int(record["probe_images"]))
            return cls(
                plan,
                Hardware.from_record(record["hardware"]),
                str(record["reason"]),
                measured,
                {str(k): float(v) for k, v in record.get("images_per_s", {}).items()},
                str(artifact) if artifact else None,
                key=str(key) if key else None,
                decode=DecodeJudged.from_record(record),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a plan record ({type(exc).__name__}: {exc}): {record!r:.200}") from exc


def plans_text(plans: dict[str, dict[str, Any]]) -> str:
    """What predicted a night, one clause per plan its actors ran: for summaries and artifacts."""
    if not plans:
        return "none recorded"
    return "; ".join(_plan_text(name, record) for name, record in sorted(plans.items()))


def _plan_text(name: str, record: dict[str, Any]) -> str:
    """How a plan was chosen, where, and what the night made of it (fallbacks to fp32, a demotion)."""
    text = str(record.get("reason", name))
    if "hardware" in record:
        text += f" on {Hardware.from_record(record['hardware']).describe()}"
    fallbacks = PlanUse.from_record(record).text()
    if fallbacks:
        text += f" ({fallbacks})"
    if record.get("demoted"):
        text += f"; later nights: {record['demoted']}"
    return text


def candidates(
    hardware: Hardware, device: str, policy: PlanPolicy, backends: tuple[Backend, ...] = ("eager",)
) -> list[Plan]:
    """The plans other than the reference worth measuring on this hardware, or the ones pinned.

    The narrower precisions the hardware computes natively, on each backend at hand (OpenVINO on CPUs only);
    and on a CPU, ONNX Runtime in fp32 (its CPU kernels have no bf16 path). A pinned precision is measured
    wherever it is asked for; fp32 pinned without a backend is the reference.
    """
    if policy.precision == "fp32" and policy.backend in (None, "eager"):
        return []  # fp32 pinned: the reference
    if device == "cuda":
        precisions: list[Precision] = ["fp16", "bf16"] if hardware.gpu_bf16 else ["fp16"]
        backends = tuple(b for b in backends if b == "eager")
    else:
        precisions = ["bf16"] if hardware.cpu_bf16 else []
    if policy.precision is not None:
        precisions = [policy.precision]
    chosen = [b for b in backends if policy.backend in (None, b)]
    plans = [
        Plan(b, p, b == "eager")
        for b in chosen
        if b != "onnxruntime"
        for p in precisions
        if (b, p) != ("eager", "fp32")
    ]
    if device == "cpu" and "onnxruntime" in chosen and policy.precision in (None, "fp32"):
        plans.append(Plan("onnxruntime", "fp32", False))
    return plans


def no_fast_path(hardware: Hardware, device: str) -> str:
    where = f"GPU {hardware.gpu}" if device == "cuda" else hardware.describe()
    return f"fp32 eager: no reduced-precision fast path on {where} (none of AVX-512-BF16, AMX)"


def measure(
    run: Logits, probe: np.ndarray, timed: np.ndarray, *, min_seconds: float = 0.2, max_calls: int = 50
) -> tuple[np.ndarray, float]:
    """``run``'s logits on ``probe`` (the gate's, and the warm-up: kernel selection), then its images per
    second on ``timed``, at least twice and for ``min_seconds`` at most ``max_calls`` times."""
    logits = run(probe)
    calls, started = 0, time.perf_counter()
    while calls < 2 or (time.perf_counter() - started < min_seconds and calls < max_calls):
        run(timed)
        calls += 1
    return logits, calls * len(timed) / (time.perf_counter() - started)


def timing_slice(probe: np.ndarray, device: str) -> np.ndarray:
    """What a plan's speed is timed on: the whole probe on a GPU (its speed depends on the batch), a CPU
    night's model call on a CPU (eager's images/s at 224 px fell by 18-20 % from 8 images a call to 32),
    so that an actor's first images are not spent three times over on timing the plans."""
    return probe if device == "cuda" else probe[:CPU_TIMED_IMAGES]


def probe_images(probe: Probe) -> Callable[[], np.ndarray]:
    """``probe``'s images, made on the first call and kept."""
    made: list[np.ndarray] = []

    def images() -> np.ndarray:
        if not made:
            made.append(probe() if callable(probe) else probe)
        return made[0]

    return images


def choose(
    make_run: Callable[[Plan], Logits],
    probe: Callable[[], np.ndarray] | np.ndarray,
    hardware: Hardware,
    device: str,
    policy: PlanPolicy,
    backends: tuple[Backend, ...] = ("eager",),
) -> PlanChoice:
    """Measure the reference and each candidate on ``probe``; the fastest that passes the gate, else fp32.

    A pinned precision (or backend other than eager) is used when it passes the gate, faster or not; a chosen
    one must also be :data:`MIN_SPEEDUP` times faster than fp32 (:data:`MIN_SPEEDUP_FP32` in fp32).
    """
    if policy.mode == "off":
        return PlanChoice(REFERENCE, hardware, "fp32 eager: the plan's choice is off")
    plans = candidates(hardware, device, policy, backends)
    pinned = policy.precision is not None or policy.backend not in (None, "eager")
    if not plans and policy.backend is not None and policy.backend not in backends:
        return PlanChoice(REFERENCE, hardware, f"fp32 eager: the pinned backend {policy.backend} is not at hand here")
    if not plans:
        fp32 = policy.precision == "fp32"
        return PlanChoice(REFERENCE, hardware, "fp32 eager: pinned" if fp32 else no_fast_path(hardware, device))
    probe = probe() if callable(probe) else probe  # only now: there is something to measure
    timed = timing_slice(probe, device)
    reference_logits, reference_speed = measure(make_run(REFERENCE), probe, timed)
    speeds = {REFERENCE.name: reference_speed}
    unjudgeable = int((~finite_rows(reference_logits)).sum())
    if unjudgeable:  # the model's own answers, in the precision it was validated in: nothing to compare with
        reason = (
            f"fp32 eager: the model's own fp32 outputs are not finite (inf or NaN) on {unjudgeable} of "
            f"{len(probe)} probe images, so no other plan can be judged against them"
        )
        return PlanChoice(REFERENCE, hardware, reason, speeds=speeds)
    accepted: list[tuple[float, Plan, Gate]] = []
    refusals = []
    for plan in plans:
        try:
            logits, speed = measure(make_run(plan), probe, timed)
        except Exception as exc:  # a plan the model or the machine cannot run is no plan
            refusals.append(f"{plan.name} failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        speeds[plan.name] = speed
        result = gate(reference_logits, logits)
        refusal = result.refusal(policy)
        needed = MIN_SPEEDUP_FP32 if plan.precision == "fp32" else MIN_SPEEDUP
        if refusal is None and not pinned and speed < needed * reference_speed:
            refusal = f"{speed:.1f} img/s is not faster than fp32's {reference_speed:.1f}"
        if refusal is None:
            accepted.append((speed, plan, result))
        else:
            refusals.append(f"{plan.name} refused: {refusal}")
    if not accepted:
        return PlanChoice(REFERENCE, hardware, f"fp32 eager: {'; '.join(refusals)}", speeds=speeds)
    speed, plan, result = max(accepted, key=lambda item: item[0])
    reason = (
        f"{plan.name}: {speed / reference_speed:.2f}x fp32's speed, top-1 agreement {result.agreement:.4f}, "
        f"top-class probability within {result.max_prob_diff:.4f} on {result.images} probe images"
    )
    reason += "".join(f" ({refusal})" for refusal in refusals)  # why a faster-looking plan was not the one
    return PlanChoice(plan, hardware, reason, result, speeds)


def torch_run(module: nn.Module, plan: Plan) -> Logits:
    """Logits of a torch module under ``plan`` (the module already in the plan's memory layout)."""
    import torch

    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plan.precision)

    def run(batch: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            images = torch.from_numpy(batch).to(device)
            if plan.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            with nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype):
                return module(images).float().cpu().numpy()  # type: ignore[no-any-return]

    return run
