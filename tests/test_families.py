"""Every decentralized family on real agents over gRPC: 4 agent processes on loopback, one short job each."""

import math

import pytest
import yaml

from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.runtime.progress import read_run_log

pytestmark = pytest.mark.cluster

FAMILIES = {
    "dsgd-sync": ({"name": "dsgd", "mode": "sync"}, {"kind": "ring"}),
    "pdmm-isvr": ({"name": "pdmm-isvr", "interval": 4}, {"kind": "ring"}),
    "admm-isvr": ({"name": "admm-isvr", "interval": 4}, {"kind": "ring"}),
    "gossip": ({"name": "gossip", "options": {"interpolation": "loss"}}, {"kind": "ring"}),
    "sgp": ({"name": "sgp"}, {"kind": "dynamic-exponential"}),
    "osgp": ({"name": "osgp"}, {"kind": "dynamic-exponential"}),
    "ad-psgd": ({"name": "ad-psgd"}, {"kind": "bipartite-exponential"}),
    "allreduce": ({"name": "allreduce"}, {"kind": "ring"}),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_over_grpc(cluster, fashion_mnist_dir, family):
    algorithm, topology = FAMILIES[family]
    job = {
        "name": family, "nodes": 4, "steps": 200, "eval_every": 100,
        "algorithm": {"lr": 0.02, **algorithm},
        "model": {"name": "logistic"},
        "data": {"data_dir": str(fashion_mnist_dir), "split": "iid", "batch_size": 50, "test_limit": 1000},
        "topology": {"seed": 1, **topology},
    }
    status = cluster.wait(cluster.submit(yaml.safe_dump(job)), timeout_s=180)
    assert status.state == pb.JOB_FINISHED
    assert [n.step for n in status.nodes] == [200] * 4
    for node in status.nodes:
        assert node.test_accuracy > 0.5, f"rank {node.rank} reached only {node.test_accuracy}"
        assert node.bytes_sent > 0 or node.bytes_received > 0
    records = read_run_log(status.run_dir)
    first = {r.rank: r.test_accuracy for r in records if r.step == 0 and not math.isnan(r.test_accuracy)}
    assert all(first[n.rank] + 0.2 < n.test_accuracy for n in status.nodes)
    assert not any(math.isnan(n.loss) for n in status.nodes)
