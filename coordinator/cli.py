"""`coordinator`: the control plane's daemon and the operator's command line.

The commands that validate, simulate or serve jobs import their modules when they run: those load torch, about
2 s of start-up that `nodes`, `status` and `stop` should not pay.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from coordinator.display import format_status, state_name, status_text
from nodeagent import __version__
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc
from nodeagent.jobspec import DEFAULT_DATA_DIR, JobFile, JobSpecError, load_job_file
from nodeagent.listen import ListenError
from nodeagent.metrics import Metrics
from nodeagent.rpc import SERVER_OPTIONS, bind_grpc_server, split_address
from nodeagent.statedir import StateDirError, hold_state_dir, writable_directory

DEFAULT_COORDINATOR = os.environ.get("PEERTRAIN_COORDINATOR", "127.0.0.1:7070")


def _add_coordinator_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--coordinator", default=DEFAULT_COORDINATOR,
        help="coordinator address HOST:PORT (env PEERTRAIN_COORDINATOR; default %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coordinator",
        description="peertrain coordinator: registers node agents, distributes jobs and topologies, and shows "
        "their progress.",
    )
    parser.add_argument("--version", action="version", version=f"peertrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the coordinator daemon")
    serve.add_argument("--listen", default="0.0.0.0:7070", help="gRPC address HOST:PORT (default %(default)s)")
    serve.add_argument(
        "--metrics-listen", default="0.0.0.0:9400", help="Prometheus /metrics address (default %(default)s)"
    )
    serve.add_argument(
        "--state-dir", type=Path,
        default=Path(os.environ.get("PEERTRAIN_STATE_DIR", "/var/lib/peertrain/coordinator")),
        help="SQLite state and, unless --runs-dir is given, run directories (default %(default)s)",
    )
    serve.add_argument("--runs-dir", type=Path, help="where run directories go (default STATE_DIR/runs)")
    serve.add_argument(
        "--heartbeat-timeout", type=float, default=15.0,
        help="seconds without a heartbeat after which a node is marked down (default %(default)s)",
    )
    serve.add_argument("--ready-file", type=Path, help="write the bound addresses here as JSON once serving")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    submit = commands.add_parser("submit", help="submit a job spec (YAML); prints the job id")
    submit.add_argument("job_file", type=Path, metavar="JOB.yaml")
    _add_coordinator_option(submit)

    nodes = commands.add_parser(
        "nodes", help="list registered node agents; remove or drain one",
        description="Without an action: every registered agent, up or down, draining or not, and its job. "
        "`remove NODE` forgets a node that runs no job; `drain NODE` places no new job on it (`--undo`: again).",
    )
    nodes.add_argument("action", nargs="?", choices=["list", "remove", "drain"], default="list")
    nodes.add_argument("node_id", nargs="?", metavar="NODE", help="the node of remove or drain")
    nodes.add_argument("--undo", action="store_true", help="with drain: take the node back into service")
    _add_coordinator_option(nodes)

    status = commands.add_parser(
        "status", help="a job's state, times and reason, and per node its state, step, rate, loss, accuracy and "
        "traffic (default: the newest job)")
    status.add_argument("job_id", nargs="?", default="", metavar="JOB")
    _add_coordinator_option(status)

    stop = commands.add_parser("stop", help="stop a job")
    stop.add_argument("job_id", metavar="JOB")
    _add_coordinator_option(stop)

    simulate = commands.add_parser(
        "simulate",
        help="run a job on a virtual clock in this process (same algorithms, simulated devices and network)",
        description="Run every node of JOB.yaml in this process. Local steps are real; time is virtual and comes "
        "from the job's `simulation:` section (step time, relative speeds, jitter, latency, bandwidth, loss, "
        "faults, partitions). Writes the same metrics log as a real run.",
    )
    simulate.add_argument("job_file", type=Path, metavar="JOB.yaml")
    simulate.add_argument("--runs", type=Path, default=Path("runs"), help="parent of the run directory")
    simulate.add_argument("--data-dir", default=os.environ.get("PEERTRAIN_DATA_DIR"),
                          help="directory of the IDX files, overriding the job's")
    simulate.add_argument(
        "--allow-import", action="append", default=[], metavar="PACKAGE.MODULE",
        help="a module the job may name its model factory from ('PACKAGE.MODULE:factory'), as `nodeagent serve "
        "--allow-import`; repeat for several",
    )

    inspect = commands.add_parser(
        "inspect", help="show a job's topology and each node's data shard (counts and label histogram)"
    )
    inspect.add_argument("job_file", type=Path, metavar="JOB.yaml")
    inspect.add_argument("--data-dir", default=os.environ.get("PEERTRAIN_DATA_DIR"),
                         help="directory of the IDX files, overriding the job's")

    demo = commands.add_parser(
        "demo",
        help="start a coordinator and agents on loopback, train on Fashion-MNIST, print the result",
        description="Start a local cluster (a coordinator and N agents as processes on 127.0.0.1), train one job "
        "on the real Fashion-MNIST data, show progress, print a per-node accuracy table, and stop every process.",
    )
    demo.add_argument("--agents", type=int, default=8, help="number of node agents (default %(default)s)")
    demo.add_argument(
        "--algorithms", default="pdmm-isvr,dsgd", help="comma-separated algorithms, one job each (default %(default)s)"
    )
    demo.add_argument("--topology", default="multiplex-ring", help="topology (default %(default)s)")
    demo.add_argument("--split", default="class-window", help="data split (default %(default)s)")
    demo.add_argument("--model", default="logistic", help="model (default %(default)s)")
    demo.add_argument("--steps", type=int, default=3000, help="local steps per node (default %(default)s)")
    demo.add_argument("--lr", type=float, default=0.02, help="step size (default %(default)s)")
    demo.add_argument("--l2", type=float, default=0.01, help="L2 term (default %(default)s)")
    demo.add_argument(
        "--data-dir", default=os.environ.get("PEERTRAIN_DATA_DIR", DEFAULT_DATA_DIR),
        help="directory of the Fashion-MNIST IDX files (default %(default)s)",
    )
    demo.add_argument("--runs", type=Path, default=Path("runs"), help="parent of the demo's run directory")
    demo.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    return parser


def _stub(address: str) -> coordinator_pb2_grpc.CoordinatorStub:
    return coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(address))


def cmd_serve(args: argparse.Namespace) -> int:
    from coordinator.service import CoordinatorConfig, CoordinatorService

    logging.basicConfig(level=args.log_level, format="%(asctime)s coordinator %(levelname)s: %(message)s")
    config = CoordinatorConfig(
        state_dir=args.state_dir, runs_dir=args.runs_dir, heartbeat_timeout_s=args.heartbeat_timeout
    )
    with hold_state_dir(config.state_dir):
        writable_directory(config.run_root, "runs directory")
        # Every agent holds a thread with its assignment stream, and synchronous parameter-server pushes wait for
        # their round on one: size the pool for a few hundred agents. Frame limits as on the peer service.
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=512, thread_name_prefix="coordinator"), options=SERVER_OPTIONS
        )
        host, _port = split_address(args.listen)
        bound = bind_grpc_server(server, args.listen)
        metrics = Metrics()
        metrics_host, metrics_port = split_address(args.metrics_listen)
        metrics_bound = metrics.serve_http(metrics_host, metrics_port)
        service = CoordinatorService(config, metrics)
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server)
        service.start()
        server.start()
        logging.info("serving on %s:%d, metrics on %s:%d, state in %s", host, bound, metrics_host, metrics_bound,
                     args.state_dir)
        logging.warning("control calls are not authenticated (insecure mode): run only on a trusted network")
        if args.ready_file:
            tmp = args.ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"listen": f"{host}:{bound}", "metrics": f"{metrics_host}:{metrics_bound}"}))
            os.replace(tmp, args.ready_file)
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        stop.wait()
        logging.info("shutting down")
        service.stop()
        server.stop(grace=2).wait()
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    job = _load_job(args.job_file)  # refused here, before anything reaches the coordinator
    # The text as loaded: an edge file the job names is inlined, since the coordinator reads no files.
    reply = _stub(args.coordinator).SubmitJob(pb.SubmitJobRequest(spec_yaml=job.text), timeout=30)
    print(reply.job_id)
    print(f"state: {state_name(reply.state)}; run dir: {reply.run_dir}", file=sys.stderr)
    if reply.warning:
        print(f"warning: {reply.warning}", file=sys.stderr)
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    stub = _stub(args.coordinator)
    if args.action != "list":
        if not args.node_id:
            raise SystemExit(f"coordinator: nodes {args.action} needs a NODE (see `coordinator nodes`)")
        if args.action == "remove":
            stub.RemoveNode(pb.NodeRequest(node_id=args.node_id), timeout=10)
            print(f"{args.node_id}: removed")
        else:
            node = stub.DrainNode(pb.DrainRequest(node_id=args.node_id, drain=not args.undo), timeout=10)
            job = f"; it finishes rank {node.rank} of job {node.job_id} first" if node.job_id and node.draining else ""
            print(f"{args.node_id}: {'draining' if node.draining else 'in service'}{job}")
        return 0
    reply = stub.ListNodes(pb.ListNodesRequest(), timeout=10)
    print(f"{'node':<14} {'name':<16} {'state':<8} {'peer address':<22} {'metrics':<22} {'job':<32} rank")
    for n in reply.nodes:
        state = ("up" if n.up else "down") + (", drain" if n.draining else "")
        print(
            f"{n.node_id:<14} {n.name:<16} {state:<8} {n.peer_address:<22} "
            f"{n.metrics_address:<22} {n.job_id or '-':<32} {n.rank if n.job_id else '-'}"
        )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    print(status_text(_stub(args.coordinator).JobStatus(pb.JobStatusRequest(job_id=args.job_id), timeout=10)))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    reply = _stub(args.coordinator).StopJob(pb.StopJobRequest(job_id=args.job_id), timeout=10)
    print(f"{args.job_id}: {state_name(reply.state)}")
    return 0


def _load_job(path: Path) -> JobFile:
    """The job of `path`, validated as the coordinator validates it (schema, algorithm, options, topology)."""
    from coordinator.jobs import validate_job

    try:
        job = load_job_file(path)
        validate_job(job.spec)
    except OSError as error:
        raise SystemExit(f"coordinator: cannot read {path}: {error.strerror}") from None
    except JobSpecError as error:
        raise SystemExit(f"coordinator: {path}: {error}") from None
    return job


def cmd_simulate(args: argparse.Namespace) -> int:
    from coordinator.simulate import SimulationProgress, simulate
    from nodeagent.training.models import ModelError, module_problem

    for module in args.allow_import:
        if problem := module_problem(module):
            raise SystemExit(f"coordinator: --allow-import {problem}")
    spec = _load_job(args.job_file).spec
    job_id = f"sim-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = (args.runs / job_id).resolve()
    print(f"simulating {spec.nodes} nodes of {spec.algorithm.name} for {spec.steps} steps; run dir {run_dir}")
    try:
        result = simulate(spec, run_dir, args.data_dir, on_progress=SimulationProgress(spec.steps),
                          allow_imports=tuple(args.allow_import))
    except ModelError as error:  # an import path not allowed here, most likely
        raise SystemExit(f"coordinator: {args.job_file}: {error}") from None
    print()
    state = "finished" if result.mesh.finished else "running"
    print(f"job {job_id} ({spec.name}): {state}, {spec.nodes} nodes, run dir {run_dir}")
    print(format_status(result.progress))
    print(f"virtual time {result.mesh.now:.2f} s, wall time {result.wall_s:.1f} s; metrics log {run_dir}/metrics.jsonl")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from coordinator.jobs import validate_job
    from nodeagent.training.data import load_dataset
    from nodeagent.training.splits import describe_split, format_split_table, split_indices

    spec = _load_job(args.job_file).spec
    topology = validate_job(spec)
    degrees = [topology.degree(rank) for rank in range(spec.nodes)]
    print(f"topology {spec.topology.kind}: {spec.nodes} nodes, {len(topology.edges)} edges, "
          f"degree {min(degrees)}..{max(degrees)}")
    print("edges: " + " ".join(f"{a}-{b}" for a, b in topology.edges))
    train = load_dataset(spec.data.dataset, args.data_dir or spec.data.data_dir, "train", spec.data.train_limit)
    labels = train.labels.numpy()
    shards = split_indices(labels, spec.nodes, spec.data.split, spec.seed, dict(spec.data.split_options))
    print(f"split {spec.data.split} of {spec.data.dataset} ({len(labels)} training samples):")
    print(format_split_table(describe_split(labels, shards)))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from coordinator.demo import run_demo

    return run_demo(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {
        "serve": cmd_serve, "submit": cmd_submit, "nodes": cmd_nodes, "status": cmd_status, "stop": cmd_stop,
        "simulate": cmd_simulate, "inspect": cmd_inspect, "demo": cmd_demo,
    }
    try:
        exit_code = handlers[args.command](args)
        sys.stdout.flush()  # a reader gone away (`| head`) shows here rather than as a warning at exit
        return exit_code
    except BrokenPipeError:
        # Quiet, as a process killed by SIGPIPE; stdout goes to /dev/null so that Python's flush at exit is quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (ListenError, StateDirError) as error:
        print(f"coordinator: {error}", file=sys.stderr)
        return 1
    except grpc.RpcError as error:
        print(f"coordinator: {rpc_error_line(error, getattr(args, 'coordinator', None))}", file=sys.stderr)
        return 1


def rpc_error_line(error: grpc.RpcError, address: str | None) -> str:
    """A failed call in one line: the coordinator's address (for the commands that call one), code and details."""
    line = f"{error.code().name}: {' '.join((error.details() or '').split())}"
    return f"{address}: {line}" if address else line


if __name__ == "__main__":
    sys.exit(main())
