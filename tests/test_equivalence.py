"""The two runtimes drive the same algorithm objects: every deterministic synchronous algorithm ends with the same
parameters on every node whether its job runs on real agents over gRPC or in the simulator."""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from clusters import agents_up, final_checkpoint
from devices import DEVICES

from coordinator.cluster import LocalCluster
from coordinator.simulate import simulate
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.jobspec import parse_job_spec
from nodeagent.training.data import describe_dataset
from nodeagent.training.models import flat_parameters, initial_model

pytestmark = pytest.mark.cluster

STEPS = 40


@dataclass(frozen=True)
class Case:
    algorithm: dict
    # Whether both runtimes do the same float operations in the same order (then the result is bit for bit).
    bit_identical: bool
    # Every node ends with one shared model (a parameter server's, or an all-reduced one); otherwise each keeps its
    # own, which differ on the heterogeneous split.
    shared_model: bool


CASES = {
    "dsgd-sync": Case({"name": "dsgd", "mode": "sync", "momentum": 0.5}, bit_identical=True, shared_model=False),
    # On a ring every node gets two shares per round, so the test depends on SGP absorbing them in sender order.
    "sgp": Case({"name": "sgp"}, bit_identical=True, shared_model=False),
    # The server sums a round's updates, and gloo the all-reduce's, in arrival order, which differs between runs:
    # equal up to float rounding, not bit for bit.
    "ssgd": Case({"name": "ssgd"}, bit_identical=False, shared_model=True),
    "allreduce": Case({"name": "allreduce", "momentum": 0.5}, bit_identical=False, shared_model=True),
    # A robust rule all-gathers the gradients and every member takes their median in rank order: no summation order.
    "allreduce-robust": Case({"name": "allreduce", "momentum": 0.5, "robust": {"rule": "median"}},
                             bit_identical=True, shared_model=True),
}
# Not ESync, even with a huge epsilon: in the first round a worker whose step duration the server has not seen yet
# counts as infinitely slow (nodeagent.ps.esync), so the others run local steps until every worker's first report
# is in, and how many depends on when each agent started.


@pytest.fixture(scope="module", params=DEVICES)
def cluster(request, tmp_path_factory, four_agents):
    """Four agents on one device: on the CPU the shared cluster (four_agents), on a GPU four that share it."""
    if request.param == "cpu":
        yield agents_up(four_agents)
        return
    with LocalCluster(root=tmp_path_factory.mktemp("equivalence"), agents=4, device=request.param) as running:
        yield running

def job_of(case: Case, fashion_mnist_dir: Path) -> dict:
    return {
        "name": "equivalence", "nodes": 4, "steps": STEPS, "eval_every": 20, "seed": 7,
        "algorithm": {"lr": 0.05, **case.algorithm},
        "model": {"name": "logistic"},
        "data": {"data_dir": str(fashion_mnist_dir), "split": "class-window", "batch_size": 32, "test_limit": 500},
        "topology": {"kind": "ring", "seed": 2},
        "checkpoint": {"keep": True},  # read after the job ended (agent_states)
    }


def agent_states(cluster: LocalCluster, status: pb.JobStatusReply) -> dict[int, dict]:
    """Every rank's final checkpoint, by rank."""
    names = {n.node_id: n.name for n in cluster.nodes()}
    states = {}
    for member in status.nodes:
        states[member.rank] = final_checkpoint(cluster.root / names[member.node_id], status.job_id, member.rank)
    return states


@pytest.mark.parametrize("case_name", list(CASES))
def test_agents_end_with_the_simulators_parameters(cluster, fashion_mnist_dir, case_name):
    case = CASES[case_name]
    job = job_of(case, fashion_mnist_dir)
    status = cluster.wait(cluster.submit(yaml.safe_dump(job)), timeout_s=180)
    assert status.state == pb.JOB_FINISHED
    states = agent_states(cluster, status)
    assert sorted(states) == [0, 1, 2, 3]

    spec = parse_job_spec(job)
    mesh = simulate(spec, device=torch.device(cluster.device)).mesh
    initial = flat_parameters(initial_model(spec, describe_dataset(spec.data.dataset, fashion_mnist_dir)))
    for sim in mesh.nodes:
        rank = sim.node.rank
        state, simulated = states[rank], sim.node.algorithm.w.cpu()  # checkpoints hold host tensors
        assert state["clock"] == STEPS
        if mesh.server is not None:
            assert state["version"] == STEPS  # a round of the server per step
        # On a GPU the same operations in the same order need not round alike: cuBLAS may pick another kernel
        # for the same product from one process to the next.
        if case.bit_identical and cluster.device == "cpu":
            assert torch.equal(state["w"], simulated), (
                f"rank {rank} differs by {(state['w'] - simulated).abs().max().item():.3g}"
            )
        else:
            assert torch.allclose(state["w"], simulated, rtol=0, atol=1e-5), (
                f"rank {rank} differs by {(state['w'] - simulated).abs().max().item():.3g}"
            )
        assert not torch.allclose(state["w"], initial, atol=1e-3), f"rank {rank} did not train"

    final = [states[rank]["w"] for rank in range(4)]
    if case.shared_model:
        simulated_final = [sim.node.algorithm.w.cpu() for sim in mesh.nodes]
        assert all(torch.equal(w, simulated_final[0]) for w in simulated_final)
        if mesh.server is not None:
            assert torch.equal(simulated_final[0], mesh.server.half.w)
    else:
        # Heterogeneous data: the nodes did not all end at the same point, so the comparison is per node.
        assert any(not torch.allclose(final[0], w, atol=1e-4) for w in final[1:])
