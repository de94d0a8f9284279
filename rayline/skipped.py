"""How a listing's skipped objects are told: one phrase, the same in task logs, flow artifacts and the CLI.

Pure text, apart from :mod:`rayline.storage` (which lists and names the
reasons), so that a flow can word a result without importing storage.
"""

from __future__ import annotations


def skipped_text(skipped: dict[str, int]) -> str:
    """``4 (folder marker 1, hidden or underscore name 3)``: a listing's skipped objects, in one phrase."""
    reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(skipped.items()))
    return f"{sum(skipped.values())} ({reasons})"
