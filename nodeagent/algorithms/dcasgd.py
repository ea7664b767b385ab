"""DC-ASGD (ALGORITHMS.md, "DC-ASGD"): ASGD with delay compensation,
w <- w - lr * (g_m + lambda * g_m * g_m * (w - w_bak(m))), with one backup w_bak(m) per worker: the model it
last pulled.

Options (algorithm.options): `adaptive` (false: constant lambda; true: lambda_t = lambda0 / sqrt(MS_m + 1e-7)
with MS_m <- mean_square_decay * MS_m + (1 - mean_square_decay) * g_m^2 per worker), `lambda` (0.04),
`lambda0` (2.0), `mean_square_decay` (0.95, the paper's m).

Worker: `PSWorker`. Server: nodeagent.ps.DCASGDServer. A pull records the backup, so the server's state changes
on pulls too. The backups and mean squares are "volatile" state: the coordinator writes them periodically, not
before every answer (they are several models' worth); a push computed on another model than its worker's backup
(possible only after a coordinator restart) is rejected and the worker pulls again.
"""

from __future__ import annotations

from typing import Any

import torch

from nodeagent.algorithms.ps import PSWorker, ServerHalf
from nodeagent.ps.rules import DCASGDServer, ParameterServer


class DCASGDServerHalf(ServerHalf):
    pull_mutates = True
    volatile = ("backup", "backup_version", "mean_square")

    def build_rule(self, w0: torch.Tensor) -> ParameterServer:
        o = self.options
        return DCASGDServer(
            w0, self.num_workers, self.spec.algorithm.lr, lam=o["lambda"], adaptive=o["adaptive"],
            lam0=o["lambda0"], momentum=o["mean_square_decay"],
        )


class DCASGD(PSWorker):
    name = "dc-asgd"
    server_half = DCASGDServerHalf
    OPTIONS = {"adaptive": False, "lambda": 0.04, "lambda0": 2.0, "mean_square_decay": 0.95}

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        if options["lambda"] < 0 or options["lambda0"] < 0:
            raise ValueError("algorithm.options.lambda: must be >= 0")
        if not 0 <= options["mean_square_decay"] < 1:
            raise ValueError("algorithm.options.mean_square_decay: must be in [0, 1)")
