"""The shared cluster of the cluster tests (conftest's `four_agents`): how a test gets it with every agent up."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from coordinator.cluster import LocalCluster
from nodeagent.agent.checkpoint import checkpoint_path


def agents_up(cluster: LocalCluster) -> LocalCluster:
    """`cluster` with every agent registered: one that a test before killed and left down is started again."""
    for index in range(cluster.agents):
        process = cluster.processes.get(f"agent-{index}")
        if process is None or process.poll() is not None:
            cluster.start_agent(index)
    cluster.wait_for_nodes(cluster.agents, time.monotonic() + 120)
    return cluster


def final_checkpoint(state_dir: Path, job_id: str, rank: int) -> dict:
    """A rank's last checkpoint, of a job that keeps its checkpoints (`checkpoint: {keep: true}`), which stays on
    its agent after the job ended."""
    return torch.load(checkpoint_path(state_dir, job_id, rank, keep=True), weights_only=True)
