"""A member's traffic over its whole part in a job, from the counters its agent reports.

An agent's counters are its own run's: they start at zero when the agent restarts (and rejoins its job), and a
topology switch drops from its reports the edges to the neighbours it left. The coordinator adds them up here, so
that a rank's per-edge bytes add up to its total whatever happened to it: each report's counters replace the last
ones of the same run, an edge that a report no longer names keeps what it carried, and a report whose counters went
back (a new run of the agent) closes the last run, whose figures are carried over.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from nodeagent.jobspec import MAX_NODES
from nodeagent.runtime.progress import EdgeCounters, Progress

Bytes = tuple[int, int]  # sent, received
# The most peers a member's ledger keeps: a node's neighbours over the whole job (at most every other node) and the
# parameter server or the all-reduce. A report naming others (a broken or hostile agent) grows it no further.
MAX_PEERS = MAX_NODES + 1


@dataclass
class TrafficLedger:
    earlier: Bytes = (0, 0)  # the totals of the agent's earlier runs in the job
    earlier_edges: dict[str, Bytes] = field(default_factory=dict)  # per peer, of its earlier runs
    last: Bytes = (0, 0)  # the totals of its current run at its last report
    last_edges: dict[str, Bytes] = field(default_factory=dict)  # per peer, at the last report of this run that named it
    last_elapsed_s: float = 0.0

    def add(self, progress: Progress) -> Progress:
        """Take a report in; returns it with the traffic of the member's whole part in the job: totals, and every
        edge it ever had (an edge the report does not name carries only its bytes)."""
        if self._restarted(progress):
            self.earlier = _plus(self.earlier, self.last)
            for peer, carried in self.last_edges.items():
                self.earlier_edges[peer] = _plus(self.earlier_edges.get(peer, (0, 0)), carried)
            self.last_edges = {}
        self.last = (progress.bytes_sent, progress.bytes_received)
        self.last_elapsed_s = progress.elapsed_s
        for edge in progress.edges:
            if edge.peer in self.last_edges or edge.peer in self.earlier_edges or self._peers() < MAX_PEERS:
                self.last_edges[edge.peer] = (edge.bytes_sent, edge.bytes_received)
        sent, received = _plus(self.earlier, self.last)
        totals = {peer: _plus(self.earlier_edges.get(peer, (0, 0)), self.last_edges.get(peer, (0, 0)))
                  for peer in {*self.earlier_edges, *self.last_edges}}
        reported = {edge.peer for edge in progress.edges}
        edges = [dataclasses.replace(edge, bytes_sent=totals[edge.peer][0], bytes_received=totals[edge.peer][1])
                 if edge.peer in totals else edge for edge in progress.edges]
        edges += [EdgeCounters(peer, *totals[peer]) for peer in totals if peer not in reported]
        return dataclasses.replace(progress, bytes_sent=sent, bytes_received=received,
                                   edges=tuple(sorted(edges, key=lambda edge: edge.peer)))

    def _peers(self) -> int:
        return len(self.last_edges.keys() | self.earlier_edges.keys())

    def _restarted(self, progress: Progress) -> bool:
        """A new run of the agent: its counters, which only grow within a run, went back."""
        return (progress.elapsed_s < self.last_elapsed_s or progress.bytes_sent < self.last[0]
                or progress.bytes_received < self.last[1])

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> TrafficLedger:
        if not text:
            return cls()
        fields = json.loads(text)
        return cls(tuple(fields["earlier"]), {p: tuple(b) for p, b in fields["earlier_edges"].items()},
                   tuple(fields["last"]), {p: tuple(b) for p, b in fields["last_edges"].items()},
                   fields["last_elapsed_s"])


def _plus(a: Bytes, b: Bytes) -> Bytes:
    return a[0] + b[0], a[1] + b[1]
