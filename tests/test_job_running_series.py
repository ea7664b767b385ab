"""peertrain_coordinator_job_running{job_id}: one series per running job, gone once the job ends. The per-job
PeertrainJobStalled alert (deploy/prometheus/alerts.yml, unit-tested with promtool in tests/test_deploy.py) joins
the agents' step counters on it, so a stalled job fires even while other jobs step on."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from coordinator.control.states import JobState
from coordinator.service import CoordinatorConfig, CoordinatorService
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.metrics import Metrics

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def running_series(metrics: Metrics, job_id: str, expected: float | None) -> float | None:
    """The job's series once the coordinator's monitor (every second) shows `expected`, or what it shows after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        value = metrics.registry.get_sample_value("peertrain_coordinator_job_running", {"job_id": job_id})
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def test_each_running_job_has_a_series_until_it_ends(tmp_path: Path) -> None:
    metrics = Metrics()
    service = CoordinatorService(CoordinatorConfig(state_dir=tmp_path), metrics)
    service.start()
    try:
        spec = (ROOT / "deploy" / "jobs" / "demo.yaml").read_text()
        first, second = (service.SubmitJob(pb.SubmitJobRequest(spec_yaml=spec), None).job_id for _ in range(2))
        assert running_series(metrics, first, None) is None, "a pending job is not running"
        service.store.start_job(first, ["n0", "n1", "n2", "n3"])
        service.store.start_job(second, ["n4", "n5", "n6", "n7"])
        assert running_series(metrics, first, 1.0) == 1.0
        assert running_series(metrics, second, 1.0) == 1.0
        service.store.end_job(first, JobState.FINISHED)
        assert running_series(metrics, first, None) is None, "an ended job keeps its series"
        assert running_series(metrics, second, 1.0) == 1.0
    finally:
        service.stop()
