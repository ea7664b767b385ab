"""ControlPlane: the coordinator's rules, sans I/O. It takes events (a node registered, came back, left or was
drained; a job was submitted, stopped, reported ready, finished or failed; a topology change was asked for; time
passed) against a ControlState and a clock, and returns effects (assignments changed, a job was released or ended,
an event to write). It never calls the servicer: the servicer turns calls into events and effects into replies,
streams and the closing of a job's rendezvous or parameter server, as the node driver's caller does with its
decisions.

Where each rule lives: scheduling (`_schedule`, `_grow_elastic_jobs`, `wait_reason`), the start barrier (`ready`,
`_review_start_barriers`), the failure policy (`_review_running_jobs`, `failed`), elastic replanning (`_replan`,
`drained`), the switch step of a topology change (`switch_step`, `topology_requested`) and each member's place in its
job's graph (`plan`), suspicion and quarantine (`progress_reported`, `server_reported`, `_review_suspicion`,
`quarantine`, `revoked`), and members that withhold their rounds (`_review_withheld`).

Quarantine (issue 28): a quarantined member's contributions are dropped from the job.
- Peer-to-peer: its edges are dropped through a live topology change (as `coordinator topology` makes one): from
  the switch step on, the job runs an edge-list graph without them, its neighbours stop exchanging with it, and the
  mixing weights are planned again on the remaining graph (each neighbour's weight on it goes to the others and to
  itself, as the graph's weight rule gives them). What 'dropped' means is what each algorithm's change_topology
  drops of a neighbour that leaves (nodeagent.algorithms):
  - DSGD: its copy of the member's model is forgotten (its last contribution is mixed no more, from the switch
    step on) and the member's messages are ignored; a synchronous round before the switch completes as it was;
  - gossip: its score and any unanswered fetch from the member are forgotten (pull-only gossip mixes a neighbour's
    model only when a fetch answers, so nothing of it remains);
  - ECL-ISVR: the dual of the edge, z_ij, is forgotten (eta follows the new degree);
  - push-sum (SGP): on a static graph, shares of rounds before the switch are absorbed as they were sent (the
    total mass, and so the average, stays exact), none after; its time-varying graphs are refused (below);
  - AD-PSGD and DiLoCo over gossip run time-varying graphs (or cannot change topology): refused, with the reason;
    the operator stops the job, or changes its topology to a static one first.
  The member keeps its rank, runs alone, and is waited for by no one: the job finishes without it, and its silence
  does not fail a synchronous job. An asynchronous elastic job that keeps its least members plans its graph again
  without it (the member leaves, as a drained one does).
- Parameter server: its pushes are ignored (nodeagent.ps.server.ServerHalf: a quarantined worker's update is taken
  as zero, so a synchronous round still completes; the worker can still pull the model).
The operator is told (a `quarantined` event, `status`); a revoked member is quarantined the same way.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.control.records import Job, MemberRow, NodeRow
from coordinator.control.state import ControlState
from coordinator.control.states import JobState, MemberState
from coordinator.control.suspicion import SERVER_REPORTER, Suspicion
from coordinator.jobs import (
    NodePlan,
    check_topology_changes,
    plan_member,
    validate_membership,
    validate_topology_change,
    with_topology,
)
from coordinator.topology import DYNAMIC_KINDS, Topology, build_topology
from nodeagent.algorithms import Family, lookup
from nodeagent.jobspec import JobSpec, JobSpecError, TopologySpec
from nodeagent.runtime import events
from nodeagent.runtime.progress import Progress
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


@dataclass(frozen=True)
class Quarantined:
    """A member's contributions are to be dropped (`released`: taken again). The servicer tells the job's parameter
    server; a peer-to-peer job's quarantine reaches its nodes as a topology change (AssignmentsChanged)."""

    job: Job
    rank: int
    released: bool = False


Effect = AssignmentsChanged | JobEnded | JobEvent | Quarantined


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


class QuarantineRefused(Exception):
    """A quarantine (or release) the job cannot take now, with the reason."""


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
        # Issue 28, in memory (a restarted coordinator measures again; a peer-to-peer quarantine lives on in the
        # job's topology): the suspicion of members, the flagged ones, since when each has been above its job's
        # quarantine fraction, the quarantined ranks, and the highest step of each synchronous job with since when.
        self.suspicion = Suspicion()
        self._flagged: dict[str, set[int]] = {}
        self._above_since: dict[tuple[str, int], float] = {}
        self._quarantined: dict[str, set[int]] = {}
        self._quarantined_nodes: dict[str, set[str]] = {}  # by job: their nodes, which an elastic job takes no more
        self._progressed: dict[str, tuple[int, float]] = {}
        # By job and rank: what the last report said the member waits for, and when it came.
        self._waiting: dict[str, dict[int, tuple[str, float]]] = {}

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
            self._review_withheld(effects)
        self._review_suspicion(effects)
        self._schedule(effects)
        return effects.items

    def nodes_changed(self) -> list[Effect]:
        """A node registered, came back, left, was removed or put back in service: assignments that name it change,
        and pending jobs may start."""
        effects = Effects([AssignmentsChanged()])
        # A node that registers again (restarted) or comes back may be a member that rejoins its job: a synchronous
        # job's stall counts again from now (_review_withheld).
        now = self.clock()
        self._progressed = {job_id: (step, now) for job_id, (step, _) in self._progressed.items()}
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
        quarantined = self._quarantined.get(job.job_id, set())
        if job.state == JobState.RUNNING and all(m.progress.finished or m.rank in quarantined
                                                 for m in self.state.members(job.job_id)):
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
        if rank in self._quarantined.get(job_id, set()):
            # Its contributions are dropped and nobody waits for it: a quarantined member cannot end the job.
            effects.add(JobEvent(job, events.QUARANTINED, f"rank {rank} (node {node_id}), quarantined, failed: "
                                 f"{reason}; the job goes on without it", "WARNING"))
            return True, effects.items
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

    def progress_reported(self, job: Job, progress: Progress) -> list[Effect]:
        """A member's progress record arrived: what its robust rule found of its neighbours (suspicion), and
        whether a synchronous job still steps (withheld rounds). Reviewed at the next tick."""
        if job.state != JobState.RUNNING or progress.rank in self._quarantined.get(job.job_id, set()):
            return []
        now = self.clock()
        if progress.step > self._progressed.get(job.job_id, (-1, now))[0]:
            self._progressed[job.job_id] = (progress.step, now)
        self._waiting.setdefault(job.job_id, {})[progress.rank] = (progress.waiting_for, now)
        if job.spec.algorithm.robust is not None:
            ranks = {m.node_id: m.rank for m in self.state.members(job.job_id)}
            members = set(ranks.values())
            for edge in progress.edges:
                member = ranks.get(edge.peer)
                if member is not None and member != progress.rank:
                    self.suspicion.observe(job.job_id, progress.rank, member, edge.robust_outlying,
                                           edge.judged_contributions(), now)
                # A collective's all-gathered rows, judged per member: only the job's members count.
                for judged in edge.judged:
                    if judged.rank in members and judged.rank != progress.rank:
                        self.suspicion.observe(job.job_id, progress.rank, judged.rank, judged.outlying, judged.seen,
                                               now)
        return []

    def server_reported(self, job: Job, counts: dict[int, tuple[int, int]]) -> list[Effect]:
        """The job's parameter server's cumulative counts per worker: (pushes its robust rule flagged, pushes)."""
        now = self.clock()
        for rank, (flagged, pushes) in counts.items():
            self.suspicion.observe(job.job_id, SERVER_REPORTER, rank, flagged, pushes, now)
        return []

    def quarantine(self, job: Job, rank: int, reason: str) -> list[Effect]:
        """Drop `rank`'s contributions from `job` (see the module's text). Raises QuarantineRefused."""
        effects = Effects()
        self._quarantine(job, rank, reason, effects)
        return effects.items

    def release(self, job: Job, rank: int) -> list[Effect]:
        """Take a quarantined parameter-server worker's pushes again. Raises QuarantineRefused (a peer-to-peer
        member's edges are not put back: change the job's topology for that)."""
        quarantined = self._quarantined.get(job.job_id, set())
        if job.state != JobState.RUNNING or rank not in quarantined:
            raise QuarantineRefused(f"rank {rank} of job {job.job_id} is not quarantined")
        if lookup(job.spec.algorithm.name).family is not Family.SERVER:
            raise QuarantineRefused(f"job {job.job_id} runs without rank {rank}'s edges since its quarantine; to "
                                    "take it back, change the job's topology (`coordinator topology`)")
        quarantined.discard(rank)
        self._above_since.pop((job.job_id, rank), None)
        return [Quarantined(job, rank, released=True),
                JobEvent(job, events.QUARANTINED, f"rank {rank}: released by an operator, its pushes count again")]

    def revoked(self, node_ids: list[str]) -> list[Effect]:
        """The certificates of `node_ids` were revoked: each one's running membership is quarantined, so that
        its last contributions are not mixed again (the failure policy treats its silence as usual)."""
        effects = Effects()
        for node_id in node_ids:
            membership = self.state.running_membership(node_id)
            if membership is None or membership[1] in self._quarantined.get(membership[0].job_id, set()):
                continue
            try:
                self._quarantine(membership[0], membership[1], "its certificate was revoked", effects)
            except QuarantineRefused as error:
                effects.add(JobEvent(membership[0], events.QUARANTINED, f"rank {membership[1]} (node {node_id}): "
                                     f"certificate revoked, not quarantined: {error}", "WARNING"))
        return effects.items

    # -- what the servicer asks --------------------------------------------------------------------------------------

    def quarantined(self, job_id: str) -> frozenset[int]:
        return frozenset(self._quarantined.get(job_id, ()))

    def flagged(self, job_id: str) -> frozenset[int]:
        return frozenset(self._flagged.get(job_id, ()))

    def suspicion_of(self, job: Job, rank: int) -> float:
        """`rank`'s suspicion in `job` now (NaN: not measured, or the job has no robust rule)."""
        robust = job.spec.algorithm.robust
        if robust is None:
            return math.nan
        return self.suspicion.score(job.job_id, rank, self.clock(), robust.window_s)

    def plan(self, job: Job, members: list[MemberRow], rank: int) -> NodePlan:
        """`rank`'s place in the graph `job` runs now, on its `members` now."""
        return plan_member(job.running_spec, self._topology(job), sorted(m.rank for m in members), rank)

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
            quarantined = self._quarantined.get(job.job_id, set())
            lost = []
            for member in members:
                if member.rank in quarantined:  # waited for by no one
                    continue
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
            elif all(m.progress.finished or m.rank in {gone.rank for gone, _ in lost} | quarantined
                     for m in members):
                self._end_job(job, JobState.FINISHED, f"without the lost {ranks}", effects)

    def _review_withheld(self, effects: Effects) -> None:
        """A synchronous peer-to-peer job whose highest step has not moved for as long as a silent node would be
        lost (the heartbeat timeout plus `failure.lost_grace_s`) since it was released or a node (re)registered or
        came back: the members whose nodes are up but that do not say they wait (no report within the heartbeat
        timeout whose `waiting_for` says what for) withhold their rounds, and are treated as lost: the job fails
        naming them, as it would for a silent member, instead of stalling for ever. Where every member says it
        waits, nobody is named and the job goes on waiting, as before."""
        now = self.clock()
        for job in self.state.jobs((JobState.RUNNING,)):
            spec = job.spec
            algorithm = lookup(spec.algorithm.name)
            progressed = self._progressed.get(job.job_id)
            if algorithm.family is not Family.PEER or not algorithm.synchronous(spec.algorithm) or \
                    progressed is None or (spec.start.barrier and not job.released_unix):
                continue
            bound = self.heartbeat_timeout_s + spec.failure.lost_grace_s
            stalled = now - max(progressed[1], job.released_unix)
            if stalled <= bound:
                continue
            quarantined = self._quarantined.get(job.job_id, set())
            running = [m for m in self.state.members(job.job_id)
                       if not m.progress.finished and m.rank not in quarantined]
            if not running:
                continue
            waiting = self._waiting.get(job.job_id, {})
            up = {n.node_id for n in self.state.nodes() if n.up}
            # Says it waits: a report within the heartbeat timeout that names what for.
            waits = {rank for rank, (what, when) in waiting.items() if what and now - when <= self.heartbeat_timeout_s}
            withholding = [m for m in running if m.node_id in up and m.rank not in waits]
            if not withholding:
                continue
            ranks = ", ".join(f"rank {m.rank} (node {m.node_id}, at step {m.progress.step})" for m in withholding)
            self._end_job(job, JobState.FAILED, f"lost {ranks}: it heartbeats but has withheld its rounds, no step of "
                          f"the job for {stalled:.0f} s, longer than the heartbeat timeout and failure.lost_grace_s "
                          f"({spec.failure.lost_grace_s:g} s) allow a synchronous job", effects)

    def _review_suspicion(self, effects: Effects) -> None:
        """Flag the members of running jobs with a robust rule whose suspicion reached the job's
        `suspect_fraction` (an event; unflagged, with another, once it falls below), and quarantine those whose
        suspicion stayed at or above `quarantine.fraction` for `quarantine.after_s`, where the job asks for it."""
        now = self.clock()
        for job in self.state.jobs((JobState.RUNNING,)):
            robust = job.spec.algorithm.robust
            if robust is None:
                continue
            flagged = self._flagged.setdefault(job.job_id, set())
            quarantined = self._quarantined.get(job.job_id, set())
            for member in self.state.members(job.job_id):
                rank = member.rank
                if rank in quarantined:
                    continue
                score = self.suspicion.score(job.job_id, rank, now, robust.window_s)
                suspected = score >= robust.suspect_fraction  # NaN: not measured, not suspected
                described = f"rank {rank} (node {member.node_id})"
                if suspected and rank not in flagged:
                    flagged.add(rank)
                    log.warning("job %s: %s suspected (%.2f)", job.job_id, described, score)
                    effects.add(JobEvent(job, events.SUSPECTED, f"{described}: {score:.0%} of its contributions in "
                                         f"the last {robust.window_s:g} s were outlying (suspect_fraction "
                                         f"{robust.suspect_fraction:g}): suspected", "WARNING"))
                elif not suspected and rank in flagged:
                    flagged.discard(rank)
                    effects.add(JobEvent(job, events.SUSPECTED, f"{described}: no longer suspected"
                                         + ("" if math.isnan(score) else f" ({score:.0%} outlying)")))
                quarantine = robust.quarantine
                key = (job.job_id, rank)
                if quarantine is None or not score >= quarantine.fraction:
                    self._above_since.pop(key, None)
                    continue
                since = self._above_since.setdefault(key, now)
                if now - since >= quarantine.after_s:
                    reason = (f"{score:.0%} of its contributions in the last {robust.window_s:g} s were outlying, at "
                              f"or above quarantine.fraction {quarantine.fraction:g} for {now - since:.0f} s")
                    try:
                        self._quarantine(job, rank, reason, effects)
                    except QuarantineRefused as error:
                        self._above_since[key] = now  # said again after another after_s, not every second
                        effects.add(JobEvent(job, events.QUARANTINED, f"{described} not quarantined ({reason}): "
                                             f"{error}", "WARNING"))

    def _quarantine(self, job: Job, rank: int, reason: str, effects: Effects) -> None:
        """See `quarantine`."""
        if job.state != JobState.RUNNING:
            raise QuarantineRefused(f"job {job.job_id} is {job.state.event_kind}: only a running job's member can "
                                    "be quarantined")
        members = self.state.members(job.job_id)
        member = next((m for m in members if m.rank == rank), None)
        if member is None:
            raise QuarantineRefused(f"job {job.job_id} has no member of rank {rank}")
        quarantined = self._quarantined.setdefault(job.job_id, set())
        if rank in quarantined:
            raise QuarantineRefused(f"rank {rank} of job {job.job_id} is quarantined already")
        spec = job.running_spec
        algorithm = lookup(spec.algorithm.name)
        described = f"rank {rank} (node {member.node_id})"
        if algorithm.family is Family.COLLECTIVE:
            raise QuarantineRefused(f"{spec.algorithm.name} sums every member's part in one all-reduce: there is no "
                                    "edge to drop (a robust rule moves such a job to an all-gather)")
        if algorithm.family is Family.SERVER:
            how = "its pushes are ignored"
            effects.add(Quarantined(job, rank))
        elif spec.elastic and not algorithm.synchronous(spec.algorithm) and len(members) - 1 >= spec.min_nodes:
            if self._change_pending(job, members) or not self._replan(job, members, [], [member],
                                                                       f"quarantined: {reason}", effects):
                raise QuarantineRefused(f"job {job.job_id} cannot plan its graph without {described} now (a change "
                                        "under way, or its graph does not fit)")
            how = "it left the job"
        else:
            version, switch_step = self._drop_edges(job, members, quarantined | {rank})
            how = f"its edges are dropped from step {switch_step} (topology version {version})"
            effects.add(AssignmentsChanged())
        quarantined.add(rank)
        self._quarantined_nodes.setdefault(job.job_id, set()).add(member.node_id)
        self._above_since.pop((job.job_id, rank), None)
        self.suspicion.forget_reporter(job.job_id, rank)
        log.warning("job %s: %s quarantined: %s; %s", job.job_id, described, reason, how)
        effects.add(JobEvent(job, events.QUARANTINED, f"{described} quarantined: {reason}; {how}", "WARNING"))

    def _drop_edges(self, job: Job, members: list[MemberRow], gone: set[int]) -> tuple[int, int]:
        """Change `job`'s topology to its graph now without the edges of the ranks `gone`: (version, switch
        step). Raises QuarantineRefused where the job cannot (its algorithm does not change topology, its graph
        changes every step, the remaining members would not be connected, or it is switching already)."""
        try:
            self.check_topology_change(job)
        except TopologyRefused as error:
            raise QuarantineRefused(str(error)) from None
        spec = job.running_spec
        if spec.topology.kind in DYNAMIC_KINDS:
            raise QuarantineRefused(f"topology {spec.topology.kind} changes its peers every step: a member's edges "
                                    "cannot be dropped from it (change the job's topology to a static one first)")
        if self._change_pending(job, members):
            raise QuarantineRefused(f"job {job.job_id} is switching to version {job.topology_version} of its "
                                    "topology; try again once every member has")
        ranks = sorted(m.rank for m in members)
        position = {r: i for i, r in enumerate(ranks)}
        out = {position[r] for r in gone if r in position}
        current = self._topology(job)
        edges = [(a, b) for a, b in current.edges if a not in out and b not in out]
        # An edge file's text ('#': a comment, the file of a graph without edges).
        topology_spec = TopologySpec(kind="edge-list", seed=spec.topology.seed,
                                     options={"edges": "".join(f"{a} {b}\n" for a, b in edges) or "#\n"})
        remaining = build_topology(topology_spec, len(ranks))
        honest = [p for p in range(len(ranks)) if p not in out]
        reached, frontier = {honest[0]}, [honest[0]]
        while frontier:
            for neighbor in remaining.neighbors(frontier.pop()):
                if neighbor not in reached:
                    reached.add(neighbor)
                    frontier.append(neighbor)
        if len(reached) < len(honest):
            raise QuarantineRefused(f"without the edges of rank{'s' if len(gone) > 1 else ''} "
                                    f"{', '.join(map(str, sorted(gone)))} the other members of job {job.job_id} "
                                    f"would not be connected in its {spec.topology.kind} graph")
        try:
            lookup(spec.algorithm.name).check(with_topology(spec.sized(len(ranks)), topology_spec), remaining)
        except (JobSpecError, ValueError) as error:
            raise QuarantineRefused(f"{spec.algorithm.name} does not run on the graph without its edges: {error}") \
                from None
        switch_step = self.switch_step(members)
        if switch_step >= spec.steps:
            raise QuarantineRefused(f"job {job.job_id} ends at step {spec.steps}, before the earliest step its "
                                    f"nodes could all switch at ({switch_step})")
        version = job.topology_version + 1
        if not self.state.change_topology(job.job_id, topology_spec.model_dump_json(), version, switch_step):
            raise QuarantineRefused(f"job {job.job_id} ended or changed meanwhile; try again")
        return version, switch_step

    def _topology(self, job: Job) -> Topology:
        """The graph `job` runs now, on its member positions (see `plan`)."""
        key = (job.job_id, job.topology_version)
        topology = self._topologies.get(key)
        if topology is None:
            topology = self._topologies[key] = build_topology(job.running_spec.topology, job.world_size)
        return topology

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
            barred = self._quarantined_nodes.get(job.job_id, set())
            idle = [node_id for node_id in self._idle(nodes, spec) if node_id not in barred]
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
        quarantined = self._quarantined.get(job.job_id, set())  # waited for by no one
        return any(
            not m.progress.finished and m.progress.step < job.switch_step and m.rank not in quarantined
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
        self.suspicion.forget(job.job_id)
        self._flagged.pop(job.job_id, None)
        self._quarantined.pop(job.job_id, None)
        self._quarantined_nodes.pop(job.job_id, None)
        self._progressed.pop(job.job_id, None)
        self._waiting.pop(job.job_id, None)
        self._above_since = {key: since for key, since in self._above_since.items() if key[0] != job.job_id}
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
