"""Stop the Ray work a task attempt started when the attempt is interrupted (a timeout, a cancel).

Prefect's task timeout only raises in the task's thread; the Ray work the task started (a Ray Train controller
and its workers, Tune's trials, Ray Data's actor pools, remote tasks) goes on, and a retry would share the
cluster with it. :func:`cancel_on_abort` remembers this Ray job's actors alive when the attempt began; when the
body is interrupted (an exception that is no ``Exception``, or a ``TimeoutError``), it kills the job's actors
that appeared since (not detached ones: Serve and Ray Data keep shared helpers that way), force-cancels the refs
handed to :func:`track`, and waits until all of them are gone.

Actors are attributed by job and time, not by thread: while two scopes run at once in one process (a backfill's
concurrent nights), an interrupted one cannot tell its actors from its siblings'. Then it stops only what it can name as
its own: its tracked refs, and the Ray Data executions of datasets marked by :func:`stop_with_scope`, shut down with
force. Ray Data's own shutdown of an abandoned execution only drops the pool's handles, leaving busy actors running: so
a failed execution's shutdown is forced, and the actors of one shut down without force are killed when the scope stops.

Work may also have to end for a reason of its own while its attempt goes on (a night whose lease another run
took over): the marked executions started under a :func:`stoppable` block are shut down the same way by its
:class:`Stopper`, from any thread, with the error it is given.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import ray

from rayline.errors import RaylineError, WorkTimedOut, causes

log = logging.getLogger(__name__)

# How long an interrupted scope waits for what it stopped to be gone.
GONE_WITHIN_S = 30.0
_LIVE_ACTOR_STATES = ("DEPENDENCIES_UNREADY", "PENDING_CREATION", "ALIVE", "RESTARTING")


@dataclass
class _Scope:
    what: str
    actors_before: frozenset[str] | None  # None: Ray was not connected yet, so every actor of the job is new
    refs: dict[Any, None] = field(default_factory=dict)  # a set in the order tracked: gather tracks again
    executors: list[Any] = field(default_factory=list)  # Ray Data's StreamingExecutors running in this scope
    released: set[str] = field(default_factory=set)  # actors of its executions shut down without force
    stopped: bool = False  # by an interrupt or by the watchdog: once
    timed_out: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


_current: ContextVar[_Scope | None] = ContextVar("rayline_ray_work_scope", default=None)
_stoppers: ContextVar[tuple[Stopper, ...]] = ContextVar("rayline_ray_work_stoppers", default=())
_active = 0
_lock = threading.Lock()


def track(refs: Iterable[Any]) -> None:
    """Hand Ray object refs of remote tasks to the current scope: an interrupt cancels them (no-op outside one).

    A ref handed to a scope already stopped is cancelled at once, and waited for: the stop did not see it.
    Loops that submit should ask :func:`raise_if_stopped` first, since a task cancelled as it is being pushed
    to a worker may still run there.
    """
    scope = _current.get()
    if scope is None:
        return
    refs = list(dict.fromkeys(refs))  # ray.wait refuses a list that names a ref twice
    with scope.lock:
        scope.refs.update(dict.fromkeys(refs))
        stopped = scope.stopped
    if stopped:
        _cancel(refs)
        _wait_gone(set(), refs, time.monotonic() + GONE_WITHIN_S)


def raise_if_stopped() -> None:
    """Raise :class:`~rayline.errors.WorkTimedOut` when the current scope was stopped (no-op outside one).

    The watchdog stops a scope from its own thread, and the body learns of it only through the Ray work it
    waits on: a body before its first submission (a slow listing) would go on submitting doomed work.
    """
    scope = _current.get()
    if scope is not None and scope.stopped:
        raise WorkTimedOut(f"{scope.what} was stopped; no more Ray work is submitted")


def stop_with_scope(context: Any) -> None:
    """Make the Ray Data executions of datasets with this ``DataContext`` stop with the scope they run in
    (and with the :func:`stoppable` blocks they start in).

    A dataset's context is its own copy (``dataset.context``): only this dataset and those derived from it
    after the call are marked. Stopped, the dataset's consumer gets an error rather than a short, normal end.
    """
    if _StopsWithScope not in context.custom_execution_callback_classes:
        context.custom_execution_callback_classes.append(_StopsWithScope)


class Stopper:
    """Stops the Ray Data executions of marked datasets (:func:`stop_with_scope`) started under it
    (:func:`stoppable`), from any thread and with the caller's error, which their consumers raise; one started
    after the stop is refused with it.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._error: RaylineError | None = None
        self._executors: list[Any] = []
        self._lock = threading.Lock()

    def stop(self, error: RaylineError) -> None:
        """Stop the executions running under this stopper, and refuse new ones; once (later calls do nothing)."""
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            executors = list(self._executors)
        for executor in executors:
            _stop_execution(executor, error)
        log.warning("%s stopped %d Ray Data run(s): %s", self.what, len(executors), error)

    def register(self, executor: Any) -> None:
        with self._lock:
            if self._error is not None:
                raise self._error
            self._executors.append(executor)

    def forget(self, executor: Any) -> None:
        with self._lock:
            if executor in self._executors:
                self._executors.remove(executor)


@contextmanager
def stoppable(what: str) -> Iterator[Stopper]:
    """A :class:`Stopper` for the Ray Data executions that the body starts (in this thread or context)."""
    stopper = Stopper(what)
    token = _stoppers.set((*_stoppers.get(), stopper))
    try:
        yield stopper
    finally:
        _stoppers.reset(token)


class _StopsWithScope:
    """A Ray Data execution callback (duck-typed: Ray Data makes one per execution, with no arguments)."""

    def __init__(self) -> None:
        self.scope: _Scope | None = None
        self.stoppers: tuple[Stopper, ...] = ()

    def before_execution_starts(self, executor: Any) -> None:
        # this runs in the consumer's thread, in the scope (and under the stoppers) that started the execution
        self.stoppers = _stoppers.get()
        for stopper in self.stoppers:
            stopper.register(executor)
        scope = _current.get()
        if scope is None:
            return
        self.scope = scope
        original = executor.shutdown

        def shutdown(force: bool, exception: BaseException | None = None) -> None:
            # Ray Data's own shutdown only drops the pools' handles (see the module's docstring): force a
            # failed one, remember the actors of one ended without force for a stop of the scope to kill
            forced = force or scope.stopped or exception is not None
            if not forced:
                with scope.lock:
                    scope.released |= _pool_actors(executor)
            original(forced, exception)

        executor.shutdown = shutdown
        with scope.lock:
            if scope.stopped:
                raise WorkTimedOut(f"{scope.what} was stopped: no new Ray Data execution starts in it")
            scope.executors.append(executor)

    def on_execution_step(self, executor: Any) -> None:
        return None

    def after_execution_succeeds(self, executor: Any) -> None:
        self._forget(executor)

    def after_execution_fails(self, executor: Any, error: Exception) -> None:
        self._forget(executor)

    def _forget(self, executor: Any) -> None:
        for stopper in self.stoppers:
            stopper.forget(executor)
        if self.scope is not None:
            with self.scope.lock:
                if executor in self.scope.executors:
                    self.scope.executors.remove(executor)


def _is_interrupt(exc: BaseException | None) -> bool:
    return exc is not None and (isinstance(exc, TimeoutError) or not isinstance(exc, Exception))


def gather(refs: list[Any]) -> list[Any]:
    """``ray.get`` of remote tasks' refs, tracked (:func:`track`); a task's rayline error is raised as itself
    (chained to Ray's ``RayTaskError``), since callers classify failures by rayline's own types."""
    track(refs)
    try:
        return list(ray.get(refs))
    except ray.exceptions.RayTaskError as exc:
        wrapper = ray.exceptions.RayTaskError
        ours = [e for e in causes(exc) if isinstance(e, RaylineError) and not isinstance(e, wrapper)]
        if ours:
            raise ours[0] from exc
        raise


def _job_actors() -> dict[str, bool]:
    """This job's live actors: id → detached; from the GCS's actor table (the state API needs the dashboard,
    which the embedded cluster does not start)."""
    from ray._private.state import state

    table = state.actor_table(None, job_id=ray.get_runtime_context().job_id)
    return {a["ActorID"]: bool(a["IsDetached"]) for a in table.values() if a["State"] in _LIVE_ACTOR_STATES}


@contextmanager
def cancel_on_abort(what: str, timeout_s: float | None = None) -> Iterator[None]:
    """Run the body; if it is interrupted or outruns ``timeout_s``, stop the Ray work it started.

    The watchdog is needed beside Prefect's own timeout: a thread blocked in ``ray.get`` (Ray Train's ``fit``
    on its controller) sees no alarm signal or injected exception until the call returns. Stopping the work
    makes it return; the body's error then comes out as :class:`~rayline.errors.WorkTimedOut`, not retried.
    """
    scope = _Scope(what, frozenset(_job_actors()) if ray.is_initialized() else None)
    token = _current.set(scope)
    watchdog = threading.Timer(timeout_s, _time_out, (scope, timeout_s)) if timeout_s else None
    _count_active(1)
    if watchdog is not None:
        watchdog.daemon = True
        watchdog.start()
    try:
        yield
    except BaseException as exc:  # interrupts and cancellations too: they must stop the Ray work; always re-raised
        if _is_interrupt(exc):
            _stop(scope, exc)
        elif scope.timed_out:
            # the body may see its first cancelled ref before the watchdog has seen the rest gone: a
            # retry must not start (and clear the attempt's folder) while a task of this one still ends
            if watchdog is not None:
                watchdog.join(GONE_WITHIN_S + 5.0)
            raise WorkTimedOut(f"{what} outran its {timeout_s:g} s limit; its Ray work was stopped") from exc
        raise
    finally:
        if watchdog is not None:
            watchdog.cancel()
        _count_active(-1)
        _current.reset(token)


def _count_active(change: int) -> None:
    global _active
    with _lock:
        _active += change


def _time_out(scope: _Scope, timeout_s: float) -> None:
    scope.timed_out = True
    _stop(scope, TimeoutError(f"{scope.what} outran {timeout_s:g} s"))


def _stop(scope: _Scope, exc: BaseException) -> None:
    """Stop the scope's Ray Data executions, kill its new actors (when it is the only scope running), cancel
    its refs, and wait until they are gone."""
    with scope.lock:
        if scope.stopped or not ray.is_initialized():
            return
        scope.stopped = True
        executors = list(scope.executors)
    started = time.monotonic()
    for executor in executors:
        _stop_execution(executor, WorkTimedOut(f"{scope.what} was interrupted ({type(exc).__name__}): {exc}"))
    with _lock:
        alone = _active == 1
    with scope.lock:
        actors = sorted(scope.released)  # the scope's own for certain, alone or not
    if alone:
        new = [a for a, detached in _job_actors().items() if not detached and a not in (scope.actors_before or ())]
        actors = sorted({*actors, *new})
    else:
        log.warning(
            "%s interrupted beside other tasks running Ray work: it stops its tracked tasks and Ray Data runs only",
            scope.what,
        )
    # ray.kill needs a handle, and these actors are anonymous: kill by id, as ray.kill does inside
    core = ray._private.worker.global_worker.core_worker  # type: ignore[attr-defined]
    for actor_id in actors:
        try:
            core.kill_actor(ray.ActorID.from_hex(actor_id), True)
        except Exception as err:  # already gone, or not ours to kill: the wait below says which
            log.debug("killing actor %s: %s", actor_id, err)
    with scope.lock:
        refs = list(scope.refs)
    _cancel(refs)
    left = _wait_gone(set(actors), refs, started + GONE_WITHIN_S)
    log.warning(
        "%s interrupted (%s): stopped %d Ray Data run(s), %d actor(s) and %d task(s) it started in %.1f s%s",
        scope.what,
        type(exc).__name__,
        len(executors),
        len(actors),
        len(refs),
        time.monotonic() - started,
        f"; still alive: {sorted(left)}" if left else "",
    )


def _pool_actors(executor: Any) -> set[str]:
    """The ids of the actors in a Ray Data execution's actor pools (its operators hold them; no public list)."""
    ids: set[str] = set()
    try:
        for op in executor._topology or ():
            for pool in op.get_autoscaling_actor_pools() if hasattr(op, "get_autoscaling_actor_pools") else ():
                handles = [*pool._running_actors, *pool._pending_actors.values()]
                ids.update(handle._actor_id.hex() for handle in handles)
    except Exception as err:  # Ray Data's internals moved: the stop then relies on the forced shutdowns alone
        log.warning("listing a Ray Data execution's actors: %s", err)
    return ids


def _cancel(refs: list[Any]) -> None:
    for ref in refs:
        try:
            ray.cancel(ref, force=True, recursive=True)
        except Exception as err:  # finished already, or not a task's ref
            log.debug("cancelling %s: %s", ref, err)


def _stop_execution(executor: Any, error: RaylineError) -> None:
    """Shut one Ray Data execution down with force (its actor pools killed, its tasks cancelled), and make its
    consumer raise ``error`` rather than end as if finished. Under the executor's shutdown lock, so that the
    consumer, woken by the error, cannot shut it down first without force."""
    try:
        with executor._shutdown_lock:
            executor._output_node[1].mark_finished(error)
            executor.shutdown(True, error)
    except Exception as err:  # an execution already ending: what it leaves shows in the wait below
        log.warning("stopping a Ray Data execution: %s", err)


def _wait_gone(actors: set[str], refs: list[Any], deadline: float) -> set[str]:
    """Poll until the actors are dead and the refs' tasks ended; what is still alive at the deadline."""
    left = set(actors)
    pending = list(refs)
    while time.monotonic() < deadline:
        left &= set(_job_actors()) if left else set()
        pending = ray.wait(pending, num_returns=len(pending), timeout=0)[1] if pending else []
        if not left and not pending:
            return set()
        time.sleep(0.25)
    return left | {str(r) for r in pending}
