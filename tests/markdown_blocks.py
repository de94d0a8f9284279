"""The fenced ``bash`` blocks of a Markdown page that carry a test tag, in page order.

A page marks each block a test runs with an HTML comment on the line before its fence (GitHub shows
nothing of it)::

    <!-- test: quickstart -->
    ```bash
    rayline register-model …
    ```

``<!-- test: quickstart, second shell -->`` marks a block the reader types into a second shell while the
block before it still runs its last command (``rayline serve start … --block``). The page is parsed as
CommonMark by markdown-it-py (rich's own parser), so a fence inside a list item or a comment in prose is
read as GitHub reads it. A tag on anything but a ``bash`` fence is refused: a misplaced tag must not
quietly leave a block untested.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from markdown_it import MarkdownIt

SECOND_SHELL = "second shell"
_TAG = re.compile(r"^<!--\s*test:\s*(?P<name>[\w ]+?)\s*(?:,\s*(?P<shell>second shell)\s*)?-->\s*$")


@dataclass(frozen=True)
class Block:
    """One tagged block: its page and first line (1-based, the fence's), its tag's name, and its text."""

    page: Path
    line: int
    tag: str
    second_shell: bool
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.name}:{self.line}"

    def commands(self) -> list[str]:
        """The block's commands, one a logical line (continuations joined), comments and blank lines left out."""
        commands, pending = [], ""
        for line in self.text.splitlines():
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.endswith("\\"):
                pending += line[:-1]
                continue
            commands.append(pending + line)
            pending = ""
        if pending:
            raise ValueError(f"{self.where}: the block ends inside a command continued with '\\'")
        return commands


def untagged_bash_blocks(page: Path) -> dict[int, str]:
    """The page's ``bash`` fences that carry no test tag: their first lines, each with the ``## `` section it is in."""
    found, section, before = {}, "", None
    tokens = MarkdownIt("commonmark").parse(page.read_text())
    for i, token in enumerate(tokens):
        if token.type == "heading_open" and token.tag == "h2":
            section = tokens[i + 1].content
        tagged = before is not None and before.type == "html_block" and _TAG.match(before.content.strip())
        if token.type == "fence" and token.info.strip() == "bash" and not tagged:
            found[(token.map or [0])[0] + 1] = section
        before = token
    return found


def tagged_blocks(page: Path, tag: str | None = None) -> list[Block]:
    """The page's tagged ``bash`` blocks (only those tagged ``tag`` when given), in page order."""
    tokens = MarkdownIt("commonmark").parse(page.read_text())
    blocks = []
    for before, token in zip(tokens, tokens[1:], strict=False):
        if before.type != "html_block" or not before.content.lstrip().startswith("<!-- test"):
            continue
        match = _TAG.match(before.content.strip())
        line = (before.map or [0])[0] + 1
        if match is None:
            raise ValueError(f"{page.name}:{line}: a test tag reads <!-- test: NAME --> or <!-- test: NAME, "
                             f"{SECOND_SHELL} -->, not {before.content.strip()!r}")  # fmt: skip
        if token.type != "fence" or token.info.strip() != "bash":
            raise ValueError(f"{page.name}:{line}: the test tag must be on the line before a ```bash fence")
        block = Block(
            page=page,
            line=(token.map or [0])[0] + 1,
            tag=match["name"],
            second_shell=match["shell"] is not None,
            text=token.content,
        )
        if tag is None or block.tag == tag:
            blocks.append(block)
    return blocks
