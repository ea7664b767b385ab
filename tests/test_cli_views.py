"""What `status`, `edges` and the live progress bars show of a job, from replies made here (no coordinator)."""

from __future__ import annotations

import io
import re
from collections import deque

import pytest

from coordinator.display import status_text
from coordinator.progress_view import ProgressView
from coordinator.service import RATE_SAMPLES, recent_rate
from nodeagent._proto import coordinator_pb2 as pb

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


def stalled_job() -> pb.JobStatusReply:
    """A running job of 2000 steps: rank 0 moves at 40 steps/s lately, rank 1 made 12.8 steps/s over its run but
    none lately."""
    return pb.JobStatusReply(
        job_id="j-1", name="j", state=pb.JOB_RUNNING, world_size=2, started_unix=1000.0, spec_yaml="steps: 2000",
        nodes=[pb.NodeProgress(rank=0, node_id="n0", step=1200, elapsed_s=60.0, updated_unix=1059.0, state="up",
                               recent_steps_per_s=40.0),
               pb.NodeProgress(rank=1, node_id="n1", step=768, elapsed_s=60.0, updated_unix=1059.0, state="up",
                               recent_steps_per_s=0.0)])


def test_status_shows_each_nodes_recent_rate_and_an_eta_that_a_stalled_node_holds_back():
    lines = status_text(stalled_job(), now=1060.0).splitlines()
    assert "progress: step 768 of 2000; ETA unknown: rank 1 made no step in the last 30 s" in lines
    rows = {int(line.split()[0]): line.split() for line in lines if line.split()[:1] in (["0"], ["1"])}
    assert rows[0][4] == "40.0" and rows[1][4] == "0.0"  # not the run's 20.0 and 12.8
    moving = stalled_job()
    moving.nodes[1].recent_steps_per_s = 10.0
    assert "progress: step 768 of 2000; ETA 2 min at the recent rates (the slowest node's)" in \
        status_text(moving, now=1060.0).splitlines()  # rank 1: 1232 steps at 10/s
    # Without a recent rate (a finished node, an older coordinator), the run's rate.
    moving.nodes[1].ClearField("recent_steps_per_s")
    row = next(line.split() for line in status_text(moving, now=1060.0).splitlines() if line.startswith("   1"))
    assert row[4] == "12.8"


def test_status_of_a_parameter_server_job_has_a_line_for_its_server():
    status = stalled_job()
    assert not any(line.startswith("parameter server") for line in status_text(status, now=1060.0).splitlines())
    status.server_version = 4321
    assert "parameter server (at the coordinator): model version 4321" in status_text(status, now=1060.0).splitlines()


def test_a_nodes_recent_rate_is_over_the_last_window_of_its_reports():
    moving = deque([(t, 40 * t) for t in range(0, 100, 1)], maxlen=RATE_SAMPLES)
    assert recent_rate(moving, now=100.0) == pytest.approx(40.0)
    # Moved fast for 60 s, then stood still (it still reports): 0 over the window, whatever its run's rate.
    stalled = deque([(t, 40 * min(t, 60)) for t in range(0, 100, 1)], maxlen=RATE_SAMPLES)
    assert recent_rate(stalled, now=100.0) == 0.0
    # Silent: nothing reported in the window.
    assert recent_rate(deque([(0.0, 0), (10.0, 400)]), now=100.0) == 0.0
    assert recent_rate(deque([(99.0, 3)]), now=100.0) is None  # one report says no rate yet
