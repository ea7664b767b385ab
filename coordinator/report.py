"""`coordinator report RUN [RUN...]`: the papers' figures of one or several runs, and one HTML page that shows them.

A run directory holds the job (`job.json`), its progress records (`metrics.jsonl`, one per node report; `time` is
Unix time for real runs and virtual seconds in the simulator) and its events (`events.jsonl`, possibly absent).
From them: mean and per-node test accuracy against time and against steps, mean test accuracy against the bytes
sent per node (the communication comparison of DiLoCo), test and training loss, the traffic of every edge as a
matrix, throughput and computing time ratio per device, and the parameter server's traffic up and
down per worker. Several runs are overlaid for comparison; a single-node run (or one labelled "reference") is the
reference and drawn dashed.

The plotting helpers (`line_figure`, `bar_figure`, `matrix_figure`) take plain series so that the benchmarks draw
their figures through the same code. matplotlib is imported inside them: the CLI's quick commands do not load it.
Run directories hold text that nodes supplied (names, event messages): the page escapes all of it.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from coordinator.display import mean_measured
from nodeagent.jobspec import JobSpec
from nodeagent.ps.messages import SERVER_NAME
from nodeagent.runtime.events import EVENTS_FILE, TOPOLOGY, Event, read_events
from nodeagent.runtime.progress import LOG_FILE, Metric, Progress, read_run_log, task_metrics
from nodeagent.text import clip

REPORT_FILE = "report.html"
DEFAULT_ACCURACIES = (0.6, 0.7, 0.8)  # the table's "time to reach" columns
MAX_EVENTS_LISTED = 200  # per run on the page; a run with more says how many it left out
MAX_MARKER_CHARS = 40  # of an event's message written on a plot
MAX_ANNOTATED_CELLS = 16  # a traffic matrix up to this size shows its values in the cells
UNIX_TIME = 1e9  # a record's time above this is Unix time (a real run), else virtual seconds (the simulator)


class ReportError(Exception):
    """A run cannot be read: said in words an operator can act on."""


@dataclass(frozen=True)
class Series:
    """One line of a line figure. `label` None keeps it out of the legend (the thin per-node lines)."""

    label: str | None
    xs: Sequence[float]
    ys: Sequence[float]
    color: int = 0  # index into the colour cycle: a run's lines share it
    style: str = "-"  # matplotlib's line style: "-", "--" (a reference), ":" (the sequential baseline)
    thin: bool = False


@dataclass(frozen=True)
class Marker:
    """A vertical line on a time axis with a short text (a topology change)."""

    x: float
    text: str
    color: int = 0


@dataclass(eq=False)  # runs compare by identity: `run in timed`
class Run:
    label: str
    path: Path
    spec: JobSpec
    records: list[Progress]  # in the order they were recorded
    events: list[Event] = field(default_factory=list)

    @property
    def virtual(self) -> bool:
        return self.records[0].time < UNIX_TIME

    @property
    def origin(self) -> float:
        """The job's start on its clock: zero in the simulator, else the earliest node start the records show."""
        return 0.0 if self.virtual else min(r.time - r.elapsed_s for r in self.records)

    @property
    def reference(self) -> bool:
        return self.spec.max_nodes == 1 or "reference" in self.label.lower()

    @property
    def last(self) -> list[Progress]:
        """The last record of each rank, by rank."""
        latest = {r.rank: r for r in self.records}
        return [latest[rank] for rank in sorted(latest)]

    @property
    def ranks(self) -> dict[str, int]:
        """Node names (as peers name them in edge counters) to ranks."""
        return {r.node: r.rank for r in self.records}


def load_run(path: Path, label: str | None = None) -> Run:
    """The run in directory `path`, labelled `label` (default: the job's name)."""
    if not path.is_dir():
        raise ReportError(f"{path}: no such run directory")
    if not (path / "job.json").is_file():
        raise ReportError(f"{path}: not a run directory (no job.json)")
    if not (path / LOG_FILE).is_file():  # a job that has not started
        raise ReportError(f"{path}: no progress records yet (no {LOG_FILE})")
    try:
        spec = JobSpec.model_validate_json((path / "job.json").read_text())
        records = read_run_log(path)
        events, _ = read_events(path)
    except OSError as error:
        raise ReportError(f"{path}: cannot read {error.filename}: {error.strerror}") from None
    except ValidationError as error:
        raise ReportError(f"{path}/job.json is not a job this version reads: {error.errors()[0]['msg']}") from None
    except (ValueError, TypeError, AttributeError) as error:  # a damaged line of metrics.jsonl or events.jsonl
        raise ReportError(f"{path}: a damaged line in {LOG_FILE} or {EVENTS_FILE}: {error}") from None
    if not records:
        raise ReportError(f"{path}: {LOG_FILE} has no progress records yet")
    return Run(label or spec.name, path, spec, records, events)


# -- what the records say ----------------------------------------------------------------------------------------


def mean_curve(run: Run, x: str, y: str) -> tuple[list[float], list[float]]:
    """The mean of `y` over the ranks against `x` ("time" from the job's start, or "step"): each rank's latest
    value, from the point where every rank has one on."""
    ranks = len({r.rank for r in run.records})
    latest: dict[int, float] = {}
    xs, ys = [], []
    for record in sorted(run.records, key=lambda r: _x(run, r, x)):
        value = getattr(record, y)
        if math.isnan(value):
            continue
        latest[record.rank] = value
        if len(latest) == ranks:
            xs.append(_x(run, record, x))
            ys.append(sum(latest.values()) / ranks)
    return xs, ys


def node_curves(run: Run, x: str, y: str) -> dict[int, tuple[list[float], list[float]]]:
    curves: dict[int, tuple[list[float], list[float]]] = {}
    for record in run.records:
        value = getattr(record, y)
        if not math.isnan(value):
            xs, ys = curves.setdefault(record.rank, ([], []))
            xs.append(_x(run, record, x))
            ys.append(value)
    return curves


def _x(run: Run, record: Progress, x: str) -> float:
    return record.time - run.origin if x == "time" else float(record.step)


def accuracy_against_bytes(run: Run, field: str = "test_accuracy") -> tuple[list[float], list[float]]:
    """The communication comparison (DiLoCo against all-reduce SGD): the mean test accuracy (or another figure of
    the task: `field` of the records) over the ranks against the mean payload bytes a rank had sent, from the point
    where every rank has one on: one point per step that records reached (the last record of the step completes
    it)."""
    ranks = len({r.rank for r in run.records})
    accuracy: dict[int, float] = {}
    sent: dict[int, int] = {}
    points: dict[int, tuple[float, float]] = {}
    for record in run.records:
        sent[record.rank] = record.bytes_sent
        value = getattr(record, field)
        if math.isnan(value):
            continue
        accuracy[record.rank] = value
        if len(accuracy) == ranks:
            points[record.step] = (sum(sent.values()) / ranks, sum(accuracy.values()) / ranks)
    return [x for x, _ in points.values()], [y for _, y in points.values()]


def time_to_reach(run: Run, accuracy: float) -> float:
    """Seconds from the job's start until the mean test accuracy first reached `accuracy` (NaN: never)."""
    xs, ys = mean_curve(run, "time", "test_accuracy")
    return next((t for t, a in zip(xs, ys, strict=True) if a >= accuracy), math.nan)


def traffic_matrix(run: Run) -> tuple[list[str], list[list[int]]]:
    """Bytes sent from row to column over the job, from each node's last record: the ranks, then the peers that
    are no rank (the parameter server as "PS", "allreduce"), whose rows come from what the nodes received."""
    ranks = run.ranks
    nodes = sorted(set(ranks.values()))
    extras = sorted({e.peer for r in run.last for e in r.edges if e.peer not in ranks})
    names = [str(rank) for rank in nodes] + ["PS" if peer == SERVER_NAME else _short(peer) for peer in extras]
    index = {rank: i for i, rank in enumerate(nodes)}
    index.update({peer: len(nodes) + i for i, peer in enumerate(extras)})
    matrix = [[0] * len(names) for _ in names]
    for record in run.last:
        row = index[record.rank]
        for edge in record.edges:
            column = index[ranks[edge.peer]] if edge.peer in ranks else index[edge.peer]
            matrix[row][column] += edge.bytes_sent
            if edge.peer not in ranks:  # the peer reports no records of its own
                matrix[column][row] += edge.bytes_received
    return names, matrix


def throughput(run: Run) -> dict[int, float]:
    """Samples per second of each rank: its local steps times the batch size over its elapsed time."""
    batch = run.spec.data.batch_size
    return {r.rank: r.local_steps * batch / r.elapsed_s if r.elapsed_s > 0 else math.nan for r in run.last}


def computing_time_ratio(run: Run) -> dict[int, float]:
    """compute_s / elapsed_s of each rank: the share of its time spent on local steps."""
    return {r.rank: r.compute_s / r.elapsed_s if r.elapsed_s > 0 else math.nan for r in run.last}


def server_traffic(run: Run) -> dict[int, tuple[int, int]]:
    """Per worker: bytes it pushed to the parameter server and bytes it pulled from it (none: not a PS run)."""
    return {r.rank: (e.bytes_sent, e.bytes_received) for r in run.last for e in r.edges if e.peer == SERVER_NAME}


# -- figures -----------------------------------------------------------------------------------------------------


def _figure(width: float = 8.0, height: float = 5.0):
    from matplotlib.figure import Figure  # a figure without pyplot: no display, no global state, Agg for PNG

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _color(index: int) -> str:
    return f"C{index % 10}"


def line_figure(path: Path, title: str, xlabel: str, ylabel: str, series: Sequence[Series],
                markers: Sequence[Marker] = (), log_x: bool = False) -> Path:
    """Lines (with a dot at each point when `log_x`: runs that differ by orders of magnitude are short curves)."""
    figure = _figure()
    axes = figure.add_subplot()
    for line in series:
        axes.plot(line.xs, line.ys, linestyle=line.style, color=_color(line.color), label=line.label,
                  linewidth=0.7 if line.thin else 2.0, alpha=0.35 if line.thin else 1.0,
                  marker="o" if log_x else None)
    if log_x:
        axes.set_xscale("log")
    for marker in markers:
        axes.axvline(marker.x, color=_color(marker.color), linestyle=":", linewidth=1.2)
        axes.annotate(marker.text, (marker.x, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top",
                      ha="right", fontsize=7, color=_color(marker.color))
    axes.set(title=title, xlabel=xlabel, ylabel=ylabel)
    axes.grid(alpha=0.3)
    if any(line.label for line in series):
        axes.legend(fontsize=8)
    figure.savefig(path)
    return path


def bar_figure(path: Path, title: str, xlabel: str, ylabel: str, groups: Sequence[str],
               bars: dict[str, Sequence[float]], hatched: Sequence[str] = ()) -> Path:
    """Grouped bars: one group per entry of `groups`, one bar in each for every entry of `bars` (its values by
    group; NaN: no bar). Bars named in `hatched` are drawn hatched (the second of a pair, e.g. down against up)."""
    figure = _figure()
    axes = figure.add_subplot()
    width = 0.8 / max(1, len(bars))
    for i, (label, values) in enumerate(bars.items()):
        positions = [g + (i - (len(bars) - 1) / 2) * width for g in range(len(groups))]
        axes.bar(positions, [0 if math.isnan(v) else v for v in values], width, label=label,
                 color=_color(i // 2 if hatched else i), hatch="//" if label in hatched else None,
                 edgecolor="white" if label in hatched else None)
    axes.set_xticks(range(len(groups)), groups)
    axes.set(title=title, xlabel=xlabel, ylabel=ylabel)
    axes.grid(axis="y", alpha=0.3)
    if len(bars) > 1:
        axes.legend(fontsize=8)
    figure.savefig(path)
    return path


def matrix_figure(path: Path, title: str, names: Sequence[str], matrix: Sequence[Sequence[float]],
                  unit: str) -> Path:
    figure = _figure(6.5, 5.5)
    axes = figure.add_subplot()
    image = axes.imshow(matrix, cmap="viridis")
    figure.colorbar(image, ax=axes, label=unit)
    axes.set_xticks(range(len(names)), names)
    axes.set_yticks(range(len(names)), names)
    axes.set(title=title, xlabel="to (rank)", ylabel="from (rank)")
    if len(names) <= MAX_ANNOTATED_CELLS:
        peak = max((max(row) for row in matrix), default=0) or 1
        for i, row in enumerate(matrix):
            for j, value in enumerate(row):
                if value:
                    axes.text(j, i, f"{value:.3g}", ha="center", va="center", fontsize=7,
                              color="black" if value > peak / 2 else "white")
    figure.savefig(path)
    return path


# -- the report --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plot:
    """A figure written to the report's directory and its caption."""

    file: str
    caption: str


def _time_axis(runs: Sequence[Run]) -> str:
    clocks = {run.virtual for run in runs if not run.reference} or {run.virtual for run in runs}
    if clocks == {True}:
        return "virtual time since the start (s)"
    if clocks == {False}:
        return "wall time since the start (s)"
    return "time since the start (s): wall for real runs, virtual for simulated ones"


def _accuracy_series(runs: Sequence[Run], x: str, y: str, per_node: bool) -> list[Series]:
    """Each run's mean (thick) and per-node (thin) curves. On a time axis, a reference on another clock than the
    compared runs is its final value as a horizontal line: its seconds are not theirs."""
    series = []
    timed = _same_clock(runs)
    for color, run in enumerate(runs):
        style = "--" if run.reference else "-"
        xs, ys = mean_curve(run, x, y)
        if x == "time" and run not in timed and ys:
            ends = [0.0, max(_last_x(other) for other in runs if other is not run)]
            series.append(Series(f"{run.label}: final, on another clock", ends, [ys[-1]] * 2, color, style))
            continue
        mean = per_node and len(runs) > 1 and not run.reference
        series.append(Series(run.label + (" (mean)" if mean else ""), xs, ys, color, style))
        if per_node and not run.reference:
            series += [Series(None, nx, ny, color, style, thin=True)
                       for nx, ny in node_curves(run, x, y).values()]
    return series


def _bytes_series(runs: Sequence[Run], field: str) -> list[Series]:
    series = []
    for color, run in enumerate(runs):
        points = [(x, y) for x, y in zip(*accuracy_against_bytes(run, field), strict=True) if x > 0]
        if points:
            xs, ys = zip(*points, strict=True)
            series.append(Series(run.label, xs, ys, color, "--" if run.reference else "-"))
    return series


def _same_clock(runs: Sequence[Run]) -> list[Run]:
    """The runs whose seconds compare: all but a reference on another clock than the compared runs."""
    compared = {run.virtual for run in runs if not run.reference}
    return [run for run in runs if not (run.reference and compared and run.virtual not in compared)]


def _last_x(run: Run) -> float:
    return max(r.time for r in run.records) - run.origin


def _markers(runs: Sequence[Run]) -> list[Marker]:
    return [Marker(event.time - run.origin, _short(event.message), color)
            for color, run in enumerate(runs) for event in run.events if event.kind == TOPOLOGY]


def _short(text: str) -> str:
    return clip(" ".join(text.split()), MAX_MARKER_CHARS)


def headline(runs: Sequence[Run]) -> Metric:
    """The figure the runs are compared by, their task's headline (test accuracy, validation perplexity);
    ReportError if they are runs of different tasks."""
    tasks = sorted({run.spec.task for run in runs})
    if len(tasks) > 1:
        raise ReportError(f"runs of different tasks ({', '.join(tasks)}) have no figure in common: report them "
                          "apart")
    return task_metrics(tasks[0])[0]


def _figures(runs: Sequence[Run], out: Path) -> list[Plot]:
    axis = _time_axis(runs)
    markers = _markers(runs)
    names = ", ".join(run.label for run in runs)
    metric = headline(runs)
    title, word, field = metric.name[:1].upper() + metric.name[1:], metric.word, metric.field
    language = runs[0].spec.task == "language-model"
    loss = "validation loss (cross-entropy per token)" if language else "test loss (cross-entropy)"
    figures = [
        Plot(line_figure(out / f"{word}_time.png", f"{title} against time: {names}", axis,
                         metric.name, _accuracy_series(runs, "time", field, True), markers).name,
             f"Mean {metric.name} over the nodes (thick; each node's latest evaluation) and each node's (thin) "
             "against time from the job's start. A dashed line is the single-node reference; dotted vertical "
             "lines are topology changes."),
        Plot(line_figure(out / f"{word}_steps.png", f"{title} against steps: {names}", "step",
                         metric.name, _accuracy_series(runs, "step", field, True)).name,
             f"Mean (thick) and per-node (thin) {metric.name} against the job's step (for parameter-server "
             "algorithms: rounds or pushes)."),
        Plot(line_figure(out / f"{word}_bytes.png", f"{title} against bytes sent per node: {names}",
                         "payload bytes sent per node (mean over the nodes, log scale)", metric.name,
                         _bytes_series(runs, field), log_x=True).name,
             f"Communication against {word} (DiLoCo's comparison): the mean {metric.name} at each evaluation "
             "against the mean payload bytes each node had sent by then; a run's last point is its final one. "
             "Runs that sent nothing (a single node) have no place on the log scale."),
        Plot(line_figure(out / "test_loss_time.png", f"{loss.split(' (')[0].capitalize()} against time: {names}",
                         axis, loss, _accuracy_series(runs, "time", "test_loss", False), markers).name,
             f"Mean {loss.split(' (')[0]} over the nodes against time from the job's start."),
        Plot(line_figure(out / "train_loss_steps.png", f"Training loss against steps: {names}", "step",
                         "training loss (cross-entropy, last minibatch)",
                         _accuracy_series(runs, "step", "loss", False)).name,
             "Mean over the nodes of the loss of each node's last local minibatch against the step."),
    ]
    for i, run in enumerate(runs):
        labels, matrix = traffic_matrix(run)
        if any(any(row) for row in matrix):
            megabytes = [[value / 1e6 for value in row] for row in matrix]
            file = matrix_figure(out / f"traffic_{i}.png", f"Traffic per edge: {run.label}", labels, megabytes,
                                 "payload sent (MB)").name
            figures.append(Plot(file, f"{run.label}: payload bytes each node sent to each peer over the job "
                                        "(row: sender, column: receiver, in MB), from each node's last "
                                        "record. PS is the parameter server."))
    timed = _same_clock(runs)  # a reference simulated beside real runs has no comparable seconds
    names = ", ".join(run.label for run in timed)
    ranks = [str(rank) for rank in range(max(run.spec.max_nodes for run in timed))]
    rate = "samples per virtual second" if {run.virtual for run in timed} == {True} else "samples per second"
    figures.append(Plot(bar_figure(
        out / "throughput.png", f"Throughput per device: {names}", "rank", f"throughput ({rate})", ranks,
        {run.label: _by_rank(throughput(run), len(ranks)) for run in timed}).name,
        "Data throughput of each device: its local steps times the batch size over its elapsed time."))
    figures.append(Plot(bar_figure(
        out / "computing_time_ratio.png", f"Computing time ratio per device: {names}", "rank",
        "computing time ratio", ranks, {run.label: _by_rank(computing_time_ratio(run), len(ranks)) for run in timed},
    ).name, "Computing time ratio of each device: compute time over elapsed time, as the records carry it (ESync's "
            "1 - (aggregation + wait) / elapsed counts aggregation as computing; here it counts as not computing)."))
    servers = {run.label: server_traffic(run) for run in runs if server_traffic(run)}
    if servers:
        bars: dict[str, list[float]] = {}
        for label, traffic in servers.items():
            bars[f"{label} up"] = [traffic[r][0] / 1e6 if r in traffic else math.nan for r in range(len(ranks))]
            bars[f"{label} down"] = [traffic[r][1] / 1e6 if r in traffic else math.nan for r in range(len(ranks))]
        figures.append(Plot(bar_figure(
            out / "ps_traffic.png", f"Parameter-server traffic per worker: {', '.join(servers)}", "worker rank",
            "payload (MB)", ranks, bars, hatched=[label for label in bars if label.endswith(" down")]).name,
            "Bytes each worker pushed to the parameter server (up) and pulled from it (down, hatched)."))
    return figures


def _by_rank(values: dict[int, float], ranks: int) -> list[float]:
    return [values.get(rank, math.nan) for rank in range(ranks)]


def write_report(paths: Sequence[Path], out: Path | None = None, labels: Sequence[str] = (),
                 accuracies: Sequence[float] = DEFAULT_ACCURACIES) -> Path:
    """Write the figures of the runs in `paths` and `report.html` to `out` (default: RUN/report for one run, else
    ./report); returns the page's path."""
    if labels and len(labels) != len(paths):
        raise ReportError(f"{len(labels)} labels for {len(paths)} runs: give one label per run")
    runs = [load_run(Path(path), labels[i] if labels else None) for i, path in enumerate(paths)]
    seen: dict[str, int] = {}
    for run in runs:  # two runs of one job name stay apart in the legends
        seen[run.label] = seen.get(run.label, 0) + 1
        if seen[run.label] > 1:
            run.label = f"{run.label} ({seen[run.label]})"
    out = out or (Path(paths[0]) / "report" if len(paths) == 1 else Path("report"))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ReportError(f"cannot create the output directory {out}: {error.strerror}") from None
    figures = _figures(runs, out)
    page = out / REPORT_FILE
    page.write_text(_page(runs, figures, accuracies))
    return page


def _fmt(value: float, pattern: str) -> str:
    return "-" if math.isnan(value) else pattern.format(value)


def _page(runs: Sequence[Run], figures: Sequence[Plot], accuracies: Sequence[float]) -> str:
    e = html.escape
    title = "peertrain report: " + ", ".join(run.label for run in runs)
    metrics = task_metrics(runs[0].spec.task)  # one task for all (`headline`)
    if metrics[0].field != "test_accuracy":  # the times to reach an accuracy are a classifier's
        accuracies = ()
    head = ["run", "directory", "algorithm", "nodes", "topology", "split", "clock", "steps",
            *(f"final mean {metric.name}" for metric in metrics),
            *(f"time to {a:g} (s)" for a in accuracies), "sent (MB)", "received (MB)"]
    rows = []
    for run in runs:
        last = run.last
        cells = [run.label, str(run.path), run.spec.algorithm.name, str(run.spec.max_nodes), run.spec.topology.kind,
                 run.spec.data.split, "virtual" if run.virtual else "wall", str(max(r.step for r in last)),
                 *(metric.text(mean_measured(map(metric.of, last))) for metric in metrics),
                 *(_fmt(time_to_reach(run, a), "{:.1f}") for a in accuracies),
                 f"{sum(r.bytes_sent for r in last) / 1e6:.1f}", f"{sum(r.bytes_received for r in last) / 1e6:.1f}"]
        rows.append("<tr>" + "".join(f"<td>{e(cell)}</td>" for cell in cells) + "</tr>")
    parts = [
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{e(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:70em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left}figure{margin:1.5em 0}"
        "img{max-width:100%}pre{background:#f6f6f6;padding:.5em;overflow:auto;max-height:30em}</style></head><body>",
        f"<h1>{e(title)}</h1>",
        f"<p>Time: {e(_time_axis(runs))}.</p>",
        "<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>",
    ]
    for figure in figures:
        parts.append(f"<figure><img src='{e(figure.file)}' alt='{e(figure.caption)}'>"
                     f"<figcaption>{e(figure.caption)}</figcaption></figure>")
    for run in runs:
        parts.append(f"<h2>{e(run.label)}</h2>")
        parts.append(_events_html(run))
        parts.append(f"<h3>Job</h3><pre>{e(run.spec.model_dump_json(indent=2))}</pre>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _events_html(run: Run) -> str:
    e = html.escape
    if not run.events:
        return "<p>No events recorded.</p>"
    topology = [event for event in run.events if event.kind == TOPOLOGY]
    listed = topology + [event for event in run.events if event.kind != TOPOLOGY]
    items = "".join(f"<li>t={event.time - run.origin:.2f} s: {e(event.line())}</li>"
                    for event in listed[:MAX_EVENTS_LISTED])
    left = len(listed) - MAX_EVENTS_LISTED
    more = f"<p>{left} more events in {e(str(run.path / EVENTS_FILE))}.</p>" if left > 0 else ""
    return (f"<h3>Events ({len(topology)} topology changes)</h3><ul>{items}</ul>{more}")
