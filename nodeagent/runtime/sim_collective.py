"""The simulator's all-reduce (and all-gather): the agents' quorum policy in virtual time, with the simulation's
faults (a node down, a partition) as lost members. The decisions are the agents' own pure rules: `may_close`
(nodeagent.agent.quorum) closes a quorum, `agree` (nodeagent.agent.agreement) picks the state a new quorum goes on
from; only their inputs come from the virtual clock instead of a store.

A quorum (its number, its members, all at the same step) takes rounds. A round completes once every member
contributed (its message, and its state at that moment, as the agent takes it when the collective is asked for) and
every member is up and reachable from the others: the round is committed and each member receives the mean (or every
member's tensors) after a ring's time: its bytes, a latency per step of the ring, and one message's fixed cost. A
round not complete `step_timeout_s` after its first contribution (a member down or cut off) is aborted, applied
nowhere, and the next quorum is formed from the ranks that contributed, are up and reach each other (the largest
such group), once `may_close` allows (every rank there, or `min_members` and `join_s` waited by the rank there
longest; looked at as the agents poll the store, PRESENCE_POLL_S after a rank came and every `join_s`, for at most
`wait_s`, after which the job is left unfinished as the agents' GroupLost would fail it). A new quorum agrees on the
state: a rank whose key is not the best is answered the best one's state (a PARAMS message) and contributes again
from it; the others' contributions stand. A rank that contributes while it is not a member (it was lost when the
quorum formed) waits; the members' next round carries their flag of it, they leave after that round and form the
next quorum with it. A rank that comes to a quorum after every member finished takes their final state at once (the
agents' hand-over).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nodeagent.agent.agreement import MemberState, StateKey, agree
from nodeagent.agent.quorum import PRESENCE_POLL_S, QuorumOptions, may_close
from nodeagent.algorithms.base import ALLREDUCE_RANK, Route
from nodeagent.runtime.driver import Reply, Transmission
from nodeagent.runtime.progress import ring_allgather_bytes, ring_allreduce_bytes
from nodeagent.wire.message import Kind, Message

if TYPE_CHECKING:
    from nodeagent.runtime.simulator import SimNode, VirtualMesh


@dataclass(frozen=True)
class Contribution:
    transmission: Transmission
    message: Message
    state: MemberState  # the member's state when it contributed, for a new quorum's agreement


class SimulatedQuorum:
    def __init__(self, mesh: VirtualMesh, options: QuorumOptions, tell: Callable[[str], None] = lambda line: None):
        self.mesh = mesh
        self.options = options
        self.tell = tell
        world = len(mesh.nodes)
        self.number = 0  # the job's first quorum: every rank, from the same seeded model (nothing to agree on)
        self.members: tuple[int, ...] = tuple(range(world))
        self.held_in = [0] * world
        self.parts: dict[int, Contribution] = {}  # this round's contributions of the members
        self.waiting: dict[int, Contribution] = {}  # ranks not in the quorum, in their collective call
        self.arrived: dict[int, float] = {}  # when each waiting rank came to the quorum being formed
        self.forming_since: float | None = None  # the members left: the next quorum is being formed
        self.round = 0  # counts rounds and quorums, so that a timeout looks at the round it was set for
        self.watchdog: int | None = None  # the mesh's event that aborts the round under way if it is not complete
        self.aborted = 0  # rounds applied nowhere
        self.quorums: list[tuple[int, ...]] = [self.members]  # every quorum's members, in order

    # -- what the mesh calls -----------------------------------------------------------------------------------

    def contribute(self, sim: SimNode, t: Transmission) -> None:
        assert isinstance(t.send.message, Message)
        message = self.mesh.forged(t.send.message)  # a liar's (simulation.byzantine) contribution is its forgery
        algorithm = sim.node.algorithm
        part = Contribution(t, message, MemberState(algorithm.group_state(), algorithm.round_applied()))
        if self.forming_since is None and sim.rank in self.members:
            first = not self.parts
            self.parts[sim.rank] = part
            if first:
                self._watch()
            self._complete()
        else:
            self._wait(sim.rank, part)
            self._hand_over()
            self._look_soon()

    # -- rounds ----------------------------------------------------------------------------------------------------

    def _complete(self) -> None:
        if len(self.parts) < len(self.members) or not self._connected(self.members):
            return
        leave = any(self._up(rank) for rank in self.waiting)  # every member's flag of a waiting rank, alike
        parts = [self.parts[rank] for rank in self.members]
        self.parts = {}
        self.round += 1
        self._unwatch()
        message, t = parts[0].message, parts[0].transmission
        gather = t.send.route == Route.ALLGATHER
        count = len(self.members)
        if gather:
            share = ring_allgather_bytes(message.payload_bytes, count)
            latencies = count - 1
        else:
            share = ring_allreduce_bytes(message.payload_bytes, count)
            latencies = 2 * (count - 1)
        network = self.mesh.network
        # A ring's steps are gloo's, each a latency; the fixed cost of a message (the hand-off to the collective's
        # thread and the runner's wake-up) is paid once a round: charged per step, a 2-member all-reduce of logistic
        # regression ran at 0.59 times the agents' rate (benchmarks/rounds.py --nodes 2), once 1.03 times.
        duration = share / network.bandwidth_bytes_per_s + latencies * network.latency_s + network.message_cost_s
        stacked = {name: torch.stack([p.message.tensors[name] for p in parts]) for name in message.tensors}
        result = stacked if gather else {name: tensor.mean(dim=0) for name, tensor in stacked.items()}
        for index, (rank, part) in enumerate(zip(self.members, parts, strict=True)):
            self.held_in[rank] = self.number
            node = self.mesh.nodes[rank]
            self.mesh.count(node, self.mesh.nodes[self.members[(index + 1) % count]], share)
            reply = Reply(part.transmission, Message(part.transmission.send.kind, ALLREDUCE_RANK, rank, result,
                                                     clock=part.message.clock,
                                                     members=self.members if gather else ()))
            self.mesh.at(self.mesh.now + duration, lambda node=node, reply=reply: self.mesh.arrive(node, reply))
        if leave:  # every member saw the flags: the next quorum is formed with the waiting ranks
            self._leave()

    def _watch(self) -> None:
        """The round under way is aborted if it is not complete `step_timeout_s` from now."""
        round_ = self.round
        self.watchdog = self.mesh.at(self.mesh.now + self.options.step_timeout_s, lambda: self._timeout(round_))

    def _unwatch(self) -> None:
        """The round completed: its watchdog neither fires nor holds the virtual clock until its time (a job's last
        round would end it `step_timeout_s` late)."""
        if self.watchdog is not None:
            self.mesh.cancel(self.watchdog)
            self.watchdog = None

    def _timeout(self, round_: int) -> None:
        self.watchdog = None  # it fired: there is nothing left to cancel
        if round_ != self.round or self.forming_since is not None:
            return  # that round completed (or was aborted) already
        self.aborted += 1
        self.tell(f"the all-reduce round of quorum {self.number} {list(self.members)} was not complete within "
                  f"{self.options.step_timeout_s:g} s: applied nowhere")
        self.round += 1
        for rank, part in self.parts.items():
            self._wait(rank, part)
        self.parts = {}
        self._leave()

    def _wait(self, rank: int, part: Contribution) -> None:
        self.waiting[rank] = part
        self.arrived[rank] = self.mesh.now
        back = self.mesh.down_until(rank, self.mesh.now)
        if back is not None:  # a rank lost in its call knocks when it comes back
            self.mesh.at(back, self._came_back)

    def _came_back(self) -> None:
        self._hand_over()
        self._try_close()

    def _leave(self) -> None:
        self.forming_since = self.mesh.now
        self._look_soon()

    def _look_soon(self) -> None:
        """Look at who came after the agents' poll interval: ranks that come at once are seen together."""
        round_ = self.round
        self.mesh.at(self.mesh.now + PRESENCE_POLL_S, lambda: self._look_again(round_))

    # -- forming a quorum ------------------------------------------------------------------------------------------

    def _try_close(self) -> None:
        since = self.forming_since
        if since is None:
            return
        present = self._largest_group([rank for rank in self.waiting if self._up(rank)])
        # As on agents, the rank there longest closes the quorum once it has waited the join time.
        waited = self.mesh.now - min((self.arrived[rank] for rank in present), default=since)
        if not present or not may_close(self.number + 1, len(present), len(self.mesh.nodes), waited, self.options):
            if self.mesh.now - since < self.options.wait_s:  # look again (as the agents poll the store), within it
                round_ = self.round
                self.mesh.at(self.mesh.now + self.options.join_s, lambda: self._look_again(round_))
            return
        self.number += 1
        self.round += 1
        self.members = tuple(sorted(present))
        self.quorums.append(self.members)
        self.forming_since = None
        parts = {rank: self.waiting.pop(rank) for rank in self.members}
        for rank in self.members:
            del self.arrived[rank]
        keys = [StateKey(self.held_in[rank], parts[rank].state.message.clock, parts[rank].state.applied)
                for rank in self.members]
        agreement = agree(keys, first_quorum=False)
        for rank in self.members:
            self.held_in[rank] = self.number
        if agreement.source is not None:
            source = parts[self.members[agreement.source]].state.message
            for rank, key in zip(self.members, keys, strict=True):
                if key.rank != agreement.best.rank:  # it takes the job up from the source's state
                    self._hand_state(rank, parts.pop(rank).transmission, source)
        self.parts = parts
        if parts:
            self._watch()
        self._complete()

    def _look_again(self, round_: int) -> None:
        if round_ == self.round:
            self._hand_over()
            self._try_close()

    def _hand_over(self) -> None:
        """Ranks waiting after every member finished take the final state of the lowest member."""
        finished = [rank for rank in self.members if self.mesh.nodes[rank].done]
        if len(finished) < len(self.members) or not finished:
            return
        final = self.mesh.nodes[finished[0]].node.algorithm.group_state()
        for rank in [rank for rank in self.waiting if self._up(rank)]:
            del self.arrived[rank]
            self._hand_state(rank, self.waiting.pop(rank).transmission, final)

    def _hand_state(self, rank: int, t: Transmission, state: Message) -> None:
        node = self.mesh.nodes[rank]
        size = state.payload_bytes
        self.mesh.count(self.mesh.nodes[self.members[0]], node, size)
        taken = Message(Kind.PARAMS, ALLREDUCE_RANK, rank, dict(state.tensors), clock=state.clock)
        duration = size / self.mesh.network.bandwidth_bytes_per_s + self.mesh.network.latency_s + \
            self.mesh.network.message_cost_s
        self.mesh.at(self.mesh.now + duration, lambda: self.mesh.arrive(node, Reply(t, taken)))

    # -- faults ----------------------------------------------------------------------------------------------------

    def _up(self, rank: int) -> bool:
        return self.mesh.down_until(rank, self.mesh.now) is None

    def _connected(self, ranks: tuple[int, ...]) -> bool:
        return all(self.mesh.reachable(ranks[0], rank, self.mesh.now) for rank in ranks[1:]) and self._up(ranks[0])

    def _largest_group(self, ranks: list[int]) -> list[int]:
        """The largest group of `ranks` that reach each other now (the lowest rank's on a tie)."""
        groups: list[list[int]] = []
        for rank in sorted(ranks):
            group = next((g for g in groups if self.mesh.reachable(g[0], rank, self.mesh.now)), None)
            if group is None:
                groups.append([rank])
            else:
                group.append(rank)
        return max(groups, key=len, default=[])
