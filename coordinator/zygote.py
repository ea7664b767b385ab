"""Python programs started by forking one process that has imported torch already: what a local cluster's coordinator
and agents are started as (coordinator/cluster.py).

A fresh interpreter spends about 4 s of CPU importing torch, numpy, pydantic, grpc and peertrain's daemon before an
agent or a coordinator does anything; the cluster tests start them dozens of times, and `coordinator demo` starts
five at once on the user's cores. multiprocessing's fork server imports those once (`PRELOADED`) and forks each
program from there: a start then costs about 0.1 s of CPU, and the program is `python -m MODULE ARGS` as before
(its own environment, working directory and log file; its own pid, for signals; its exit status).

The fork server imports no CUDA state (importing torch initialises no device), so a forked program may use a GPU.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

# What a coordinator and an agent import before they do anything: the libraries and peertrain's daemons (not the CLI
# modules, which each program runs as its __main__). Importing them touches no device, opens no socket and starts
# no gRPC thread (a forked child would inherit such state broken); numpy's idle OpenBLAS pool handles a fork itself.
PRELOADED = ("torch", "numpy", "pydantic", "grpc", "yaml", "cryptography.x509", "prometheus_client",
             "nodeagent.agent.daemon", "coordinator.service")

# multiprocessing's context of the fork server: also for programs that hand it a function (a test's ranks).
FORK_SERVER = multiprocessing.get_context("forkserver")
FORK_SERVER.set_forkserver_preload([__name__, *PRELOADED])


class ForkedProcess:
    """A program forked from the fork server, with the part of `subprocess.Popen`'s interface a cluster uses."""

    def __init__(self, module: str, args: list[str], log_path: Path, env: dict[str, str],
                 prepare: Callable[[], None] | None = None) -> None:
        """`prepare`, a module-level function (it is sent by name), runs in the child before the module: a process
        attribute that `python -m` cannot set, such as a network namespace of its own (coordinator/chaos.py)."""
        # Daemonic: if the process that started it exits without stopping it, multiprocessing ends it (SIGTERM).
        self._process = FORK_SERVER.Process(target=_run_module,
                                            args=(module, args, str(log_path), env, os.getcwd(), prepare),
                                            name=module, daemon=True)
        self._process.start()
        self.args = [module, *args]
        self.pid: int = self._process.pid  # type: ignore[assignment]  # set by start()

    @property
    def returncode(self) -> int | None:
        """The exit status once it exited (-N where signal N ended it, as Popen's), else None."""
        return self._process.exitcode

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_module(module: str, args: list[str], log_path: str, env: dict[str, str], cwd: str,
                prepare: Callable[[], None] | None) -> None:
    """In the forked child: become `python -m MODULE ARGS` with stdout and stderr appended to `log_path`."""
    os.environ.clear()
    os.environ.update(env)
    # multiprocessing gives the child the path of the process that started it, where a PYTHONPATH changed since
    # (this environment's) has no effect: put its entries first, as an interpreter started with it would.
    sys.path[:0] = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry and entry not in sys.path]
    os.chdir(cwd)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own streams, never closed)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    if prepare is not None:
        prepare()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
