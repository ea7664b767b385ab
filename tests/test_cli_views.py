"""What `status`, `edges` and the live progress bars show of a job, from replies made here (no coordinator)."""

from __future__ import annotations

import io
import re

import pytest

from coordinator.progress_view import ProgressView

pytestmark = pytest.mark.unit


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def final_frame(out: Terminal, rows: int) -> list[str]:
    """The last `rows` lines the live display drew, without its control sequences."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    return text.replace("\r", "\n").splitlines()[-rows:]


@pytest.mark.parametrize("width", [80, 132])
def test_the_progress_bars_keep_their_figures_on_an_80_column_terminal(monkeypatch, width):
    monkeypatch.setenv("COLUMNS", str(width))  # what rich reads for the terminal's width
    out = Terminal()
    with ProgressView("job-20261127-101500-0123456789abcdef", 8000, 2, out=out) as view:
        view.update([1000, 1200], 0.8123, "running")
    job, *ranks = final_frame(out, 3)
    assert all(len(line.rstrip()) <= width for line in (job, *ranks))
    assert job.startswith("job-20261127-10") and "1100/8000" in job and "ETA" in job
    assert "running accuracy 0.8123" in job
    for rank, (line, steps) in enumerate(zip(ranks, (1000, 1200), strict=True)):
        assert line.startswith(f"  rank {rank}") and f"{steps}/8000" in line and "/s" in line
        assert re.search("[━╸]", line), line  # a bar, however short
