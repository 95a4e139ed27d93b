"""The README's numbers table quotes the latest runs in docs/results/, figure for figure.

The rule, kept simple so a row can be replaced by a new run:
- Each row of the table under "## Current numbers" names one run: its "run" cell holds the run's
  date (YYYY-MM-DD) and a link to the results file (docs/results/NAME.md); its "reproduce" cell
  starts with the command in backticks.
- Each results file starts with "## Latest", a block per run, each block a "### " heading that
  starts with the run's date; older runs go under "## History" below it.
- A row matches a block of its file's "## Latest" section whose heading starts with the row's date
  and that contains every number of the row's "result" cell and every word of its command.
So a figure edited by hand in the README, or a run moved to History, fails here. To quote a new run:
put its block under "## Latest" in the results file, then its figures in the README row.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def table_rows(readme: str) -> list[dict[str, str]]:
    """The numbers table's rows as {column: cell}."""
    section = readme.split("## Current numbers", 1)[1]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]


def latest_blocks(text: str) -> list[tuple[str, str]]:
    """(heading, block text) of each "### " block under "## Latest" (up to the next "## ")."""
    latest = text.split("\n## Latest\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.split(r"\n(?=### )", latest)[1:]
    return [(b.split("\n", 1)[0][4:], b) for b in blocks]


def numbers(text: str) -> set[str]:
    return set(NUMBER.findall(text.replace("**", "")))


def row_problem(row: dict[str, str], results: Path = RESULTS) -> str | None:
    """Why `row` does not match a latest run (None: it does)."""
    dates, files = DATE.findall(row["run"]), re.findall(r"docs/results/([\w-]+\.md)", row["run"])
    commands = re.findall(r"`([^`]+)`", row["reproduce"])
    if len(dates) != 1 or len(files) != 1 or not commands:
        return "the run cell needs one date and one docs/results link, the reproduce cell a command"
    want, words = numbers(row["result"]), commands[0].split()
    for heading, block in latest_blocks((results / files[0]).read_text()):
        if heading.startswith(dates[0]) and want <= numbers(block) and all(w in block for w in words):
            return None
    return f"no block dated {dates[0]} under ## Latest in {files[0]} has {sorted(want)} and `{commands[0]}`"


ROWS = table_rows((ROOT / "README.md").read_text())


def test_the_readme_has_a_numbers_table():
    assert len(ROWS) >= 5 and all(set(r) == {"what", "result", "run", "reproduce"} for r in ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[r["what"][:40] for r in ROWS])
def test_every_readme_figure_is_in_the_latest_run_it_names(row):
    assert row_problem(row) is None, f"{row['what']}: {row_problem(row)}"


@pytest.mark.parametrize("path", sorted(p for p in RESULTS.glob("*.md") if p.name != "README.md"),
                         ids=lambda p: p.name)
def test_every_results_file_starts_with_its_latest_runs_each_dated(path):
    text = path.read_text()
    assert re.findall(r"(?m)^## .*", text)[0] == "## Latest", "the first section is ## Latest"
    blocks = latest_blocks(text)
    assert blocks and all(DATE.match(heading) for heading, _ in blocks), "each ### block starts with its date"


def test_a_figure_edited_by_hand_or_a_run_moved_to_history_fails(tmp_path):
    row = ROWS[0]
    assert row_problem(row) is None
    edited = dict(row, result=row["result"].replace(NUMBER.findall(row["result"])[0], "999.9", 1))
    assert "no block dated" in row_problem(edited)
    name = re.findall(r"docs/results/([\w-]+\.md)", row["run"])[0]
    text = (RESULTS / name).read_text()
    (tmp_path / name).write_text(text.replace("\n## Latest\n", "\n## Latest\n\n### 1999-01-01: none\n\n"
                                              "## History\n", 1))
    assert "no block dated" in row_problem(row, tmp_path)
