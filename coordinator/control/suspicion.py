"""How much the coordinator suspects a member of sending wrong numbers (issue 28), from what the others report. Sans
I/O: counts in, a score out, on the caller's clock.

A reporter is a member whose robust rule judged another's contributions (a neighbour, per edge: its
`robust_outlying` next to its `robust_judged`, nodeagent.robust), or the parameter server (reporter
SERVER_REPORTER: per worker, the pushes its rule flagged next to the pushes it took). The counts are cumulative; the
tracker keeps each reporter's increments over the last `window_s` seconds.

A reporter's share: the outlying contributions of the member in the window over the contributions it judged in the
window (at most 1), once it judged at least MIN_CONTRIBUTIONS there. The member's suspicion: the lower median
of its reporters' shares, so it is suspected only when a majority of those that judged it agree (for a member with
one honest and one lying neighbour, the liar's word alone is not enough: a liar cannot get an honest node blamed
without a majority of its neighbours). A member judged by one neighbour only is not scored (that one may be the
liar); the parameter server's word counts alone. NaN: not enough judged yet. A liar that shares an honest member's
judges could skew their judgement itself, by sending each its own state back, which shrinks the scale they judge
against: a node that takes local steps reports a neighbour only where it is also far on the scale of its own steps,
which no neighbour can shrink (nodeagent.robust, "echoes"; docs/operations.md, "A known limit").
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

SERVER_REPORTER = -1  # the parameter server, as the reporter of its workers' pushes
MIN_CONTRIBUTIONS = 5  # a reporter's contributions of a member in the window before its share counts
MIN_PEER_JUDGES = 2  # neighbours whose shares count before a member is scored


@dataclass
class _Reporter:
    outlying: int = 0  # the cumulative counts last reported
    received: int = 0
    increments: deque[tuple[float, int, int]] = field(default_factory=deque)  # (time, outlying, received)


class Suspicion:
    def __init__(self) -> None:
        self._jobs: dict[str, dict[int, dict[int, _Reporter]]] = {}  # job -> member -> reporter -> counts

    def observe(self, job_id: str, reporter: int, member: int, outlying: int, received: int, now: float) -> None:
        """`reporter`'s cumulative counts of `member`'s contributions: `outlying` of the `received`."""
        counts = self._jobs.setdefault(job_id, {}).setdefault(member, {}).setdefault(reporter, _Reporter())
        added_outlying, added_received = outlying - counts.outlying, received - counts.received
        if added_outlying < 0 or added_received < 0:  # the reporter restarted: its counts began again
            added_outlying, added_received = outlying, received
        counts.outlying, counts.received = outlying, received
        if added_outlying or added_received:
            counts.increments.append((now, added_outlying, added_received))

    def score(self, job_id: str, member: int, now: float, window_s: float) -> float:
        """`member`'s suspicion over the last `window_s` seconds (see the module's text)."""
        shares = []
        reporters = self._jobs.get(job_id, {}).get(member, {})
        for reporter, counts in reporters.items():
            while counts.increments and counts.increments[0][0] < now - window_s:
                counts.increments.popleft()
            outlying = sum(i[1] for i in counts.increments)
            received = sum(i[2] for i in counts.increments)
            if received >= MIN_CONTRIBUTIONS:
                if reporter == SERVER_REPORTER:
                    return min(1.0, outlying / received)
                shares.append(min(1.0, outlying / received))
        if len(shares) < MIN_PEER_JUDGES:
            return math.nan
        return sorted(shares)[(len(shares) - 1) // 2]

    def forget_reporter(self, job_id: str, reporter: int) -> None:
        """A quarantined member's word about the others counts no more."""
        for reporters in self._jobs.get(job_id, {}).values():
            reporters.pop(reporter, None)

    def forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)
