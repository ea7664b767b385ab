"""Data per dataset on each machine (issue 27, item 1): an agent maps dataset kinds and names to its own
directories (nodeagent.training.datadirs), and a node that does not have a job's data fails the job at its start
barrier, naming the node and the dataset."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.control.memory import MemoryState
from coordinator.control.plane import ControlPlane, JobEnded
from coordinator.control.states import JobState, MemberState
from nodeagent.agent.runner import missing_data_text
from nodeagent.cli import build_parser
from nodeagent.jobspec import DataSpec, parse_job_spec
from nodeagent.training.data import DataError
from nodeagent.training.datadirs import DataDirs, DataDirsError

pytestmark = pytest.mark.unit


def data(dataset: str = "fashion-mnist", data_dir: str = "/usr/share/datasets/fashion-mnist") -> DataSpec:
    return DataSpec(dataset=dataset, data_dir=data_dir)


def test_each_dataset_kind_reads_its_own_directory(tmp_path: Path) -> None:
    dirs = DataDirs.parse([f"fashion-mnist={tmp_path / 'fmnist'}", f"cifar10={tmp_path / 'cifar'}"])
    assert dirs.directory_for(data()) == str(tmp_path / "fmnist")
    assert dirs.directory_for(data("cifar10", "/var/lib/peertrain/data/cifar-10-batches-bin")) == \
        str(tmp_path / "cifar")
    # A kind nobody mapped reads the job's own directory, not another dataset's.
    assert dirs.directory_for(data("npy", "/srv/features")) == "/srv/features"


def test_a_name_maps_one_dataset_of_a_kind_that_has_many(tmp_path: Path) -> None:
    dirs = DataDirs.parse([f"npy={tmp_path / 'any-npy'}", f"imagenette={tmp_path / 'imagenette'}"])
    assert dirs.directory_for(data("image-folder", "/srv/imagenette")) == str(tmp_path / "imagenette")
    assert dirs.directory_for(data("npy", "/srv/other")) == str(tmp_path / "any-npy")


def test_a_root_holds_one_directory_per_dataset_and_a_mapping_comes_first(tmp_path: Path) -> None:
    for name in ("fashion-mnist", "cifar10", "cifar-10-batches-bin"):
        (tmp_path / name).mkdir()
    dirs = DataDirs.parse([], root=str(tmp_path))
    assert dirs.directory_for(data()) == str(tmp_path / "fashion-mnist")
    # The directory named as the job's data_dir comes before the kind's.
    assert dirs.directory_for(data("cifar10", "/x/cifar-10-batches-bin")) == str(tmp_path / "cifar-10-batches-bin")
    assert dirs.directory_for(data("cifar10", "/x/elsewhere")) == str(tmp_path / "cifar10")
    # Nothing under the root: the job's own directory; nothing anywhere: the first place looked (the loader says
    # it is missing).
    (tmp_path / "own" / "mnist").mkdir(parents=True)
    assert dirs.directory_for(data("mnist", str(tmp_path / "own" / "mnist"))) == str(tmp_path / "own" / "mnist")
    assert dirs.directory_for(data("mnist", "/nowhere/mnist")) == str(tmp_path / "mnist")
    mapped = DataDirs.parse(["fashion-mnist=/mapped"], root=str(tmp_path))
    assert mapped.directory_for(data()) == "/mapped"  # a mapping is final, even when missing
    assert mapped.candidates(data()) == ["/mapped"]


def test_the_old_bare_form_serves_every_dataset_only_after_the_mappings(tmp_path: Path) -> None:
    (tmp_path / "all").mkdir()
    dirs = DataDirs.parse([str(tmp_path / "all"), f"cifar10={tmp_path / 'cifar'}"])
    assert dirs.directory_for(data("cifar10")) == str(tmp_path / "cifar")
    assert dirs.directory_for(data("npy", "/nowhere/features")) == str(tmp_path / "all")


@pytest.mark.parametrize("entries, fragment", [
    (["=/data"], "expected KIND=DIR"),
    (["cifar10="], "expected KIND=DIR"),
    (["a/b=/data"], "expected KIND=DIR"),
    (["cifar10=/a", "cifar10=/b"], "mapped to '/a' already"),
    (["/a", "/b"], "a second directory for every dataset"),
])
def test_entries_that_cannot_be_read_are_refused_naming_them(entries: list[str], fragment: str) -> None:
    with pytest.raises(DataDirsError, match=fragment):
        DataDirs.parse(entries)


def test_the_command_line_and_the_environment_take_the_same_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["serve", "--data-dir", "fashion-mnist=/data/fmnist", "--data-dir",
                                      "cifar10=/data/cifar10", "--data-root", "/data"])
    from_flags = DataDirs.parse(args.data_dir, args.data_root)
    monkeypatch.setenv("PEERTRAIN_DATA_DIR", "fashion-mnist=/data/fmnist, cifar10=/data/cifar10")
    monkeypatch.setenv("PEERTRAIN_DATA_ROOT", "/data")
    from_env = build_parser().parse_args(["serve"])
    assert from_env.data_dir == []
    assert DataDirs.from_text(from_env.data_dir_env, from_env.data_root) == from_flags
    assert from_flags.by_dataset == {"fashion-mnist": "/data/fmnist", "cifar10": "/data/cifar10"}


def test_a_node_without_the_jobs_data_fails_it_at_the_start_barrier_naming_node_and_dataset() -> None:
    now = [1000.0]
    state = MemoryState(lambda: now[0])
    plane = ControlPlane(state, lambda: now[0], 15.0)
    for node in ("a", "b"):
        state.register_node(f"node-{node}", f"worker-{node}", f"127.0.0.1:700{ord(node) % 10}", "", "cpu", "1", "",
                            0)
    spec = parse_job_spec({"name": "t", "nodes": 2, "steps": 10, "topology": {"kind": "ring"},
                           "data": {"dataset": "cifar10", "data_dir": "/data/cifar10"}})
    state.add_job("job1", spec, "", "/runs/job1")
    plane.submitted()
    assert state.job("job1").state == JobState.RUNNING
    members = {m.rank: m.node_id for m in state.members("job1")}
    missing = missing_data_text(spec, DataDirs.parse([], root="/srv/data"),
                                DataError("/data/cifar10: no such directory"))
    assert missing.startswith("no data for dataset cifar10 (looked in /srv/data/cifar10, /data/cifar10)")
    accepted, effects = plane.data_missing("job1", 1, members[1], missing)
    assert accepted
    job = state.job("job1")
    assert job.state == JobState.FAILED
    node = members[1]
    assert job.reason.startswith(f"start barrier: rank 1 (node {node}, worker-{node[-1]}) has no data for dataset "
                                 "cifar10")
    assert any(isinstance(e, JobEnded) for e in effects)
    assert {m.rank: m.state for m in state.members("job1")}[1] == MemberState.FAILED
    # A node that does not hold the rank changes nothing.
    assert plane.data_missing("job1", 0, "node-x", missing) == (False, [])
