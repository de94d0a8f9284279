"""rayline's exception tree.

Every error rayline raises on purpose is one of these, chained ``from exc``
to the library error that caused it::

    RaylineError
    ├── ConfigError            bad settings or stage parameters (not retried)
    ├── InputDataError         the input itself is wrong: empty prefix, bad URI,
    │   │                      unreadable manifest (not retried)
    │   └── ErrorBudgetExceeded  more of a night's inputs failed than allowed
    │                          (the night is committed first, then refused)
    ├── StorageError           a storage operation failed for good
    ├── RolloutRolledBack      a canary gate failed; traffic went back to the
    │                          incumbent (not retried)
    ├── NightCommittedElsewhere  another run committed the same night of a
    │                          Delta table first (not retried: a retry would
    │                          replace that run's commit)
    ├── NightsFailed           some nights of a range failed, the others
    │                          committed (``rayline.nights``: it carries them)
    ├── RetriesExhausted       Ray's own retries of a stage were used up: a Train
    │                          run past ``max_failures``, every Tune trial
    │                          failed, an input that kills its actor each time
    │                          (not retried: Ray already ran it again)
    ├── WorkTimedOut           a task's Ray work outran the task's time limit and
    │                          was stopped (not retried: it would outrun it again)
    ├── LeaseError             a lease in storage (``rayline.leases``)
    │   ├── LeaseBusy          another run still holds it after the wait (the
    │   │                      message names that run)
    │   └── LeaseLost          it expired and another run took it over: this
    │                          run must not commit what it guards (not retried)
    └── TransientError         worth retrying at the task level
        ├── TransientStorageError   S3 throttling / 5xx / connection reset
        └── ClusterError            Ray unreachable, workers or nodes lost

Per-sample problems (one undecodable image) are *not* exceptions at this
level: workloads record them as error rows and carry on.
"""

from __future__ import annotations

from collections.abc import Iterator


class RaylineError(Exception):
    """Base of every error rayline raises on purpose."""


class ConfigError(RaylineError):
    """Settings or stage parameters are invalid."""


class InputDataError(RaylineError):
    """The input data (prefix, manifest, URI) is unusable as given."""


class ErrorBudgetExceeded(InputDataError):
    """More inputs failed than the configured fraction allows: upstream data needs a look."""


class StorageError(RaylineError):
    """A storage read or write failed and retrying will not help."""


class RolloutRolledBack(RaylineError):
    """A rollout gate refused the candidate; it was taken out of serving."""


class NightCommittedElsewhere(RaylineError):
    """Another run committed the same (model, night) partition while this run was working."""

    def __init__(self, message: str, *, winner_run_id: str | None = None) -> None:
        super().__init__(message)
        self.winner_run_id = winner_run_id


class RetriesExhausted(RaylineError):
    """Ray retried a stage's work itself and it failed every time; ``attempts`` is how often Ray ran it.

    Not retried by Prefect even when the last cause looks transient (a lost
    actor): a failure that survived Ray's restarts is a poison input, a bug or
    a cluster that cannot hold the work, and a fourth run would only repeat it.
    """

    def __init__(self, stage: str, attempts: int, first_error: BaseException | str) -> None:
        error = first_error if isinstance(first_error, str) else f"{type(first_error).__name__}: {first_error}"
        super().__init__(f"{stage} failed in all {attempts} attempt(s) Ray made; the first error: {error}")
        self.stage = stage
        self.attempts = attempts


class WorkTimedOut(RaylineError):
    """The Ray work of a task outran the task's time limit; rayline stopped it (``rayline.ray_work``)."""


class LeaseError(RaylineError):
    """A lease in storage could not be had or kept."""


class LeaseBusy(LeaseError):
    """Another run still holds the lease after the wait; ``holder`` names it."""

    def __init__(self, message: str, *, holder: str | None = None) -> None:
        super().__init__(message)
        self.holder = holder


class LeaseLost(LeaseError):
    """The lease this run held expired and another run took it over: commit nothing it guards."""


class TransientError(RaylineError):
    """A failure that is expected to go away on retry."""


class TransientStorageError(TransientError, StorageError):
    """S3 throttling, a 5xx answer or a dropped connection."""


class ClusterError(TransientError):
    """The Ray cluster could not be reached or lost workers mid-job."""


_TRANSIENT_BUILTINS: tuple[type[BaseException], ...] = (
    ConnectionError,
    TimeoutError,
)

# Names rather than imports: Ray and botocore are heavy, and the classifier
# must work on exceptions that crossed a process boundary.
_TRANSIENT_NAMES = frozenset(
    {
        # Ray: lost workers, actors, nodes, objects
        "WorkerCrashedError",
        "ActorDiedError",
        "ActorUnavailableError",
        "NodeDiedError",
        "ObjectLostError",
        "OwnerDiedError",
        "ObjectReconstructionFailedError",
        "RaySystemError",
        "GetTimeoutError",
        # botocore / aiohttp transport problems
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ServerDisconnectedError",
        "ClientConnectorError",
        "ClientOSError",
    }
)

# Timeouts that look transient (they subclass TimeoutError) but are not: work that outran its
# task's or flow's time limit once will outrun it again, and a retry would only run beside the
# Ray work the timed-out attempt left running.
_DETERMINISTIC_NAMES = frozenset({"TaskRunTimeoutError", "FlowRunTimeoutError"})

_TRANSIENT_S3_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "503",
        "500",
        "502",
        "504",
    }
)


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


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` (or anything in its cause chain) is worth retrying.

    Deliberate rayline errors decide by their class; a config or input error,
    or Ray's exhausted retries, anywhere in the chain wins over a
    transient-looking cause.
    """
    for err in causes(exc):
        if isinstance(err, ConfigError | InputDataError | RetriesExhausted | WorkTimedOut):
            return False
        if type(err).__name__ in _DETERMINISTIC_NAMES:
            return False
        if isinstance(err, (TransientError, *_TRANSIENT_BUILTINS)):
            return True
        if type(err).__name__ in _TRANSIENT_NAMES:
            return True
        if _s3_error_code(err) in _TRANSIENT_S3_CODES:
            return True
    return False
