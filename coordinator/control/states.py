"""The states of a job and of a job's member, and the one table of the moves between them.

A move that is not in the table is a bug in the coordinator, not a race: it raises. A race (a job that ended
while a call about it was under way) is seen before the move is tried, by the state's owner (ControlState), and
answered as such (False, None).
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    PENDING = "PENDING"  # submitted, waiting for idle nodes
    RUNNING = "RUNNING"  # its ranks are given to nodes (its start barrier may still hold them)
    FINISHED = "FINISHED"
    STOPPED = "STOPPED"
    FAILED = "FAILED"

    @property
    def active(self) -> bool:
        return self in ACTIVE_JOB_STATES

    @property
    def event_kind(self) -> str:
        """The kind of the job event that records a move to this state (nodeagent.runtime.events)."""
        return self.value.lower()


class MemberState(StrEnum):
    """Where a rank of a job stands, from its node's reports (a member's row holds when each came)."""

    JOINED = "JOINED"  # holds the rank; not reported ready to start yet
    READY = "READY"  # reported ready (the start barrier's part)
    FINISHED = "FINISHED"  # its last step is done and evaluated
    FAILED = "FAILED"  # its node reported that it cannot build or continue the job
    LEFT = "LEFT"  # left a running elastic job (drained, or lost while the job keeps its least members)


ACTIVE_JOB_STATES = frozenset({JobState.PENDING, JobState.RUNNING})
FINAL_JOB_STATES = frozenset({JobState.FINISHED, JobState.STOPPED, JobState.FAILED})

JOB_MOVES: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.RUNNING, JobState.STOPPED}),
    JobState.RUNNING: frozenset({JobState.FINISHED, JobState.STOPPED, JobState.FAILED}),
    JobState.FINISHED: frozenset(),
    JobState.STOPPED: frozenset(),
    JobState.FAILED: frozenset(),
}
MEMBER_MOVES: dict[MemberState, frozenset[MemberState]] = {
    MemberState.JOINED: frozenset({MemberState.READY, MemberState.FINISHED, MemberState.FAILED, MemberState.LEFT}),
    MemberState.READY: frozenset({MemberState.FINISHED, MemberState.FAILED, MemberState.LEFT}),
    # A node may fail after its last step (while its neighbours still need it), and an operator may drain a node
    # whose rank has finished.
    MemberState.FINISHED: frozenset({MemberState.FAILED, MemberState.LEFT}),
    MemberState.FAILED: frozenset(),
    MemberState.LEFT: frozenset(),
}


class TransitionError(RuntimeError):
    """A move between states that the table does not hold."""


def check_job_move(job_id: str, current: JobState, target: JobState) -> None:
    if target not in JOB_MOVES[current]:
        raise TransitionError(f"job {job_id}: no move from {current} to {target}")


def check_member_move(job_id: str, rank: int, current: MemberState, target: MemberState) -> None:
    """Raises unless `target` follows `current`; a member already in `target` stays there (a repeated report)."""
    if target != current and target not in MEMBER_MOVES[current]:
        raise TransitionError(f"job {job_id} rank {rank}: no move from {current} to {target}")
