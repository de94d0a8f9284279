"""The CLI's terminal: rayline's own progress and summaries; Ray's and Prefect's chatter in a log file.

Quiet (the default): Ray's worker output and log lines, Ray Data's stats, Prefect's per-task INFO lines and what
native code writes to the process's stderr go to ``<state>/logs/<command>-<time>.log``; the terminal keeps
ERROR records, and the Prefect API still gets every task log. ``--verbose`` leaves all of it on the terminal.
Progress of each long stage (``rayline.progress``): live bars on a terminal; elsewhere (pipes, CI) a line when
a stage ends and at most one every ``PLAIN_INTERVAL_S`` while it runs, so a log shows how far it got.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any, TextIO

import typer

from rayline import progress, ray_cluster

PLAIN_INTERVAL_S = 30.0
# Loggers that do not propagate to the root logger and bring their own terminal handler.
_OWN_HANDLER_LOGGERS = ("ray", "ray.data", "ray.serve")
LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s - %(message)s"


@dataclass
class _PlainStage:
    label: str
    total: int | None
    unit: str
    started: float
    shown: float
    done: int = 0


def _count_text(done: int, total: int | None, unit: str) -> str:
    return f"{done}/{total} {unit}" if total is not None else f"{done} {unit}"


@dataclass
class PlainReporter:
    """Progress as a few plain lines: for pipes and CI logs, where a bar would be a line per update."""

    echo: Callable[[str], None] = typer.echo
    clock: Callable[[], float] = time.monotonic
    interval_s: float = PLAIN_INTERVAL_S
    _stages: dict[str, _PlainStage] = field(init=False, default_factory=dict)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def start(self, key: str, label: str, total: int | None, unit: str) -> None:
        now = self.clock()
        with self._lock:
            self._stages[key] = _PlainStage(label, total, unit, now, now)

    def update(self, key: str, done: int) -> None:
        with self._lock:
            stage = self._stages.get(key)
            if stage is None:
                return
            stage.done = done
            now = self.clock()
            if now - stage.shown < self.interval_s:
                return
            stage.shown = now
        self.echo(
            f"  … {stage.label:<17}  {_count_text(done, stage.total, stage.unit)} after {now - stage.started:.0f} s"
        )

    def finish(self, key: str, ok: bool) -> None:
        with self._lock:
            stage = self._stages.pop(key, None)
        if stage is None:
            return
        state = "done" if ok else "FAILED"
        elapsed = self.clock() - stage.started
        self.echo(f"  {state} {stage.label:<17}  {_count_text(stage.done, stage.total, stage.unit)} in {elapsed:.1f} s")


class RichReporter:
    """Live bars on a terminal (rich, which typer brings): one row per stage, kept when it ends."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            SpinnerColumn(finished_text="✓"),
            TextColumn("{task.description:<18}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[unit]}"),
            TimeElapsedColumn(),
        )
        self._tasks: dict[str, Any] = {}
        self._progress.start()

    def start(self, key: str, label: str, total: int | None, unit: str) -> None:
        self._tasks[key] = self._progress.add_task(label, total=total, unit=unit)

    def update(self, key: str, done: int) -> None:
        if key in self._tasks:
            self._progress.update(self._tasks[key], completed=done)

    def finish(self, key: str, ok: bool) -> None:
        task = self._tasks.pop(key, None)
        if task is None:
            return
        if ok:
            done = self._progress.tasks[task].completed
            self._progress.update(task, total=self._progress.tasks[task].total or done or 1, completed=done or 1)
        else:
            self._progress.update(task, description=f"[red]FAILED[/red] {self._progress.tasks[task].description}")
        self._progress.stop_task(task)

    def close(self) -> None:
        self._progress.stop()


def log_path(state_dir: Path, command: str, now: datetime | None = None) -> Path:
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return state_dir / "logs" / f"{command}-{stamp}.log"


def _is_terminal_handler(handler: logging.Handler) -> bool:
    stream = getattr(handler, "stream", None)
    return not isinstance(handler, logging.FileHandler) and stream in (sys.stderr, sys.stdout, sys.__stderr__)


class _LockedWriter:
    """The log file as a stream for Ray's worker-log thread, taking turns with the logging handler."""

    def __init__(self, handler: logging.FileHandler) -> None:
        self._handler = handler

    def write(self, text: str) -> int:
        self._handler.acquire()
        try:
            stream = self._handler.stream
            return stream.write(text) if stream is not None else 0
        finally:
            self._handler.release()

    def flush(self) -> None:
        self._handler.flush()


@dataclass
class Terminal:
    """What one CLI command changed about the process's output, to undo when it ends."""

    log_file: Path | None
    reporter: PlainReporter | RichReporter
    _undo: list[Callable[[], object]] = field(default_factory=list)

    def close(self) -> None:
        progress.install(None)
        if isinstance(self.reporter, RichReporter):
            self.reporter.close()
        for undo in reversed(self._undo):
            undo()
        # The file stays open for Ray's worker-log thread, which still delivers lines while Ray shuts down;
        # logging closes it at exit.
        if self.log_file is not None:
            typer.echo(  # a note, not the command's output: stdout may be a --json document
                f"Ray worker logs, Ray Data stats and Prefect task lines: {self.log_file} (--verbose prints them)",
                err=True,
            )


def _quiet_logging(terminal: Terminal, handler: logging.Handler) -> None:
    """Terminal handlers keep ERROR records only; the log file gets everything they would have printed."""
    import prefect  # noqa: F401 - configures logging now, so what is set below is not replaced later
    import ray.data  # noqa: F401 - Ray Data and Serve install their terminal handlers on import
    import ray.serve  # noqa: F401

    for logger in [logging.getLogger(), *map(logging.getLogger, _OWN_HANDLER_LOGGERS)]:
        for h in logger.handlers:
            if _is_terminal_handler(h):
                level = h.level
                h.setLevel(max(level, logging.ERROR))
                terminal._undo.append(functools.partial(h.setLevel, level))
        logger.addHandler(handler)
        terminal._undo.append(functools.partial(logger.removeHandler, handler))
    logging.captureWarnings(True)  # deprecation warnings of Ray and others: into the file, via the root logger
    terminal._undo.append(functools.partial(logging.captureWarnings, False))
    # Tune's console reporter: its legacy one honours the RunConfig(verbose=0) the workloads set
    _set_env_default(terminal, "RAY_AIR_NEW_OUTPUT", "0")
    # MLflow writes "View run … at" to stdout for every run it ends: the run's link is in the log file anyway
    _set_env_default(terminal, "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


def _native_stderr_to(terminal: Terminal, log: IO[str]) -> None:
    """Point file descriptor 2 at the log file; Python's ``sys.stderr`` moves to a copy of the terminal's.

    Ray's core worker in this process writes its warnings and errors to descriptor 2 from C++ (its file sink
    is set up for workers, not drivers, and no option changes that), e.g. a line for every Ray Data actor pool.
    Only a stderr that is the process's own descriptor 2 moves: a captured one (tests, wrappers) stays.
    """
    native: TextIO = sys.stderr
    try:
        if sys.stderr is not sys.__stderr__ or native.fileno() != 2:
            return
    except (AttributeError, OSError, ValueError):  # no real file behind it
        return
    native.flush()
    to_terminal = os.fdopen(os.dup(2), "w", buffering=1, encoding=native.encoding, errors=native.errors)
    os.dup2(log.fileno(), 2)
    sys.stderr = to_terminal
    moved = _stream_handlers_writing_to(native)
    _set_streams(moved, to_terminal)

    def undo() -> None:
        to_terminal.flush()
        os.dup2(to_terminal.fileno(), 2)
        sys.stderr = native
        _set_streams(moved, native)
        to_terminal.close()

    terminal._undo.append(undo)


def _stream_handlers_writing_to(stream: IO[str]) -> list[logging.StreamHandler[Any]]:
    """Every logging handler, on any logger, that writes to ``stream``."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]  # placeholders have no handlers
    return [
        h
        for logger in loggers
        for h in getattr(logger, "handlers", [])
        if isinstance(h, logging.StreamHandler) and h.stream is stream
    ]


def _set_streams(handlers: list[logging.StreamHandler[Any]], stream: IO[str]) -> None:
    """The handlers write to ``stream``; Prefect's, which print through a rich console of their own, too."""
    for handler in handlers:
        previous = handler.setStream(stream)
        console = getattr(handler, "console", None)
        if console is not None and previous is not None and console.file is previous:
            console.file = stream


def _set_env_default(terminal: Terminal, key: str, value: str) -> None:
    if key not in os.environ:
        os.environ[key] = value
        terminal._undo.append(functools.partial(os.environ.pop, key, None))


def open_terminal(command: str, state_dir: Path | None, verbose: bool, tty: bool | None = None) -> Terminal:
    """Set this process's output up for one CLI command; ``close()`` the result when the command ends.

    ``state_dir`` None (settings unreadable: the command is about to fail and say why) keeps the output verbose.
    """
    tty = sys.stdout.isatty() if tty is None else tty
    reporter: PlainReporter | RichReporter = RichReporter() if tty else PlainReporter()
    quiet = not verbose and state_dir is not None
    terminal = Terminal(log_path(state_dir, command) if quiet and state_dir else None, reporter)
    progress.install(reporter)
    if terminal.log_file is not None:
        terminal.log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(terminal.log_file, encoding="utf-8")
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        _quiet_logging(terminal, handler)
        ray_cluster.send_worker_logs_to(_LockedWriter(handler))
        if handler.stream is not None:
            _native_stderr_to(terminal, handler.stream)
    return terminal
