"""Live progress of a job, as `follow`, `submit --follow`, `demo` and `simulate` show it.

On a terminal: rich progress bars, one for the job (the mean step of its nodes) and one per node for small jobs,
each with steps, steps/s, ETA and the mean of the task's headline figure (test accuracy, validation perplexity);
events print above the bars. Elsewhere (a pipe, a CI
log): a plain line every few seconds with the same figures, and the events as they come.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Column
from rich.text import Text

from nodeagent.runtime.progress import TASK_METRICS, Metric

MAX_NODE_BARS = 16  # a bar per node up to this many nodes; beyond, only the job's
PLAIN_EVERY_S = 5.0
TITLE_CHARS = 16  # of a bar's title (a job id is longer: its start is shown)
MIN_BAR_CHARS = 8


class _RateColumn(TextColumn):
    def __init__(self) -> None:
        super().__init__("", table_column=Column(no_wrap=True))

    def render(self, task):  # type: ignore[no-untyped-def]
        speed = task.finished_speed or task.speed
        return Text("     -/s" if speed is None else f"{speed:6.1f}/s")


class _EtaColumn(TimeRemainingColumn):
    def __init__(self) -> None:
        super().__init__(table_column=Column(no_wrap=True))

    def render(self, task):  # type: ignore[no-untyped-def]
        return Text("ETA ") + super().render(task)


def _columns() -> list[ProgressColumn]:
    """The bars' columns, laid out to fit an 80-column terminal: the title cut to its first characters, the bar
    and the note (state, figure) sharing what the fixed columns leave, the note first."""
    return [
        TextColumn("{task.description}", table_column=Column(max_width=TITLE_CHARS, no_wrap=True,
                                                             overflow="ellipsis")),
        BarColumn(bar_width=None, table_column=Column(ratio=1, min_width=MIN_BAR_CHARS)),
        MofNCompleteColumn(table_column=Column(no_wrap=True)),
        _RateColumn(),
        _EtaColumn(),
        TextColumn("{task.fields[note]}", table_column=Column(ratio=3, no_wrap=True, overflow="ellipsis")),
    ]


class ProgressView:
    """Shows a job of `nodes` nodes with `steps` steps each; `time_label` names the clock of `elapsed` when it is
    not the wall's (the simulator's virtual seconds)."""

    def __init__(self, title: str, steps: int, nodes: int, out: TextIO | None = None,
                 plain_every_s: float = PLAIN_EVERY_S):
        self.title = title
        self.steps = steps
        self.nodes = nodes
        self.out = out or sys.stdout
        self.plain_every_s = plain_every_s
        self.started = time.monotonic()
        self._printed = -math.inf
        self._first: tuple[float, float] | None = None  # (time, mean step) when first seen, for the plain rate
        self._line = ""  # the latest figures
        self._shown = ""  # the figures last printed
        self.live = self.out.isatty()
        self._progress: Progress | None = None
        self._job: TaskID | None = None
        self._node_tasks: list[TaskID] = []

    def __enter__(self) -> ProgressView:
        if self.live:
            self._progress = Progress(*_columns(), console=Console(file=self.out), transient=False,
                                      refresh_per_second=4, expand=True)
            self._progress.start()
            self._job = self._progress.add_task(self.title, total=self.steps, note="")
            if self.nodes <= MAX_NODE_BARS:
                self._node_tasks = [self._progress.add_task(f"  rank {rank}", total=self.steps, note="")
                                    for rank in range(self.nodes)]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
        elif self._line != self._shown:
            print(self._line, file=self.out, flush=True)  # the last figures, whenever the last line was printed

    def log(self, line: str) -> None:
        """A line above the bars (an event)."""
        if self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=self.out, flush=True)

    def update(self, steps: Sequence[int], figure: float, state: str = "", note: str = "",
               metric: Metric = TASK_METRICS["classification"][0]) -> None:
        """The nodes' steps (by rank), their mean of the task's headline `metric` (test accuracy, validation
        perplexity; NaN: not evaluated yet), the job's state and anything else worth a word (virtual time)."""
        mean = sum(steps) / len(steps) if steps else 0.0
        shown = " ".join(part for part in (
            state, "" if math.isnan(figure) else f"{metric.word} {metric.text(figure)}", note) if part)
        if self._progress is not None and self._job is not None:
            self._progress.update(self._job, completed=mean, note=shown)
            for task, step in zip(self._node_tasks, steps, strict=False):
                self._progress.update(task, completed=step)
            return
        now = time.monotonic()
        if self._first is None:
            self._first = (now, mean)
        elapsed = now - self._first[0]
        rate = (mean - self._first[1]) / elapsed if elapsed > 0 else math.nan
        eta = (self.steps - mean) / rate if rate > 0 else math.nan
        self._line = (
            f"[{now - self.started:5.0f} s] {self.title}: step {mean:.0f}/{self.steps} "
            f"({100 * mean / self.steps:.0f}%, nodes {min(steps, default=0)}..{max(steps, default=0)})"
            f"{'' if math.isnan(rate) else f', {rate:.1f} steps/s'}"
            f"{'' if math.isnan(eta) else f', ETA {eta:.0f} s'}{'; ' + shown if shown else ''}"
        )
        if now - self._printed >= self.plain_every_s:
            self._printed = now
            print(self._line, file=self.out, flush=True)
            self._shown = self._line
