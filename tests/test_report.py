"""`coordinator report`: figures and one HTML page from run directories of tiny simulated jobs."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import struct
from pathlib import Path

import grpc
import pytest

from coordinator.cli import main
from coordinator.report import accuracy_against_bytes, load_run, time_to_reach, traffic_matrix, write_report
from coordinator.simulate import reference_spec, simulate
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto.coordinator_pb2_grpc import CoordinatorStub
from nodeagent.jobspec import parse_job_spec
from nodeagent.runtime.events import EVENTS_FILE, TOPOLOGY, Event, EventLog
from nodeagent.runtime.progress import LOG_FILE, RunLog, read_run_log

pytestmark = pytest.mark.integration

HOSTILE = "<script>alert('x')</script>"
CURVES = ("accuracy_time.png", "accuracy_steps.png", "accuracy_bytes.png", "test_loss_time.png",
          "train_loss_steps.png", "throughput.png", "computing_time_ratio.png")


def job(fashion_mnist_dir: Path, name: str, algorithm: str, nodes: int = 4, **simulation) -> dict:
    return {
        "name": name, "nodes": nodes, "steps": 20, "eval_every": 5,
        "algorithm": {"name": algorithm, "lr": 0.05, "interval": 4},
        "model": {"name": "logistic"},
        "data": {"data_dir": str(fashion_mnist_dir), "split": "iid", "batch_size": 32, "train_limit": 1000,
                 "test_limit": 200},
        "topology": {"kind": "ring", "seed": 1},
        "simulation": {"step_time_s": 0.01, **simulation},
    }


@pytest.fixture(scope="module")
def runs(fashion_mnist_dir, tmp_path_factory) -> dict[str, Path]:
    """Run directories of a decentralized job, its single-node reference and a parameter-server job."""
    root = tmp_path_factory.mktemp("runs")
    dsgd = parse_job_spec(job(fashion_mnist_dir, "tiny-dsgd", "dsgd"))
    simulate(dsgd, root / "dsgd")
    simulate(reference_spec(dsgd), root / "reference")
    simulate(parse_job_spec(job(fashion_mnist_dir, "tiny-esync", "esync", speeds=[4.0, 4.0, 1.0, 1.0])),
             root / "esync")
    return {"dsgd": root / "dsgd", "reference": root / "reference", "esync": root / "esync"}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is no PNG"
    return struct.unpack(">II", data[16:24])  # the IHDR chunk: width, height


def assert_figures(out: Path, names: list[str]) -> str:
    page = (out / "report.html").read_text()
    for name in names:
        width, height = png_size(out / name)
        assert width >= 400 and height >= 300, (name, width, height)
        assert (out / name).stat().st_size > 5000, f"{name} looks empty"
        assert f"src='{name}'" in page
    return page


def test_one_run_gets_its_report_in_its_directory(runs, capsys):
    assert main(["report", str(runs["dsgd"])]) == 0
    out = runs["dsgd"] / "report"
    assert capsys.readouterr().out.strip() == str(out / "report.html")
    page = assert_figures(out, [*CURVES, "traffic_0.png"])
    assert "ps_traffic.png" not in page and not (out / "ps_traffic.png").exists()  # no parameter server
    assert "[started]" in page and "[finished]" in page  # the run's events, as the simulator wrote them
    assert "tiny-dsgd" in page and "virtual time since the start (s)" in page and "<td>virtual</td>" in page


def test_a_run_without_events_is_reported(runs, tmp_path):
    run_dir = tmp_path / "quiet"
    shutil.copytree(runs["dsgd"], run_dir, ignore=shutil.ignore_patterns("report", EVENTS_FILE))
    assert "No events recorded." in write_report([run_dir], tmp_path / "out").read_text()


def test_several_runs_are_compared_on_one_page(runs, tmp_path):
    out = tmp_path / "report"
    code = main(["report", str(runs["dsgd"]), str(runs["reference"]), str(runs["esync"]), "--out", str(out),
                 "--labels", "DSGD", "reference", "ESync", "--accuracies", "0.3,0.99"])
    assert code == 0
    page = assert_figures(out, [*CURVES, "traffic_0.png", "traffic_2.png", "ps_traffic.png"])
    assert not (out / "traffic_1.png").exists()  # the single-node reference has no edges
    for label in ("DSGD", "reference", "ESync"):
        assert f"<td>{label}</td>" in page
    assert "time to 0.3 (s)" in page and "time to 0.99 (s)" in page


def test_traffic_matrix_maps_peers_to_ranks_and_the_server_to_an_extra_row(runs):
    names, matrix = traffic_matrix(load_run(runs["dsgd"]))
    assert names == ["0", "1", "2", "3"]
    for a in range(4):  # a ring of 4: each node talks to its two neighbours only
        neighbours = {(a - 1) % 4, (a + 1) % 4}
        assert all((matrix[a][b] > 0) == (b in neighbours) for b in range(4)), matrix
    names, matrix = traffic_matrix(load_run(runs["esync"]))
    assert names == ["0", "1", "2", "3", "PS"]
    last = {r.rank: r for r in read_run_log(runs["esync"])}
    for rank in range(4):
        edge = last[rank].edges[0]
        assert (matrix[rank][4], matrix[4][rank]) == (edge.bytes_sent, edge.bytes_received) != (0, 0)


def test_a_running_job_is_reported_from_its_whole_lines(runs, tmp_path):
    run_dir = tmp_path / "running"
    shutil.copytree(runs["dsgd"], run_dir, ignore=shutil.ignore_patterns("report"))
    whole = len(read_run_log(run_dir))
    with open(run_dir / LOG_FILE, "a") as log:
        log.write('{"job": "tiny-dsgd", "rank": 0, "st')  # the coordinator is writing this line
    assert len(load_run(run_dir).records) == whole
    assert write_report([run_dir], tmp_path / "out").is_file()


def test_time_to_reach_an_accuracy(runs):
    run = load_run(runs["dsgd"])
    assert time_to_reach(run, 0.01) == 0.0  # every node is evaluated at the start
    assert math.isnan(time_to_reach(run, 1.01))  # never


def test_node_supplied_text_is_escaped_and_topology_changes_are_listed(runs, tmp_path):
    run_dir = tmp_path / "hostile"
    run_dir.mkdir()
    (run_dir / "job.json").write_text((runs["dsgd"] / "job.json").read_text())
    log = RunLog(run_dir)
    for record in read_run_log(runs["dsgd"]):
        log.append(dataclasses.replace(record, node=f"{HOSTILE}{record.rank}",
                                       edges=tuple(dataclasses.replace(e, peer=f"{HOSTILE}{e.peer[-1]}")
                                                   for e in record.edges)))
    events = EventLog(run_dir)
    events.append(Event(0.1, "hostile", TOPOLOGY, f"ring -> multiplex-ring {HOSTILE}"))
    events.append(Event(0.2, "hostile", "log", HOSTILE, level="WARNING", rank=1, node=HOSTILE))
    page = write_report([run_dir], tmp_path / "out").read_text()
    assert "<script>" not in page
    assert "&lt;script&gt;" in page
    assert "Events (1 topology changes)" in page
    _, matrix = traffic_matrix(load_run(run_dir))
    assert len(matrix) == 4  # hostile names still map peers to ranks


def test_absent_or_unreadable_runs_fail_clearly(runs, tmp_path, capsys):
    assert_exit(["report", str(tmp_path / "nowhere")], "no such run directory", capsys)
    (tmp_path / "empty").mkdir()
    assert_exit(["report", str(tmp_path / "empty")], "not a run directory (no job.json)", capsys)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "job.json").write_text((runs["dsgd"] / "job.json").read_text())
    for line in ("{not json\n", "5\n", '{"rank": 0, "unknown": 1}\n'):
        (damaged / LOG_FILE).write_text(line)
        assert_exit(["report", str(damaged)], "a damaged line", capsys)
    (damaged / LOG_FILE).write_text("")
    assert_exit(["report", str(damaged)], "no progress records yet", capsys)
    (damaged / "job.json").write_text(json.dumps({"name": "x", "nodes": "many"}))
    assert_exit(["report", str(damaged)], "not a job this version reads", capsys)
    assert_exit(["report", str(runs["dsgd"]), "--labels", "a", "b"], "2 labels for 1 runs", capsys)


def test_a_job_is_found_by_name_through_the_coordinator(runs, coordinator_address, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no run directory of the job's name here
    client = ["--insecure", "--coordinator", coordinator_address]
    with grpc.insecure_channel(coordinator_address) as channel:
        spec = json.loads((runs["dsgd"] / "job.json").read_text())
        reply = CoordinatorStub(channel).SubmitJob(pb.SubmitJobRequest(spec_yaml=json.dumps(spec)), timeout=10)
    # Submitted, waiting for agents: the run directory has the job and no records yet.
    assert_exit(["report", "tiny-dsgd", *client], "no progress records yet", capsys)
    shutil.copy(runs["dsgd"] / LOG_FILE, Path(reply.run_dir) / LOG_FILE)
    assert main(["report", "tiny-dsgd", *client]) == 0
    assert capsys.readouterr().out.strip() == str(Path(reply.run_dir) / "report" / "report.html")
    assert_exit(["report", "no-such-job", *client], "no-such-job is no run directory here, nor a job", capsys)


def test_a_job_reference_without_a_coordinator_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_exit(["report", "some-job", "--insecure", "--coordinator", "127.0.0.1:1"],
                "some-job is no run directory here, nor a job the coordinator knows", capsys)


def assert_exit(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code != 0
    assert message in str(exited.value.code), exited.value.code


def test_the_diloco_comparison_draws_accuracy_against_bytes_sent_per_node(fashion_mnist_dir, tmp_path):
    """All-reduce SGD and DiLoCo (H = 10) on the same tiny job: one curve each, its points at the evaluations, its
    x the mean bytes the nodes had sent; DiLoCo's last point is 10x left of all-reduce SGD's."""
    base = job(fashion_mnist_dir, "tiny-allreduce", "allreduce")
    base["algorithm"] = {"name": "allreduce", "lr": 0.05}
    diloco = {**base, "name": "tiny-diloco", "algorithm": {"name": "diloco", "lr": 1e-3,
                                                           "options": {"inner_steps": 10}}}
    simulate(parse_job_spec(base), tmp_path / "allreduce")
    simulate(parse_job_spec(diloco), tmp_path / "diloco")
    curves = {}
    for name in ("allreduce", "diloco"):
        run = load_run(tmp_path / name)
        xs, ys = accuracy_against_bytes(run)
        assert len(xs) == 5  # steps 0, 5, 10, 15, 20
        assert xs == sorted(xs) and xs[0] == 0
        assert xs[-1] == sum(record.bytes_sent for record in run.last) / 4
        assert ys[-1] == pytest.approx(sum(record.test_accuracy for record in run.last) / 4)
        curves[name] = xs[-1]
    assert curves["allreduce"] == pytest.approx(10 * curves["diloco"], rel=0.01)
    out = tmp_path / "report"
    assert main(["report", str(tmp_path / "allreduce"), str(tmp_path / "diloco"), "--out", str(out)]) == 0
    page = assert_figures(out, ["accuracy_bytes.png"])
    assert "Test accuracy against bytes sent per node" in page or "bytes each node had sent" in page


def test_every_ranks_edges_add_up_to_its_bytes_sent_across_a_topology_change(fashion_mnist_dir, tmp_path):
    # Ring, then a star from step 10: the edges 1-2 and 2-3 carried traffic before the switch and none after.
    spec = parse_job_spec(job(fashion_mnist_dir, "switched", "dsgd",
                              topology_changes=[{"at_step": 10, "kind": "star"}]))
    simulate(spec, tmp_path / "switched")
    run = load_run(tmp_path / "switched")
    names, matrix = traffic_matrix(run)
    assert names == ["0", "1", "2", "3"]
    for record in run.last:
        assert sum(matrix[record.rank]) == record.bytes_sent > 0
    assert matrix[1][2] > 0 and matrix[2][3] > 0  # the dropped edges keep what they carried
