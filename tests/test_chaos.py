"""The chaos harness (coordinator/chaos.py) on stand-in processes: schedules parsed and checked, faults begun and
ended in time order, what is in force undone on exit, and only the cluster's own processes signalled."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from coordinator.chaos import Chaos, Fault, Kind, PrivateNetworkCluster, check_schedule
from coordinator.cluster import LocalCluster

pytestmark = pytest.mark.integration


def state_of(process: subprocess.Popen) -> str:
    """The process's state letter in /proc: T stopped; S or R (just woken) running."""
    return Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


class SleeperCluster(LocalCluster):
    """A LocalCluster whose agents are `sleep` processes: what the harness signals, nothing else."""

    def start_agent(self, index: int) -> None:
        self.processes[f"agent-{index}"] = subprocess.Popen(["sleep", "120"])


@dataclass
class PartitionedSleepers(SleeperCluster, PrivateNetworkCluster):
    """Partitions recorded, not made: the network is PrivateNetworkCluster's business (tests/test_chaos_cluster.py)."""

    cuts: list[object] = field(default_factory=list)

    def partition(self, groups) -> None:
        self.cuts.append(("partition", tuple(map(tuple, groups))))

    def heal(self) -> None:
        self.cuts.append(("heal",))


@pytest.fixture
def sleepers(tmp_path):
    cluster = SleeperCluster(root=tmp_path, agents=3)
    for index in range(3):
        cluster.start_agent(index)
    yield cluster
    for process in cluster.processes.values():
        process.kill()
        process.wait()


def test_faults_are_parsed_and_printed_alike():
    assert Fault.parse("partition 0,1/2,3 at 10 for 20") == Fault(Kind.PARTITION, 10, 20, groups=((0, 1), (2, 3)))
    assert Fault.parse("kill 5 at 30 for 10.5") == Fault(Kind.KILL, 30, 10.5, agent=5)
    for text in ("stop 2 at 1.5 for 3", "partition 0,1,2/3 at 0 for 1"):
        assert str(Fault.parse(text)) == text
    for bad in ("stop 2 at 1", "pause 2 at 1 for 2", "partition 0,1 at 1 for 2", "partition 0,1/1,2 at 1 for 2",
                "stop 2 at -1 for 2", "stop 2 at 1 for 0", "kill x at 1 for 2", "stop 2 at nan for 1"):
        with pytest.raises(ValueError):
            Fault.parse(bad)


def test_a_schedule_is_refused_for_unknown_agents_and_overlapping_faults():
    check_schedule([Fault.parse("stop 1 at 0 for 5"), Fault.parse("kill 1 at 5 for 5"),
                    Fault.parse("partition 0/1 at 2 for 2"), Fault.parse("partition 0/2 at 4 for 2")], agents=3)
    for faults in ([Fault.parse("stop 3 at 0 for 5")], [Fault.parse("partition 0/3 at 0 for 5")],
                   [Fault.parse("stop 1 at 0 for 5"), Fault.parse("kill 1 at 4 for 5")],
                   [Fault.parse("partition 0/1 at 0 for 5"), Fault.parse("partition 0/2 at 4 for 5")]):
        with pytest.raises(ValueError):
            check_schedule(faults, agents=3)


def test_partitions_need_a_private_network(sleepers):
    with pytest.raises(ValueError, match="PrivateNetworkCluster"):
        Chaos(sleepers, [Fault.parse("partition 0/1 at 0 for 1")])


def test_the_schedule_runs_in_time_order(sleepers):
    first_pid = sleepers.processes["agent-0"].pid
    faults = [Fault.parse("kill 0 at 0.6 for 0.4"), Fault.parse("stop 1 at 0 for 0.5"),
              Fault.parse("stop 2 at 0.5 for 0.3")]
    with Chaos(sleepers, faults) as chaos:
        time.sleep(0.25)
        assert state_of(sleepers.processes["agent-1"]) == "T"
        assert chaos.wait(10)
    assert [(a.action, a.fault) for a in chaos.record] == [
        ("stop", "stop 1 at 0 for 0.5"), ("cont", "stop 1 at 0 for 0.5"), ("stop", "stop 2 at 0.5 for 0.3"),
        ("kill", "kill 0 at 0.6 for 0.4"), ("cont", "stop 2 at 0.5 for 0.3"), ("restart", "kill 0 at 0.6 for 0.4")]
    expected_at = [0, 0.5, 0.5, 0.6, 0.8, 1.0]
    assert all(want <= action.at_s < want + 0.5 for want, action in zip(expected_at, chaos.record, strict=True))
    assert chaos.record[3].detail == f"pid {first_pid}"
    assert sleepers.processes["agent-0"].pid != first_pid and sleepers.processes["agent-0"].poll() is None
    assert "T" not in [state_of(sleepers.processes[f"agent-{i}"]) for i in (1, 2)]
    assert chaos.errors == []


def test_what_is_in_force_is_undone_on_exit_even_after_a_failure(tmp_path, sleepers):
    with pytest.raises(AssertionError), Chaos(sleepers, [Fault.parse("stop 1 at 0 for 60")]) as chaos:
        time.sleep(0.3)
        assert state_of(sleepers.processes["agent-1"]) == "T"
        raise AssertionError("the test failed while agent 1 was stopped")
    assert state_of(sleepers.processes["agent-1"]) != "T"
    assert [(a.action, a.detail) for a in chaos.record] == [
        ("stop", f"pid {sleepers.processes['agent-1'].pid}"), ("cont", f"pid {sleepers.processes['agent-1'].pid} "
                                                                       "on exit")]
    cluster = PartitionedSleepers(root=tmp_path / "p", agents=4, network=None)
    with Chaos(cluster, [Fault.parse("partition 0,1/2,3 at 0 for 60")]):
        time.sleep(0.3)
        assert cluster.cuts == [("partition", ((0, 1), (2, 3)))]
    assert cluster.cuts == [("partition", ((0, 1), (2, 3))), ("heal",)]


def test_only_the_clusters_own_running_processes_are_signalled(sleepers):
    stranger = subprocess.Popen(["sleep", "120"])  # not the cluster's: never touched
    try:
        sleepers.processes["agent-2"].kill()
        sleepers.processes["agent-2"].wait()  # an agent that has exited: its pid may be someone else's by now
        with Chaos(sleepers, [Fault.parse("stop 2 at 0 for 0.2"), Fault.parse("kill 2 at 0.3 for 0.2")]) as chaos:
            assert chaos.wait(10)
        assert [(a.action, a.detail) for a in chaos.record] == [
            ("skipped", "agent 2 is not running"), ("skipped", "agent 2 is not running")]
        assert sleepers.processes["agent-2"].poll() is not None  # nor was a kill's restart made for it
        assert state_of(stranger) != "T" and stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()
