"""MemoryState: the ControlState in memory, the twin of SqliteState (the same conformance test passes on both).
Policy tests and the simulator run the control plane on it; nothing survives the process."""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable

from coordinator.control.records import Job, MemberRow, NodeRow, Readiness, Specs
from coordinator.control.state import ControlState
from coordinator.control.states import ACTIVE_JOB_STATES, JobState, MemberState, check_job_move, check_member_move
from coordinator.control.traffic import TrafficLedger
from nodeagent.jobspec import JobSpec
from nodeagent.runtime.progress import Progress


@dataclasses.dataclass
class _Member:
    row: MemberRow
    ready_unix: float = 0.0
    left_unix: float = 0.0
    traffic: TrafficLedger = dataclasses.field(default_factory=TrafficLedger)


class MemoryState(ControlState):
    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._specs = Specs()
        self._lock = threading.Lock()
        self._nodes: dict[str, NodeRow] = {}
        self._jobs: dict[str, Job] = {}  # in the order added
        self._members: dict[str, dict[int, _Member]] = {}  # by job, then rank
        # Per job, its members not ready yet: a ready report is counted off, not found by a walk over every member
        # (10,000 simulated ranks report ready at once).
        self._not_ready: dict[str, int] = {}
        self._order = itertools.count()  # ties of created_unix keep the order added, as SQLite's rowid does

    def close(self) -> None:
        pass

    # -- nodes ---------------------------------------------------------------------------------------------------

    def register_node(self, node_id: str, name: str, peer_address: str, metrics_address: str, device: str,
                      version: str, device_name: str, device_memory_bytes: int) -> str:
        now = self.clock()
        with self._lock:
            known = self._nodes.get(node_id) if node_id else None
            if known is not None:
                self._nodes[node_id] = dataclasses.replace(
                    known, name=name, peer_address=peer_address, metrics_address=metrics_address, device=device,
                    version=version, last_seen_unix=now, up=True, device_name=device_name,
                    device_memory_bytes=device_memory_bytes)
                return node_id
            node_id = node_id or f"node-{uuid.uuid4().hex[:8]}"
            self._nodes[node_id] = NodeRow(node_id, name, peer_address, metrics_address, device, version, now, now,
                                           True, False, device_name, device_memory_bytes)
            return node_id

    def touch_node(self, node_id: str) -> tuple[bool, bool]:
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                return False, False
            self._nodes[node_id] = dataclasses.replace(node, last_seen_unix=self.clock(), up=True)
            return True, not node.up

    def mark_silent_nodes_down(self, timeout_s: float) -> list[str]:
        cutoff = self.clock() - timeout_s
        with self._lock:
            silent = [n for n in self._nodes.values() if n.up and n.last_seen_unix < cutoff]
            for node in silent:
                self._nodes[node.node_id] = dataclasses.replace(node, up=False)
        return [n.node_id for n in silent]

    def nodes(self) -> list[NodeRow]:
        with self._lock:  # those registered at the same time in the order registered (a stable sort)
            return sorted(self._nodes.values(), key=lambda n: n.registered_unix)

    def node(self, node_id: str) -> NodeRow | None:
        return self._nodes.get(node_id)

    def mark_down(self, node_id: str) -> bool:
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None or not node.up:
                return False
            self._nodes[node_id] = dataclasses.replace(node, up=False)
            return True

    def set_draining(self, node_id: str, draining: bool) -> bool:
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                return False
            self._nodes[node_id] = dataclasses.replace(node, draining=draining)
            return True

    def remove_node(self, node_id: str) -> None:
        with self._lock:
            self._nodes.pop(node_id, None)

    # -- jobs ----------------------------------------------------------------------------------------------------

    def add_job(self, job_id: str, spec: JobSpec, spec_yaml: str, run_dir: str) -> None:
        with self._lock:
            if job_id in self._jobs:
                raise KeyError(f"job {job_id} exists")
            self._specs.add(job_id, spec)
            self._jobs[job_id] = Job(job_id, spec.name, spec, spec, spec_yaml, JobState.PENDING, spec.min_nodes,
                                     self.clock(), run_dir)
            self._members[job_id] = {}
            self._not_ready[job_id] = 0

    def job(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def _by_age(self) -> list[Job]:
        """Every job, oldest first (those created at the same time in the order added)."""
        return sorted(self._jobs.values(), key=lambda job: job.created_unix)

    def latest_job(self) -> Job | None:
        with self._lock:
            jobs = self._by_age()
        return jobs[-1] if jobs else None

    def find_job(self, reference: str) -> Job | None:
        with self._lock:
            if reference in self._jobs:
                return self._jobs[reference]
            named = [job for job in self._by_age() if job.name == reference]
            if named:
                return named[-1]
            prefixed = [job for job in self._jobs.values() if job.job_id.startswith(reference)]
        return prefixed[0] if len(prefixed) == 1 else None

    def job_ids_starting(self, prefix: str, limit: int) -> list[str]:
        with self._lock:
            return [job.job_id for job in self._by_age()[::-1] if job.job_id.startswith(prefix)][:limit]

    def all_jobs(self, limit: int) -> list[Job]:
        with self._lock:
            return self._by_age()[::-1][:limit]

    def jobs(self, states: Iterable[JobState]) -> list[Job]:
        wanted = {JobState(state) for state in states}
        with self._lock:
            return [job for job in self._by_age() if job.state in wanted]

    def job_counts(self) -> dict[JobState, int]:
        with self._lock:
            counts: dict[JobState, int] = {}
            for job in self._jobs.values():
                counts[job.state] = counts.get(job.state, 0) + 1
            return counts

    def ended_job_ids(self) -> list[str]:
        with self._lock:
            order = {job_id: index for index, job_id in enumerate(self._jobs)}
            ended = [job for job in self._jobs.values() if job.state not in ACTIVE_JOB_STATES]
        return [job.job_id for job in sorted(ended, key=lambda job: (job.ended_unix, order[job.job_id]),
                                             reverse=True)]

    def delete_job(self, job_id: str) -> bool:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.state in ACTIVE_JOB_STATES:
                return False
            del self._jobs[job_id]
            self._members.pop(job_id, None)
            self._not_ready.pop(job_id, None)
            self._specs.forget(job_id)
            return True

    def _replace(self, job: Job, **changes: object) -> None:
        changed = dataclasses.replace(job, **changes)  # type: ignore[arg-type]
        self._jobs[job.job_id] = dataclasses.replace(changed, running_spec=self._specs.running(
            job.job_id, changed.spec, changed.topology_json, changed.topology_version))

    def end_job(self, job_id: str, state: JobState, reason: str = "") -> bool:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.state not in ACTIVE_JOB_STATES:
                return False
            check_job_move(job_id, job.state, state)
            self._replace(job, state=state, reason=reason, ended_unix=self.clock())
            return True

    def change_topology(self, job_id: str, topology_json: str, version: int, switch_step: int) -> bool:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.state != JobState.RUNNING or job.topology_version != version - 1:
                return False
            self._replace(job, topology_json=topology_json, topology_version=version, switch_step=switch_step)
            return True

    def set_pending_reason(self, job_id: str, reason: str) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None and job.state == JobState.PENDING:
                self._replace(job, reason=reason)

    def start_job(self, job_id: str, node_ids: list[str]) -> None:
        with self._lock:
            job = self._jobs.get(job_id)
            check_job_move(job_id, job.state if job else JobState.FAILED, JobState.RUNNING)
            assert job is not None
            members = self._members[job_id]
            for rank, node_id in enumerate(node_ids):
                if rank in members:
                    raise KeyError(f"job {job_id} has a rank {rank}")
                members[rank] = _Member(MemberRow(job_id, rank, node_id, Progress(job_id, rank, node_id)))
            self._not_ready[job_id] += len(node_ids)
            self._replace(job, state=JobState.RUNNING, reason="", started_unix=self.clock(),
                          world_size=len(node_ids))

    def change_members(self, job_id: str, version: int, switch_step: int, joined: list[tuple[int, str]],
                       left: list[int]) -> bool:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.state != JobState.RUNNING or job.topology_version != version - 1:
                return False
            members = self._members[job_id]
            for rank in left:
                if rank in members:
                    check_member_move(job_id, rank, members[rank].row.state, MemberState.LEFT)
            now = self.clock()
            for rank in left:
                member = members.get(rank)
                if member is not None and not member.left_unix:
                    member.left_unix = now
                    member.row = dataclasses.replace(member.row, left=True)
                    self._not_ready[job_id] -= not member.ready_unix
            for rank, node_id in joined:
                replaced = members.get(rank)
                if replaced is not None and not replaced.left_unix and not replaced.ready_unix:
                    self._not_ready[job_id] -= 1
                members[rank] = _Member(MemberRow(job_id, rank, node_id, Progress(job_id, rank, node_id),
                                                 joined_step=switch_step))
                self._not_ready[job_id] += 1
            self._replace(job, topology_version=version, switch_step=switch_step,
                          world_size=sum(not m.left_unix for m in members.values()))
            return True

    # -- members -------------------------------------------------------------------------------------------------

    def _held(self, job_id: str, rank: int, node_id: str) -> _Member | None:
        member = self._members.get(job_id, {}).get(rank)
        return member if member is not None and member.row.node_id == node_id and not member.left_unix else None

    def record_failure(self, job_id: str, rank: int, node_id: str, reason: str) -> bool:
        with self._lock:
            member = self._held(job_id, rank, node_id)
            if member is None:
                return False
            check_member_move(job_id, rank, member.row.state, MemberState.FAILED)
            member.row = dataclasses.replace(member.row, failure=reason)
            return True

    def mark_ready(self, job_id: str, rank: int, node_id: str, data_json: str) -> Readiness | None:
        with self._lock:
            job = self._jobs.get(job_id)
            member = self._held(job_id, rank, node_id)
            if job is None or job.state != JobState.RUNNING or member is None:
                return None
            agreed, released = job.data_json or data_json, job.released_unix > 0
            if agreed != data_json:
                return Readiness(agreed, released, released_now=False)
            now = self.clock()
            if not member.ready_unix:
                member.ready_unix = now
                member.row = dataclasses.replace(member.row, ready=True)
                self._not_ready[job_id] -= 1
            released_now = not released and not self._not_ready[job_id]
            self._replace(job, data_json=agreed, released_unix=now if released_now else job.released_unix)
            return Readiness(agreed, released or released_now, released_now)

    def busy_node_ids(self) -> set[str]:
        with self._lock:
            return {m.row.node_id for job in self._jobs.values() if job.state == JobState.RUNNING
                    for m in self._members[job.job_id].values() if not m.left_unix}

    def members(self, job_id: str, with_left: bool = False) -> list[MemberRow]:
        with self._lock:
            members = self._members.get(job_id, {})
            return [members[rank].row for rank in sorted(members) if with_left or not members[rank].left_unix]

    def running_membership(self, node_id: str) -> tuple[Job, int] | None:
        with self._lock:
            for job in self._jobs.values():
                if job.state != JobState.RUNNING:
                    continue
                for rank, member in self._members[job.job_id].items():
                    if member.row.node_id == node_id and not member.left_unix:
                        return job, rank
        return None

    def record_progress(self, progress: Progress) -> Progress | None:
        with self._lock:
            member = self._held(progress.job, progress.rank, progress.node)
            if member is None:
                return None
            progress = member.traffic.add(progress)
            previous = member.row.progress
            # As the SQLite state keeps them: the figures of the last evaluation stay until the next, and nothing
            # of the report's live edges or waits is stored.
            stored = dataclasses.replace(
                progress,
                test_accuracy=previous.test_accuracy if math.isnan(progress.test_accuracy) else progress.test_accuracy,
                test_loss=previous.test_loss if math.isnan(progress.test_loss) else progress.test_loss,
                test_perplexity=(previous.test_perplexity if math.isnan(progress.test_perplexity)
                                 else progress.test_perplexity),
                edges=(), waiting_for="")
            member.row = dataclasses.replace(member.row, progress=stored)
            return progress
