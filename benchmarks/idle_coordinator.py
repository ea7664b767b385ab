"""An idle coordinator's CPU per monitor second (the rules' tick, then the gauges) with no ended jobs and with 60
stopped jobs of 1 MiB specs (issue 27: 0.275 s of CPU per second with 60 such jobs, 0.008 without). Prints both
beside BEFORE, the figure this benchmark measured at the commit before the fix on the same machine.

    .venv/bin/python benchmarks/idle_coordinator.py [--jobs 60] [--seconds 20]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import yaml

from coordinator.control.states import JobState
from coordinator.service import CoordinatorConfig, CoordinatorService
from nodeagent.jobspec import MAX_JOB_BYTES, parse_job_yaml
from nodeagent.metrics import Metrics

BEFORE = "0.49 s per second with 60 stopped 1 MiB jobs (a3194dc, a shared 2-core machine)"


def cpu_per_monitor_second(ended: int, seconds: int) -> float:
    with tempfile.TemporaryDirectory() as root:
        service = CoordinatorService(CoordinatorConfig(state_dir=Path(root)), Metrics())
        store = service.store
        for index in range(ended):
            text = yaml.safe_dump({"name": f"job{index}", "nodes": 1, "steps": 10})
            text += "#" + "x" * (MAX_JOB_BYTES - len(text) - 2) + "\n"  # an operator's comment: a 1 MiB spec
            store.add_job(f"job{index}", parse_job_yaml(text), text, str(Path(root) / f"job{index}"))
            store.end_job(f"job{index}", JobState.STOPPED, "stopped by an operator")
        service._update_gauges()
        start = time.process_time()
        for _ in range(seconds):
            service._control(service.plane.tick)
            service._update_gauges()
        spent = (time.process_time() - start) / seconds
        store.close()
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=60, help="stopped 1 MiB jobs (default %(default)s)")
    parser.add_argument("--seconds", type=int, default=20, help="monitor seconds timed (default %(default)s)")
    args = parser.parse_args()
    none, many = cpu_per_monitor_second(0, args.seconds), cpu_per_monitor_second(args.jobs, args.seconds)
    print(f"CPU per monitor second: {none:.4f} s with no ended job, {many:.4f} s with {args.jobs} stopped 1 MiB "
          f"jobs (before: {BEFORE})")


if __name__ == "__main__":
    main()
