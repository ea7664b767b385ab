"""A job spec cannot run code or read files, and what it may cost is bounded.

Whoever can submit a job is not trusted with the machines: a model's import path loads only from the modules the
agent's operator allowed, and never at the coordinator; an edge file is read by the submitting command line and
sent as content, never opened by the coordinator; the YAML text, its aliases, nesting and values, the nodes and the
edges are bounded before they cost anything; errors never repeat what they were given at length."""

from __future__ import annotations

import sys
import time
import tracemalloc
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml

from coordinator.cli import main as coordinator_main
from coordinator.jobs import plan_node, validate_job
from coordinator.service import CoordinatorConfig, CoordinatorService
from coordinator.topology import MAX_EDGES, MAX_PERIOD_SENDS
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc
from nodeagent.agent.daemon import Agent, AgentConfig
from nodeagent.cli import main as nodeagent_main
from nodeagent.jobspec import (
    MAX_JOB_BYTES,
    MAX_SHOWN_CHARS,
    MAX_YAML_DEPTH,
    MAX_YAML_VALUES,
    JobSpecError,
    load_job_file,
    parse_job_spec,
    parse_job_yaml,
)
from nodeagent.metrics import Metrics
from nodeagent.training.datadirs import DataDirs

pytestmark = pytest.mark.integration

USER_MODULE = "peertrain_spec_safety_models"
FACTORY = """
import math

from torch import nn


def tiny(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))
"""
OS_SYSTEM = "model.name: model 'os:system': os is Python's standard library, never a model's module"
NO_FILES = "topology.options.path: topology edge-list: give the edges inline (option edges); the coordinator reads " \
    "no files"


def job(**fields: object) -> dict[str, object]:
    return {"name": "safety", "nodes": 4, "steps": 3, "eval_every": 3, "topology": {"kind": "ring"}} | fields


def alias_bomb(levels: int = 9) -> str:
    """515 bytes that expand to 9^levels values when aliases are followed."""
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    names = "abcdefghijklmnopqrstuvwxyz"
    lines += [f"{names[i + 1]}: &{names[i + 1]} [{', '.join([f'*{names[i]}'] * 9)}]" for i in range(levels - 1)]
    return "\n".join(lines) + "\n"


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[tuple[str, coordinator_pb2_grpc.CoordinatorStub, Path]]:
    """A coordinator service on loopback: its address, a stub, and its runs directory."""
    config = CoordinatorConfig(state_dir=tmp_path / "coordinator")
    service = CoordinatorService(config, Metrics())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    service.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield f"127.0.0.1:{port}", coordinator_pb2_grpc.CoordinatorStub(channel), config.run_root
    server.stop(grace=None)
    service.stop()


def refused_by_the_coordinator(stub: coordinator_pb2_grpc.CoordinatorStub, spec_yaml: str) -> str:
    with pytest.raises(grpc.RpcError) as refusal:
        stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec_yaml), timeout=10)
    assert refusal.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return refusal.value.details()


# -- import paths ----------------------------------------------------------------------------------------------------


def test_os_system_as_a_model_is_refused_at_validation() -> None:
    spec = parse_job_spec(job(model={"name": "os:system", "options": {"command": "touch /tmp/owned"}}))
    with pytest.raises(JobSpecError) as refusal:
        validate_job(spec)
    assert str(refusal.value) == OS_SYSTEM


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("subprocess:run", "model.name: model 'subprocess:run': subprocess is Python's standard library"),
        ("builtins:exec", "model.name: model 'builtins:exec': builtins is Python's standard library"),
        ("mymodels:build x", "model.name: model 'mymodels:build x': an import path must read"),
        ("my-models:build", "model.name: model 'my-models:build': an import path must read"),
        ("mymodels:", "model.name: model 'mymodels:': an import path must read"),
    ],
)
def test_an_import_path_no_agent_could_load_is_refused_at_validation(name: str, message: str) -> None:
    with pytest.raises(JobSpecError, match=f"^{message}"):
        validate_job(parse_job_spec(job(model={"name": name})))


def test_the_coordinator_refuses_os_system_and_keeps_no_job(coordinator) -> None:
    _, stub, runs = coordinator
    spec_yaml = yaml.safe_dump(job(model={"name": "os:system", "options": {"command": "touch /tmp/owned"}}))
    assert refused_by_the_coordinator(stub, spec_yaml) == f"invalid job spec: {OS_SYSTEM}"
    assert not runs.exists() or not any(runs.iterdir())


def test_submit_refuses_os_system_before_calling_the_coordinator(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job(model={"name": "os:system"})))
    with pytest.raises(SystemExit) as refusal:
        coordinator_main(["submit", str(path), "--coordinator", "127.0.0.1:9", "--insecure"])
    assert refusal.value.code == f"coordinator: {path}: {OS_SYSTEM}"


def test_the_coordinator_accepts_an_import_path_without_importing_it() -> None:
    """Whether the module exists and is allowed is the agents' to say: the coordinator imports no user code."""
    validate_job(parse_job_spec(job(model={"name": f"{USER_MODULE}:tiny"})))
    assert USER_MODULE not in sys.modules


@pytest.mark.parametrize("algorithm", ["ssgd", "asgd", "dc-asgd", "adacomp", "esync"])
def test_a_parameter_server_job_names_no_import_path(algorithm: str) -> None:
    """Its model is built at the coordinator, which imports no user code."""
    with pytest.raises(JobSpecError, match=f"^model.name: {algorithm} keeps the model at the coordinator, which "
                                           "imports no user code: name a registered model"):
        validate_job(parse_job_spec(job(algorithm={"name": algorithm}, model={"name": f"{USER_MODULE}:tiny"})))


@pytest.mark.parametrize(("module", "problem"), [
    ("os", "os is Python's standard library"),
    ("my models", "'my models' is not a module name"),
])
def test_no_operator_can_allow_what_is_never_a_model(module: str, problem: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as nodeagent_refusal:
        nodeagent_main(["serve", "--allow-import", module, "--state-dir", str(tmp_path / "agent")])
    assert str(nodeagent_refusal.value.code).startswith(f"nodeagent: --allow-import {problem}")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job()))
    with pytest.raises(SystemExit) as simulate_refusal:
        coordinator_main(["simulate", str(path), "--allow-import", module, "--runs", str(tmp_path / "runs")])
    assert str(simulate_refusal.value.code).startswith(f"coordinator: --allow-import {problem}")


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module of the user's model factories on sys.path, not yet imported."""
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / f"{USER_MODULE}.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path / "user"))
    monkeypatch.delitem(sys.modules, USER_MODULE, raising=False)
    return USER_MODULE


def run_one_node_job(coordinator, tmp_path: Path, data_dir: Path, allow_imports: tuple[str, ...]) -> pb.JobStatusReply:
    """A one-node job naming the user's model, on an agent of this process allowing `allow_imports`; its end."""
    address, stub, _ = coordinator
    agent = Agent(AgentConfig(coordinator=address, listen="127.0.0.1:0", metrics_listen=None,
                              state_dir=tmp_path / "agent", data_dirs=DataDirs.parse([str(data_dir)]), name="safety",
                              allow_imports=allow_imports))
    try:
        assert agent.start()
        spec = job(nodes=1, model={"name": f"{USER_MODULE}:tiny"}, data={"train_limit": 200, "test_limit": 100})
        job_id = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=yaml.safe_dump(spec)), timeout=10).job_id
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5)
            if status.state in (pb.JOB_FINISHED, pb.JOB_FAILED):
                return status
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} did not end in 60 s")
    finally:
        agent.stop()


def test_an_agent_refuses_a_module_its_operator_did_not_allow_and_the_job_fails(
        coordinator, tmp_path, fashion_mnist_dir, user_module):
    status = run_one_node_job(coordinator, tmp_path, fashion_mnist_dir, allow_imports=("other_models",))
    assert status.state == pb.JOB_FAILED
    assert status.reason.endswith(f"model '{user_module}:tiny': module {user_module} is not allowed on this machine; "
                                  f"its operator allows it with --allow-import {user_module} (nodeagent serve, "
                                  "coordinator simulate)"), status.reason
    assert user_module not in sys.modules  # neither the agent nor the coordinator imported it


def test_an_agent_builds_a_model_from_a_module_its_operator_allowed(
        coordinator, tmp_path, fashion_mnist_dir, user_module):
    status = run_one_node_job(coordinator, tmp_path, fashion_mnist_dir, allow_imports=(user_module,))
    assert status.state == pb.JOB_FINISHED, status.reason
    assert user_module in sys.modules


# -- edge files ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/etc/shadow", "/proc/self/environ", "/dev/zero", "edges.txt"])
def test_an_edge_list_path_reaching_validation_is_refused_unread(path: str) -> None:
    spec = parse_job_spec(job(topology={"kind": "edge-list", "options": {"path": path}}))
    with pytest.raises(JobSpecError) as refusal:
        validate_job(spec)
    assert str(refusal.value) == NO_FILES


def test_the_coordinator_refuses_an_edge_list_path(coordinator) -> None:
    _, stub, _ = coordinator
    spec_yaml = yaml.safe_dump(job(topology={"kind": "edge-list", "options": {"path": "/etc/shadow"}}))
    assert refused_by_the_coordinator(stub, spec_yaml) == f"invalid job spec: {NO_FILES}"


EDGES = "# a square\n0 1\n1 2\n2 3  # and back\n3 0\n"


def job_with_edge_file(directory: Path, path: str = "graphs/square.txt") -> Path:
    (directory / "graphs").mkdir(parents=True, exist_ok=True)
    (directory / "graphs" / "square.txt").write_text(EDGES)
    job_path = directory / "job.yaml"
    topology = {"kind": "edge-list", "options": {"path": path}}
    job_path.write_text("# the square\n" + yaml.safe_dump(job(topology=topology)))
    return job_path


def test_the_loader_inlines_an_edge_file_relative_to_the_job_file(tmp_path: Path, monkeypatch) -> None:
    job_path = job_with_edge_file(tmp_path / "jobs")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    loaded = load_job_file(job_path)
    assert loaded.spec.topology.options == {"edges": EDGES}
    assert "path" not in loaded.text and "edges: |" in loaded.text
    assert parse_job_yaml(loaded.text) == loaded.spec  # what submit sends is what was checked
    assert validate_job(loaded.spec).edges == ((0, 1), (0, 3), (1, 2), (2, 3))


def test_a_job_without_an_edge_file_is_sent_as_written(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("# my job\n" + yaml.safe_dump(job()))
    assert load_job_file(path).text == path.read_text()


def test_submit_sends_the_edges_inline(coordinator, tmp_path: Path, capsys) -> None:
    address, stub, runs = coordinator
    assert coordinator_main(["submit", str(job_with_edge_file(tmp_path)), "--coordinator", address, "--insecure"]) == 0
    job_id = capsys.readouterr().out.strip()
    status = stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=5)
    assert yaml.safe_load(status.spec_yaml)["topology"]["options"] == {"edges": EDGES}
    assert (runs / job_id / "job.yaml").read_text() == status.spec_yaml


def test_inspect_reads_the_edge_file_locally(tmp_path: Path, capsys, fashion_mnist_dir) -> None:
    path = job_with_edge_file(tmp_path)
    assert coordinator_main(["inspect", str(path), "--data-dir", str(fashion_mnist_dir)]) == 0
    output = capsys.readouterr().out
    assert "topology edge-list: 4 nodes, 4 edges" in output and "0-1 0-3 1-2 2-3" in output


@pytest.mark.parametrize(
    ("path", "content", "message"),
    [
        ("/dev/zero", None, "topology.options.path: '/dev/zero': the edge file is larger than a job may be (1048576 "
                            "bytes, 1 MiB)"),
        ("huge.txt", b"0 1\n" * (MAX_JOB_BYTES // 4 + 1), "topology.options.path: 'huge.txt': the edge file is "
                                                          "larger than a job may be (1048576 bytes, 1 MiB)"),
        ("binary.bin", b"0 1\n\xff\xfe", "topology.options.path: 'binary.bin': not a text file (byte 4 is not UTF-8)"),
        ("missing.txt", None, "topology.options.path: cannot read 'missing.txt': No such file or directory"),
        ("", None, "topology.options.path: must be the name of an edge file"),
    ],
)
def test_an_edge_file_that_cannot_be_used_is_refused_naming_the_field(tmp_path, path, content, message) -> None:
    if content is not None:
        (tmp_path / path).write_bytes(content)
    job_path = tmp_path / "job.yaml"
    job_path.write_text(yaml.safe_dump(job(topology={"kind": "edge-list", "options": {"path": path}})))
    with pytest.raises(JobSpecError) as refusal:
        load_job_file(job_path)
    assert str(refusal.value) == message


def test_an_edge_file_error_names_the_line_and_never_repeats_it(tmp_path: Path) -> None:
    (tmp_path / "edges.txt").write_text("0 1\nroot:$6$secret-hash:19000:0:99999:7:::\n")
    job_path = tmp_path / "job.yaml"
    job_path.write_text(yaml.safe_dump(job(topology={"kind": "edge-list", "options": {"path": "edges.txt"}})))
    with pytest.raises(JobSpecError) as refusal:
        validate_job(load_job_file(job_path).spec)
    assert str(refusal.value) == "topology: topology 'edge-list': edges line 2: expected two ranks 'a b'"


def test_an_edge_list_with_both_a_path_and_edges_is_refused(tmp_path: Path) -> None:
    job_path = job_with_edge_file(tmp_path)
    data = yaml.safe_load(job_path.read_text())
    data["topology"]["options"]["edges"] = "0 1\n"
    job_path.write_text(yaml.safe_dump(data))
    with pytest.raises(JobSpecError, match=r"^topology.options: give the edges inline \(edges\) or as a file"):
        load_job_file(job_path)


def test_an_inlined_edge_file_that_makes_the_job_too_large_is_refused(tmp_path: Path) -> None:
    (tmp_path / "edges.txt").write_text("0 1\n" * (MAX_JOB_BYTES // 8))  # half a megabyte, indented when inlined
    job_path = tmp_path / "job.yaml"
    job_path.write_text(yaml.safe_dump(job(topology={"kind": "edge-list", "options": {"path": "edges.txt"}})))
    with pytest.raises(JobSpecError, match=r"^with the edges of 'edges.txt' inlined, the job is [0-9]+ bytes; a job "
                                           r"may be at most 1048576"):
        load_job_file(job_path)


# -- bounds ----------------------------------------------------------------------------------------------------------


def test_an_alias_bomb_is_refused_before_any_alias_is_expanded(coordinator) -> None:
    bomb = alias_bomb()
    assert len(bomb) < 600
    tracemalloc.start()
    with pytest.raises(JobSpecError, match=r"^YAML anchors and aliases \(& and \*\) are not accepted \(line 1\)"):
        parse_job_yaml(bomb)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20
    _, stub, runs = coordinator
    assert refused_by_the_coordinator(stub, bomb).startswith("invalid job spec: YAML anchors and aliases")
    assert not runs.exists() or not any(runs.iterdir())  # no run directory written


def test_a_single_anchor_is_refused_too() -> None:
    with pytest.raises(JobSpecError, match="anchors and aliases"):
        parse_job_yaml("name: &n job\n")


def nested(depth: int) -> str:
    """A job whose lists and mappings nest `depth` deep: the job (1), algorithm (2), options (3), then lists."""
    return "algorithm: {options: {x: " + "[" * (depth - 3) + "]" * (depth - 3) + "}}\n"


def test_nesting_deeper_than_the_bound_is_refused() -> None:
    parse_job_yaml(nested(MAX_YAML_DEPTH))  # the YAML is accepted; what it holds is the algorithm's to refuse
    with pytest.raises(JobSpecError, match=f"^lists and mappings nested deeper than {MAX_YAML_DEPTH} levels"):
        parse_job_yaml(nested(MAX_YAML_DEPTH + 1))
    with pytest.raises(JobSpecError, match="nested deeper"):
        parse_job_yaml("a: " + "[" * 200_000)  # libyaml would take minutes over it, and its loader would crash


def test_more_values_than_the_bound_are_refused() -> None:
    with pytest.raises(JobSpecError, match=f"^more than {MAX_YAML_VALUES} values"):
        parse_job_yaml("algorithm: {options: {x: [" + ", ".join(["0"] * MAX_YAML_VALUES) + "]}}\n")


def test_a_job_larger_than_a_mebibyte_is_refused_before_parsing() -> None:
    text = "name: [" + "#" * MAX_JOB_BYTES  # not even YAML: the size is what is refused
    with pytest.raises(JobSpecError) as refusal:
        parse_job_yaml(text)
    assert str(refusal.value) == f"the job is {MAX_JOB_BYTES + 7} bytes; a job may be at most {MAX_JOB_BYTES} (1 MiB)"
    parse_job_yaml("name: a\n" + "#" * (MAX_JOB_BYTES - 8))  # a mebibyte is accepted


def test_a_job_file_that_never_ends_is_refused_after_a_bounded_read() -> None:
    with pytest.raises(JobSpecError, match=r"^the job file is larger than a job may be"):
        load_job_file("/dev/zero")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nodes: 1" + "0" * 5000 + "\n", "not valid YAML: a value cannot be read: Exceeds the limit (4300 digits)"),
        ("? " + "x" * 100_000 + "\n: 1\n", "'xxxxx"),
        ("topology: {kind: " + "k" * 100_000 + "}\n", "topology.kind: String should have at most 64 characters"),
        ("model: {name: " + "m" * 100_000 + "}\n", "model.name: String should have at most 200 characters"),
        ("simulation: {speeds: [" + ", ".join(["fast"] * 2000) + "]}\n", "; and 1990 more"),
    ],
)
def test_errors_never_repeat_at_length_what_they_were_given(text: str, message: str) -> None:
    with pytest.raises(JobSpecError) as refusal:
        validate_job(parse_job_yaml(text))
    assert message in str(refusal.value)
    assert len(str(refusal.value)) < 20 * MAX_SHOWN_CHARS


def test_a_topology_option_too_long_to_repeat_is_cut() -> None:
    spec = parse_job_spec(job(topology={"kind": "ring", "options": {"x" * 10_000: 1}}))
    with pytest.raises(JobSpecError) as refusal:
        validate_job(spec)
    assert len(str(refusal.value)) < 3 * MAX_SHOWN_CHARS


def test_a_4096_node_complete_graph_is_refused_naming_its_edges() -> None:
    spec = parse_job_spec(job(nodes=4096, topology={"kind": "complete"}))
    with pytest.raises(JobSpecError) as refusal:
        validate_job(spec)
    assert str(refusal.value) == f"topology: topology 'complete': 8386560 edges; a job's graph may have at most " \
        f"{MAX_EDGES}"


@pytest.mark.parametrize(
    ("nodes", "topology", "algorithm", "message"),
    [
        (4096, {"kind": "random-regular", "options": {"degree": 4095}}, "dsgd", "8386560 edges"),
        (4096, {"kind": "bipartite-linear"}, "ad-psgd", "4194304 edges"),
        (446, {"kind": "bipartite-linear", "options": {"peers_per_iteration": 221}}, "ad-psgd",
         f"one period of its schedule has 21980218 sends (446 nodes x 223 iterations x 221 peers per iteration); at "
         f"most {MAX_PERIOD_SENDS}"),
        (10_000, {"kind": "exponential"}, "dsgd", "140000 edges"),
        (10_001, {"kind": "ring"}, "dsgd", "nodes.fixed: Input should be less than or equal to 10000"),
    ],
)
def test_a_graph_beyond_the_bounds_is_refused(nodes: int, topology: dict, algorithm: str, message: str) -> None:
    with pytest.raises(JobSpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_job(parse_job_spec(job(nodes=nodes, topology=topology, algorithm={"name": algorithm})))


@pytest.mark.parametrize(
    ("nodes", "topology", "algorithm"),
    [
        (4096, {"kind": "exponential"}, "pdmm-isvr"),
        (4096, {"kind": "dynamic-exponential", "options": {"peers_per_iteration": 2}}, "sgp"),
        (4096, {"kind": "random-regular", "options": {"degree": 2}}, "dsgd"),
        (362, {"kind": "complete"}, "dsgd"),  # the largest complete graph within MAX_EDGES
    ],
)
def test_the_largest_jobs_within_the_bounds_are_planned_for_every_node(nodes, topology, algorithm) -> None:
    """Their timing is benchmarks/planning.py's (under 2 s each); here: they are accepted and every node planned."""
    spec = parse_job_spec(job(nodes=nodes, topology=topology, algorithm={"name": algorithm}))
    graph = validate_job(spec)
    plans = [plan_node(spec, graph, rank) for rank in range(nodes)]
    assert sum(len(plan.neighbors) for plan in plans) == 2 * len(graph.edges) <= 2 * MAX_EDGES
    assert all(plan.neighbors for plan in plans)
