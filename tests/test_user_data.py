"""Jobs on the users' own data: a CIFAR-10-format directory and a directory of NumPy arrays train in the simulator
and on real agents, peer to peer and through the parameter server (whose model the coordinator shapes from the data
the agents describe), and `coordinator inspect` shows their data and shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from datafiles import learnable, write_cifar10, write_npy

from coordinator.cli import main as coordinator_main
from coordinator.display import progress_of
from coordinator.simulate import simulate
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.jobspec import load_job_file, parse_job_spec

pytestmark = pytest.mark.cluster

CLASSES = {"cifar10": 10, "npy": 3}


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory) -> dict[str, Path]:
    """Learnable data in both formats: 3x32x32 pixels of 10 classes as CIFAR-10's files; 6x6 floating samples of 3
    classes as NumPy arrays."""
    root = tmp_path_factory.mktemp("user-data")
    train = learnable(300, (3, 32, 32), 10, seed=1)
    write_cifar10(root / "cifar", train, learnable(100, (3, 32, 32), 10, seed=2))
    x, y = learnable(300, (6, 6), 3, seed=3, spread=20.0)
    test_x, test_y = learnable(100, (6, 6), 3, seed=4, spread=20.0)
    write_npy(root / "npy", (x.astype(np.float32) / 10, y), (test_x.astype(np.float32) / 10, test_y))
    return {"cifar10": root / "cifar", "npy": root / "npy"}


PEER = {"name": "dsgd", "mode": "sync", "lr": 0.05}
SERVER = {"name": "asgd", "lr": 0.05}


def job(kind: str, data_dir: Path, split: str = "iid", algorithm: dict = PEER) -> dict:
    return {
        "name": f"{kind}-{algorithm['name']}", "nodes": 2, "steps": 60, "eval_every": 30, "seed": 0,
        "algorithm": algorithm,
        "model": {"name": "logistic"},
        "data": {"dataset": kind, "data_dir": str(data_dir), "split": split, "batch_size": 20},
        "topology": {"kind": "ring"},
    }


@pytest.mark.parametrize("algorithm", [PEER, SERVER], ids=["peer", "server"])
@pytest.mark.parametrize("kind", ["cifar10", "npy"])
def test_a_job_on_the_users_data_learns_in_the_simulator(data_dirs, kind, algorithm):
    result = simulate(parse_job_spec(job(kind, data_dirs[kind], algorithm=algorithm)))
    assert result.mesh.finished
    # Chance is 1/10 and 1/3.
    assert result.mean_accuracy > 0.8, result.mean_accuracy


def test_jobs_on_the_users_data_learn_on_agents(cluster, data_dirs):
    # No --data-dir on the agents: each job's data.data_dir is read.
    submitted = {kind: cluster.submit(yaml.safe_dump(job(kind, data_dirs[kind]))) for kind in CLASSES}
    submitted["npy, parameter server"] = cluster.submit(yaml.safe_dump(job("npy", data_dirs["npy"],
                                                                           algorithm=SERVER)))
    for kind, job_id in submitted.items():
        status = cluster.wait(job_id, timeout_s=120)
        assert status.state == pb.JOB_FINISHED, (kind, status.message)
        accuracies = [node.test_accuracy for node in progress_of(status)]
        assert [node.step for node in status.nodes] == [60, 60]
        assert min(accuracies) > 0.8, (kind, accuracies)


@pytest.mark.parametrize(("kind", "shape", "train", "test"), [("cifar10", "3x32x32", 300, 100),
                                                              ("npy", "6x6", 300, 100)])
def test_inspect_shows_the_data_and_the_shards(data_dirs, tmp_path, capsys, kind, shape, train, test):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job(kind, tmp_path / "elsewhere", split="by-class")))
    assert coordinator_main(["inspect", str(path), "--data-dir", str(data_dirs[kind])]) == 0
    lines = capsys.readouterr().out.splitlines()
    classes = CLASSES[kind]
    assert f"dataset {kind} in {data_dirs[kind]}: input {shape}, {classes} classes, {train} training and {test} " \
           "test samples" in lines
    header = lines.index(f"split by-class of {kind} ({train} training samples):") + 1
    assert lines[header].split() == ["node", "samples", *(f"L{label}" for label in range(classes))]
    assert [int(line.split()[1]) for line in lines[header + 1 : header + 3]] == [150, 150]


def test_the_ecl_isvr_cifar10_job_file_runs_on_cifar10_files(data_dirs):
    """The ECL-ISVR paper's second table (deploy/jobs/ecl-cifar10-resnet32.yaml: ResNet-32 with GroupNorm on CIFAR-10,
    8 nodes, class-window split) runs as shipped, but for its length, on files of the CIFAR-10 binary format."""
    shipped = load_job_file(Path(__file__).parents[1] / "deploy" / "jobs" / "ecl-cifar10-resnet32.yaml").spec
    data = shipped.data.model_copy(update={"data_dir": str(data_dirs["cifar10"]), "batch_size": 8, "test_limit": 20})
    spec = shipped.model_copy(update={"steps": 2, "eval_every": 2, "data": data})
    result = simulate(spec)
    assert result.mesh.finished and [sim.node.algorithm.clock for sim in result.mesh.nodes] == [2] * 8
    model = result.mesh.nodes[0].node.algorithm.model
    assert sum(p.numel() for p in model.parameters()) == 466_906  # ResNet-32 for 3x32x32 inputs and 10 classes
