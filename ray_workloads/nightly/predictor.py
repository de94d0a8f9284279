"""The Ray Data UDF of batch inference: one call takes a span of blocks of the listing from URIs to Parquet.

:class:`PredictorUDF` loads the model once per actor; for each block it fetches the objects concurrently,
decodes them (a bad image is an error row, not a failed job), predicts ``batch_size`` at a time and writes
the block's files inside the tables' partition folders, invisible until the driver commits them
(docs/nights.md). It returns only reports: images never enter the object store. On a shadowed night it
also scores the same decoded pixels with a second version. torch is imported inside the actors only.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from rayline import errors
from rayline.models.registry import ModelVersion
from rayline.ray_workloads.data.images import Decode, ImageSpec, decode_image, decode_rows
from rayline.ray_workloads.execution.cache import plan_for, probe_set
from rayline.ray_workloads.execution.plan import PROBE_IMAGES, REFERENCE, PlanChoice, PlanPolicy
from rayline.ray_workloads.nightly.blocks import (
    SPAN_COLUMNS,
    BlockReport,
    NightOutput,
    PartRows,
    block_contents,
    reports_batch,
    reused_report,
    write_block_files,
)
from rayline.storage import fetching
from rayline.tables.predictions_table import ERRORS_SCHEMA, PREDICTIONS_SCHEMA

if TYPE_CHECKING:
    from rayline.ray_workloads.execution.interface import LoadedModel


def fetch(uris: list[str], etags: list[str], concurrency: int) -> list[fetching.Fetched]:
    """Fetch the objects; a bad object carries its error rather than raising.

    An object whose ETag differs from the listing's (``etags``) was replaced since: its row would name a
    version it was not predicted from, so it is a ``fetch`` error (``ObjectChangedError``), as in ingest.
    Reads that keep failing transiently are no bad object: ``fetching.fetch_many`` raises
    ``TransientStorageError``, failing the night uncommitted for the task's retry; a refused read fails it
    as ``StorageAccessDenied`` (the night's policy, not its inputs).
    """
    fetched = fetching.fetch_many(uris, concurrency)
    return [fetching.as_listed(f, etag) for f, etag in zip(fetched, etags, strict=True)]


def decode_fetched(items: list[fetching.Fetched], spec: ImageSpec, decode: Decode | None) -> dict[str, np.ndarray]:
    """Decode each fetched image as the plan says; a fetch error or a bad image becomes the row's error fields."""
    failed = [None if i.error is None else (type(i.error).__name__, str(i.error)[:500]) for i in items]
    return decode_rows([i.data for i in items], failed, spec, decode)


def first_images(photos: list[bytes | None], spec: ImageSpec) -> np.ndarray:
    """The first :data:`PROBE_IMAGES` photos that decode (the spec's own decode): a plan's measurement probe."""
    images: list[np.ndarray] = []
    for photo in photos:
        if len(images) == PROBE_IMAGES:
            break
        try:
            images.append(decode_image(photo, spec))
        except Exception:  # a bad photo is no probe image; its row's error comes from the chunk's decode
            continue
    return np.stack(images) if images else np.zeros((0, 3, spec.size, spec.size), dtype=np.float32)


class PredictorUDF:
    """Callable class for ``map_batches``: the model is loaded once per actor; a call writes whole blocks."""

    def __init__(
        self,
        model: ModelVersion,
        top_k: int,
        batch_size: int,
        io_concurrency: int,
        output: NightOutput,
        constants: dict[str, Any],
        plan_policy: PlanPolicy | None = None,
        shadow: ModelVersion | None = None,
    ) -> None:
        self.cpu_mark = time.process_time()  # the actor's CPU from here on is the night's (its core-seconds)
        import torch  # here, not at module level: only the actors need it

        from rayline.ray_workloads.execution.interface import assigned_cpus, torch_threads

        torch.set_num_threads(torch_threads(assigned_cpus()))
        self.spec = model.image_spec
        self.top_k = min(top_k, len(model.classes))
        self.names = np.array(model.classes, dtype=object)
        self.batch_size = model_batch_size(self.spec.size, batch_size, "cuda" if torch.cuda.is_available() else "cpu")
        self.io_concurrency = io_concurrency
        self.output = output
        self.constants = constants
        self.plan_policy = plan_policy or PlanPolicy()
        self.version, self.version_uri = model, model.uri
        self.part_rows = PartRows()
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.load_error: Exception | None = None
        self.shadow, self.shadow_model = shadow, None
        try:
            self.model = _load_for_inference(model, self.device)
            if shadow is not None:  # a second version scored on the same decoded pixels (shadow_rows)
                self.shadow_model = _load_for_inference(shadow, self.device)
        except Exception as exc:  # raised by each call: an actor whose __init__ fails tells the driver only
            # that it died (which reads as transient), not that the checkpoint is bad
            self.load_error = exc

    def __call__(self, batch: pa.Table) -> dict[str, np.ndarray]:
        if self.load_error is not None:
            raise self.load_error
        reports = []
        for span in batch.select(list(SPAN_COLUMNS)).to_pylist():  # spans of blocks (blocks.cut_part)
            for block, uris, etags in self.part_rows.blocks(span):
                # a block an earlier attempt of the same night wrote with these rows is reused, not predicted
                reused = reused_report(self.output, block, uris, etags) if span["resuming"] else None
                reports.append(reused or self.run_block(block, uris, etags))
        now = time.process_time()
        spent, self.cpu_mark = now - self.cpu_mark, now
        return reports_batch(reports, spent)

    def run_block(self, block: str, uris: list[str], etags: list[str]) -> BlockReport:
        """Fetch, decode and predict the block a chunk at a time; write the block's rows once.

        Chunking bounds what an actor holds to one chunk's bytes and pixels (:func:`chunk_size`): a whole
        256-object ImageNet block would be 154 MB of float32. Only the prediction columns are kept.
        """
        parts, shadow_parts = [], []
        used_before = self.model.use
        step = chunk_size(self.spec.size, self.batch_size)
        for start in range(0, len(uris), step):
            stop = start + step
            items = fetch(uris[start:stop], etags[start:stop], self.io_concurrency)
            decode = self.plans([i.data for i in items])
            rows = decode_fetched(items, self.spec, decode)
            rows["uri"] = np.array(uris[start:stop], dtype=object)
            rows["etag"] = np.array(etags[start:stop], dtype=object)
            shadow = self.shadow_rows(rows)  # before the champion's model calls turn failed rows into errors
            self.predict(rows)
            if shadow is not None:
                self.predict(shadow, shadowing=True)
                del shadow["image"]
                shadow_parts.append(shadow)
            del rows["image"]  # the pixels are done with: keep only the chunk's prediction columns
            parts.append(rows)
            self.model.forget()  # probe scores the chunk did not use: its photos failed to decode
        plan: dict[str, Any] = self.model.plan.record() if self.model.plan else {"plan": REFERENCE.name}
        plan.update((self.model.use - used_before).record())  # the block's calls, and those fp32 answered
        shadow_table = self._shadow_table(shadow_parts) if shadow_parts else None
        constants = {**self.constants, "plan": plan["plan"]}
        return write_block(block, concat_rows(parts), self.output, constants, plan, shadow_table)

    def plans(self, photos: list[bytes | None]) -> Decode | None:
        """The decode the night's plan runs with, the plans chosen on the first photos an actor fetches.

        The champion's plan is measured, or adopted from the cache, with its decode judged on ``photos``; the
        shadow version scores the champion's pixels, so its plan names the champion's decode.
        """
        if self.model.plan is None or self.model.plan.decode_pending:  # pending: another actor judges it
            self._plan_for(self.model, self.version, photos, judge_decode=True)
        judged = self.model.plan.decode if self.model.plan else None
        shadow_model, shadow = self.shadow_model, self.shadow
        if shadow_model is not None and shadow is not None:
            chosen = shadow_model.plan or self._plan_for(shadow_model, shadow, photos, judge_decode=False)
            shadow_model.plan = replace(chosen, decode=judged)
        return judged.decode if judged else None

    def _plan_for(
        self, model: LoadedModel, version: ModelVersion, photos: Sequence[bytes | None], *, judge_decode: bool
    ) -> PlanChoice:
        """The version's plan, its probe set the version's samples and the night's first images."""

        def probe() -> np.ndarray:  # made only where a plan is measured
            night = first_images(list(photos), self.spec)
            judged_on = probe_set(version, self.spec, night)
            return night if judged_on is None else judged_on

        return plan_for(model, version.uri, probe, self.plan_policy, photos if judge_decode else ())

    def shadow_rows(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """The chunk's decoded images for the shadow version: the same pixels, its own prediction columns."""
        if self.shadow_model is None:
            return None
        n = len(rows["ok"])
        shadow = {key: rows[key] for key in ("uri", "etag", "image")}
        shadow["ok"] = rows["ok"].copy()
        shadow.update({key: np.array([None] * n, dtype=object) for key in ("stage", "error_type", "error_message")})
        return shadow

    def _shadow_table(self, parts: list[dict[str, np.ndarray]]) -> pa.Table:
        """The shadow's rows of the block: every image it scored (one its model call failed on has none)."""
        assert self.shadow_model is not None and self.shadow is not None
        plan = self.shadow_model.plan.record() if self.shadow_model.plan else {"plan": REFERENCE.name}
        rows = concat_rows(parts)
        constants = {**self.constants, "model_version": self.shadow.version, "plan": plan["plan"]}
        return _prediction_table(rows, rows["ok"], constants)

    def predict(self, rows: dict[str, np.ndarray], *, shadowing: bool = False) -> None:
        """Add top-k predictions to the decoded rows, ``batch_size`` images per model call.

        A model call that fails for its input turns its rows into ``predict`` errors. One that fails for
        the machine (``errors.model_call_fault``: out of memory, a CUDA error) raises instead, failing the
        night uncommitted: no sample is to blame. ``shadowing``: with the shadow version, whose failed rows
        are left out of its table, never the night's.
        """
        n, ok = len(rows["ok"]), rows["ok"]
        rows["predicted_index"] = np.full(n, -1, dtype=np.int64)
        rows["confidence"] = np.zeros(n, dtype=np.float32)
        rows["top_k_index"] = np.full((n, self.top_k), -1, dtype=np.int64)
        rows["top_k_prob"] = np.zeros((n, self.top_k), dtype=np.float32)
        rows["inference_ms"] = np.zeros(n, dtype=np.float32)
        decoded = np.flatnonzero(ok)
        for start in range(0, len(decoded), self.batch_size):
            batch = decoded[start : start + self.batch_size]
            try:
                self._predict_batch(rows, batch, shadowing)
            except Exception as exc:  # the model call failed as a whole: each of its samples is an error row
                fault = errors.model_call_fault(exc, f"a model call on {len(batch)} images")
                if fault is not None:
                    raise fault from exc
                ok[batch] = False
                rows["stage"][batch], rows["error_type"][batch] = "predict", type(exc).__name__
                rows["error_message"][batch] = str(exc)[:500]
        _non_finite_as_errors(rows)
        names = [self.names[p] if p >= 0 else None for p in rows["predicted_index"]]
        rows["predicted_class"] = np.array(names, dtype=object)
        # a list per row (not a 2-D array): a failed row has no classes, only -1 indices
        rows["top_k_class"] = np.empty(n, dtype=object)
        for i, row in enumerate(rows["top_k_index"]):  # one by one: numpy would broadcast equal-length lists
            rows["top_k_class"][i] = [str(self.names[j]) for j in row] if row[0] >= 0 else []

    def _predict_batch(self, rows: dict[str, np.ndarray], batch: np.ndarray, shadowing: bool) -> None:
        model = self.shadow_model if shadowing else self.model
        assert model is not None
        started = time.perf_counter()
        probabilities = model.probabilities(rows["image"][batch])
        indices = top_k_indices(probabilities, self.top_k)
        rows["top_k_index"][batch] = indices
        rows["top_k_prob"][batch] = np.take_along_axis(probabilities, indices, axis=1)
        rows["predicted_index"][batch] = rows["top_k_index"][batch, 0]
        rows["confidence"][batch] = rows["top_k_prob"][batch, 0]
        rows["inference_ms"][batch] = (time.perf_counter() - started) * 1000 / len(batch)


def _non_finite_as_errors(rows: dict[str, np.ndarray]) -> None:
    """Predicted rows whose probabilities are not numbers become ``predict`` errors (``NonFiniteOutput``).

    These are fp32's own answers (execution.fallback): a NaN row's argmax would name class 0 with a NaN
    confidence, which nothing downstream can tell from a real prediction.
    """
    bad = rows["ok"] & ~np.isfinite(rows["top_k_prob"]).all(axis=1)
    if not bad.any():
        return
    rows["ok"][bad] = False
    rows["stage"][bad], rows["error_type"][bad] = "predict", "NonFiniteOutput"
    rows["error_message"][bad] = "the model's fp32 scores for this image are not finite (inf or NaN)"
    rows["predicted_index"][bad], rows["top_k_index"][bad] = -1, -1


def top_k_indices(probabilities: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` most probable classes of each row, most probable first (ties: the lower index)."""
    if k < probabilities.shape[1]:
        candidates = np.argpartition(-probabilities, k - 1, axis=1)[:, :k]
    else:
        candidates = np.broadcast_to(np.arange(probabilities.shape[1]), probabilities.shape)
    scores = np.take_along_axis(probabilities, candidates, axis=1)
    order = np.lexsort((candidates, -scores), axis=1)
    return np.take_along_axis(candidates, order, axis=1).astype(np.int64)


# Decoded float32 pixels an actor holds at once (one chunk of a block).
DECODED_BYTES_PER_CHUNK = 64 * 2**20
# Input pixels per model call. A ResNet's activations, not its input, are what a call costs. On a CPU, eager
# fp32 ran 18-20 % faster at 8 images of 224 px a call than at 32 (ResNet-50: 9.1 against 7.6 img/s on one
# thread; a night 10.6 against 9.1), the activations of fewer images staying in cache; ONNX Runtime's speed
# barely moved (bench/README.md). A GPU wants its batches large: 32 there, as a GPU night asks.
PIXELS_PER_MODEL_CALL = {"cpu": 8 * 224 * 224, "cuda": 32 * 224 * 224}


def model_batch_size(side: int, batch_size: int, device: str = "cpu") -> int:
    """Images per model call: ``batch_size``, fewer for large inputs (the digits at 32 px keep 64)."""
    return max(1, min(batch_size, PIXELS_PER_MODEL_CALL.get(device, PIXELS_PER_MODEL_CALL["cuda"]) // (side * side)))


def chunk_size(side: int, batch_size: int) -> int:
    """Objects fetched and decoded together: as many as fit in ``DECODED_BYTES_PER_CHUNK``, at least a batch
    (the digits at 32 px: a whole block; a 224 px crop: 111, so a chunk's fetches still overlap)."""
    return max(batch_size, DECODED_BYTES_PER_CHUNK // (3 * side * side * 4))


def concat_rows(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The chunks of one block as one set of columns (chunks share their keys)."""
    return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}


def _load_for_inference(model: ModelVersion, device: Any) -> LoadedModel:
    from rayline.ray_workloads.execution.interface import assigned_cpus, load_version, torch_threads

    return load_version(model, device=device, threads=torch_threads(assigned_cpus()))


def _prediction_table(rows: dict[str, np.ndarray], selected: np.ndarray, constants: dict[str, Any]) -> pa.Table:
    n = int(selected.sum())
    columns: dict[str, Any] = {
        name: rows[name][selected].tolist()
        for name in ("uri", "etag", "predicted_class", "top_k_index", "top_k_prob", "top_k_class")
    }
    columns.update({name: rows[name][selected] for name in ("predicted_index", "confidence", "inference_ms")})
    columns.update({key: [value] * n for key, value in constants.items()})
    return pa.table({field.name: pa.array(columns[field.name], field.type) for field in PREDICTIONS_SCHEMA})


def _error_table(rows: dict[str, np.ndarray], selected: np.ndarray) -> pa.Table:
    return pa.table({field.name: pa.array(rows[field.name][selected].tolist(), field.type) for field in ERRORS_SCHEMA})


def write_block(
    block: str,
    rows: dict[str, np.ndarray],
    output: NightOutput,
    constants: dict[str, Any],
    plan: dict[str, Any] | None = None,
    shadow: pa.Table | None = None,
) -> BlockReport:
    """Write a block's predictions and errors (and the shadow's rows), one file each, at the block's fixed
    names (nightly.blocks)."""
    ok = rows["ok"]
    errors = _error_table(rows, ~ok)
    types = Counter(str(t) for t in errors.column("error_type").to_pylist())
    contents = block_contents(list(rows["uri"]), list(rows["etag"]))
    predictions = _prediction_table(rows, ok, constants)
    return write_block_files(output, block, predictions, errors, dict(types), contents, plan, shadow)
