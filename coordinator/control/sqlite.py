"""The coordinator's ControlState in SQLite (WAL): nodes, jobs, the ranks of each job, and node progress.

Everything the coordinator must not forget across a restart lives here; the servicer keeps only
wake-up signals in memory. One connection guarded by a lock: the load is a few writes per second per node.
"""

from __future__ import annotations

import math
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from coordinator.control.records import Job, MemberRow, NodeRow, Readiness, Specs
from coordinator.control.state import ControlState
from coordinator.control.states import ACTIVE_JOB_STATES, JobState, MemberState, check_job_move, check_member_move
from coordinator.control.traffic import TrafficLedger
from nodeagent.jobspec import JobSpec
from nodeagent.runtime.progress import Progress

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    peer_address TEXT NOT NULL,
    metrics_address TEXT NOT NULL,
    device TEXT NOT NULL,
    version TEXT NOT NULL,
    registered_unix REAL NOT NULL,
    last_seen_unix REAL NOT NULL,
    up INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    spec_json TEXT NOT NULL,
    spec_yaml TEXT NOT NULL,
    state TEXT NOT NULL,
    world_size INTEGER NOT NULL,
    created_unix REAL NOT NULL,
    run_dir TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS members (
    job_id TEXT NOT NULL REFERENCES jobs(job_id),
    rank INTEGER NOT NULL,
    node_id TEXT NOT NULL REFERENCES nodes(node_id),
    step INTEGER NOT NULL DEFAULT 0,
    loss REAL,
    test_accuracy REAL,
    finished INTEGER NOT NULL DEFAULT 0,
    updated_unix REAL NOT NULL DEFAULT 0,
    bytes_sent INTEGER NOT NULL DEFAULT 0,
    bytes_received INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (job_id, rank)
);
"""
# Columns added since the tables' first version: a database written before gets them when it is opened.
COLUMNS_ADDED = {
    "nodes": {
        "draining": "INTEGER NOT NULL DEFAULT 0",
        # What the node's device is (shown by `coordinator nodes`): the card's name and its memory (0: the CPU).
        "device_name": "TEXT NOT NULL DEFAULT ''",
        "device_memory_bytes": "INTEGER NOT NULL DEFAULT 0",
    },
    "jobs": {
        "reason": "TEXT NOT NULL DEFAULT ''",  # why it failed, or what a pending job waits for
        "started_unix": "REAL NOT NULL DEFAULT 0",
        "ended_unix": "REAL NOT NULL DEFAULT 0",
        # The topology the job runs now, after changes (`coordinator topology`): its TopologySpec as JSON ('': the
        # job spec's own), its version (1: the job's own) and the step its nodes switch at.
        "topology_json": "TEXT NOT NULL DEFAULT ''",
        "topology_version": "INTEGER NOT NULL DEFAULT 1",
        "switch_step": "INTEGER NOT NULL DEFAULT 0",
        # The start barrier: the description of the job's data its ranks reported (nodeagent.runtime.readiness,
        # as JSON; '' before the first), and when the last rank became ready (0: not yet).
        "data_json": "TEXT NOT NULL DEFAULT ''",
        "released_unix": "REAL NOT NULL DEFAULT 0",
    },
    "members": {
        "test_loss": "REAL",
        "elapsed_s": "REAL NOT NULL DEFAULT 0",
        "compute_s": "REAL NOT NULL DEFAULT 0",
        "wait_s": "REAL NOT NULL DEFAULT 0",
        "exchanges": "INTEGER NOT NULL DEFAULT 0",
        "exchange_failures": "INTEGER NOT NULL DEFAULT 0",
        "failure": "TEXT NOT NULL DEFAULT ''",
        "local_steps": "INTEGER NOT NULL DEFAULT 0",
        "ready_unix": "REAL NOT NULL DEFAULT 0",  # when the node reported its rank ready to start (0: not yet)
        # Elastic jobs: the step from which a member that joined the running job is in its topology (0: a member
        # from the start), and when a member left it (0: it has not). A rank that left may be given to a node that
        # joins later, which replaces its row.
        "joined_step": "INTEGER NOT NULL DEFAULT 0",
        "left_unix": "REAL NOT NULL DEFAULT 0",
        "test_perplexity": "REAL",  # a language model's, at its last evaluation (NULL: none)
        # The member's traffic over its part in the job (coordinator.control.traffic.TrafficLedger, as JSON).
        "traffic_json": "TEXT NOT NULL DEFAULT ''",
    },
}
# The columns in the order the rows below read them.
_NODE_FIELDS = ("node_id", "name", "peer_address", "metrics_address", "device", "version", "registered_unix",
                "last_seen_unix", "up", *COLUMNS_ADDED["nodes"])
_JOB_FIELDS = ("job_id", "name", "spec_json", "spec_yaml", "state", "world_size", "created_unix", "run_dir",
               *COLUMNS_ADDED["jobs"])
_MEMBER_FIELDS = ("job_id", "rank", "node_id", "step", "loss", "test_accuracy", "finished", "updated_unix",
                  "bytes_sent", "bytes_received", *COLUMNS_ADDED["members"])
class SqliteState(ControlState):
    def __init__(self, path: Path, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._specs = Specs()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        for table, columns in COLUMNS_ADDED.items():
            present = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            for column, definition in columns.items():
                if column not in present:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
        # The monitor reads the live jobs every second: by this index it never walks the ended ones' rows (a row
        # holds its spec, up to a MiB twice, stored before the state).
        self._db.execute("CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs(state, created_unix)")
        self._db.execute("CREATE INDEX IF NOT EXISTS jobs_by_end ON jobs(ended_unix)")
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- nodes ---------------------------------------------------------------------------------------------------

    def register_node(
        self, node_id: str, name: str, peer_address: str, metrics_address: str, device: str, version: str,
        device_name: str, device_memory_bytes: int,
    ) -> str:
        """Insert a new node, or bring a known one back up with its new addresses and device; returns its id."""
        now = self.clock()
        with self._tx() as db:
            known = node_id and db.execute("SELECT 1 FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
            if known:
                db.execute(
                    "UPDATE nodes SET name=?, peer_address=?, metrics_address=?, device=?, version=?, "
                    "last_seen_unix=?, up=1, device_name=?, device_memory_bytes=? WHERE node_id=?",
                    (name, peer_address, metrics_address, device, version, now, device_name, device_memory_bytes,
                     node_id),
                )
                return node_id
            node_id = node_id or f"node-{uuid.uuid4().hex[:8]}"
            db.execute(
                "INSERT INTO nodes (node_id, name, peer_address, metrics_address, device, version, registered_unix, "
                "last_seen_unix, up, device_name, device_memory_bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 1, ?, ?)",
                (node_id, name, peer_address, metrics_address, device, version, now, now, device_name,
                 device_memory_bytes),
            )
            return node_id

    def touch_node(self, node_id: str) -> tuple[bool, bool]:
        """Record a heartbeat; returns (known, came_back_up)."""
        with self._tx() as db:
            row = db.execute("SELECT up FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
            if row is None:
                return False, False
            db.execute("UPDATE nodes SET last_seen_unix=?, up=1 WHERE node_id=?", (self.clock(), node_id))
            return True, not row[0]

    def mark_silent_nodes_down(self, timeout_s: float) -> list[str]:
        cutoff = self.clock() - timeout_s
        with self._tx() as db:
            rows = db.execute("SELECT node_id FROM nodes WHERE up=1 AND last_seen_unix < ?", (cutoff,)).fetchall()
            db.executemany("UPDATE nodes SET up=0 WHERE node_id=?", rows)
        return [r[0] for r in rows]

    def nodes(self) -> list[NodeRow]:
        rows = self._query(f"SELECT {', '.join(_NODE_FIELDS)} FROM nodes ORDER BY registered_unix, rowid")
        return [_node_row(r) for r in rows]

    def node(self, node_id: str) -> NodeRow | None:
        rows = self._query(f"SELECT {', '.join(_NODE_FIELDS)} FROM nodes WHERE node_id = ?", (node_id,))
        return _node_row(rows[0]) if rows else None

    def mark_down(self, node_id: str) -> bool:
        """A node that left cleanly; whether it was up."""
        with self._tx() as db:
            return db.execute("UPDATE nodes SET up=0 WHERE node_id=? AND up=1", (node_id,)).rowcount == 1

    def set_draining(self, node_id: str, draining: bool) -> bool:
        with self._tx() as db:
            return db.execute("UPDATE nodes SET draining=? WHERE node_id=?", (int(draining), node_id)).rowcount == 1

    def remove_node(self, node_id: str) -> None:
        """Forget a node (not in a running job: the caller checks); the ended jobs it was a member of keep its
        rows."""
        with self._tx() as db:
            db.execute("DELETE FROM nodes WHERE node_id=?", (node_id,))

    # -- jobs ----------------------------------------------------------------------------------------------------

    def add_job(self, job_id: str, spec: JobSpec, spec_yaml: str, run_dir: str) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO jobs (job_id, name, spec_json, spec_yaml, state, world_size, created_unix, run_dir) "
                "VALUES (?, ?, ?, ?, 'PENDING', ?, ?, ?)",
                (job_id, spec.name, spec.to_json(), spec_yaml, spec.min_nodes, self.clock(), run_dir),
            )
        self._specs.add(job_id, spec)

    def _job(self, row: tuple) -> Job:
        """A jobs row as a Job: its spec parsed the first time the job is read (Specs)."""
        fields = dict(zip(_JOB_FIELDS, row, strict=True))
        job_id = fields["job_id"]
        spec = self._specs.spec(job_id, fields.pop("spec_json"))
        running = self._specs.running(job_id, spec, fields["topology_json"], fields["topology_version"])
        return Job(**{**fields, "state": JobState(fields["state"])}, spec=spec, running_spec=running)

    def job(self, job_id: str) -> Job | None:
        rows = self._query(f"SELECT {', '.join(_JOB_FIELDS)} FROM jobs WHERE job_id = ?", (job_id,))
        return self._job(rows[0]) if rows else None

    def latest_job(self) -> Job | None:
        rows = self._query(f"SELECT {', '.join(_JOB_FIELDS)} FROM jobs ORDER BY created_unix DESC LIMIT 1")
        return self._job(rows[0]) if rows else None

    def find_job(self, reference: str) -> Job | None:
        fields = ", ".join(_JOB_FIELDS)
        for query, argument in (
            (f"SELECT {fields} FROM jobs WHERE job_id = ?", reference),
            (f"SELECT {fields} FROM jobs WHERE name = ? ORDER BY created_unix DESC LIMIT 1", reference),
            (f"SELECT {fields} FROM jobs WHERE substr(job_id, 1, ?) = ? LIMIT 2", None),
        ):
            rows = self._query(query, (len(reference), reference) if argument is None else (argument,))
            if len(rows) == 1:
                return self._job(rows[0])
        return None

    def job_ids_starting(self, prefix: str, limit: int) -> list[str]:
        rows = self._query("SELECT job_id FROM jobs WHERE substr(job_id, 1, ?) = ? ORDER BY created_unix DESC LIMIT ?",
                           (len(prefix), prefix, limit))
        return [row[0] for row in rows]

    def all_jobs(self, limit: int) -> list[Job]:
        rows = self._query(f"SELECT {', '.join(_JOB_FIELDS)} FROM jobs ORDER BY created_unix DESC LIMIT ?", (limit,))
        return [self._job(r) for r in rows]

    def jobs(self, states: Iterable[JobState]) -> list[Job]:
        wanted = tuple(JobState(state).value for state in states)
        marks = ",".join("?" * len(wanted))
        rows = self._query(f"SELECT {', '.join(_JOB_FIELDS)} FROM jobs WHERE state IN ({marks}) ORDER BY created_unix",
                           wanted)
        return [self._job(r) for r in rows]

    def job_counts(self) -> dict[JobState, int]:
        return {JobState(state): count for state, count in
                self._query("SELECT state, COUNT(*) FROM jobs GROUP BY state")}

    def ended_job_ids(self) -> list[str]:
        ended = tuple(state.value for state in JobState if state not in ACTIVE_JOB_STATES)
        rows = self._query(f"SELECT job_id FROM jobs WHERE state IN ({','.join('?' * len(ended))}) "
                           "ORDER BY ended_unix DESC, rowid DESC", ended)
        return [row[0] for row in rows]

    def delete_job(self, job_id: str) -> bool:
        with self._tx() as db:
            row = db.execute("SELECT state FROM jobs WHERE job_id=?", (job_id,)).fetchone()
            if row is None or JobState(row[0]) in ACTIVE_JOB_STATES:
                return False
            db.execute("DELETE FROM members WHERE job_id=?", (job_id,))
            db.execute("DELETE FROM jobs WHERE job_id=?", (job_id,))
        self._specs.forget(job_id)
        return True

    def end_job(self, job_id: str, state: JobState, reason: str = "") -> bool:
        with self._tx() as db:
            row = db.execute("SELECT state FROM jobs WHERE job_id=?", (job_id,)).fetchone()
            if row is None or JobState(row[0]) not in ACTIVE_JOB_STATES:
                return False
            check_job_move(job_id, JobState(row[0]), state)
            db.execute("UPDATE jobs SET state=?, reason=?, ended_unix=? WHERE job_id=?",
                       (state.value, reason, self.clock(), job_id))
            return True

    def change_topology(self, job_id: str, topology_json: str, version: int, switch_step: int) -> bool:
        with self._tx() as db:
            cursor = db.execute(
                "UPDATE jobs SET topology_json=?, topology_version=?, switch_step=? "
                "WHERE job_id=? AND state='RUNNING' AND topology_version=?",
                (topology_json, version, switch_step, job_id, version - 1),
            )
            return cursor.rowcount == 1

    def set_pending_reason(self, job_id: str, reason: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE jobs SET reason=? WHERE job_id=? AND state='PENDING'", (reason, job_id))

    def start_job(self, job_id: str, node_ids: list[str]) -> None:
        with self._tx() as db:
            row = db.execute("SELECT state FROM jobs WHERE job_id=?", (job_id,)).fetchone()
            check_job_move(job_id, JobState(row[0]) if row else JobState.FAILED, JobState.RUNNING)
            db.executemany(
                "INSERT INTO members (job_id, rank, node_id) VALUES (?, ?, ?)",
                [(job_id, rank, node_id) for rank, node_id in enumerate(node_ids)],
            )
            db.execute("UPDATE jobs SET state='RUNNING', reason='', started_unix=?, world_size=? WHERE job_id=?",
                       (self.clock(), len(node_ids), job_id))

    def change_members(self, job_id: str, version: int, switch_step: int, joined: list[tuple[int, str]],
                       left: list[int]) -> bool:
        with self._tx() as db:
            cursor = db.execute(
                "UPDATE jobs SET topology_version=?, switch_step=? WHERE job_id=? AND state='RUNNING' "
                "AND topology_version=?", (version, switch_step, job_id, version - 1))
            if cursor.rowcount != 1:
                return False
            for rank in left:
                check_member_move(job_id, rank, _member_state(db, job_id, rank), MemberState.LEFT)
            db.executemany("UPDATE members SET left_unix=? WHERE job_id=? AND rank=? AND left_unix=0",
                           [(self.clock(), job_id, rank) for rank in left])
            db.executemany(
                "INSERT OR REPLACE INTO members (job_id, rank, node_id, joined_step) VALUES (?, ?, ?, ?)",
                [(job_id, rank, node_id, switch_step) for rank, node_id in joined])
            db.execute("UPDATE jobs SET world_size=(SELECT COUNT(*) FROM members WHERE job_id=? AND left_unix=0) "
                       "WHERE job_id=?", (job_id, job_id))
            return True

    def record_failure(self, job_id: str, rank: int, node_id: str, reason: str) -> bool:
        with self._tx() as db:
            held = db.execute("SELECT 1 FROM members WHERE job_id=? AND rank=? AND node_id=? AND left_unix=0",
                              (job_id, rank, node_id)).fetchone()
            if held is None:
                return False
            check_member_move(job_id, rank, _member_state(db, job_id, rank), MemberState.FAILED)
            cursor = db.execute("UPDATE members SET failure=? WHERE job_id=? AND rank=? AND node_id=? AND left_unix=0",
                                (reason, job_id, rank, node_id))
            return cursor.rowcount == 1

    def mark_ready(self, job_id: str, rank: int, node_id: str, data_json: str) -> Readiness | None:
        with self._tx() as db:
            row = db.execute(
                "SELECT j.data_json, j.released_unix FROM jobs j JOIN members m ON m.job_id = j.job_id "
                "WHERE j.job_id=? AND j.state='RUNNING' AND m.rank=? AND m.node_id=? AND m.left_unix=0",
                (job_id, rank, node_id),
            ).fetchone()
            if row is None:
                return None
            agreed, released = row[0] or data_json, row[1]
            if agreed != data_json:
                return Readiness(agreed, released > 0, released_now=False)
            now = self.clock()
            db.execute("UPDATE members SET ready_unix=? WHERE job_id=? AND rank=? AND ready_unix=0",
                       (now, job_id, rank))
            db.execute("UPDATE jobs SET data_json=? WHERE job_id=? AND data_json=''", (data_json, job_id))
            waiting = db.execute("SELECT 1 FROM members WHERE job_id=? AND ready_unix=0 AND left_unix=0 LIMIT 1",
                                 (job_id,)).fetchone()
            released_now = not released and waiting is None
            if released_now:
                db.execute("UPDATE jobs SET released_unix=? WHERE job_id=?", (now, job_id))
            return Readiness(agreed, released > 0 or released_now, released_now)

    def busy_node_ids(self) -> set[str]:
        rows = self._query(
            "SELECT m.node_id FROM members m JOIN jobs j ON j.job_id = m.job_id WHERE j.state = 'RUNNING' "
            "AND m.left_unix = 0"
        )
        return {r[0] for r in rows}

    def members(self, job_id: str, with_left: bool = False) -> list[MemberRow]:
        rows = self._query(f"SELECT {', '.join(_MEMBER_FIELDS)} FROM members WHERE job_id = ? "
                           f"{'' if with_left else 'AND left_unix = 0 '}ORDER BY rank", (job_id,))
        members = []
        for row in rows:
            f = dict(zip(_MEMBER_FIELDS, row, strict=True))
            progress = Progress(
                job=job_id, rank=f["rank"], node=f["node_id"], step=f["step"], loss=_float(f["loss"]),
                test_accuracy=_float(f["test_accuracy"]), test_loss=_float(f["test_loss"]), elapsed_s=f["elapsed_s"],
                finished=bool(f["finished"]), bytes_sent=f["bytes_sent"], bytes_received=f["bytes_received"],
                compute_s=f["compute_s"], wait_s=f["wait_s"], exchanges=f["exchanges"],
                exchange_failures=f["exchange_failures"], time=f["updated_unix"], local_steps=f["local_steps"],
                test_perplexity=_float(f["test_perplexity"]),
            )
            members.append(MemberRow(job_id, f["rank"], f["node_id"], progress, f["failure"], f["ready_unix"] > 0,
                                     f["joined_step"], f["left_unix"] > 0))
        return members

    def running_membership(self, node_id: str) -> tuple[Job, int] | None:
        rows = self._query(
            f"SELECT {', '.join('j.' + field for field in _JOB_FIELDS)}, m.rank FROM members m JOIN jobs j "
            "ON j.job_id = m.job_id "
            "WHERE m.node_id = ? AND j.state = 'RUNNING' AND m.left_unix = 0",
            (node_id,),
        )
        return (self._job(rows[0][:-1]), rows[0][-1]) if rows else None

    def record_progress(self, progress: Progress) -> Progress | None:
        with self._tx() as db:
            row = db.execute("SELECT traffic_json FROM members WHERE job_id=? AND rank=? AND node_id=? AND left_unix=0",
                             (progress.job, progress.rank, progress.node)).fetchone()
            if row is None:
                return None
            traffic = TrafficLedger.from_json(row[0])
            p = traffic.add(progress)
            db.execute(
                "UPDATE members SET step=?, loss=?, test_accuracy=COALESCE(?, test_accuracy), "
                "test_loss=COALESCE(?, test_loss), test_perplexity=COALESCE(?, test_perplexity), finished=?, "
                "updated_unix=?, bytes_sent=?, bytes_received=?, elapsed_s=?, compute_s=?, wait_s=?, exchanges=?, "
                "exchange_failures=?, local_steps=?, traffic_json=? WHERE job_id=? AND rank=? AND node_id=? "
                "AND left_unix=0",
                (p.step, _null(p.loss), _null(p.test_accuracy), _null(p.test_loss), _null(p.test_perplexity),
                 int(p.finished), p.time, p.bytes_sent, p.bytes_received, p.elapsed_s, p.compute_s, p.wait_s,
                 p.exchanges, p.exchange_failures, p.local_steps, traffic.to_json(), p.job, p.rank, p.node),
            )
            return p


def _member_state(db: sqlite3.Connection, job_id: str, rank: int) -> MemberState:
    failure, finished, ready_unix, left_unix = db.execute(
        "SELECT failure, finished, ready_unix, left_unix FROM members WHERE job_id=? AND rank=?",
        (job_id, rank)).fetchone()
    if left_unix:
        return MemberState.LEFT
    if failure:
        return MemberState.FAILED
    if finished:
        return MemberState.FINISHED
    return MemberState.READY if ready_unix else MemberState.JOINED


def _node_row(row: tuple) -> NodeRow:
    fields = dict(zip(_NODE_FIELDS, row, strict=True))
    return NodeRow(**{**fields, "up": bool(fields["up"]), "draining": bool(fields["draining"])})


def _null(value: float) -> float | None:
    """NaN (not measured) as SQL NULL."""
    return None if math.isnan(value) else value


def _float(value: float | None) -> float:
    return math.nan if value is None else value
