"""The shared cluster of the cluster tests (conftest's `four_agents`): how a test gets it with every agent up."""

from __future__ import annotations

import time

from coordinator.cluster import LocalCluster


def agents_up(cluster: LocalCluster) -> LocalCluster:
    """`cluster` with every agent registered: one that a test before killed and left down is started again."""
    for index in range(cluster.agents):
        process = cluster.processes.get(f"agent-{index}")
        if process is None or process.poll() is not None:
            cluster.start_agent(index)
    cluster.wait_for_nodes(cluster.agents, time.monotonic() + 120)
    return cluster
