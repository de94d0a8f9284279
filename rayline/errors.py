"""rayline's exception tree: every error it raises on purpose, chained ``from exc`` to its cause::

    RaylineError
    ├── ConfigError             (ConditionalWritesUnsupported, DeltaWritesUnsupported, InferenceOnlyFormat,
    │                            DatabaseUnusable)
    ├── InputDataError          (ErrorBudgetExceeded, NoLineageError, UnsafeCheckpointError, UnsafeModelFileError,
    │                            WeightsMismatchError, ModelExportError, ImageDecodeError → EmptyImageError,
    │                            UnsupportedFormatError, CorruptImageError, ImageTooLargeError)
    ├── StorageError            (StorageAccessDenied)
    ├── LeaseError              (LeaseBusy, LeaseLost → StaleFence)
    ├── ObjectChangedError, OutOfMemory, RolloutRolledBack, QualityGateFailed, NightCommittedElsewhere,
    │   NightsFailed, RetriesExhausted, WorkTimedOut, AliasConflict, PlatformBusy, HttpError, ModelOutputError,
    │   InjectedFailure
    └── TransientError          (TransientStorageError, ClusterError, DeviceError, ModelTimeoutError)

Every class lives here (a stage with errors of its own would keep them in its package's ``errors.py``, named in this
tree). Each class says when it is raised; :func:`is_transient` says which are worth a retry. Per-sample problems (an
undecodable image, a model call its input broke) are error rows, not exceptions; a failure of the machine or of the
run's rights is never per-sample (:func:`model_call_fault`, :func:`is_access_denied`), and fails the stage uncommitted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class RaylineError(Exception):
    """Base of every error rayline raises on purpose."""


class ConfigError(RaylineError):
    """Settings or stage parameters are invalid."""


class ConditionalWritesUnsupported(ConfigError):
    """The object store answered a conditional write that should have been refused: it ignores
    ``If-None-Match`` / ``If-Match`` (S3, Azure) or ``ifGenerationMatch`` (GCS), on which every lease,
    claim and commit relies. Not retried."""


class DeltaWritesUnsupported(ConfigError):
    """delta-rs could not write a Delta table at the store's endpoint (a server that lacks the API its
    client speaks, such as a GCS emulator without the XML API): a night there would predict everything
    and then fail to commit. Not retried."""


class InferenceOnlyFormat(ConfigError):
    """A code-free model file (TorchScript, .pt2, ONNX) asked to be trained: rayline cannot rebuild its module."""


class DatabaseUnusable(ConfigError):
    """The PostgreSQL database ``rayline up`` was given cannot serve: its server is unreachable, it refused the
    credentials, or the database does not exist. Raised before any service starts; not retried."""


class InputDataError(RaylineError):
    """The input data (prefix, manifest, URI) is unusable as given."""


class ErrorBudgetExceeded(InputDataError):
    """More inputs failed than the configured fraction allows: upstream data needs a look."""


class NoLineageError(InputDataError):
    """No lineage record (nor model version) produced the URI asked about."""


class UnsafeCheckpointError(InputDataError):
    """A checkpoint that is not plain tensors (pickled code/objects) was refused."""


class UnsafeModelFileError(InputDataError):
    """A model file that would need arbitrary unpickling (or native code) to load was refused."""


class WeightsMismatchError(InputDataError):
    """A state dict whose keys or shapes don't fit the architecture it is registered as."""


class ModelExportError(InputDataError):
    """A version's module that does not export to ONNX, or whose export answers otherwise than the module: the
    MLflow mirror leaves that version out (saying why) rather than publish a model that predicts something else."""


class ImageDecodeError(InputDataError):
    """The bytes are not a decodable image: one sample's error row (or an HTTP answer), never a failed stage."""


class EmptyImageError(ImageDecodeError):
    """Zero bytes where an image was expected."""


class UnsupportedFormatError(ImageDecodeError):
    """The bytes are not in any image format PIL recognises."""


class CorruptImageError(ImageDecodeError):
    """A recognised format whose data is truncated or damaged."""


class ImageTooLargeError(ImageDecodeError):
    """The image declares more pixels than the configured limit."""


class StorageError(RaylineError):
    """A storage read or write failed and retrying will not help."""


class ObjectChangedError(RaylineError):
    """An object was replaced between its listing and its read: the read's ETag is not the listed one.

    Never raised: an error row (naming both ETags) of the ingest or night that listed the old version, which
    no longer exists to read. The next run lists the new version and reads it.
    """


class RolloutRolledBack(RaylineError):
    """A rollout gate refused the candidate; it was taken out of serving."""


class QualityGateFailed(RaylineError):
    """The labels say the candidate is worse than the champion (the paired test failed): it is not promoted."""


class NightCommittedElsewhere(RaylineError):
    """Another run committed the same (model, night) partition while this run was working."""

    def __init__(self, message: str, *, winner_run_id: str | None = None) -> None:
        super().__init__(message)
        self.winner_run_id = winner_run_id


class NightsFailed(RaylineError):
    """Some nights of a range failed (the others committed): the run ends Failed, naming them. ``result`` holds
    every night's outcome (the backfill's ``BackfillResult``), for a caller that reports them."""

    def __init__(self, message: str, result: Any) -> None:
        super().__init__(message)
        self.result = result

    def __reduce__(self) -> tuple[type[NightsFailed], tuple[str, Any]]:
        # Exception pickles only ``args``: keep the outcomes when Prefect copies the exception
        return (type(self), (str(self), self.result))


class RetriesExhausted(RaylineError):
    """Ray retried a stage's work itself and it failed every time; ``attempts`` is how often Ray ran it.

    Not retried by Prefect even when the last cause looks transient (a lost actor): a failure that survived
    Ray's restarts is a poison input, a bug or a cluster that cannot hold the work; another run repeats it.
    """

    def __init__(self, stage: str, attempts: int, first_error: BaseException | str) -> None:
        error = first_error if isinstance(first_error, str) else f"{type(first_error).__name__}: {first_error}"
        super().__init__(f"{stage} failed in all {attempts} attempt(s) Ray made; the first error: {error}")
        self.stage = stage
        self.attempts = attempts


class WorkTimedOut(RaylineError):
    """The Ray work of a task outran the task's time limit; rayline stopped it (``rayline.ray_work``)."""


class AliasConflict(RaylineError):
    """An alias move lost to another writer (or to the rollout holding the champion); ``current`` is the
    version the alias is on now, ``rollout_holder`` the rollout holding the champion (if that was why)."""

    def __init__(self, message: str, *, current: int | None = None, rollout_holder: str | None = None) -> None:
        super().__init__(message)
        self.current = current
        self.rollout_holder = rollout_holder


class LeaseError(RaylineError):
    """A lease in storage could not be had or kept."""


class LeaseBusy(LeaseError):
    """Another run still holds the lease after the wait; ``holder`` names it."""

    def __init__(self, message: str, *, holder: str | None = None) -> None:
        super().__init__(message)
        self.holder = holder


class LeaseLost(LeaseError):
    """The lease this run held expired and another run took it over: commit nothing it guards."""


class StaleFence(LeaseLost):
    """A receiver refused a change made under an older lease generation than one it has already seen:
    the lease was taken over while its holder was paused or cut off (``rayline.storage.fencing``)."""


class PlatformBusy(RaylineError):
    """Another ``rayline up`` or ``down`` holds the state folder's lock: two at once would orphan each other's
    processes."""


class HttpError(RaylineError):
    """A request the router answers with a 4xx/5xx JSON error (and ``headers``, e.g. a 429's ``Retry-After``)."""

    def __init__(self, status: int, error: str, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.error, self.detail, self.headers = status, error, detail, headers


class ModelOutputError(RaylineError):
    """A served model produced scores that are not finite (NaN/inf): the version is broken."""


class InjectedFailure(RaylineError):
    """Raised by the training loop's fault drill, to exercise recovery from checkpoints."""


class StorageAccessDenied(StorageError):
    """S3 or the filesystem refused a read for want of permission (AccessDenied, 403).

    A policy, a role or expired credentials refuse the caller, not an object: one such read fails the stage,
    so that no night or ingest is committed with rows that say only that this run could not look. Not
    retried: the policy is the same a minute later.
    """


class OutOfMemory(RaylineError):
    """A model call ran out of device or host memory (``torch.OutOfMemoryError``, ``MemoryError``).

    Not retried: the same batch shape on the same kind of machine runs out again. Lower the batch size or
    give each actor more memory (fewer actors per GPU or node).
    """


class TransientError(RaylineError):
    """A failure that is expected to go away on retry."""


class TransientStorageError(TransientError, StorageError):
    """S3 throttling, a 5xx answer or a dropped connection."""


class ClusterError(TransientError):
    """The Ray cluster could not be reached or lost workers mid-job."""


class DeviceError(TransientError):
    """The accelerator failed a model call: a CUDA error (illegal access, launch failure, ECC, device-side assert).

    Transient: CUDA errors are sticky, so nothing is retried in place; a task retry runs a fresh actor pool,
    which clears a faulty context or a failing device. A bug that raises one every time costs the bounded retries.
    """


class ModelTimeoutError(TransientError):
    """A served version did not answer within ``ServeConfig.request_timeout_s`` (HTTP 504)."""


_TRANSIENT_BUILTINS: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)

# Names rather than imports: Ray and botocore are heavy, and the classifier
# must work on exceptions that crossed a process boundary.
_TRANSIENT_NAMES = frozenset(
    # Ray: lost workers, actors, nodes, objects
    "WorkerCrashedError ActorDiedError ActorUnavailableError NodeDiedError ObjectLostError OwnerDiedError"
    " ObjectReconstructionFailedError RaySystemError GetTimeoutError"
    # botocore / aiohttp transport problems
    " EndpointConnectionError ConnectTimeoutError ReadTimeoutError ConnectionClosedError ServerDisconnectedError"
    " ClientConnectorError ClientOSError ServerTimeoutError"
    # aiohttp's body cut short (s3fs, gcsfs, adlfs all read through aiohttp)
    " ClientPayloadError ContentLengthError TransferEncodingError"
    # the Azure SDK's transport problems
    " ServiceRequestError ServiceResponseError"
    # a body cut short: botocore's length check, its wrapper of urllib3's error, urllib3's own,
    # and http.client's under them
    " IncompleteReadError ResponseStreamingError ProtocolError IncompleteRead".split()
)

# Timeouts that look transient (they subclass TimeoutError) but are not: work that outran its
# task's or flow's time limit once will outrun it again, and a retry would only run beside the
# Ray work the timed-out attempt left running.
_DETERMINISTIC_NAMES = frozenset({"TaskRunTimeoutError", "FlowRunTimeoutError"})

_TRANSIENT_S3_CODES = frozenset(
    "SlowDown Throttling ThrottlingException RequestTimeout InternalError ServiceUnavailable 500 502 503 504".split()
)

# S3 error codes that refuse the caller rather than report on an object: policies and credentials.
_ACCESS_DENIED_S3_CODES = frozenset(
    "AccessDenied 403 Forbidden AllAccessDisabled InvalidAccessKeyId SignatureDoesNotMatch AccountProblem".split()
)

# Model-call failures of the machine, by class name (torch need not be imported here) and by message:
# torch raises many device errors as a plain RuntimeError whose text alone says what happened.
_OUT_OF_MEMORY_NAMES = frozenset({"OutOfMemoryError", "MemoryError"})  # torch.OutOfMemoryError is torch.cuda's
_OUT_OF_MEMORY_TEXT = ("out of memory", "not enough memory", "can't allocate memory", "cannot allocate memory")
_DEVICE_NAMES = frozenset({"AcceleratorError"})  # torch >= 2.8: a CUDA error
_DEVICE_TEXT = ("cuda error", "cuda driver", "cudnn", "cublas", "cufft", "nccl", "device-side", "hip error")


def causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what caused it, across Ray's task-error wrappers."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        wrapped = getattr(current, "cause", None)  # RayTaskError keeps the remote exception here
        current = wrapped if isinstance(wrapped, BaseException) else current.__cause__ or current.__context__


def _s3_error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return str(code) if code is not None else None
    return None


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status a store's client failed with: botocore's response, the Azure SDK's ``status_code``,
    gcsfs's ``HttpError.code``, aiohttp's ``status``; None when there was no answer."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return int(status) if isinstance(status, int) else None
    for attribute in ("status_code", "code", "status"):
        status = getattr(exc, attribute, None)
        if isinstance(status, int) and 100 <= status < 600:
            return status
    return None


def is_access_denied(exc: BaseException) -> bool:
    """True when a read failed because the caller may not read: an S3 AccessDenied or 403, a ``PermissionError``
    (s3fs's form of AccessDenied)."""
    return any(
        isinstance(err, PermissionError | StorageAccessDenied)
        or _s3_error_code(err) in _ACCESS_DENIED_S3_CODES
        or _http_status(err) == 403
        for err in causes(exc)
    )


def model_call_fault(exc: BaseException, what: str) -> RaylineError | None:
    """The run's error when ``what`` (a model call) failed for the machine, not for its input; else None.

    Out of memory is :class:`OutOfMemory`, a CUDA or other device error :class:`DeviceError`. Anything else
    (a shape the model refuses, a NaN check) is the input's: the caller records its samples as error rows.
    """
    name, text = type(exc).__name__, str(exc).lower()
    detail = f"{what} failed for the machine, not the input: {name}: {str(exc)[:300]}"
    if name in _OUT_OF_MEMORY_NAMES or (isinstance(exc, RuntimeError) and any(t in text for t in _OUT_OF_MEMORY_TEXT)):
        return OutOfMemory(detail)
    if name in _DEVICE_NAMES or (isinstance(exc, RuntimeError) and any(t in text for t in _DEVICE_TEXT)):
        return DeviceError(detail)
    return None


_NEVER_TRANSIENT = (ConfigError, InputDataError, RetriesExhausted, WorkTimedOut, StorageAccessDenied, OutOfMemory)


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` (or anything in its cause chain) is worth retrying.

    rayline's errors decide by their class; a config or input error, or Ray's exhausted retries, anywhere in
    the chain wins over a transient-looking cause.
    """
    for err in causes(exc):
        if type(err).__name__ in _DETERMINISTIC_NAMES or isinstance(err, _NEVER_TRANSIENT):
            return False
        if isinstance(err, (TransientError, *_TRANSIENT_BUILTINS)) or type(err).__name__ in _TRANSIENT_NAMES:
            return True
        if _s3_error_code(err) in _TRANSIENT_S3_CODES:
            return True
        if (status := _http_status(err)) is not None and (status == 429 or status >= 500):
            return True  # throttled, or the store's own fault: GCS and Azure say so with the status alone
    return False
