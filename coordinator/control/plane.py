"""ControlPlane: the coordinator's rules, sans I/O. It takes events (a node registered, came back, left or was
drained; a job was submitted, stopped, reported ready, finished or failed; a topology change was asked for; time
passed) against a ControlState and a clock, and returns effects (assignments changed, a job was released or ended,
an event to write). It never calls the servicer: the servicer turns calls into events and effects into replies,
streams and the closing of a job's rendezvous or parameter server, as the node driver's caller does with its
decisions.

Where each rule lives: scheduling (`_schedule`, `_grow_elastic_jobs`, `wait_reason`), the start barrier (`ready`,
`_review_start_barriers`), the failure policy (`_review_running_jobs`, `failed`), elastic replanning (`_replan`,
`drained`), the switch step of a topology change (`switch_step`, `topology_requested`) and each member's place in its
job's graph (`plan`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.control.records import Job, MemberRow, NodeRow
from coordinator.control.state import ControlState
from coordinator.control.states import JobState, MemberState
from coordinator.jobs import (
    NodePlan,
    check_topology_changes,
    plan_member,
    validate_membership,
    validate_topology_change,
)
from coordinator.topology import Topology, build_topology
from nodeagent.algorithms import Family, lookup
from nodeagent.jobspec import JobSpec, JobSpecError, TopologySpec
from nodeagent.runtime import events
from nodeagent.runtime.readiness import data_differences, data_from_json, data_to_json
from nodeagent.training.data import DatasetInfo

log = logging.getLogger("coordinator")

# A topology change: every node switches just before the same step, the highest step reported so far plus the
# steps the fastest node takes in SWITCH_LEAD_S (at least MIN_SWITCH_MARGIN_STEPS). Nodes report every second and
# the new assignment reaches them within milliseconds, so a node that has passed the step before it learns of the
# change (it then switches at once, and says so) is one that ran several seconds ahead of its reports.
SWITCH_LEAD_S = 5.0
MIN_SWITCH_MARGIN_STEPS = 10


# -- effects ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AssignmentsChanged:
    """Some node's assignment may differ now: the servicer computes the assignments again and sends those that
    changed."""


@dataclass(frozen=True)
class JobEnded:
    """The job ended (its state holds why): its rendezvous and parameter server close, its live figures go."""

    job: Job
    state: JobState
    reason: str


@dataclass(frozen=True)
class JobEvent:
    """One of the coordinator's own events of a job, to write to its events log."""

    job: Job
    kind: str
    message: str
    level: str = "INFO"


Effect = AssignmentsChanged | JobEnded | JobEvent


@dataclass
class Effects:
    """The effects of one event, in order."""

    items: list[Effect] = field(default_factory=list)

    def add(self, effect: Effect) -> None:
        if not (isinstance(effect, AssignmentsChanged) and effect in self.items):
            self.items.append(effect)


class TopologyRefused(Exception):
    """A topology change the job cannot take now (`precondition`: not now; `aborted`: a race, try again)."""

    def __init__(self, message: str, kind: str = "precondition"):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class ReadyOutcome:
    """What a ready report found: the job released (every rank ready, or no barrier), or not (yet)."""

    running: bool  # the job still runs
    released: bool


@dataclass(frozen=True)
class TopologyChanged:
    version: int
    switch_step: int
    previous_kind: str


class ControlPlane:
    """The coordinator's policy over `state`, on `clock` (Unix seconds). `heartbeat_timeout_s`: how long a node may
    be silent before it is down. After a start, no node is marked down for silence for a timeout's time: its last
    heartbeat went to the coordinator that stopped."""

    def __init__(self, state: ControlState, clock: Callable[[], float], heartbeat_timeout_s: float):
        self.state = state
        self.clock = clock
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._silence_counts_from = clock() + heartbeat_timeout_s
        self._topologies: dict[tuple[str, int], Topology] = {}  # by job and topology version
        self._unplannable: set[tuple[str, int]] = set()  # (elastic job, member count) its graph does not fit
        # Ranks whose data description differs from the job's (the first one reported), by job: rank -> (node, data).
        # They are not marked ready; the job fails once a majority of its ranks is known, naming the minority.
        self._other_data: dict[str, dict[int, tuple[str, DatasetInfo]]] = {}

    # -- events ----------------------------------------------------------------------------------------------------

    def tick(self) -> list[Effect]:
        """Time passed (about a second): start barriers that waited too long fail their jobs, silent nodes are
        down, the failure policy reviews running jobs, and pending jobs start where they fit."""
        effects = Effects()
        self._review_start_barriers(effects)
        if self.clock() >= self._silence_counts_from:
            down = self.state.mark_silent_nodes_down(self.heartbeat_timeout_s)
            if down:
                log.warning("no heartbeat from %s: marked down", ", ".join(down))
                effects.add(AssignmentsChanged())
            self._review_running_jobs(effects)
        self._schedule(effects)
        return effects.items

    def nodes_changed(self) -> list[Effect]:
        """A node registered, came back, left, was removed or put back in service: assignments that name it change,
        and pending jobs may start."""
        effects = Effects([AssignmentsChanged()])
        self._schedule(effects)
        return effects.items

    def submitted(self) -> list[Effect]:
        effects = Effects()
        self._schedule(effects)
        return effects.items

    def stopped(self, job: Job) -> list[Effect]:
        effects = Effects()
        self._end_job(job, JobState.STOPPED, "stopped by an operator", effects)
        return effects.items

    def reported(self, job: Job) -> list[Effect]:
        """A member of `job` reported its last step done: the job finishes when every member has."""
        effects = Effects()
        if job.state == JobState.RUNNING and all(m.progress.finished for m in self.state.members(job.job_id)):
            self._end_job(job, JobState.FINISHED, "", effects)
        return effects.items

    def failed(self, job_id: str, rank: int, node_id: str, reason: str) -> tuple[bool, list[Effect]]:
        """A node cannot build or continue its job: the default policy fails the job. False (and nothing changes)
        when that node does not hold that rank of that job."""
        if not self.state.record_failure(job_id, rank, node_id, reason):
            return False, []
        job = self.state.job(job_id)
        assert job is not None
        effects = Effects()
        self._end_job(job, JobState.FAILED, f"rank {rank} (node {node_id}) failed: {reason}", effects)
        return True, effects.items

    def data_missing(self, job_id: str, rank: int, node_id: str, missing: str) -> tuple[bool, list[Effect]]:
        """A rank cannot start: its node does not have the job's data (`missing`, in the node's words, names the
        dataset and where it looked). The job fails at its start barrier, naming the node and the dataset. False
        (and nothing changes) when that node does not hold that rank of that job."""
        if not self.state.record_failure(job_id, rank, node_id, missing):
            return False, []
        job = self.state.job(job_id)
        assert job is not None
        node = self.state.node(node_id)
        named = node_id if node is None or node.name == node_id else f"{node_id}, {node.name}"
        effects = Effects()
        self._end_job(job, JobState.FAILED, f"start barrier: rank {rank} (node {named}) has {missing}", effects)
        return True, effects.items

    def ready(self, job: Job, rank: int, node_id: str, data: DatasetInfo) -> tuple[ReadyOutcome, list[Effect]]:
        """A rank is ready to start, with its data: the job is released when its last rank is. Ranks whose data
        differ fail the job once a majority of its ranks agree on one description, naming the minority and what
        differs (never simply whoever reported second: a lying first reporter would get an honest rank blamed), or
        once every rank has reported without a majority, naming no culprit."""
        effects = Effects()
        readiness = self.state.mark_ready(job.job_id, rank, node_id, data_to_json(data))
        if readiness is None:  # the job is not running (any more)
            return ReadyOutcome(running=False, released=False), effects.items
        disagreeing = readiness.data_json != data_to_json(data)
        if disagreeing:
            self._other_data.setdefault(job.job_id, {})[rank] = (node_id, data)
        if job.job_id in self._other_data:
            if self._judge_data(job, data_from_json(readiness.data_json), effects):
                return ReadyOutcome(running=False, released=False), effects.items
            if disagreeing:  # not ready: it waits for the verdict (or the barrier's timeout)
                return ReadyOutcome(running=True, released=False), effects.items
        if readiness.released_now:
            effects.add(JobEvent(job, events.RELEASED, f"every rank is ready, {self.clock() - job.started_unix:.2f} "
                                 f"s after the job started: released ({data})"))
            effects.add(AssignmentsChanged())
        return ReadyOutcome(running=True, released=readiness.released or not job.spec.start.barrier), effects.items

    def _judge_data(self, job: Job, first: DatasetInfo, effects: Effects) -> bool:
        """Whether the job failed over its ranks' data descriptions (see `ready`)."""
        members = self.state.members(job.job_id)
        nodes = {m.rank: m.node_id for m in members}
        groups: dict[str, tuple[DatasetInfo, list[int]]] = {data_to_json(first): (first, [m.rank for m in members
                                                                                         if m.ready])}
        for rank, (_node, info) in sorted(self._other_data[job.job_id].items()):
            groups.setdefault(data_to_json(info), (info, []))[1].append(rank)
        reported = sum(len(ranks) for _, ranks in groups.values())
        majority = next(((info, ranks) for info, ranks in groups.values() if 2 * len(ranks) > len(members)), None)

        def named(ranks: list[int]) -> str:
            return f"rank{'s' if len(ranks) > 1 else ''} " + ", ".join(f"{r} (node {nodes.get(r, '?')})"
                                                                         for r in ranks)

        if majority is not None:
            agreed, majority_ranks = majority
            outliers = [(info, ranks) for info, ranks in groups.values() if ranks and ranks is not majority_ranks]
            if not outliers:
                return False
            culprits = sorted(r for _, ranks in outliers for r in ranks)
            differences = "; ".join(dict.fromkeys(d for info, _ in outliers for d in data_differences(info, agreed)))
            reason = (f"{named(culprits)} {'has' if len(culprits) == 1 else 'have'} other data than "
                      f"rank{'s' if len(majority_ranks) > 1 else ''} {', '.join(map(str, majority_ranks))}: "
                      f"{differences}")
        elif reported == len(members):
            described = [(info, ranks) for info, ranks in groups.values() if ranks]
            base = described[0][0]
            differences = "; ".join(dict.fromkeys(d for info, _ in described[1:] for d in data_differences(info, base)))
            reason = (f"no majority of the ranks agrees on the data ({'; '.join(named(r) for _, r in described)} "
                      f"differ): {differences}")
        else:
            return False  # wait: a majority is not known yet
        self._end_job(job, JobState.FAILED, reason, effects)
        return True

    def drained(self, node_id: str) -> list[Effect]:
        """An operator drained a node: it takes no new rank, and a member of an asynchronous elastic job leaves it
        now while at least its least members remain and no change is under way. (A synchronous job's neighbours
        would wait for its rounds: it stays, as in any job, until the job ends.)"""
        effects = Effects([AssignmentsChanged()])
        membership = self.state.running_membership(node_id)
        if membership is not None:
            job = membership[0]
            spec = job.spec
            if spec.elastic and not lookup(spec.algorithm.name).synchronous(spec.algorithm):
                members = self.state.members(job.job_id)
                leaving = [m for m in members if m.node_id == node_id and m.state != MemberState.FAILED]
                if leaving and len(members) - len(leaving) >= spec.min_nodes and not self._change_pending(job, members):
                    self._replan(job, members, [], leaving, "drained by an operator", effects)
        self._schedule(effects)
        return effects.items

    def topology_requested(self, job: Job, topology_spec: TopologySpec) -> tuple[TopologyChanged, list[Effect]]:
        """An operator's topology change of a running job (`coordinator topology`): every node switches just before
        the same step (switch_step). Raises JobSpecError (the topology does not fit the job) or TopologyRefused."""
        self.check_topology_change(job)
        spec = job.running_spec
        validate_topology_change(spec.sized(job.world_size), topology_spec)
        members = self.state.members(job.job_id)
        running = [m.progress for m in members if not m.progress.finished]
        if job.switch_step and running and min(p.step for p in running) < job.switch_step:
            raise TopologyRefused(f"job {job.job_id} has not reached step {job.switch_step} yet, where it switches to "
                                  f"version {job.topology_version} of its topology: change it again once it has")
        switch_step = self.switch_step(members)
        if switch_step >= spec.steps:
            raise TopologyRefused(f"job {job.job_id} ends at step {spec.steps}, before the earliest step its nodes "
                                  f"could all switch at ({switch_step})")
        version = job.topology_version + 1
        if not self.state.change_topology(job.job_id, topology_spec.model_dump_json(), version, switch_step):
            raise TopologyRefused(f"job {job.job_id} ended or changed meanwhile; try again", "aborted")
        message = f"topology {spec.topology.kind} -> {topology_spec.kind} (version {version}) at step {switch_step}"
        log.info("job %s: %s, by an operator", job.job_id, message)
        effects = [JobEvent(job, events.TOPOLOGY, message), AssignmentsChanged()]
        return TopologyChanged(version, switch_step, spec.topology.kind), effects

    @staticmethod
    def check_topology_change(job: Job) -> None:
        """Raises TopologyRefused unless `job` may change its topology at all (it runs, and its algorithm allows)."""
        if job.state != JobState.RUNNING:
            raise TopologyRefused(f"job {job.job_id} is {job.state.event_kind}: only a running job's topology can "
                                  "change")
        try:
            check_topology_changes(job.running_spec)
        except JobSpecError as error:
            raise TopologyRefused(f"job {job.job_id}: {error}") from None

    # -- what the servicer asks --------------------------------------------------------------------------------------

    def plan(self, job: Job, members: list[MemberRow], rank: int) -> NodePlan:
        """`rank`'s place in the graph `job` runs now, on its `members` now."""
        key = (job.job_id, job.topology_version)
        topology = self._topologies.get(key)
        if topology is None:
            topology = self._topologies[key] = build_topology(job.running_spec.topology, job.world_size)
        return plan_member(job.running_spec, topology, sorted(m.rank for m in members), rank)

    def not_ready(self, job: Job) -> str:
        """The ranks of `job` that are not ready to start, with their nodes (and whether they are down)."""
        nodes = {n.node_id: n for n in self.state.nodes()}
        waiting = [m for m in self.state.members(job.job_id) if not m.ready]
        described = ", ".join(
            f"{m.rank} (node {m.node_id}{'' if m.node_id in nodes and nodes[m.node_id].up else ', down'})"
            for m in waiting)
        return f"rank{'s' if len(waiting) > 1 else ''} {described}"

    def wait_reason(self, needed: int, nodes: list[NodeRow], spec: JobSpec) -> str:
        """What a job of `needed` nodes waits for, or "" if it can start now."""
        idle = len(self._idle(nodes, spec))
        if idle >= needed:
            return ""
        usable = sum(_usable(n, spec) for n in nodes)
        if usable < needed:
            which = "agents on a CUDA device (training.precision fp16)" if spec.training.precision == "fp16" else \
                "agents"
            return (f"needs {needed} {which}; {usable} {_are(usable)} up and not draining ({len(nodes)} registered): "
                    f"it starts when {needed - usable} more join")
        return (f"needs {needed} idle agents; {idle} {_are(idle)} idle now, the others run jobs: it starts when they "
                "end")

    @staticmethod
    def switch_step(members: list[MemberRow]) -> int:
        """The step every node switches at: the highest reported so far plus what the fastest node steps in
        SWITCH_LEAD_S (see there). A node's rate counts the steps it took itself (a node that joined or rejoined
        started at its neighbours' step)."""
        rate = max(((m.progress.local_steps or m.progress.step) / m.progress.elapsed_s for m in members
                    if m.progress.elapsed_s > 0), default=0.0)
        highest = max((m.progress.step for m in members), default=0)
        return highest + max(MIN_SWITCH_MARGIN_STEPS, math.ceil(rate * SWITCH_LEAD_S))

    # -- the rules ---------------------------------------------------------------------------------------------------

    def _review_running_jobs(self, effects: Effects) -> None:
        """Apply each running job's failure policy to its lost nodes (silent for longer than the heartbeat timeout
        plus the job's `failure.lost_grace_s`): an asynchronous elastic job that keeps at least its least members
        plans its graph again without them (they leave it); otherwise a synchronous job fails, since its other nodes
        would wait forever, and an asynchronous job goes on without them, and finishes once every other node has; so
        does an all-reduce job while its quorum keeps at least `failure.min_members`, and fails when fewer remain."""
        nodes = {n.node_id: n for n in self.state.nodes()}
        now = self.clock()
        for job in self.state.jobs((JobState.RUNNING,)):
            spec = job.spec
            members = self.state.members(job.job_id)
            lost = []
            for member in members:
                node = nodes.get(member.node_id)
                silent = now - node.last_seen_unix if node is not None else math.inf
                # A member that finished is not lost; one that failed has failed the job already.
                gone = node is None or not node.up
                if gone and member.state not in (MemberState.FINISHED, MemberState.FAILED) and \
                        silent > self.heartbeat_timeout_s + spec.failure.lost_grace_s:
                    lost.append((member, silent))
            if not lost:
                continue
            ranks = ", ".join(f"rank {m.rank} (node {m.node_id}, silent for {silent:.0f} s)" for m, silent in lost)
            grace = f"the job's failure.lost_grace_s ({spec.failure.lost_grace_s:g} s)"
            algorithm = lookup(spec.algorithm.name)
            synchronous = algorithm.synchronous(spec.algorithm)
            if spec.elastic and not synchronous and len(members) - len(lost) >= spec.min_nodes:
                if self._change_pending(job, members, nodes):
                    continue  # the members switch to the last change first; the next review plans the leave
                reason = f"no heartbeat for longer than the heartbeat timeout and failure.lost_grace_s " \
                         f"({spec.failure.lost_grace_s:g} s)"
                if self._replan(job, members, [], [m for m, _ in lost], reason, effects):
                    continue
            collective = algorithm.family is Family.COLLECTIVE
            remaining = len(members) - len(lost)
            if collective and remaining < spec.quorum_minimum:
                self._end_job(job, JobState.FAILED, f"lost {ranks}: the all-reduce has {remaining} members left, "
                              f"fewer than its quorum's minimum of {spec.quorum_minimum}, for longer than the "
                              f"heartbeat timeout and {grace} allow", effects)
            elif not collective and synchronous:
                self._end_job(job, JobState.FAILED, f"lost {ranks}: longer than the heartbeat timeout and {grace} "
                              "allow a synchronous job", effects)
            elif all(m.progress.finished or m.rank in {gone.rank for gone, _ in lost} for m in members):
                self._end_job(job, JobState.FINISHED, f"without the lost {ranks}", effects)

    def _review_start_barriers(self, effects: Effects) -> None:
        """Fail each running job whose start barrier waited longer than its `start.timeout_s`, naming the ranks
        that never became ready."""
        now = self.clock()
        for job in self.state.jobs((JobState.RUNNING,)):
            start = job.spec.start
            if not job.released_unix and start.barrier and now - job.started_unix > start.timeout_s:
                self._end_job(job, JobState.FAILED, f"start barrier: {self.not_ready(job)} not ready within "
                              f"start.timeout_s ({start.timeout_s:g} s) of the job's start", effects)

    def _schedule(self, effects: Effects) -> None:
        """Start pending jobs, oldest first, on idle nodes that are up and not draining (in registration order). A
        job that does not fit waits, with the reason, and does not hold back a smaller one that fits. An elastic job
        starts once its least members are idle, on as many idle nodes as it may have; the nodes still idle then
        join the running elastic jobs that may grow, oldest first."""
        for job in self.state.jobs((JobState.PENDING,)):
            spec = job.spec
            nodes = self.state.nodes()
            idle = self._idle(nodes, spec)
            if len(idle) < job.world_size:
                reason = self.wait_reason(job.world_size, nodes, spec)
                if reason != job.reason:
                    self.state.set_pending_reason(job.job_id, reason)
                continue
            taken = idle[: spec.max_nodes]
            self.state.start_job(job.job_id, taken)
            log.info("job %s started on %s", job.job_id, ", ".join(taken))
            effects.add(JobEvent(job, events.STARTED, "running on " + ", ".join(
                f"rank {rank} {node}" for rank, node in enumerate(taken))))
            effects.add(AssignmentsChanged())
        self._grow_elastic_jobs(effects)

    def _grow_elastic_jobs(self, effects: Effects) -> None:
        """Idle nodes join running elastic jobs below their most members, once a job has started (released at its
        start barrier) and its members have switched to its last change."""
        for job in self.state.jobs((JobState.RUNNING,)):
            spec = job.spec
            if not spec.elastic or job.world_size >= spec.max_nodes or (spec.start.barrier and not job.released_unix):
                continue
            nodes = self.state.nodes()
            idle = self._idle(nodes, spec)
            if not idle:
                continue
            members = self.state.members(job.job_id)
            if not self._change_pending(job, members, {n.node_id: n for n in nodes}):
                self._replan(job, members, idle[: spec.max_nodes - len(members)], [], "", effects)

    def _change_pending(self, job: Job, members: list[MemberRow], nodes: dict[str, NodeRow] | None = None) -> bool:
        """Whether some member that is up and not finished has not reached the step where the job switches to its
        latest change (one that joined has not reported from it yet): a new change waits until every one has."""
        if nodes is None:
            nodes = {n.node_id: n for n in self.state.nodes()}
        return any(
            not m.progress.finished and m.progress.step < job.switch_step
            and m.node_id in nodes and nodes[m.node_id].up for m in members)

    def _replan(self, job: Job, members: list[MemberRow], joining: list[str], leaving: list[MemberRow],
                reason: str, effects: Effects) -> bool:
        """An elastic job's new membership: `joining` nodes take the lowest free ranks, `leaving` members leave,
        and the graph (the same kind and seed) is planned again for the new member count. It reaches the members as
        a topology change (a new version, switched to just before one step for all, as `coordinator topology`
        does); the nodes that join start in it. Ranks stay with their members. False when the job cannot take it
        now: its graph does not fit the new count, or it ends before its members could all switch."""
        spec = job.running_spec
        gone = {m.rank for m in leaving}
        staying = [m for m in members if m.rank not in gone]
        held = {m.rank for m in staying}
        free = [rank for rank in range(spec.max_nodes) if rank not in held][: len(joining)]
        count = len(staying) + len(free)
        try:
            validate_membership(spec, count)
        except JobSpecError as error:
            if (job.job_id, count) not in self._unplannable:  # said once: the join is tried again every second
                self._unplannable.add((job.job_id, count))
                log.warning("job %s: cannot plan %d members: %s", job.job_id, count, error)
            return False
        switch_step = self.switch_step(members)
        if switch_step >= spec.steps:
            return False
        version = job.topology_version + 1
        joined = list(zip(free, joining, strict=False))
        if not self.state.change_members(job.job_id, version, switch_step, joined, sorted(gone)):
            return False
        planned = f"{count} members; {spec.topology.kind} planned again (version {version}) from step {switch_step}"
        for rank, node_id in joined:
            effects.add(JobEvent(job, events.JOINED, f"node {node_id} joined as rank {rank}: {planned}"))
        for member in leaving:
            effects.add(JobEvent(job, events.LEFT, f"rank {member.rank} (node {member.node_id}) left: {reason}; "
                                 f"{planned}", "WARNING"))
        log.info("job %s: %s%s: %s", job.job_id, ", ".join(f"{node} joins as rank {rank}" for rank, node in joined),
                 ", ".join(f"rank {m.rank} leaves" for m in leaving), planned)
        effects.add(AssignmentsChanged())
        return True

    def _idle(self, nodes: list[NodeRow], spec: JobSpec) -> list[str]:
        busy = self.state.busy_node_ids()
        return [n.node_id for n in nodes if _usable(n, spec) and n.node_id not in busy]

    def _end_job(self, job: Job, state: JobState, reason: str, effects: Effects) -> None:
        """Finish, stop or fail an active job: its agents are freed (their assignment ends), and pending jobs may
        start on them."""
        self._other_data.pop(job.job_id, None)
        if not self.state.end_job(job.job_id, state, reason):
            return
        log.log(logging.WARNING if state == JobState.FAILED else logging.INFO, "job %s %s%s", job.job_id,
                state.event_kind, f": {reason}" if reason else "")
        effects.add(JobEnded(job, state, reason))
        effects.add(JobEvent(job, state.event_kind, reason or f"job {state.event_kind}",
                             "ERROR" if state == JobState.FAILED else "INFO"))
        effects.add(AssignmentsChanged())
        self._schedule(effects)


def _usable(node: NodeRow, spec: JobSpec) -> bool:
    """Whether `node` may take a rank of `spec`: up, not draining, and on a CUDA device where the job needs one
    (training.precision fp16)."""
    return node.up and not node.draining and (spec.training.precision != "fp16" or node.device.startswith("cuda"))


def _are(count: int) -> str:
    return "is" if count == 1 else "are"
