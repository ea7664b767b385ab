"""What the control state holds: nodes, jobs (their spec parsed once) and the ranks of each job."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.control.states import JobState, MemberState
from coordinator.jobs import with_topology
from nodeagent.jobspec import JobSpec, TopologySpec
from nodeagent.runtime.progress import Progress


@dataclass(frozen=True)
class NodeRow:
    node_id: str
    name: str
    peer_address: str
    metrics_address: str
    device: str
    version: str
    registered_unix: float
    last_seen_unix: float
    up: bool
    draining: bool = False
    device_name: str = ""
    device_memory_bytes: int = 0


@dataclass(frozen=True)
class Job:
    """A job as the coordinator knows it. `spec` is the job as submitted, parsed once (when submitted, or when the
    state first read it); `running_spec` is the job as it runs now, with the topology of its latest change."""

    job_id: str
    name: str
    spec: JobSpec
    running_spec: JobSpec
    spec_yaml: str
    state: JobState
    world_size: int
    created_unix: float
    run_dir: str
    reason: str = ""
    started_unix: float = 0.0
    ended_unix: float = 0.0
    # The topology the job runs now, after changes (`coordinator topology`): its TopologySpec as JSON ('': the job
    # spec's own), its version (1: the job's own) and the step its nodes switch at.
    topology_json: str = ""
    topology_version: int = 1
    switch_step: int = 0
    # The start barrier: the description of the job's data its ranks reported (nodeagent.runtime.readiness, as
    # JSON; '' before the first), and when the last rank became ready (0: not yet).
    data_json: str = ""
    released_unix: float = 0.0


@dataclass(frozen=True)
class MemberRow:
    job_id: str
    rank: int
    node_id: str
    progress: Progress  # the last one the node reported (nothing measured before the first)
    failure: str = ""  # why the node could not build or continue the job, in its words
    ready: bool = False  # the node reported its rank ready to start
    joined_step: int = 0  # joined the running job, in its topology from this step (0: a member from the start)
    left: bool = False  # left the (elastic) job while it ran

    @property
    def state(self) -> MemberState:
        if self.left:
            return MemberState.LEFT
        if self.failure:
            return MemberState.FAILED
        if self.progress.finished:
            return MemberState.FINISHED
        return MemberState.READY if self.ready else MemberState.JOINED


@dataclass(frozen=True)
class Readiness:
    """What a rank's ready report found (ControlState.mark_ready)."""

    data_json: str  # the job's data description: the rank's own unless another rank's came first
    released: bool  # every rank is ready
    released_now: bool  # this report released the job


class Specs:
    """Each job's spec parsed once, and the spec it runs now once per topology version: a job's spec is read on
    every report and assignment, and parsing it is most of their cost."""

    def __init__(self) -> None:
        self._specs: dict[str, JobSpec] = {}
        self._running: dict[str, tuple[int, JobSpec]] = {}

    def spec(self, job_id: str, spec_json: str) -> JobSpec:
        spec = self._specs.get(job_id)
        if spec is None:
            spec = self._specs[job_id] = JobSpec.from_json(spec_json)
        return spec

    def add(self, job_id: str, spec: JobSpec) -> None:
        self._specs[job_id] = spec

    def forget(self, job_id: str) -> None:
        self._specs.pop(job_id, None)
        self._running.pop(job_id, None)

    def running(self, job_id: str, spec: JobSpec, topology_json: str, version: int) -> JobSpec:
        """The job as it runs with its latest topology change (`topology_json`, version `version`; '': none)."""
        if not topology_json:
            return spec
        cached = self._running.get(job_id)
        if cached is None or cached[0] != version:
            topology = TopologySpec.model_validate_json(topology_json)
            cached = self._running[job_id] = (version, with_topology(spec, topology))
        return cached[1]
