"""ControlState: what the coordinator must not forget across a restart (nodes, jobs, the ranks of each job and their
progress), behind one interface with two implementations that pass one conformance test (tests/test_control_state.py):
SqliteState, the coordinator's, and MemoryState, the twin that policy tests and the simulator run on.

Every method is one atomic step: a caller never holds a lock across two. A method that moves a job or member between
states checks the move against the table of coordinator.control.states.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from coordinator.control.records import Job, MemberRow, NodeRow, Readiness
from coordinator.control.states import JobState
from nodeagent.jobspec import JobSpec
from nodeagent.runtime.progress import Progress


class ControlState(ABC):
    @abstractmethod
    def close(self) -> None: ...

    # -- nodes ---------------------------------------------------------------------------------------------------

    @abstractmethod
    def register_node(self, node_id: str, name: str, peer_address: str, metrics_address: str, device: str,
                      version: str, device_name: str, device_memory_bytes: int) -> str:
        """Insert a new node (an empty `node_id`: a new one is made), or bring a known one back up with its new
        addresses and device; returns its id."""

    @abstractmethod
    def touch_node(self, node_id: str) -> tuple[bool, bool]:
        """Record a heartbeat; returns (known, came_back_up)."""

    @abstractmethod
    def mark_silent_nodes_down(self, timeout_s: float) -> list[str]:
        """Mark down the nodes that are up and have not been seen for `timeout_s`; returns their ids."""

    @abstractmethod
    def nodes(self) -> list[NodeRow]:
        """Every node, in registration order."""

    @abstractmethod
    def node(self, node_id: str) -> NodeRow | None: ...

    @abstractmethod
    def mark_down(self, node_id: str) -> bool:
        """A node that left cleanly; whether it was up."""

    @abstractmethod
    def set_draining(self, node_id: str, draining: bool) -> bool:
        """Whether the node is known."""

    @abstractmethod
    def remove_node(self, node_id: str) -> None:
        """Forget a node (not in a running job: the caller checks). The jobs it was a member of keep its rows, their
        results and its id: a finished job's record does not change with the nodes that come and go later."""

    # -- jobs ----------------------------------------------------------------------------------------------------

    @abstractmethod
    def add_job(self, job_id: str, spec: JobSpec, spec_yaml: str, run_dir: str) -> None:
        """A pending job (its world size: the least nodes it starts on)."""

    @abstractmethod
    def job(self, job_id: str) -> Job | None: ...

    @abstractmethod
    def latest_job(self) -> Job | None: ...

    @abstractmethod
    def find_job(self, reference: str) -> Job | None:
        """The job a person names: its id, else the newest job of that name, else the only job whose id starts
        with `reference` (None when none or several do)."""

    @abstractmethod
    def job_ids_starting(self, prefix: str, limit: int) -> list[str]:
        """The ids of at most `limit` jobs that start with `prefix`, newest first (to say which ones a prefix that
        `find_job` found ambiguous means)."""

    @abstractmethod
    def all_jobs(self, limit: int) -> list[Job]:
        """The newest `limit` jobs, newest first."""

    @abstractmethod
    def jobs(self, states: Iterable[JobState]) -> list[Job]:
        """The jobs in `states`, oldest first."""

    @abstractmethod
    def job_counts(self) -> dict[JobState, int]:
        """How many jobs are in each state (a state with none is left out), without reading the jobs: the
        coordinator's gauges ask every second, and ended jobs pile up."""

    @abstractmethod
    def ended_job_ids(self) -> list[str]:
        """The ids of the ended jobs (finished, stopped, failed), the latest ended first, without reading the
        jobs."""

    @abstractmethod
    def delete_job(self, job_id: str) -> bool:
        """Forget an ended job: its record and its members' rows (their results). False (and nothing changes) when
        it is unknown or still pending or running."""

    @abstractmethod
    def end_job(self, job_id: str, state: JobState, reason: str = "") -> bool:
        """Move a pending or running job to the final `state`; whether it was still active."""

    @abstractmethod
    def change_topology(self, job_id: str, topology_json: str, version: int, switch_step: int) -> bool:
        """A running job's new topology (version `version`, taken from step `switch_step` on); False if the job is
        not running or another change came first (its version is not `version` - 1)."""

    @abstractmethod
    def set_pending_reason(self, job_id: str, reason: str) -> None: ...

    @abstractmethod
    def start_job(self, job_id: str, node_ids: list[str]) -> None:
        """Give the pending job its ranks (in the order given) and mark it running."""

    @abstractmethod
    def change_members(self, job_id: str, version: int, switch_step: int, joined: list[tuple[int, str]],
                       left: list[int]) -> bool:
        """A running elastic job's new membership, in its topology's version `version` from step `switch_step`:
        nodes that join, as (rank, node id), and the ranks that leave; the job's world size becomes its member
        count. A rank that left may be given to a node that joins later, which replaces its row. False if the job
        is not running or another change came first (its version is not `version` - 1)."""

    # -- members -------------------------------------------------------------------------------------------------

    @abstractmethod
    def record_failure(self, job_id: str, rank: int, node_id: str, reason: str) -> bool:
        """A node's failure in a job; False if that node does not hold that rank of that job."""

    @abstractmethod
    def mark_ready(self, job_id: str, rank: int, node_id: str, data_json: str) -> Readiness | None:
        """A node's rank of a running job is ready to start, its data described by `data_json`: the first
        description becomes the job's; a rank whose description differs is not marked. The job is released when
        its last rank becomes ready. None if that node does not hold that rank of that running job."""

    @abstractmethod
    def busy_node_ids(self) -> set[str]:
        """The nodes that hold a rank of a running job."""

    @abstractmethod
    def members(self, job_id: str, with_left: bool = False) -> list[MemberRow]:
        """The job's members by rank; `with_left`: also those that left it (an elastic job's) and were not
        replaced."""

    @abstractmethod
    def running_membership(self, node_id: str) -> tuple[Job, int] | None:
        """The running job the node holds a rank of, and the rank."""

    @abstractmethod
    def record_progress(self, progress: Progress) -> Progress | None:
        """Store a node's progress (an evaluation's figures stay until the next evaluation) with its traffic added
        up over the member's part in the job (coordinator.control.traffic: across restarts of its agent and
        topology switches); returns the progress so added up, None if that node does not hold that rank of that
        job."""
