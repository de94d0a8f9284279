"""The blocks of commands the pages tag for tests/e2e/test_pages_as_written.py: well-formed, and all there.

The e2e test runs them (minutes); these checks are the seconds' part: a block bash cannot parse, a quickstart
block left untagged (so untested), or a first-screen command the quickstart does not run, fails here first.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from tests.markdown_blocks import Block, tagged_blocks, untagged_bash_blocks
from tests.support import REPO_ROOT

pytestmark = pytest.mark.unit

README, API = REPO_ROOT / "README.md", REPO_ROOT / "docs" / "api.md"
PAGES = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]
# the README's sections a newcomer types in order, every block of them run by the e2e test
RUN_SECTIONS = ("Installing into your own project", "Quickstart: your model, your bucket")


@pytest.mark.parametrize("block", [b for page in PAGES for b in tagged_blocks(page)], ids=lambda b: b.where)
def test_each_tagged_block_is_bash_that_parses(block: Block) -> None:
    done = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"{block.where}: {done.stderr}"


def test_every_block_of_the_quickstart_and_the_api_example_is_tagged() -> None:
    untagged = {line: s for line, s in untagged_bash_blocks(README).items() if s in RUN_SECTIONS}
    assert not untagged, f"README.md blocks the e2e test would not run: {untagged}"
    assert not untagged_bash_blocks(API), "docs/api.md's example blocks are all run"
    tags = {b.tag for b in tagged_blocks(README)} | {b.tag for b in tagged_blocks(API)}
    assert tags == {"install", "quickstart", "quickstart summary", "example"}, tags


def _words(command: str) -> tuple[tuple[str, ...], set[tuple[str, str]]]:
    """A command's program and subcommands (``.venv/bin/rayline`` is ``rayline``), and its options with values."""
    words = shlex.split(command, comments=True)
    words[0] = Path(words[0]).name
    head = 0
    while head < len(words) and not words[head].startswith("--"):
        head += 1
    options = set()
    for i in range(head, len(words)):
        if words[i].startswith("--"):
            value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else ""
            options.add((words[i], value))
    return tuple(words[:head]), options


def test_the_first_screen_s_commands_are_commands_the_quickstart_runs() -> None:
    """The first screen promises each of its commands is in the quickstart: with the same options, each one
    is a command the e2e test runs."""
    (summary,) = tagged_blocks(README, "quickstart summary")
    run = [_words(c) for b in tagged_blocks(README, "quickstart") for c in b.commands()]
    for command in summary.commands():
        head, options = _words(command)
        assert any(h == head and options <= o for h, o in run), f"{command!r} is not among the quickstart's"
