"""Retention: what the agents keep of ended jobs' checkpoints (nodeagent.agent.checkpoint.retire_checkpoints) and
what the coordinator keeps of ended jobs' run directories (coordinator.service.retire_run_dirs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coordinator.control.memory import MemoryState
from coordinator.control.states import JobState
from coordinator.service import retire_run_dirs
from nodeagent.agent.checkpoint import CHECKPOINTS_DIR, KEPT_DIR, checkpoint_path, retire_checkpoints
from nodeagent.jobspec import parse_job_spec

pytestmark = pytest.mark.unit


def checkpoints(state_dir: Path, jobs: list[str], ranks: int = 2) -> None:
    """Checkpoints of `jobs`, written in that order (the last the newest)."""
    for age, job in enumerate(reversed(jobs)):
        for rank in range(ranks):
            path = checkpoint_path(state_dir, job, rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"checkpoint")
            os.utime(path, (1_000_000 - age, 1_000_000 - age))


def jobs_left(state_dir: Path, where: str = "") -> set[str]:
    return {path.name.rsplit("-rank", 1)[0] for path in (state_dir / CHECKPOINTS_DIR / where).glob("*.pt")}


def test_an_ended_jobs_checkpoints_are_deleted_and_the_running_jobs_kept(tmp_path):
    checkpoints(tmp_path, ["old-1", "running-2", "ended-3"])
    deleted = retire_checkpoints(tmp_path, running="running-2")
    assert jobs_left(tmp_path) == {"running-2"}
    assert len(deleted) == 4


def test_keep_checkpoints_keeps_the_jobs_whose_checkpoints_were_written_last(tmp_path):
    checkpoints(tmp_path, ["job-a", "job-b", "job-c", "job-d"])
    retire_checkpoints(tmp_path, keep_jobs=2)
    assert jobs_left(tmp_path) == {"job-c", "job-d"}
    retire_checkpoints(tmp_path, keep_jobs=2, running="job-a")  # a running job counts not among the kept
    assert jobs_left(tmp_path) == {"job-c", "job-d"}


def test_a_job_that_keeps_its_checkpoints_writes_them_where_retention_never_looks(tmp_path):
    kept = checkpoint_path(tmp_path, "kept-job", 0, keep=True)
    assert kept.parent == tmp_path / CHECKPOINTS_DIR / KEPT_DIR
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"checkpoint")
    checkpoints(tmp_path, ["other"])
    retire_checkpoints(tmp_path)
    assert jobs_left(tmp_path) == set() and jobs_left(tmp_path, KEPT_DIR) == {"kept-job"}


def test_a_write_cut_short_is_swept_too_and_a_missing_directory_is_nothing_to_do(tmp_path):
    checkpoints(tmp_path, ["resumed"])
    (tmp_path / CHECKPOINTS_DIR / "cut-short-rank0.tmp").write_bytes(b"half")
    (tmp_path / CHECKPOINTS_DIR / "resumed-rank0.tmp").write_bytes(b"half")  # the running job's: left to it
    retire_checkpoints(tmp_path, running="resumed")
    assert jobs_left(tmp_path) == {"resumed"}
    assert [path.name for path in (tmp_path / CHECKPOINTS_DIR).glob("*.tmp")] == ["resumed-rank0.tmp"]
    assert retire_checkpoints(tmp_path / "nothing-here") == []


def test_the_coordinator_keeps_the_run_directories_of_the_newest_ended_jobs(tmp_path):
    clock = iter(range(100, 200))
    store = MemoryState(clock=lambda: float(next(clock)))
    runs = tmp_path / "runs"
    outside = tmp_path / "elsewhere"
    for index, (state, run_dir) in enumerate([(JobState.FINISHED, runs / "j0"), (JobState.FAILED, runs / "j1"),
                                              (JobState.STOPPED, outside), (JobState.FINISHED, runs / "j3"),
                                              (JobState.RUNNING, runs / "j4"), (JobState.FINISHED, runs / "j5")]):
        run_dir.mkdir(parents=True)
        store.add_job(f"j{index}", parse_job_spec({"name": f"j{index}", "nodes": 1}), "", str(run_dir))
        store.start_job(f"j{index}", [f"node-{index}"])
        if state != JobState.RUNNING:
            store.end_job(f"j{index}", state)
    assert retire_run_dirs(store, runs, keep=0) == []  # 0: keep all
    removed = retire_run_dirs(store, runs, keep=2)
    # The newest ended are j5 and j3; j2's directory is not under the runs directory, j4 still runs.
    assert removed == [("j1", (runs / "j1").resolve()), ("j0", (runs / "j0").resolve())]
    assert sorted(path.name for path in runs.iterdir()) == ["j3", "j4", "j5"] and outside.is_dir()
    assert store.job("j0") is not None  # the job stays listed
