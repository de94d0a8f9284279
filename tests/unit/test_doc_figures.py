"""A figure a page quotes from a bench is the figure that bench's run recorded.

A page quotes one as a link to the run's result file in bench/results/, titled with the figure's key:
``[18.3 s](../bench/results/night_scale-2026-12-03-2core.json "first_block_s_1m")``. Figures copied by hand
drift apart from the runs (and from each other across pages); a quote checked against its file cannot.
docs/capacity.md is measured figures throughout, so a measured-looking figure there without a quote on its
line fails as well.
"""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO_ROOT

pytestmark = pytest.mark.unit

RESULTS = REPO_ROOT / "bench" / "results"
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
FIELDS = ("bench", "command", "machine", "date", "figures")

QUOTE = re.compile(r'\[(?P<shown>[^\]]+)\]\((?P<path>[^)\s]*bench/results/[^)\s]+)\s+"(?P<key>[^"]+)"\)')
LINK_TO_RESULTS = re.compile(r"\]\([^)\s]*bench/results/[^)\s]+\.json")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
# a measured-looking figure: a number with a time, a rate, a ratio or a size after it
MEASURED = re.compile(r"\d[\d,]*(?:\.\d+)?\s?(?:×|img/s\b|images/s\b|req/s\b|ms\b|MB\b|s\b)")


@dataclass(frozen=True)
class Quote:
    page: Path
    line: int
    shown: str
    path: str
    key: str

    def where(self) -> str:
        return f"{self.page.relative_to(REPO_ROOT)}:{self.line} [{self.shown}] {self.key!r}"


def quotes(page: Path, text: str) -> list[Quote]:
    return [
        Quote(page, number, m["shown"], m["path"], m["key"])
        for number, line in enumerate(text.splitlines(), 1)
        for m in QUOTE.finditer(line)
    ]


def figure(figures: Any, key: str) -> Any:
    """The value at ``key``, dotted through nested objects (a list's items by index)."""
    node = figures
    for part in key.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def scale(shown: str, key: str) -> float:
    """What the shown unit multiplies the file's value by: ms of a key in seconds, % of a fraction."""
    if "%" in shown:
        return 100.0
    if re.search(r"\bms\b", shown) and "s" in key.rsplit(".", 1)[-1].split("_"):
        return 1000.0
    return 1.0


def quote_problem(quote: Quote) -> str | None:
    """Why ``quote`` is not its result file's figure, or None: the file, the key, then the number at the
    precision it is shown with (``18.3 s`` is any value from 18.25 to 18.35)."""
    target = (quote.page.parent / quote.path).resolve()
    if target.parent != RESULTS or not target.is_file():
        return f"{quote.where()}: {quote.path} is no result file in bench/results/"
    try:
        value = figure(json.loads(target.read_text())["figures"], quote.key)
    except (KeyError, IndexError, ValueError, TypeError):
        return f"{quote.where()}: {target.name} has no figure {quote.key!r}"
    number = NUMBER.search(quote.shown)
    if number is None or isinstance(value, bool) or not isinstance(value, int | float):
        return f"{quote.where()}: shows no number, or {quote.key!r} is not one ({value!r})"
    shown = float(number[0].replace(",", ""))
    decimals = len(number[0].partition(".")[2])
    expected = value * scale(quote.shown, quote.key)
    if abs(shown - expected) > 0.5 * 10**-decimals + 1e-9 * max(1.0, abs(expected)):
        return f"{quote.where()}: shows {shown:g}, {target.name} has {expected:g}"
    return None


def page_problems(page: Path, text: str) -> list[str]:
    found = quotes(page, text)
    problems = [problem for q in found if (problem := quote_problem(q)) is not None]
    for number, line in enumerate(text.splitlines(), 1):
        if len(LINK_TO_RESULTS.findall(line)) != len(QUOTE.findall(line)):
            problems.append(f"{page.relative_to(REPO_ROOT)}:{number}: a link to a result names no key (its title)")
    return problems


def unquoted_figures(text: str) -> list[str]:
    """Lines of prose or tables with a measured-looking figure and no quote: code blocks (fenced, or indented
    after a blank line) are the formulas and commands, not figures."""
    found, fenced, indented, previous = [], False, False, ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        indented = line.startswith("    ") and (indented or not previous.strip())
        previous = line
        if fenced or indented or line.startswith("```") or QUOTE.search(line):
            continue
        if MEASURED.search(line):
            found.append(f"docs/capacity.md:{number}: {line.strip()}")
    return found


def test_every_quoted_figure_is_its_result_files() -> None:
    problems = [p for page in PAGES for p in page_problems(page, page.read_text())]
    assert not problems, "\n".join(problems)


def test_the_pages_quote_the_figures_of_the_capacity_page_and_the_decode_speedup() -> None:
    """The pages whose figures came apart before quote from result files: if a rewrite drops the links, the
    figures are unchecked again."""
    counts = {page.name: len(quotes(page, page.read_text())) for page in PAGES}
    assert counts["capacity.md"] >= 40 and counts["models.md"] >= 2, counts


def test_capacity_quotes_no_measured_figure_without_its_result() -> None:
    unquoted = unquoted_figures((REPO_ROOT / "docs" / "capacity.md").read_text())
    assert not unquoted, "quote these from bench/results/ (bench/results/README.md):\n" + "\n".join(unquoted)


def test_each_result_file_says_what_ran_where_and_when() -> None:
    files = sorted(RESULTS.glob("*.json"))
    assert files, "no result files in bench/results/"
    for path in files:
        result = json.loads(path.read_text())
        missing = [f for f in FIELDS if not result.get(f)]
        assert not missing, f"{path.name}: no {missing}"
        assert isinstance(result["figures"], dict), path.name
        assert path.name.startswith(f"{result['bench']}-{result['date']}-"), path.name
        assert (REPO_ROOT / "bench" / f"{result['bench']}.py").is_file(), f"{path.name}: no bench {result['bench']}"
        datetime.date.fromisoformat(result["date"])


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('[18.3 s](../bench/results/night_scale-2026-12-03-2core.json "first_block_s_1m")', None),
        ('[18.4 s](../bench/results/night_scale-2026-12-03-2core.json "first_block_s_1m")', "shows 18.4"),
        ('[24.1 ms](../bench/results/capacity-2026-12-03-2core.json "costs.forward_s")', None),
        ('[6 %](../bench/results/capacity-2026-12-03-2core.json "plans.10M_2h_cpu_256p.shares.listing")', "has 1"),
        ('[3 s](../bench/results/night_scale-2026-12-03-2core.json "no_such_key")', "no figure"),
        ('[3 s](../bench/results/no-such-file.json "first_block_s_1m")', "no result file"),
        ("[18.3 s](../bench/results/night_scale-2026-12-03-2core.json)", "names no key"),
    ],
)
def test_a_quote_that_is_not_its_files_figure_fails(line: str, problem: str | None) -> None:
    found = page_problems(REPO_ROOT / "docs" / "example.md", line)
    assert (problem is None and not found) or (problem is not None and problem in " ".join(found)), found


def test_an_unquoted_measurement_on_the_capacity_page_fails() -> None:
    text = 'A night took 30.8 s.\n\n    T(N) = N × c\n\nmeasured [30.8 s](x/bench/results/a.json "k")\n'
    assert unquoted_figures(text) == ["docs/capacity.md:1: A night took 30.8 s."]


def test_a_bench_run_saves_its_result_file_beside_the_days_earlier_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A page may quote the day's first run: a second run on the same machine must not replace its file."""
    from bench.support.results import RESULTS_VARIABLE, emit

    monkeypatch.setenv(RESULTS_VARIABLE, str(tmp_path))
    monkeypatch.setattr("sys.argv", ["bench/night_plan.py", "--quick"])
    emit("night_plan", {"speedup_resnet50": 1.5})
    emit("night_plan", {"speedup_resnet50": 1.6})
    assert capsys.readouterr().out.splitlines() == ['{"speedup_resnet50": 1.5}', '{"speedup_resnet50": 1.6}']
    first, second = sorted(tmp_path.glob("*.json"), key=lambda p: len(p.name))
    assert second.name == first.name.replace(".json", "-2.json")
    result = json.loads(first.read_text())
    assert all(result[f] for f in FIELDS) and result["figures"] == {"speedup_resnet50": 1.5}
    assert result["command"].endswith("bench/night_plan.py --quick")
