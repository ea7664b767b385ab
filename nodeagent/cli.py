"""`nodeagent`: the node agent's command line."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from nodeagent import __version__
from nodeagent.defaults import (
    AGENT_HEALTH_PORT,
    AGENT_LANE_PORT,
    AGENT_METRICS_PORT,
    AGENT_PORT,
    COORDINATOR_ADDRESS,
    COORDINATOR_PORT,
    ENROLL_PORT,
    KEEP_CHECKPOINTS,
    MAX_MODEL_MEMORY_MIB,
)
from nodeagent.listen import ListenError
from nodeagent.rpc import field_problem, with_default_port
from nodeagent.signals import wait_for_stop
from nodeagent.statedir import StateDirError, hold_state_dir
from nodeagent.training.datadirs import DataDirs, DataDirsError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nodeagent",
        description="peertrain node agent: trains on this machine's data shard and exchanges with its neighbours.",
    )
    parser.add_argument("--version", action="version", version=f"peertrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the agent daemon (register, watch the assignment, train, serve peers)",
        description="Run the node agent until SIGTERM or SIGINT. It registers with the coordinator, trains the jobs "
        "it is assigned, serves its neighbours over gRPC and exposes Prometheus metrics.",
    )
    serve.add_argument(
        "--coordinator", default=os.environ.get("PEERTRAIN_COORDINATOR", COORDINATOR_ADDRESS),
        help="coordinator address HOST:PORT (env PEERTRAIN_COORDINATOR; default %(default)s)",
    )
    serve.add_argument("--listen", default=f"0.0.0.0:{AGENT_PORT}",
                       help="peer service address HOST:PORT; port 0 picks one (default %(default)s)")
    serve.add_argument(
        "--lane-port", type=int, default=0,
        help="TCP port of the tensor lanes that carry exchange payloads beside gRPC; fix it where a firewall sits "
        f"between agents (the shipped deployments use {AGENT_LANE_PORT}; default 0: any free port)",
    )
    serve.add_argument(
        "--health-listen", default="",
        help="serve the standard gRPC health service (grpc.health.v1, plaintext: for Kubernetes gRPC probes) on "
        f"HOST:PORT, SERVING once registered; the shipped deployments use port {AGENT_HEALTH_PORT} (default: off)",
    )
    serve.add_argument("--advertise", help="address neighbours dial (default: the listen address, or the hostname)")
    serve.add_argument(
        "--metrics-listen", default=f"0.0.0.0:{AGENT_METRICS_PORT}",
        help="Prometheus /metrics address HOST:PORT (default %(default)s)",
    )
    serve.add_argument(
        "--state-dir", type=Path, default=Path(os.environ.get("PEERTRAIN_STATE_DIR", "/var/lib/peertrain/agent")),
        help="node id and checkpoints (env PEERTRAIN_STATE_DIR; default %(default)s)",
    )
    serve.add_argument(
        "--data-dir", action="append", default=[], metavar="DATASET=DIR",
        help="where this machine keeps one dataset: DATASET is a data.dataset kind (fashion-mnist, cifar10, ...) or "
        "the last part of a job's data.data_dir (one npy or image-folder dataset: imagenette for /srv/imagenette); "
        "repeat for each. A bare DIR (the old form) serves every job whatever its dataset, after the mappings and "
        "--data-root. Env PEERTRAIN_DATA_DIR: the same entries separated by commas. Without any, a job reads its own "
        "data.data_dir",
    )
    # PEERTRAIN_DATA_DIR's entries: used when no --data-dir is given.
    serve.set_defaults(data_dir_env=os.environ.get("PEERTRAIN_DATA_DIR", ""))
    serve.add_argument(
        "--data-root", default=os.environ.get("PEERTRAIN_DATA_ROOT"), metavar="ROOT",
        help="a directory holding one directory per dataset, named as its kind or its data.data_dir's last part "
        "(ROOT/fashion-mnist, ROOT/cifar10, ROOT/imagenette); a --data-dir mapping of the same dataset comes first "
        "(env PEERTRAIN_DATA_ROOT)",
    )
    serve.add_argument("--device", default="auto", metavar="{auto,cpu,cuda,cuda:N}",
                       help="where this agent's jobs compute (model, algorithm state, batches, evaluation): cpu, "
                       "cuda (the current CUDA device), cuda:N (one agent per GPU on a multi-GPU host), or auto: cuda "
                       "where torch sees one, else cpu (default %(default)s)")
    serve.add_argument("--name", default=socket.gethostname(),
                       help="human name shown by `coordinator nodes` (default: this machine's hostname)")
    serve.add_argument(
        "--slowdown", type=float, default=1.0,
        help="stretch each local step by this factor (>= 1) to emulate a slower device (default %(default)s)",
    )
    serve.add_argument(
        "--torch-threads", type=int, default=0,
        help="intra-op threads of torch, 0: torch's own choice; use 1 when several agents share a machine "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--tls-dir", type=Path,
        help="this node's credentials: ca.crt, tls.crt, tls.key (env PEERTRAIN_AGENT_TLS_DIR; default STATE_DIR/tls; "
        "PEERTRAIN_TLS_DIR is the operator CLI's and is not read here); "
        "written by enrollment, or by `coordinator cert issue --node NAME`",
    )
    serve.add_argument(
        "--join-token", default=os.environ.get("PEERTRAIN_JOIN_TOKEN", ""),
        help="enroll with this one-time token when TLS_DIR holds no certificate (env PEERTRAIN_JOIN_TOKEN; "
        "`coordinator token create` makes one; default: none)",
    )
    serve.add_argument(
        "--ca-fingerprint", default=os.environ.get("PEERTRAIN_CA_FINGERPRINT", ""),
        help="SHA-256 of the cluster CA, checked before enrolling (env PEERTRAIN_CA_FINGERPRINT; default: none)",
    )
    serve.add_argument(
        "--enroll-address",
        help=f"the coordinator's enrollment address HOST:PORT (default: the coordinator's host, port {ENROLL_PORT})",
    )
    serve.add_argument(
        "--insecure", action="store_true",
        help="no TLS and no identities: anyone who reaches the ports can read and change this node. Local "
        "experiments only",
    )
    serve.add_argument(
        "--allow-import", action="append", default=[], metavar="PACKAGE.MODULE",
        help="a module that jobs may name their model factory from ('PACKAGE.MODULE:factory'); repeat for several. "
        "Exactly that module: its package's other modules stay refused. Without it no job imports code here",
    )
    serve.add_argument(
        "--keep-checkpoints", type=int, default=KEEP_CHECKPOINTS, metavar="N",
        help="keep the checkpoints of the last N jobs that ended here (default %(default)s: a job's checkpoints are "
        "deleted when it ends; its ranks sent their final models to the coordinator, for `coordinator export`). A "
        "job with `checkpoint.keep: true` keeps its own in STATE_DIR/checkpoints/kept",
    )
    serve.add_argument(
        "--max-model-memory", type=int, default=MAX_MODEL_MEMORY_MIB, metavar="MIB",
        help="fail a job, before building its model, whose model needs more than this for its parameters, gradients "
        "and momentum (counted on torch's meta device) (default %(default)s)",
    )
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                       help="the least severe messages logged (default %(default)s)")
    return parser


def agent_tls_dir(args: argparse.Namespace) -> Path:
    """The agent's own credentials: --tls-dir, PEERTRAIN_AGENT_TLS_DIR, or STATE_DIR/tls. PEERTRAIN_TLS_DIR names the
    operator CLI's certificate (`coordinator`): an agent started from an operator's shell must not take it."""
    tls_dir = args.tls_dir or os.environ.get("PEERTRAIN_AGENT_TLS_DIR") or args.state_dir / "tls"
    if os.environ.get("PEERTRAIN_TLS_DIR") and not (args.tls_dir or os.environ.get("PEERTRAIN_AGENT_TLS_DIR")):
        logging.getLogger("nodeagent").warning(
            "PEERTRAIN_TLS_DIR is the operator CLI's certificate and nodeagent no longer reads it; "
            "this agent uses %s (set PEERTRAIN_AGENT_TLS_DIR or --tls-dir for another)", tls_dir)
    return Path(tls_dir)


def serve(args: argparse.Namespace) -> int:
    if args.slowdown < 1:
        raise SystemExit("nodeagent: --slowdown must be >= 1")
    if args.torch_threads < 0:
        raise SystemExit("nodeagent: --torch-threads must be >= 0")
    if args.max_model_memory < 1:
        raise SystemExit("nodeagent: --max-model-memory must be at least 1 (MiB)")
    if args.keep_checkpoints < 0:
        raise SystemExit("nodeagent: --keep-checkpoints must be >= 0")
    if problem := field_problem(args.name):
        raise SystemExit(f"nodeagent: --name {problem}")
    # An address without a port means the default one, not gRPC's 443.
    args.coordinator = with_default_port(args.coordinator, COORDINATOR_PORT)
    args.enroll_address = args.enroll_address and with_default_port(args.enroll_address, ENROLL_PORT)
    # torch and the agent only now: importing them takes seconds, which --help and a flag's mistake do not wait for.
    import torch

    from nodeagent.agent import Agent, AgentConfig
    from nodeagent.agent.daemon import RegistrationRefused
    from nodeagent.training.device import DeviceError, resolve_device
    from nodeagent.training.models import module_problem

    try:
        device = resolve_device(args.device)
    except DeviceError as error:
        raise SystemExit(f"nodeagent: {error}") from None
    for module in args.allow_import:
        if problem := module_problem(module):
            raise SystemExit(f"nodeagent: --allow-import {problem}")
    try:
        data_dirs = (DataDirs.parse(args.data_dir, args.data_root) if args.data_dir else
                     DataDirs.from_text(args.data_dir_env, args.data_root))
    except DataDirsError as error:
        raise SystemExit(f"nodeagent: {error}") from None
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    logging.basicConfig(
        level=args.log_level, format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    agent = Agent(
        AgentConfig(
            coordinator=args.coordinator, listen=args.listen, advertise=args.advertise,
            metrics_listen=args.metrics_listen or None, state_dir=args.state_dir, data_dirs=data_dirs,
            device=str(device), name=args.name, slowdown=args.slowdown, lane_port=args.lane_port,
            health_listen=args.health_listen or None,
            tls_dir=None if args.insecure else agent_tls_dir(args),
            join_token=args.join_token, ca_fingerprint=args.ca_fingerprint, enroll_address=args.enroll_address or "",
            allow_imports=tuple(args.allow_import), keep_checkpoints=args.keep_checkpoints,
            max_model_memory_mib=args.max_model_memory,
        )
    )
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        stop.set()
        agent.stopping.set()  # also ends a registration that is still retrying

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    with hold_state_dir(args.state_dir):
        try:
            registered = agent.start()
        except RegistrationRefused as error:
            agent.stop()
            print(f"nodeagent: {error}", file=sys.stderr)
            return 1
        except BaseException:  # a port in use: what did start (the peer server, the lanes) stops first
            agent.stop()
            raise
        if registered:
            wait_for_stop(stop)
        logging.getLogger("nodeagent").info("shutting down")
        agent.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return serve(args)
    except (ListenError, StateDirError) as error:
        print(f"nodeagent: {error}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
