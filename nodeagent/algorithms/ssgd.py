"""SSGD: every step each worker pushes its gradient; the server waits for all of them,
applies w <- w - lr * mean(g), and every worker pulls w.

Worker: `PSWorker` (push the gradient, wait for the model). Server: nodeagent.ps.SSGDServer, one round at a time;
a push answers only once the round completes, so the slowest worker sets the pace.
"""

from __future__ import annotations

import torch

from nodeagent.ps.rules import ParameterServer, SSGDServer
from nodeagent.ps.server import ServerHalf
from nodeagent.ps.worker import PSWorker


class SSGDServerHalf(ServerHalf):
    synchronous = True

    def build_rule(self, w0: torch.Tensor) -> ParameterServer:
        return SSGDServer(w0, self.num_workers, self.spec.algorithm.lr,
                          max_update_norm=self.update_bound(self.spec.algorithm.lr), robust=self.spec.algorithm.robust)


class SSGD(PSWorker):
    """Synchronous parameter-server SGD: the server averages every worker's gradient each step."""

    name = "ssgd"
    modes = ("sync",)
    server_half = SSGDServerHalf
    robust_rules = ("centered-clip", "trimmed-mean", "median", "krum")
    robust_refusal = "self-centered-clip is the peer-to-peer family's; the server aggregates the workers' updates"
