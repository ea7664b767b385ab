"""ASGD: the server applies each pushed gradient on arrival, w <- w - lr * g; the worker
pulls the new w before its next step.

Worker: `PSWorker`. Server: nodeagent.ps.ASGDServer; a push is answered at once, whatever its staleness.
"""

from __future__ import annotations

import torch

from nodeagent.ps.rules import ASGDServer, ParameterServer
from nodeagent.ps.server import ServerHalf
from nodeagent.ps.worker import PSWorker


class ASGDServerHalf(ServerHalf):
    def build_rule(self, w0: torch.Tensor) -> ParameterServer:
        return ASGDServer(w0, self.num_workers, self.spec.algorithm.lr,
                          max_update_norm=self.update_bound(self.spec.algorithm.lr), robust=self.spec.algorithm.robust)


class ASGD(PSWorker):
    """Asynchronous parameter-server SGD: the server applies each pushed gradient on arrival."""

    name = "asgd"
    server_half = ASGDServerHalf
