"""A trained model taken home: `coordinator export` of a peer-to-peer, a parameter-server and an all-reduce job on real
agents, each file loaded in plain PyTorch (torch.load with weights_only, the model rebuilt from the manifest's name
and options, load_state_dict) and evaluated to the job's own final metric; `coordinator report --model` evaluates it
the same, and a job started from the file (`model.init`) starts at its model. And retention: once a job ended, its
checkpoints are gone from the agents unless the job keeps them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import yaml

from coordinator.cli import main as coordinator_main
from coordinator.cluster import LocalCluster
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.agent.checkpoint import CHECKPOINTS_DIR, KEPT_DIR
from nodeagent.jobspec import ModelSpec
from nodeagent.training.data import load_dataset
from nodeagent.training.loop import evaluate
from nodeagent.training.models import build_model

pytestmark = pytest.mark.cluster

TEST_LIMIT = 500
RETIRE_WAIT_S = 15.0  # the agents hear of the job's end on their assignment stream


def run_job(cluster: LocalCluster, data_dir: Path, name: str, algorithm: dict, **fields) -> pb.JobStatusReply:
    spec = {"name": f"export-{name}", "nodes": 4, "steps": 40, "eval_every": 20, "algorithm": {"lr": 0.05, **algorithm},
            "model": {"name": "logistic"}, "topology": {"kind": "ring"},
            "data": {"data_dir": str(data_dir), "split": "iid", "batch_size": 50, "test_limit": TEST_LIMIT}}
    spec.update(fields)
    status = cluster.wait(cluster.submit(yaml.safe_dump(spec)), timeout_s=120)
    assert status.state == pb.JOB_FINISHED, status.reason
    return status


def export(cluster: LocalCluster, job_id: str, out: Path, *extra: str) -> Path:
    assert coordinator_main(["export", job_id, "--out", str(out), *extra, "--coordinator", cluster.address,
                             "--tls-dir", str(cluster.operator_tls)]) == 0
    return out


def load_and_evaluate(path: Path, data_dir: Path) -> tuple[float, dict, dict]:
    """What a user does with the file: plain torch.load, the model rebuilt from its manifest, load_state_dict."""
    saved = torch.load(path, weights_only=True)
    manifest, state_dict = saved["manifest"], saved["state_dict"]
    model = build_model(ModelSpec(**manifest["model"]), tuple(manifest["data"]["input_shape"]),
                        manifest["data"]["num_classes"])
    model.load_state_dict(state_dict)
    test = load_dataset(manifest["data"]["dataset"], data_dir, "test", manifest["data"]["test_limit"])
    return evaluate(model, test).accuracy, manifest, state_dict


def final_accuracy(status: pb.JobStatusReply, rank: int) -> float:
    return next(node.test_accuracy for node in status.nodes if node.rank == rank)


def checkpoints_of(cluster: LocalCluster, job_id: str, where: str = "") -> list[Path]:
    return [path for index in range(cluster.agents)
            for path in (cluster.state_dir(index) / CHECKPOINTS_DIR / where).glob(f"{job_id}-rank*.pt")]


def wait_for_no_checkpoints(cluster: LocalCluster, job_id: str) -> list[Path]:
    deadline = time.monotonic() + RETIRE_WAIT_S
    while (left := checkpoints_of(cluster, job_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_a_peer_to_peer_job_exports_each_rank_and_their_mean(cluster, fashion_mnist_dir, tmp_path, capsys):
    status = run_job(cluster, fashion_mnist_dir, "dsgd", {"name": "dsgd", "interval": 2})
    ranks = {}
    for rank in range(4):
        accuracy, manifest, state_dict = load_and_evaluate(
            export(cluster, status.job_id, tmp_path / f"rank{rank}.pt", "--rank", str(rank)), fashion_mnist_dir)
        assert accuracy == pytest.approx(final_accuracy(status, rank), abs=1e-6)
        assert manifest["source"] == f"rank {rank}" and manifest["step"] == 40
        ranks[rank] = state_dict
    accuracy, manifest, mean = load_and_evaluate(export(cluster, status.job_id, tmp_path / "mean.pt"),
                                                 fashion_mnist_dir)
    assert manifest["source"] == "the mean of the models of ranks 0..3" and manifest["ranks"] == [0, 1, 2, 3]
    assert list(mean) == list(ranks[0]) == ["1.weight", "1.bias"]  # the model's own keys, shaped as it holds them
    for key, tensor in mean.items():
        assert torch.allclose(tensor, torch.stack([ranks[rank][key] for rank in range(4)]).mean(dim=0), atol=1e-7)
    assert manifest["job_id"] == status.job_id and manifest["algorithm"] == "dsgd"
    assert manifest["model"] == {"name": "logistic", "options": {}}
    assert manifest["data"]["input_shape"] == [1, 28, 28] and manifest["data"]["num_classes"] == 10
    # `report --model` evaluates the file on the job's test set, as the job's nodes evaluate theirs.
    capsys.readouterr()
    assert coordinator_main(["report", "--model", str(tmp_path / "rank2.pt")]) == 0
    assert f"test accuracy {final_accuracy(status, 2):.4f}" in capsys.readouterr().out
    # The job ended: its checkpoints are gone from every agent (none asked to keep them).
    assert wait_for_no_checkpoints(cluster, status.job_id) == []


def test_a_parameter_server_job_exports_the_servers_model(cluster, fashion_mnist_dir, tmp_path):
    status = run_job(cluster, fashion_mnist_dir, "ssgd", {"name": "ssgd"}, topology={"kind": "complete"})
    accuracy, manifest, _ = load_and_evaluate(export(cluster, status.job_id, tmp_path / "server.pt"),
                                              fashion_mnist_dir)
    assert manifest["source"] == "the parameter server" and manifest["step"] == 40
    # Synchronous SGD: every worker's final evaluation is of the server's final model.
    for node in status.nodes:
        assert accuracy == pytest.approx(node.test_accuracy, abs=1e-6)
    assert manifest["metric"]["value"] == pytest.approx(accuracy, abs=1e-6)
    # A job that starts from the file (model.init, read by the agents and by the coordinator's server) and barely
    # moves from it ends at its accuracy; the seeded model is near chance.
    again = run_job(cluster, fashion_mnist_dir, "from-server", {"name": "ssgd", "lr": 1e-9},
                    topology={"kind": "complete"}, steps=4, eval_every=4,
                    model={"name": "logistic", "init": str(tmp_path / "server.pt")})
    assert [node.test_accuracy for node in again.nodes] == pytest.approx([accuracy] * 4, abs=1e-6)


def test_an_all_reduce_job_exports_rank_0_and_keeps_the_checkpoints_it_asks_to(cluster, fashion_mnist_dir, tmp_path):
    status = run_job(cluster, fashion_mnist_dir, "allreduce", {"name": "allreduce"}, checkpoint={"keep": True})
    accuracy, manifest, _ = load_and_evaluate(export(cluster, status.job_id, tmp_path / "allreduce.pt"),
                                              fashion_mnist_dir)
    assert manifest["source"] == "rank 0" and manifest["metric"]["value"] == final_accuracy(status, 0)
    assert accuracy == pytest.approx(final_accuracy(status, 0), abs=1e-6)
    kept = checkpoints_of(cluster, status.job_id, KEPT_DIR)
    assert sorted(path.name for path in kept) == [f"{status.job_id}-rank{rank}.pt" for rank in range(4)]
    # A job that ended after it (any job: the agents sweep when one ends) leaves them there.
    later = run_job(cluster, fashion_mnist_dir, "after-kept", {"name": "allreduce"}, steps=4, eval_every=4)
    assert wait_for_no_checkpoints(cluster, later.job_id) == []
    assert sorted(checkpoints_of(cluster, status.job_id, KEPT_DIR)) == sorted(kept)
    for path in kept:
        path.unlink()
