"""The parameter server in a real coordinator over gRPC: many workers pushing at once are applied exactly once in
a recorded order, a restarted coordinator loses no applied update (nor a synchronous round half done, nor DiLoCo's
outer momentum), ESync's reports, and streams the server must refuse."""

import json
import math
import threading
import uuid
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
import yaml
from datafiles import FASHION_MNIST
from test_codec import manifest_frame_bytes

from coordinator.ps_service import add_coordinator_servicer
from coordinator.service import CoordinatorConfig, CoordinatorService
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc
from nodeagent.algorithms import REGISTRY, NodeContext, build_server
from nodeagent.jobspec import parse_job_spec
from nodeagent.metrics import Metrics
from nodeagent.ps import OuterServer
from nodeagent.ps.messages import PUSH_ID_HEADER, ReadyAnswer, ServerPull, ServerPush, StepReport
from nodeagent.runtime.messages import data_to_proto
from nodeagent.runtime.progress import Traffic
from nodeagent.runtime.server_link import GrpcServerLink
from nodeagent.training.models import build_model
from nodeagent.wire import lowprecision
from nodeagent.wire.encoder import encode
from nodeagent.wire.message import Kind, Message
from nodeagent.wire.sparse import Codec, compress

pytestmark = pytest.mark.integration


class Coordinator:
    """A CoordinatorService behind a real gRPC server on loopback, restartable on the same state directory."""

    def __init__(self, root: Path):
        self.root = root
        self.service: CoordinatorService | None = None
        self.server: grpc.Server | None = None
        self.channel: grpc.Channel | None = None
        self.start()

    def start(self) -> None:
        self.service = CoordinatorService(CoordinatorConfig(state_dir=self.root), Metrics())
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
        add_coordinator_servicer(self.service, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.service.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)

    def stop(self) -> None:
        self.server.stop(grace=0).wait()
        self.service.stop()
        self.channel.close()

    def restart(self) -> None:
        self.stop()
        self.start()

    def job(self, spec: dict) -> tuple[str, dict[int, str], str]:
        """Register fake agents and submit `spec`; returns the job id, rank -> node id, and the run dir."""
        for index in range(spec["nodes"]):
            self.stub.Register(pb.RegisterRequest(peer_address=f"127.0.0.1:{20000 + index}", name=f"worker-{index}"))
        job_id = self.stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=yaml.safe_dump(spec))).job_id
        status = self.stub.JobStatus(pb.JobStatusRequest(job_id=job_id))
        assert status.state == pb.JOB_RUNNING
        for member in status.nodes:  # as the agents do before their first call: the server is shaped by their data
            self.stub.JobReady(pb.JobReadyRequest(node_id=member.node_id, job_id=job_id, rank=member.rank,
                                                  data=data_to_proto(FASHION_MNIST)))
        return job_id, {m.rank: m.node_id for m in status.nodes}, status.run_dir

    def client(self, job_id: str, node_id: str, rank: int, world_size: int, worker, timeout_s: float = 30.0
               ) -> GrpcServerLink:
        return GrpcServerLink(lambda: self.stub, job_id=job_id, node_id=node_id, rank=rank, world_size=world_size,
                              worker=worker, metrics=Metrics(), traffic=Traffic(), pool=futures.ThreadPoolExecutor(1),
                              timeout_s=timeout_s)


def new_push_id() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def coordinator(tmp_path):
    running = Coordinator(tmp_path / "coordinator")
    yield running
    running.stop()


def spec_of(name: str, nodes: int, **algorithm) -> dict:
    return {"name": name.replace("_", "-"), "nodes": nodes, "steps": 100,
            "algorithm": {"name": name, "lr": 0.05, **algorithm}, "model": {"name": "logistic"}}


def worker_of(spec, rank: int):
    torch.manual_seed(spec.seed)
    return REGISTRY[spec.algorithm.name](build_model(spec.model), NodeContext(rank, spec.nodes, (), spec.algorithm))


def read_log(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in Path(run_dir, "ps-log.jsonl").read_text().splitlines()]


PUSHES_PER_WORKER = 6


@pytest.mark.parametrize(
    "algorithm",
    [{"name": "asgd"}, {"name": "dc-asgd", "options": {"adaptive": True}},
     {"name": "adacomp", "options": {"rate": 0.02, "codec": "int8", "pull": "delta"}}],
    ids=["asgd", "dc-asgd", "adacomp"],
)
def test_sixteen_workers_push_at_once_and_each_push_is_applied_once_in_the_recorded_order(coordinator, algorithm):
    raw = spec_of(algorithm["name"], 16, **{k: v for k, v in algorithm.items() if k != "name"})
    job_id, nodes, run_dir = coordinator.job(raw)
    spec = parse_job_spec(raw)
    sizes = worker_of(spec, 0).params.sizes
    numel = sum(sizes)
    start = threading.Barrier(16)
    sent: dict[str, tuple[int, ServerPush]] = {}  # push id -> (rank, the push as the server decodes it)
    errors = []

    def work(rank: int) -> None:
        try:
            alg = worker_of(spec, rank)  # only its configuration is used (what it accepts from the server)
            client = coordinator.client(job_id, nodes[rank], rank, 16, alg)
            generator = torch.Generator().manual_seed(rank)
            version = 0
            start.wait()
            for k in range(PUSHES_PER_WORKER):
                grad = torch.randn(numel, generator=generator) * 0.1
                if algorithm["name"] == "adacomp":
                    payload, _ = compress(grad, sizes, 0.02, Codec.INT8)
                    tensors = {"payload": torch.frombuffer(bytearray(payload), dtype=torch.uint8)}
                else:
                    tensors = alg.params.views(grad)
                push = ServerPush(Kind.GRADIENT, tensors, version, clock=k)
                push_id = new_push_id()
                sent[push_id] = (rank, push)
                reply = client.push_update(push, push_id)
                assert reply.applied and not reply.duplicate
                version = client.fetch_model(ServerPull(version, alg.pull_delta)).version
        except Exception as error:  # reported below, with the rank
            errors.append((rank, error))

    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    final = coordinator.client(job_id, nodes[0], 0, 16, worker_of(spec, 0)).fetch_model(ServerPull())
    assert final.version == 16 * PUSHES_PER_WORKER == len(sent)
    # Replay the recorded order (pushes, and the pulls that set DC-ASGD's backups) on a fresh server.
    events = read_log(run_dir)
    pushes = [e for e in events if e["event"] == "push"]
    assert sorted(e["push_id"] for e in pushes) == sorted(sent)
    assert [e["version"] for e in pushes] == list(range(1, len(sent) + 1))
    replay = build_server(spec, FASHION_MNIST)
    for event in events:
        if event["event"] == "pull":
            replay.pull(event["rank"], 0, False, now=0.0)
            continue
        rank, push = sent[event["push_id"]]
        assert (event["rank"], event["worker_version"]) == (rank, push.version)
        result = replay.push(rank, push, event["push_id"], now=0.0)
        assert (result.applied, result.version, result.delay) == (True, event["version"], event["delay"])
    assert torch.equal(replay.params.flatten(final.tensors), replay.w)
    assert max(e["delay"] for e in pushes) > 0  # they did overlap


def test_a_restarted_coordinator_keeps_the_version_and_the_model(coordinator):
    raw = spec_of("asgd", 2)
    job_id, nodes, run_dir = coordinator.job(raw)
    spec = parse_job_spec(raw)
    alg = worker_of(spec, 0)

    def push(version: int, seed: int) -> int:
        grad = torch.randn(alg.params.numel, generator=torch.Generator().manual_seed(seed))
        update = ServerPush(Kind.GRADIENT, alg.params.views(grad), version, clock=version)
        return coordinator.client(job_id, nodes[0], 0, 2, alg).push_update(update, new_push_id()).version

    for seed in range(3):
        push(seed, seed)
    before = coordinator.client(job_id, nodes[0], 0, 2, alg).fetch_model(ServerPull())
    coordinator.restart()
    after = coordinator.client(job_id, nodes[0], 0, 2, alg).fetch_model(ServerPull())
    assert after.version == before.version == 3
    assert all(torch.equal(after.tensors[name], before.tensors[name]) for name in before.tensors)
    assert push(3, 3) == 4
    assert [e["version"] for e in read_log(run_dir)] == [1, 2, 3, 4]


def test_a_synchronous_round_half_done_survives_a_restart_and_a_retried_push_counts_once(coordinator):
    raw = spec_of("ssgd", 2)
    job_id, nodes, _ = coordinator.job(raw)
    spec = parse_job_spec(raw)
    workers = [worker_of(spec, rank) for rank in range(2)]
    grads = [torch.full((workers[0].params.numel,), float(rank + 1)) for rank in range(2)]
    pushes = [ServerPush(Kind.GRADIENT, workers[rank].params.views(grads[rank]), 0) for rank in range(2)]
    first_id = new_push_id()
    with pytest.raises(grpc.RpcError) as waited:  # the round is not complete: the call waits past its deadline
        coordinator.client(job_id, nodes[0], 0, 2, workers[0], timeout_s=1.0).push_update(pushes[0], first_id)
    assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    coordinator.restart()
    pool = futures.ThreadPoolExecutor(2)
    retried = pool.submit(coordinator.client(job_id, nodes[0], 0, 2, workers[0]).push_update, pushes[0], first_id)
    last = coordinator.client(job_id, nodes[1], 1, 2, workers[1]).push_update(pushes[1], new_push_id())
    again = retried.result(timeout=30)
    assert (last.version, again.version, again.duplicate) == (1, 1, True)
    model = coordinator.client(job_id, nodes[1], 1, 2, workers[1]).fetch_model(ServerPull())
    expected = workers[0].w - 0.05 * (grads[0] + grads[1]) / 2
    assert torch.allclose(workers[0].params.flatten(model.tensors), expected, atol=1e-7)


def test_diloco_rounds_through_the_coordinator_keep_the_outer_momentum_across_a_restart(coordinator):
    """Two outer rounds of int8 pseudo-gradients, the coordinator restarted between them: the global parameters
    are those of the outer Nesterov steps on the decoded means, the second step with the first one's momentum."""
    raw = spec_of("diloco-ps", 2, lr=1e-3, options={"inner_steps": 10, "precision": "int8"})
    job_id, nodes, _ = coordinator.job(raw)
    spec = parse_job_spec(raw)
    workers = [worker_of(spec, rank) for rank in range(2)]
    reference = OuterServer(workers[0].w.detach().clone(), 2, 0.7, 0.9, True)
    pool = futures.ThreadPoolExecutor(2)
    for round_ in range(2):
        if round_:
            coordinator.restart()
        pushes = []
        for rank in range(2):
            delta = torch.randn(workers[rank].params.numel, generator=torch.Generator().manual_seed(round_ * 2 + rank))
            tensors = lowprecision.encode(delta * 0.01, "int8")
            pushes.append(ServerPush(Kind.DELTA, tensors, round_, clock=10 * (round_ + 1)))
            reference.push(rank, lowprecision.decode(tensors, "int8", 0, torch.float32), round_)

        def push(rank: int, pushes=pushes) -> pb.PsPushReply:
            return coordinator.client(job_id, nodes[rank], rank, 2, workers[rank]).push_update(pushes[rank],
                                                                                              new_push_id())

        assert [reply.version for reply in pool.map(push, range(2))] == [round_ + 1] * 2
    model = coordinator.client(job_id, nodes[0], 0, 2, workers[0]).fetch_model(ServerPull())
    assert model.version == 2 and bool(reference.velocity.abs().sum() > 0)
    assert torch.allclose(workers[0].params.flatten(model.tensors), reference.w, rtol=0, atol=1e-7)


def test_esync_reports_and_round_over_grpc(coordinator):
    # Deltas of 0 and 2 per parameter: beyond the default bound (one update moves a parameter by at most 1 in RMS).
    raw = spec_of("esync", 2, options={"epsilon": 0.0, "max_update_norm": 1e6})
    job_id, nodes, run_dir = coordinator.job(raw)
    spec = parse_job_spec(raw)
    workers = [worker_of(spec, rank) for rank in range(2)]
    clients = [coordinator.client(job_id, nodes[rank], rank, 2, workers[rank]) for rank in range(2)]

    def report(rank: int, step: int, duration: float) -> ReadyAnswer:
        nonlocal clients
        return clients[rank].ask(StepReport(version=0, round_step=step), duration)

    assert report(0, 1, 0.01).ready is False  # rank 1 has not reported: it counts as the slowest
    assert report(1, 1, 100.0).ready is True  # the slowest stops after one step
    assert report(0, 2, 0.01).ready is True  # the slowest is ready
    coordinator.restart()  # the round's table was persisted after each report
    clients = [coordinator.client(job_id, nodes[rank], rank, 2, workers[rank]) for rank in range(2)]
    assert report(0, 2, 0.01).ready is True  # a retry of the last report: same answer
    deltas = [torch.full((workers[0].params.numel,), float(2 * rank)) for rank in range(2)]
    pool = futures.ThreadPoolExecutor(2)
    replies = [
        pool.submit(clients[rank].push_update, ServerPush(Kind.DELTA, workers[rank].params.views(deltas[rank]), 0),
                    new_push_id())
        for rank in range(2)
    ]
    assert [reply.result(timeout=30).version for reply in replies] == [1, 1]
    model = clients[0].fetch_model(ServerPull())
    assert torch.allclose(workers[0].params.flatten(model.tensors), workers[0].w + 1.0)
    assert [e["event"] for e in read_log(run_dir)][-1] == "round"


def raw_push(coordinator, frames, push_id: str | None = "x") -> grpc.RpcError:
    metadata = ((PUSH_ID_HEADER, push_id),) if push_id else ()
    with pytest.raises(grpc.RpcError) as failure:
        coordinator.stub.PsPush(iter(frames), timeout=10, metadata=metadata)
    return failure.value


def test_the_server_refuses_streams_it_cannot_accept_and_keeps_its_model(coordinator):
    raw = spec_of("asgd", 2)
    job_id, nodes, run_dir = coordinator.job(raw)
    spec = parse_job_spec(raw)
    alg = worker_of(spec, 0)
    good = Message(Kind.GRADIENT, 0, 2, alg.params.views(torch.ones(alg.params.numel)))

    def frames(message=good, node=nodes[0], job=job_id):
        return list(encode(message, job_id=job, sender_id=node, chunk_bytes=4096))

    cases = [
        (raw_push(coordinator, frames(), push_id=None), grpc.StatusCode.INVALID_ARGUMENT, "peertrain-push-id"),
        (raw_push(coordinator, frames(node=nodes[1])), grpc.StatusCode.PERMISSION_DENIED, "does not hold rank 0"),
        (raw_push(coordinator, frames(job="nope")), grpc.StatusCode.FAILED_PRECONDITION, "is not running"),
        (raw_push(coordinator, frames()[:-1]), grpc.StatusCode.INVALID_ARGUMENT, "truncated"),
        (raw_push(coordinator, frames(Message(Kind.DELTA, 0, 2, good.tensors))), grpc.StatusCode.INVALID_ARGUMENT,
         "asgd pushes gradient, not delta"),
        (raw_push(coordinator, frames(Message(Kind.GRADIENT, 0, 1, good.tensors))), grpc.StatusCode.INVALID_ARGUMENT,
         "goes to rank 2"),
        (raw_push(coordinator, frames(Message(Kind.GRADIENT, 0, 2, {"w": torch.ones(3)}))),
         grpc.StatusCode.INVALID_ARGUMENT, "expected 2 tensors"),
        (raw_push(coordinator, frames(Message(Kind.GRADIENT, 0, 2, alg.params.views(
            torch.full((alg.params.numel,), float("nan")))))), grpc.StatusCode.INVALID_ARGUMENT, "non-finite"),
        (raw_push(coordinator, frames(Message(Kind.GRADIENT, 0, 2, good.tensors, model_version=7)), push_id="y"),
         grpc.StatusCode.INVALID_ARGUMENT, "worker version 7 is not in 0..0"),
    ]
    for error, code, detail in cases:
        assert error.code() == code and detail in error.details(), (error.code(), error.details())
    model = coordinator.client(job_id, nodes[0], 0, 2, alg).fetch_model(ServerPull())
    assert model.version == 0 and torch.equal(alg.params.flatten(model.tensors), alg.w)
    assert not Path(run_dir, "ps-log.jsonl").read_text()
    with pytest.raises(grpc.RpcError) as failure:
        list(coordinator.stub.PsPull(pb.PsPullRequest(job_id=job_id, rank=1, node_id=nodes[0]), timeout=10))
    assert failure.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_dcasgd_after_a_restart_rejects_a_push_whose_backup_was_not_kept_and_recovers(coordinator):
    raw = spec_of("dc-asgd", 2, options={"adaptive": True})
    job_id, nodes, run_dir = coordinator.job(raw)
    spec = parse_job_spec(raw)
    alg = worker_of(spec, 0)
    client = coordinator.client(job_id, nodes[0], 0, 2, alg)

    def push(version: int) -> pb.PsPushReply:
        grad = torch.full((alg.params.numel,), 0.1)
        return client.push_update(ServerPush(Kind.GRADIENT, alg.params.views(grad), version, clock=version),
                                  new_push_id())

    assert push(0).version == 1
    assert client.fetch_model(ServerPull()).version == 1  # backup of version 1, not yet on disk
    coordinator.stop()
    coordinator.service = None
    Path(run_dir, "ps-tables.pt").unlink(missing_ok=True)  # as if the coordinator died before writing them
    coordinator.start()
    client = coordinator.client(job_id, nodes[0], 0, 2, alg)
    rejected = push(1)
    assert "last pulled version 0" in rejected.rejected and rejected.version == 1
    assert client.fetch_model(ServerPull(1)).version == 1
    assert push(1).version == 2


def test_a_1e30_gradient_is_clipped_to_max_update_norm_and_counted(coordinator):
    raw = spec_of("asgd", 2, options={"max_update_norm": 1.0})
    job_id, nodes, run_dir = coordinator.job(raw)
    spec = parse_job_spec(raw)
    alg = worker_of(spec, 0)
    client = coordinator.client(job_id, nodes[0], 0, 2, alg)
    huge = torch.full((alg.params.numel,), 1e30)
    reply = client.push_update(ServerPush(Kind.GRADIENT, alg.params.views(huge), 0), new_push_id())
    assert reply.applied and reply.version == 1
    model = alg.params.flatten(client.fetch_model(ServerPull()).tensors)
    assert bool(torch.isfinite(model).all())
    moved = float(torch.linalg.vector_norm((model - alg.w).double()))
    assert math.isclose(moved, 0.05 * 1.0, rel_tol=1e-4)  # lr * max_update_norm
    sample = coordinator.service.metrics.registry.get_sample_value
    assert sample("peertrain_ps_updates_clipped_total", {"job_id": job_id}) == 1
    assert [e["clipped"] for e in read_log(run_dir) if e["event"] == "push"] == [True]


def test_nonfinite_pushes_are_refused_counted_and_leave_the_model(coordinator):
    raw = spec_of("adacomp", 2, options={"codec": "fp16"})
    job_id, nodes, _ = coordinator.job(raw)
    spec = parse_job_spec(raw)
    alg = worker_of(spec, 0)
    sizes = alg.params.sizes
    # An fp16 payload whose one value is +inf: the decoder cannot see into it, the server's sparse decoding does.
    payload = bytearray(compress(torch.ones(sum(sizes)), sizes, 0.01, Codec.FP16)[0])
    payload[-2:] = b"\x00\x7c"  # the last value, a little-endian float16, becomes +inf
    sparse = Message(Kind.GRADIENT, 0, 2, {"payload": torch.frombuffer(payload, dtype=torch.uint8)})
    error = raw_push(coordinator, list(encode(sparse, job_id=job_id, sender_id=nodes[0])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "non_finite" in error.details()
    model = coordinator.client(job_id, nodes[0], 0, 2, alg).fetch_model(ServerPull())
    assert model.version == 0 and torch.equal(alg.params.flatten(model.tensors), alg.w)
    sample = coordinator.service.metrics.registry.get_sample_value
    assert sample("peertrain_stream_rejections_total",
                  {"src": "unknown", "dst": "coordinator", "reason": "non_finite"}) == 1

    raw = spec_of("asgd", 2)
    job_id, nodes, _ = coordinator.job(raw)
    alg = worker_of(parse_job_spec(raw), 0)
    for value in (math.nan, math.inf):
        dense = Message(Kind.GRADIENT, 0, 2, alg.params.views(torch.full((alg.params.numel,), value)))
        error = raw_push(coordinator, list(encode(dense, job_id=job_id, sender_id=nodes[0])))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "non_finite" in error.details()
    assert sample("peertrain_stream_rejections_total",
                  {"src": "unknown", "dst": "coordinator", "reason": "non_finite"}) == 3
    model = coordinator.client(job_id, nodes[0], 0, 2, alg).fetch_model(ServerPull())
    assert model.version == 0 and torch.equal(alg.params.flatten(model.tensors), alg.w)


def test_an_oversized_push_manifest_is_refused_before_it_is_parsed_and_counted(coordinator):
    coordinator.job(spec_of("asgd", 2))
    identity = lambda data: data  # noqa: E731
    push = coordinator.channel.stream_unary("/peertrain.v1.Coordinator/PsPush", request_serializer=identity,
                                            response_deserializer=identity)
    with pytest.raises(grpc.RpcError) as error:
        # About 110 000 tensor headers in 3 MB (this test's server keeps gRPC's default limit of 4 MiB a message).
        push(iter([manifest_frame_bytes(3)]), timeout=30, metadata=((PUSH_ID_HEADER, "x"),))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error.value.details().startswith("too_large")
    assert coordinator.service.metrics.registry.get_sample_value(
        "peertrain_stream_rejections_total", {"src": "unknown", "dst": "coordinator", "reason": "too_large"}) == 1


def test_a_quarantined_workers_pushes_are_ignored_until_it_is_released(coordinator):
    """`coordinator quarantine JOB NODE`: the server takes the worker's update as zero (the model stays), and the
    worker's pushes count again once released."""
    raw = spec_of("asgd", 2)
    job_id, nodes, _ = coordinator.job(raw)
    spec = parse_job_spec(raw)
    alg = worker_of(spec, 0)
    client = coordinator.client(job_id, nodes[0], 0, 2, alg)
    start = alg.params.flatten(client.fetch_model(ServerPull()).tensors)
    gradient = alg.params.views(torch.full((alg.params.numel,), 0.1))
    reply = coordinator.stub.Quarantine(pb.QuarantineRequest(job_id=job_id, node=nodes[0]), timeout=5)
    assert reply.rank == 0 and "its pushes are ignored" in reply.outcome
    client.push_update(ServerPush(Kind.GRADIENT, gradient, 0), new_push_id())
    assert torch.equal(alg.params.flatten(client.fetch_model(ServerPull()).tensors), start)
    status = coordinator.stub.JobStatus(pb.JobStatusRequest(job_id=job_id))
    assert status.nodes[0].quarantined and status.nodes[0].state == "quarantined"
    coordinator.stub.Quarantine(pb.QuarantineRequest(job_id=job_id, node="0", release=True), timeout=5)
    client.push_update(ServerPush(Kind.GRADIENT, gradient, 1, clock=1), new_push_id())
    assert not torch.equal(alg.params.flatten(client.fetch_model(ServerPull()).tensors), start)
