"""ESync: synchronous rounds sized for heterogeneous workers.

Worker: each round starts from the global model; the worker runs local SGD steps (lr is the local lr; momentum
and Nesterov apply to the local steps), reports the first one (a `StepReport`; the node driver stamps the step's
duration on the call) and waits for the answer. Not READY: the answer says how many steps to run before reporting again
(nodeagent.ps.steps_before_asking). READY: it pushes delta = w_local - w_global (Kind.DELTA) and waits for the
next global model. Its clock counts rounds, so a job's `steps` is the number of
rounds and `eval_every` counts rounds; `local_steps` counts the local steps.

Server: nodeagent.ps.ESyncServer. READY is nodeagent.ps.is_ready, a pure function of the reported step counts,
durations and end times, epsilon and the time (`now`: the coordinator's monotonic clock, or the simulator's
virtual clock); once every delta is in, w <- w + global_lr * mean(delta_i) and the next round starts.

Options (algorithm.options): epsilon (0.5 s), global_lr (1.0), and max_update_norm (unset) as every
parameter-server algorithm: it bounds each worker's delta.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import nn

from nodeagent.algorithms.base import NodeContext, Route, Send
from nodeagent.ps.esync import Decision, ESyncServer
from nodeagent.ps.messages import SERVER_RANK, ReadyAnswer, ServerAnswer, ServerModel, ServerPush, StepReport
from nodeagent.ps.rules import ParameterServer, ProtocolError, PushResult
from nodeagent.ps.server import ServerHalf, ServerOptions
from nodeagent.ps.worker import PSWorker
from nodeagent.wire.message import Kind, Message


class ESyncOptions(ServerOptions):
    epsilon: float = Field(0.5, ge=0, description="seconds: a worker is READY when one more of its steps would "
                           "end within epsilon of the round's end")
    global_lr: float = Field(1.0, gt=0, description="the server's step: w <- w + global_lr * mean(delta_i)")


class ESyncServerHalf(ServerHalf):
    synchronous = True
    push_kind = Kind.DELTA
    options: ESyncOptions

    def build_rule(self, w0: torch.Tensor) -> ParameterServer:
        return ESyncServer(w0, self.num_workers, global_lr=self.options.global_lr, epsilon=self.options.epsilon,
                           max_update_norm=self.update_bound(self.options.global_lr),
                           robust=self.spec.algorithm.robust)

    @property
    def esync(self) -> ESyncServer:
        assert isinstance(self.rule, ESyncServer)
        return self.rule

    def apply(self, rank: int, update: torch.Tensor, worker_version: int, now: float) -> PushResult:
        return self.esync.push(rank, update, worker_version, now)

    def pull(self, rank: int, since_version: int, delta: bool, now: float) -> ServerModel:
        # A worker pulls between rounds, or to rejoin the current one: then it starts the round again.
        if not self.holds_update(rank) and self.esync.round.restart(rank, now):
            self.events.append({"event": "rejoin", "time": now, "rank": rank, "version": self.version})
        return super().pull(rank, since_version, delta, now)

    def push(self, rank: int, push: ServerPush, push_id: str, now: float) -> PushResult:
        result = super().push(rank, push, push_id, now)
        if result.applied:
            self.events.append({"event": "round", "time": now, "version": result.version})
        return result

    def round_state(self) -> dict[str, torch.Tensor]:
        round_ = self.esync.round
        return {
            "steps": torch.tensor([r.steps for r in round_.reports], dtype=torch.int64),
            "durations": torch.tensor([r.duration for r in round_.reports], dtype=torch.float64),
            "ends": torch.tensor([r.end for r in round_.reports], dtype=torch.float64),
            "ready": torch.tensor(round_.ready, dtype=torch.bool),
            "asked_after": torch.tensor(round_.asked_after, dtype=torch.int64),
        }

    def report(self, rank: int, version: int, round_step: int, duration_s: float, now: float) -> Decision:
        """The decision for worker `rank`, which has done `round_step` steps of round `version`; a retry of the
        last report gets the same answer."""
        self.check_rank(rank)
        if version != self.version:
            raise ProtocolError(f"rank {rank} reported a step of round {version}, the round is {self.version}")
        round_ = self.esync.round
        done = round_.reports[rank].steps
        if round_step == done and done > 0:
            return round_.answer(rank)
        # More steps than the last answer asked for are accepted (a worker whose report failed stepped on).
        if round_step <= done:
            raise ProtocolError(f"rank {rank} reported step {round_step} of the round after step {done}")
        return self.esync.report(rank, duration_s, now, round_step)


class ESync(PSWorker):
    """Synchronous parameter-server rounds sized for heterogeneous workers: the server tells fast workers how many
    local steps fit (ESync)."""

    name = "esync"
    modes = ("sync",)
    server_half = ESyncServerHalf
    Options = ESyncOptions
    refuses_momentum = ""  # the local steps are plain local SGD, with momentum if asked
    robust_rules = ("centered-clip", "trimmed-mean", "median", "krum")
    robust_refusal = "self-centered-clip is the peer-to-peer family's; the server aggregates the workers' updates"

    def __init__(self, model: nn.Module, context: NodeContext, loss_fn: nn.Module | None = None):
        super().__init__(model, context, loss_fn)
        self.round_start = self.w.detach().clone()  # the global model this round started from
        self.round_steps = 0
        self.local_steps = 0
        self.report_at = 1  # the round step after which the next report goes out
        self.asking = False  # a step report is out and its answer has not come

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss, grad = self.gradient(inputs, targets)
        self.last_loss = loss
        with torch.no_grad():
            self.w.sub_(self.sgd_direction(grad), alpha=self.spec.lr)
        self.round_steps += 1
        self.local_steps += 1
        if self.round_steps < self.report_at:
            return loss
        report = StepReport(self.version, self.round_steps)
        self._outbox = [Send(Route.SERVER, SERVER_RANK, Kind.DELTA, report)]
        self.asking = True
        return loss

    def receive(self, message: Message | ServerAnswer) -> None:
        if not isinstance(message, ReadyAnswer):
            super().receive(message)  # the next global model: a round is complete
            self.round_start.copy_(self.w)
            self.round_steps = 0
            self.report_at = 1
            return
        if not self.asking:
            raise RuntimeError(f"rank {self.context.rank}: a READY answer arrived with no step report out")
        self.asking = False
        if not message.ready:
            self.report_at = self.round_steps + max(1, message.steps_before_asking)
        else:
            delta = self.w.detach() - self.round_start
            self._outbox = [self.push(self.params.views(delta), Kind.DELTA)]
            self.waiting = True

    def ready(self) -> bool:
        return not self.waiting and not self.asking

    def waiting_for(self) -> str:
        if self.asking:
            return f"the server's answer to its report of step {self.round_steps} of round {self.version}"
        return super().waiting_for()

    def failed(self, send: Send, reason: str) -> None:
        if isinstance(send.message, StepReport):
            self.asking = False
            self.rejoin()
        else:
            super().failed(send, reason)

    def load_state_dict(self, state) -> None:
        # A restored worker starts a fresh round from its checkpointed model.
        super().load_state_dict(state)
        self.round_start.copy_(self.w)
        self.round_steps = 0
        self.report_at = 1
