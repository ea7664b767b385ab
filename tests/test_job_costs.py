"""Bounds on what a job costs the coordinator (issue 27, item 6): its monitor's work each second does not grow with
the ended jobs it keeps, and it keeps only the newest --keep-jobs ended jobs' records."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from coordinator.control.states import JobState
from coordinator.service import CoordinatorConfig, CoordinatorService
from nodeagent.jobspec import parse_job_yaml
from nodeagent.metrics import Metrics

pytestmark = pytest.mark.unit

PADDING = "#" + "x" * (64 * 1024) + "\n"  # an operator's comment: a large spec (the were 1 MiB)


def coordinator(state_dir: Path, ended: int, keep_jobs: int = 0) -> CoordinatorService:
    """A coordinator (not serving, its monitor not started) with two nodes, `ended` ended jobs of large specs and
    one running job."""
    service = CoordinatorService(CoordinatorConfig(state_dir=state_dir, keep_jobs=keep_jobs), Metrics())
    store = service.store
    for node in ("a", "b"):
        store.register_node(node, node, f"127.0.0.1:{7000 + ord(node)}", "", "cpu", "1", "", 0)
    for index in range(ended + 1):
        spec_yaml = yaml.safe_dump({"name": f"job{index}", "nodes": 2, "steps": 10,
                                    "topology": {"kind": "ring"}}) + PADDING
        job_id = f"job{index}"
        run_dir = service.config.run_root / job_id
        run_dir.mkdir(parents=True)
        store.add_job(job_id, parse_job_yaml(spec_yaml), spec_yaml, str(run_dir))
        store.start_job(job_id, ["a", "b"])
        if index < ended:
            store.end_job(job_id, JobState.STOPPED, "stopped by an operator")
    return service


def jobs_read_per_tick(service: CoordinatorService, monkeypatch: pytest.MonkeyPatch) -> int:
    """How many job rows the monitor's second (the rules' tick, then the gauges) reads from the state."""
    store = service.store
    read = store._job
    count = [0]

    def counting(row: tuple):
        count[0] += 1
        return read(row)

    monkeypatch.setattr(store, "_job", counting)
    service._control(service.plane.tick)
    service._update_gauges()
    monkeypatch.setattr(store, "_job", read)
    return count[0]


def test_the_monitor_reads_only_live_jobs_however_many_ended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """60 stopped jobs of large specs kept an idle coordinator busy: every second the gauges read every ended job,
    and each query walked every row (its spec, stored before the state) to find the live ones."""
    few, many = coordinator(tmp_path / "few", ended=0), coordinator(tmp_path / "many", ended=60)
    try:
        assert jobs_read_per_tick(many, monkeypatch) == jobs_read_per_tick(few, monkeypatch) > 0
        assert many.metrics.coordinator_jobs.labels("stopped")._value.get() == 60
        assert many.metrics.coordinator_jobs.labels("running")._value.get() == 1
        # The live jobs are found by an index: SQLite reads no ended job's row to find them.
        plan = many.store._query("EXPLAIN QUERY PLAN SELECT job_id FROM jobs WHERE state IN ('RUNNING') "
                                 "ORDER BY created_unix")
        assert any("USING INDEX jobs_by_state" in str(row) or "USING COVERING INDEX jobs_by_state" in str(row)
                   for row in plan), plan
    finally:
        few.store.close()
        many.store.close()


def test_the_coordinator_keeps_the_records_of_the_newest_keep_jobs_ended_jobs(tmp_path: Path) -> None:
    service = coordinator(tmp_path, ended=5, keep_jobs=2)
    try:
        service._retire_ended_jobs()  # as a job ends
        assert [job.job_id for job in service.store.all_jobs(100)] == ["job5", "job4", "job3"]
        assert sorted(path.name for path in service.config.run_root.iterdir()) == ["job3", "job4", "job5"]
    finally:
        service.store.close()
