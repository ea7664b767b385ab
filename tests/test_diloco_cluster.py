"""DiLoCo on real agents: each variant trains on 4 agents and counts the bytes of its syncs, and an outsider's
calls to the jobs' rendezvous store are refused while the jobs finish."""

import threading

import grpc
import pytest
import yaml
from clusters import agents_up
from devices import DEVICES
from hostile import channel_as, listening_ports
from test_diloco import MODEL_BYTES

from coordinator.ca import ClusterCA
from coordinator.cluster import LocalCluster
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc
from nodeagent.algorithms.diloco import FINAL_ROUNDS_FACTOR
from nodeagent.runtime.progress import ring_allgather_bytes
from nodeagent.security.pki import Role
from nodeagent.security.tls import TlsDir

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module", params=DEVICES)
def cluster(request, tmp_path_factory, four_agents):
    """Four agents on one device: on the CPU the shared cluster (four_agents), on a GPU four that share it."""
    if request.param == "cpu":
        yield agents_up(four_agents)
        return
    with LocalCluster(root=tmp_path_factory.mktemp("diloco"), agents=4, device=request.param) as running:
        yield running

@pytest.mark.parametrize(("algorithm", "options", "topology", "per_sync"), [
    ("diloco", {"inner_steps": 20, "precision": "int8", "fragments": 2, "overlap_steps": 2}, "ring",
     ring_allgather_bytes(MODEL_BYTES // 4 // 2 + 4, 4)),
    # gossip: 2 pushes a sync (the last: FINAL_ROUNDS_FACTOR times 2), each the outer momentum in bf16 and the
    # global parameters in float32
    ("diloco-gossip", {"inner_steps": 20, "precision": "bf16"}, "npeer-exponential",
     2 * (MODEL_BYTES // 2 + MODEL_BYTES)),
    ("diloco-ps", {"inner_steps": 20, "precision": "int8"}, "ring", MODEL_BYTES // 4 + 4),
])
def test_diloco_trains_on_agents(cluster, fashion_mnist_dir, algorithm, options, topology, per_sync):
    """4 agents on loopback, 4 outer rounds: the job finishes, every rank learned, and its bytes are those of its
    syncs (the gloo all-gather's, the pushes' over the peer transport, or the pushes to the coordinator)."""
    spec = {
        "name": algorithm, "nodes": 4, "steps": 80, "eval_every": 40,
        "algorithm": {"name": algorithm, "lr": 1e-3, "options": options},
        "model": {"name": "logistic"},
        "data": {"data_dir": str(fashion_mnist_dir), "split": "iid", "batch_size": 32, "test_limit": 500},
        "topology": {"kind": topology, "seed": 1},
    }
    status = cluster.wait(cluster.submit(yaml.safe_dump(spec)), timeout_s=180)
    assert status.state == pb.JOB_FINISHED
    syncs = 80 // options["inner_steps"] * options.get("fragments", 1)
    for node in status.nodes:
        assert node.step == 80
        assert node.test_accuracy > 0.6, f"rank {node.rank} reached only {node.test_accuracy}"
        if algorithm != "diloco-gossip":
            assert node.bytes_sent == syncs * per_sync
        else:  # the final report may come before the last sync's pushes are counted: they travel as the job ends
            pushes, rest = divmod(node.bytes_sent, per_sync // 2)
            assert rest == 0 and (syncs - 1) * 2 <= pushes <= (syncs - 1) * 2 + FINAL_ROUNDS_FACTOR * 2


def test_an_allreduce_and_a_diloco_job_finish_while_an_outsider_attacks_their_rendezvous(cluster, fashion_mnist_dir):
    """What an outsider did to the open rendezvous store (list its keys, bump the knock counter, give up every quorum
    ahead of the members, pre-write gloo's keys of the next quorums, store large values), tried all along two jobs
    with a node certificate of the cluster that holds no rank, with an operator's, and without one: every call is
    refused, both jobs finish, and the coordinator listens on no port but its gRPC, enrollment and metrics ports."""
    outsider = cluster.root / "outsider-tls"
    if not TlsDir(outsider).complete():
        ClusterCA.load(cluster.root / "coordinator").issue_files(TlsDir(outsider), Role.NODE, "outsider")
    data = {"data_dir": str(fashion_mnist_dir), "split": "iid", "batch_size": 32, "test_limit": 500}
    jobs = [cluster.submit(yaml.safe_dump({
        "name": algorithm, "nodes": 2, "steps": 60, "eval_every": 60, "algorithm": {"name": algorithm, **options},
        "model": {"name": "logistic"}, "data": data}))
        for algorithm, options in (("allreduce", {"lr": 0.05}),
                                   ("diloco", {"lr": 1e-3, "options": {"inner_steps": 20, "precision": "int8"}}))]
    callers = {"a node of no job": channel_as(cluster.address, outsider, "coordinator"),
               "an operator": channel_as(cluster.address, cluster.operator_tls, "coordinator"),
               "no certificate": channel_as(cluster.address, None, "coordinator", ca=cluster.operator_tls)}
    answers: dict[str, set[str]] = {who: set() for who in callers}
    done = threading.Event()

    def attack() -> None:
        stubs = {who: coordinator_pb2_grpc.CoordinatorStub(channel) for who, channel in callers.items()}
        number = 0
        while not done.wait(0.2):
            for job_id in jobs:
                for request in (
                    pb.RendezvousRequest(job_id=job_id, op=pb.RENDEZVOUS_CHECK, keys=["next", "knocks"]),
                    pb.RendezvousRequest(job_id=job_id, op=pb.RENDEZVOUS_ADD, keys=["knocks"], amount=1),
                    *(pb.RendezvousRequest(job_id=job_id, op=pb.RENDEZVOUS_COMPARE_SET, keys=[f"q/{n}/members"],
                                           value=b"-") for n in range(number, number + 40)),
                    *(pb.RendezvousRequest(job_id=job_id, op=pb.RENDEZVOUS_SET, keys=[f"q/{n}/pg//0/{r}"],
                                           value=b"garbage") for n in range(number, number + 40) for r in (0, 1)),
                    pb.RendezvousRequest(job_id=job_id, op=pb.RENDEZVOUS_SET, keys=["big"], value=bytes(60_000)),
                ):
                    for who, stub in stubs.items():
                        try:
                            stub.Rendezvous(request, timeout=5)
                            answers[who].add("OK")
                        except grpc.RpcError as error:
                            answers[who].add(error.code().name)
            number += 1

    attacker = threading.Thread(target=attack)
    attacker.start()
    try:
        statuses = [cluster.wait(job_id, timeout_s=240) for job_id in jobs]
    finally:
        done.set()
        attacker.join()
    for status in statuses:
        assert status.state == pb.JOB_FINISHED, status.reason
        assert all(node.step == 60 for node in status.nodes)
    assert answers == {"a node of no job": {"PERMISSION_DENIED"}, "an operator": {"PERMISSION_DENIED"},
                       "no certificate": {"UNAVAILABLE"}}
    coordinator_ports = {int(address.rsplit(":", 1)[1])
                         for address in (cluster.address, cluster.enroll_address, cluster.metrics_address)}
    assert listening_ports(cluster.processes["coordinator"].pid) == coordinator_ports
