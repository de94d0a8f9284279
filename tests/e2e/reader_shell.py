"""A reader's terminal, typing a page's tagged blocks (tests/markdown_blocks.py) in order, as written.

Each block runs in ``bash -e`` from where the one before left off: its exported variables and its current
folder carry over, as when the reader pastes block after block into one terminal. Only the substitutions the
test names are made, each one the page tells the reader to make (their bucket, their own servers).

A block whose last command keeps running (``rayline serve start … --block``) is the reader's first shell: its
other commands run, then that one runs in the background until it prints its address (``POST http://…``).
The next block, tagged as a second shell, runs meanwhile with that address in place of the page's
``http://127.0.0.1:8000``; then the first shell gets SIGINT, as Ctrl-C sends it, and must end cleanly.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.markdown_blocks import Block

PAGE_ADDRESS = "http://127.0.0.1:8000"
_PRINTED_ADDRESS = re.compile(r"POST (https?://[^/\s]+)")


@dataclass(frozen=True)
class Ran:
    """A block (or the first shell's blocking command) and what it printed."""

    block: Block
    stdout: str
    stderr: str
    steps: list[tuple[float, str]]  # each command's seconds and the command, as bash ran it

    @property
    def seconds(self) -> float:
        return sum(seconds for seconds, _ in self.steps)


@dataclass
class ReaderShell:
    """The reader's shell: its environment and folder, the test's substitutions, and every block run so far."""

    env: dict[str, str]
    cwd: Path
    state: Path  # a folder of the test's: where each block leaves its folder and environment for the next
    substitutions: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 900
    ran: list[Ran] = field(default_factory=list)

    def run_blocks(self, blocks: list[Block]) -> list[Ran]:
        """Run ``blocks`` in order, each second-shell block while the block before it serves; what each printed."""
        start = len(self.ran)
        for i, block in enumerate(blocks):
            if block.second_shell:
                continue  # run by the block before it
            following = blocks[i + 1] if i + 1 < len(blocks) else None
            if following is not None and following.second_shell:
                self._run_with_second_shell(block, following)
            else:
                self.ran.append(self._run(block, block.text))
        return self.ran[start:]

    def output(self) -> str:
        return "\n".join(r.stdout for r in self.ran)

    def _script(self, text: str, keep_state: bool = True) -> str:
        for page_says, reader_has in self.substitutions.items():
            text = text.replace(page_says, reader_has)
        if not keep_state:  # the first shell's command: the shell ends with it
            return f"set -e\n{text}\n"
        # the state, and a trace of when each command started, go to files named here: nothing of the test's
        # is added to the reader's environment or output
        trace = f"exec 9>'{self.state}/trace'; BASH_XTRACEFD=9; PS4='+ $EPOCHREALTIME '; set -x"
        state = f'{{ set +x; }} 2>/dev/null\npwd > "{self.state}/cwd"\nenv -0 > "{self.state}/env"'
        return f"set -e\n{trace}\n{text}\n{state}\n"

    def _timed_steps(self) -> list[tuple[float, str]]:
        """Each command the last script ran, with its seconds: from one traced start to the next."""
        starts = []
        for line in (self.state / "trace").read_text().splitlines():
            if line.startswith("+ ") and (parts := line.split(" ", 2))[1].replace(".", "", 1).isdigit():
                starts.append((float(parts[1]), parts[2] if len(parts) > 2 else ""))
        return [(end[0] - start[0], start[1]) for start, end in zip(starts, starts[1:], strict=False)]

    def _run(self, block: Block, text: str) -> Ran:
        done = subprocess.run(
            ["bash", "-c", self._script(text)], cwd=self.cwd, env=self.env, capture_output=True, text=True,
            timeout=self.timeout_s,
        )  # fmt: skip
        assert done.returncode == 0, (
            f"{block.where} failed (exit {done.returncode}) as written:\n{text}\n"
            f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-6000:]}"
        )
        self._take_state()
        return self._done(Ran(block, done.stdout, done.stderr, self._timed_steps()))

    @staticmethod
    def _done(ran: Ran) -> Ran:
        for seconds, command in ran.steps:  # shown with the test's output: where the minutes go
            print(f"{seconds:6.1f} s  {ran.block.where}  {command[:100]}", flush=True)
        return ran

    def _take_state(self) -> None:
        self.cwd = Path((self.state / "cwd").read_text().strip())
        pairs = (item.partition("=") for item in (self.state / "env").read_text().split("\0") if item)
        self.env = {name: value for name, _, value in pairs}

    def _run_with_second_shell(self, block: Block, second: Block) -> None:
        *before, blocking = block.commands()
        assert "--block" in blocking, f"{block.where}: a second shell follows, but its last command keeps nothing up"
        self.ran.append(self._run(block, "\n".join(before)))
        out, err = self.state / "first-shell.out", self.state / "first-shell.err"
        started = time.monotonic()
        with out.open("w") as stdout, err.open("w") as stderr:
            first = subprocess.Popen(
                ["bash", "-c", self._script(blocking, keep_state=False)], cwd=self.cwd, env=self.env,
                stdout=stdout, stderr=stderr, start_new_session=True,
            )  # fmt: skip
        try:
            self.substitutions[PAGE_ADDRESS] = _wait_for_address(first, out, err, block, self.timeout_s)
            serving = (time.monotonic() - started, f"{blocking}  (until it printed its address)")
            try:
                self.ran.append(self._run(second, second.text))
            finally:
                del self.substitutions[PAGE_ADDRESS]
            os.killpg(first.pid, signal.SIGINT)  # Ctrl-C in the first shell
            first.wait(timeout=120)
        finally:
            if first.poll() is None:
                os.killpg(first.pid, signal.SIGKILL)
                first.wait()
        assert first.returncode == 0, (
            f"{block.where}: Ctrl-C ended {blocking!r} with {first.returncode}:\n{err.read_text()[-6000:]}"
        )
        self.ran.append(self._done(Ran(block, out.read_text(), err.read_text(), [serving])))


def _wait_for_address(first: subprocess.Popen[bytes], out: Path, err: Path, block: Block, timeout_s: float) -> str:
    """The address (scheme, host and port) the first shell's command prints."""
    deadline = time.monotonic() + timeout_s
    while (found := _PRINTED_ADDRESS.search(out.read_text())) is None:
        if first.poll() is not None:
            raise AssertionError(
                f"{block.where}: ended (exit {first.returncode}) before printing an address:\n"
                f"{out.read_text()}\n{err.read_text()[-6000:]}"
            )
        assert time.monotonic() < deadline, f"{block.where}: no address in {timeout_s:.0f} s:\n{out.read_text()}"
        time.sleep(0.5)
    return found[1]
