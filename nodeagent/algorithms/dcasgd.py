"""DC-ASGD (Zheng et al., ICML 2017): ASGD with delay compensation,
w <- w - lr * (g_m + lambda * g_m * g_m * (w - w_bak(m))), with one backup w_bak(m) per worker: the model it
last pulled.

Options (algorithm.options): `adaptive` (false: constant lambda; true: lambda_t = lambda0 / sqrt(MS_m + 1e-7)
with MS_m <- mean_square_decay * MS_m + (1 - mean_square_decay) * g_m^2 per worker), `lambda` (0.04),
`lambda0` (2.0), `mean_square_decay` (0.95, the paper's m), and `max_update_norm` (unset) as every
parameter-server algorithm: it bounds g_m before the compensation.

Worker: `PSWorker`. Server: nodeagent.ps.DCASGDServer. A pull records the backup, so the server's state changes
on pulls too. The backups and mean squares are "volatile" state: the coordinator writes them periodically, not
before every answer (they are several models' worth); a push computed on another model than its worker's backup
(possible only after a coordinator restart) is rejected and the worker pulls again.
"""

from __future__ import annotations

import torch
from pydantic import Field

from nodeagent.ps.rules import DCASGDServer, ParameterServer
from nodeagent.ps.server import ServerHalf, ServerOptions
from nodeagent.ps.worker import PSWorker


class DCASGDOptions(ServerOptions):
    adaptive: bool = Field(False, description="lambda_t = lambda0 / sqrt(MS_m + 1e-7) instead of the constant "
                           "lambda")
    lambda_: float = Field(0.04, ge=0, alias="lambda", description="the constant delay-compensation factor")
    lambda0: float = Field(2.0, ge=0, description="the adaptive factor's scale")
    mean_square_decay: float = Field(0.95, ge=0, lt=1, description="the paper's m: decay of the mean square MS_m "
                                     "of the gradients (adaptive only)")


class DCASGDServerHalf(ServerHalf):
    pull_mutates = True
    volatile = ("backup", "backup_version", "mean_square")

    options: DCASGDOptions

    def build_rule(self, w0: torch.Tensor) -> ParameterServer:
        o = self.options
        return DCASGDServer(
            w0, self.num_workers, self.spec.algorithm.lr, lam=o.lambda_, adaptive=o.adaptive, lam0=o.lambda0,
            momentum=o.mean_square_decay, max_update_norm=self.update_bound(self.spec.algorithm.lr),
            robust=self.spec.algorithm.robust,
        )


class DCASGD(PSWorker):
    """ASGD with delay compensation (DC-ASGD): a stale gradient is corrected towards the current model."""

    name = "dc-asgd"
    server_half = DCASGDServerHalf
    Options = DCASGDOptions
