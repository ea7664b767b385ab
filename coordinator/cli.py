"""`coordinator`: the control plane's daemon and the operator's command line.

The commands that validate, simulate or serve jobs import their modules when they run: those load torch, about
2 s of start-up that `nodes`, `status` and `stop` should not pay.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
import tomllib
from collections.abc import Iterable
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from coordinator.ca import CAError
from coordinator.display import (
    FAILING_WINDOW_S,
    STALE_INTERVALS,
    STALE_MIN_S,
    STALL_INTERVALS,
    STALL_MIN_S,
    SUSPECT_SHARE,
    device_text,
    edges_json,
    edges_text,
    format_status,
    json_state,
    show_progress,
    state_name,
    status_text,
)
from coordinator.progress_view import PLAIN_EVERY_S, ProgressView
from nodeagent import __version__
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent._proto import coordinator_pb2_grpc
from nodeagent.defaults import (
    COORDINATOR_ADDRESS,
    COORDINATOR_HEALTH_PORT,
    COORDINATOR_METRICS_PORT,
    COORDINATOR_PORT,
    ENROLL_PORT,
    HEARTBEAT_TIMEOUT_S,
    KEEP_JOBS,
    KEEP_RUNS,
    MAX_MODEL_MEMORY_MIB,
)
from nodeagent.health import HealthServer
from nodeagent.jobspec import (
    DEFAULT_DATA_DIR,
    JobFile,
    JobSpecError,
    Override,
    load_job_file,
    parse_job_yaml,
    parse_override,
)
from nodeagent.listen import ListenError
from nodeagent.metrics import Metrics
from nodeagent.rpc import SERVER_OPTIONS, bind_grpc_server, shown, split_address, unreachable_cause, with_default_port
from nodeagent.runtime.messages import event_from_proto
from nodeagent.runtime.progress import task_metrics
from nodeagent.security.pki import private_key_pem
from nodeagent.statedir import StateDirError, hold_state_dir, writable_directory

DEFAULT_CONFIG = Path("~/.config/peertrain/cli.toml")
DEFAULT_TLS_DIR = Path("~/.config/peertrain/tls")
DEFAULT_STATE_DIR = Path(os.environ.get("PEERTRAIN_STATE_DIR", "/var/lib/peertrain/coordinator"))
# `follow` and `submit --follow` exit with the job's outcome.
EXIT_FINISHED, EXIT_FAILED, EXIT_STOPPED, EXIT_INTERRUPTED = 0, 1, 3, 130
FOLLOW_EXIT_HELP = "0 finished, 1 failed (or the coordinator lost), 3 stopped, 130 interrupted (the job goes on)"
FOLLOW_POLL_S = 1.0
FOLLOW_RECONNECT_S = 60.0  # how long `follow` keeps trying to reach a coordinator that went away
EXPORT_TIMEOUT_S = 600.0  # the whole download of a trained model


def _add_coordinator_option(parser: argparse.ArgumentParser) -> None:
    """How a command reaches the coordinator. Each setting comes from its flag, else its environment variable, else
    the config file (PEERTRAIN_CONFIG, default ~/.config/peertrain/cli.toml: keys coordinator, tls_dir, insecure),
    else its default."""
    parser.add_argument(
        "--coordinator",
        help="coordinator address HOST:PORT (env PEERTRAIN_COORDINATOR, config `coordinator`; default "
        f"{COORDINATOR_ADDRESS})",
    )
    parser.add_argument(
        "--tls-dir", type=Path,
        help=f"the operator's credentials: ca.crt, tls.crt, tls.key (env PEERTRAIN_TLS_DIR, config `tls_dir`; "
        f"default {DEFAULT_TLS_DIR}); `coordinator cert issue --operator NAME` makes them",
    )
    parser.add_argument(
        "--insecure", action="store_true", default=None,
        help="plaintext, no certificate: only for a coordinator serving with --insecure (env PEERTRAIN_INSECURE=1)",
    )


def _add_set_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set", action="append", default=[], metavar="PATH=VALUE", dest="overrides",
        help="override a field of the job file, e.g. --set algorithm.lr=0.05 --set nodes=16: PATH is the field's "
        "dotted path (as in docs/jobs.md), VALUE is read as YAML (a number, true/false, a string, [a, b], {k: v}); "
        "checked by the job's schema as if the file said it; repeat for several",
    )


def _overrides(args: argparse.Namespace) -> list[Override]:
    """The command's `--set` options, parsed; SystemExit naming the one that is wrong."""
    try:
        return [parse_override(text) for text in args.overrides]
    except JobSpecError as error:
        raise SystemExit(f"coordinator: {error}") from None


def _add_state_dir_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir", type=Path, default=DEFAULT_STATE_DIR,
        help="the coordinator's state directory; the CA lives in STATE_DIR/ca (env PEERTRAIN_STATE_DIR; default "
        "%(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coordinator",
        description="peertrain coordinator: registers node agents, distributes jobs and topologies, and shows "
        "their progress.",
    )
    parser.add_argument("--version", action="version", version=f"peertrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve", help="run the coordinator daemon",
        description="Serve agents and operators under mutual TLS with the cluster CA of STATE_DIR/ca (`coordinator "
        "ca init` creates it), and new nodes' enrollment on --enroll-listen.",
    )
    serve.add_argument("--listen", default=f"0.0.0.0:{COORDINATOR_PORT}",
                       help="gRPC address HOST:PORT (default %(default)s)")
    serve.add_argument(
        "--enroll-listen", default=f"0.0.0.0:{ENROLL_PORT}",
        help="enrollment address HOST:PORT, where nodes trade a join token for a certificate (default %(default)s)",
    )
    serve.add_argument(
        "--metrics-listen", default=f"0.0.0.0:{COORDINATOR_METRICS_PORT}",
        help="Prometheus /metrics address (default %(default)s)",
    )
    serve.add_argument(
        "--health-listen", default="",
        help="serve the standard gRPC health service (grpc.health.v1, plaintext: for Kubernetes gRPC probes) on "
        f"HOST:PORT, SERVING once the coordinator serves; the shipped deployments use port {COORDINATOR_HEALTH_PORT} "
        "(default: off)",
    )
    serve.add_argument(
        "--state-dir", type=Path, default=DEFAULT_STATE_DIR,
        help="SQLite state, the CA and, unless --runs-dir is given, run directories (env PEERTRAIN_STATE_DIR; "
        "default %(default)s)",
    )
    serve.add_argument(
        "--insecure", action="store_true",
        help="no TLS, no identities, no enrollment: anyone who reaches the port controls the cluster. Local "
        "experiments only",
    )
    serve.add_argument("--runs-dir", type=Path, help="where run directories go (default STATE_DIR/runs)")
    serve.add_argument(
        "--keep-runs", type=int, default=KEEP_RUNS, metavar="N",
        help="keep the run directories (metrics, events, trained models) of the newest N ended jobs and delete older "
        "ones as jobs end; 0 keeps all (default %(default)s)",
    )
    serve.add_argument(
        "--keep-jobs", type=int, default=KEEP_JOBS, metavar="N",
        help="keep the records (state, nodes, results, events) of the N jobs that ended last and delete older ones "
        "as jobs end, run directories included; 0 keeps all. `coordinator jobs delete JOB` deletes one now "
        "(default %(default)s)",
    )
    serve.add_argument(
        "--max-model-memory", type=int, default=MAX_MODEL_MEMORY_MIB, metavar="MIB",
        help="refuse at submit a job whose model needs more than this for its parameters, gradients and momentum "
        "(counted on torch's meta device, where the dataset fixes the model's shape; each agent checks its own bound "
        "too) (default %(default)s)",
    )
    serve.add_argument(
        "--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_S,
        help="seconds without a heartbeat after which a node is marked down (default %(default)s)",
    )
    serve.add_argument("--ready-file", type=Path, help="write the bound addresses here as JSON once serving")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                       help="the least severe messages logged (default %(default)s)")

    ca = commands.add_parser("ca", help="create or show the cluster CA (on the coordinator's machine)",
                             description="The cluster CA lives in STATE_DIR/ca; every certificate hangs on it.")
    ca_actions = ca.add_subparsers(dest="action", required=True, metavar="ACTION")
    ca_init = ca_actions.add_parser(
        "init", help="create the CA in STATE_DIR/ca and print its fingerprint",
        description="Create the cluster CA in STATE_DIR/ca and print its fingerprint (SHA-256), which enrolling "
        "agents pin. Refuses to replace a CA that is there: every certificate of the cluster hangs on it.")
    ca_init.add_argument(
        "--if-missing", action="store_true",
        help="keep the CA already there instead of refusing (for start-up scripts; it is never replaced)",
    )
    _add_state_dir_option(ca_init)
    ca_show = ca_actions.add_parser("show", help="print the CA's fingerprint",
                                    description="Print the fingerprint (SHA-256) of the cluster CA in STATE_DIR/ca.")
    _add_state_dir_option(ca_show)

    _add_backup_commands(commands)

    token = commands.add_parser(
        "token", help="create a one-time join token for a new node",
        description="Prints a token (on stdout) and the CA fingerprint; a new node enrolls with them in its "
        "environment, PEERTRAIN_JOIN_TOKEN and PEERTRAIN_CA_FINGERPRINT (not on its command line, which other users "
        "of the machine can read).",
    )
    token.add_argument("action", choices=["create"])
    token.add_argument("--ttl", type=float, default=3600.0, help="seconds the token stays valid (default %(default)s)")
    _add_coordinator_option(token)

    cert = commands.add_parser(
        "cert", help="issue (offline), list or revoke certificates",
        description="`issue` runs on the coordinator's machine with its CA (no daemon needed) and writes ca.crt, "
        "tls.crt and tls.key into --out. `list` and `revoke` ask the running coordinator (operator certificate).",
    )
    cert_actions = cert.add_subparsers(dest="action", required=True, metavar="ACTION")
    issue = cert_actions.add_parser(
        "issue", help="issue a node's or an operator's certificate with the CA here (offline)",
        description="Issue a certificate with the CA in STATE_DIR/ca, on the coordinator's machine (no daemon "
        "needed), and write ca.crt, tls.crt and tls.key into --out.",
    )
    who = issue.add_mutually_exclusive_group(required=True)
    who.add_argument("--node", metavar="NAME", help="a node certificate, NAME its node id")
    who.add_argument("--operator", metavar="NAME", help="an operator certificate (for the command line)")
    issue.add_argument("--out", type=Path, help="the directory to write (default ./tls-NAME)")
    issue.add_argument("--days", type=float, help="lifetime (default: 30 for nodes, 90 for operators)")
    _add_state_dir_option(issue)
    listing = cert_actions.add_parser(
        "list", help="list the certificates the coordinator issued, with their role, expiry and revocation",
        description="Every certificate the running coordinator's CA issued: serial, role, name, expiry, revocation.",
    )
    listing.add_argument("--json", action="store_true", help="one JSON object per certificate, a line each")
    _add_coordinator_option(listing)
    revoke = cert_actions.add_parser(
        "revoke", help="revoke a certificate by its serial, or every certificate of a name",
        description="Revoke on the running coordinator: the certificate is refused on every link from then on.",
    )
    what = revoke.add_mutually_exclusive_group(required=True)
    what.add_argument("--serial", help="the certificate's serial (hex, see `cert list`)")
    what.add_argument("--name", help="every certificate of this node or operator")
    _add_coordinator_option(revoke)

    submit = commands.add_parser(
        "submit", help="submit a job spec (YAML); prints the job id, or follows the job with --follow",
        description="Validate JOB.yaml here, submit it and print the job's id. With --follow, then show its "
        f"progress and events until it ends, and exit with its outcome: {FOLLOW_EXIT_HELP}.",
    )
    submit.add_argument("job_file", type=Path, metavar="JOB.yaml")
    submit.add_argument("--follow", action="store_true", help="follow the job until it ends (as `follow JOB`)")
    _add_set_option(submit)
    _add_coordinator_option(submit)

    follow = commands.add_parser(
        "follow", help="show a job's live progress and events until it ends; the exit code is its outcome",
        description="Progress bars on a terminal (steps, steps/s, ETA, mean test accuracy; a bar per node for up to "
        f"16 nodes), a line every {PLAIN_EVERY_S:.0f} s otherwise; the job's events as they come; the per-node "
        f"table at the end. Exit code: {FOLLOW_EXIT_HELP}. Ctrl-C stops following, not the job.",
    )
    follow.add_argument("job_id", nargs="?", default="", metavar="JOB",
                        help="a job's id, a unique prefix of it, or its name (the newest of that name); default: "
                        "the newest job")
    _add_coordinator_option(follow)

    logs = commands.add_parser(
        "logs", help="a job's events: the coordinator's, and its nodes' job events and warnings",
        description="Shows the job's events from its run directory: submitted, started, topology changes, the end "
        "(the coordinator's), and each node's started, resumed, rejoined, failed and finished, with the lines it "
        "logged at WARNING and above.",
    )
    logs.add_argument("job_id", metavar="JOB",
                      help="a job's id, a unique prefix of it, or its name (the newest of that name)")
    logs.add_argument("--rank", type=int, help="only this rank's events (and the job's own)")
    logs.add_argument("--level", choices=["INFO", "WARNING", "ERROR"], default="INFO",
                      help="only events of this level and above (default %(default)s)")
    logs.add_argument("--follow", "-f", action="store_true", help="keep showing new events until the job ends")
    logs.add_argument("--json", action="store_true", help="one JSON object per event, a line each")
    _add_coordinator_option(logs)

    nodes = commands.add_parser(
        "nodes", help="list registered node agents; remove or drain one",
        description="Without an action: every registered agent, up or down, draining or not, and its job. "
        "`remove NODE` forgets a node that runs no job; `drain NODE` places no new job on it (`--undo`: again).",
    )
    nodes.add_argument("action", nargs="?", choices=["list", "remove", "drain"], default="list",
                       help="what to do (default %(default)s)")
    nodes.add_argument("node_id", nargs="?", metavar="NODE", help="the node of remove or drain")
    nodes.add_argument("--undo", action="store_true", help="with drain: take the node back into service")
    nodes.add_argument("--json", action="store_true", help="list: one JSON object per node, a line each")
    _add_coordinator_option(nodes)

    jobs = commands.add_parser(
        "jobs", help="list jobs, newest first: id, name, state, nodes, times, duration, reason",
        description="JOB, wherever a command takes one, is a job's id, a unique prefix of it, or its name (the "
        "newest job of that name).",
    )
    jobs.add_argument("--limit", type=int, default=100, help="at most this many jobs (default %(default)s)")
    jobs.add_argument("--json", action="store_true", help="one JSON object per job, a line each")
    _add_coordinator_option(jobs)
    job_commands = jobs.add_subparsers(dest="jobs_command", metavar="{delete}")
    delete = job_commands.add_parser(
        "delete", help="delete an ended job: its record, nodes' results, events and run directory",
        description="Delete a finished, stopped or failed job at the coordinator: its record and its nodes' results "
        "(`status`, `jobs`), its events (`logs`) and its run directory (metrics, trained models). A pending or "
        "running job is refused: stop it first. The coordinator also deletes the oldest ended jobs itself beyond "
        "its --keep-jobs.",
    )
    delete.add_argument("job_id", metavar="JOB",
                        help="a job's id, a unique prefix of it, or its name (the newest of that name)")
    _add_coordinator_option(delete)

    status = commands.add_parser(
        "status", help="a job's state, times and reason, and per node its state, step, rate, loss, accuracy and "
        "traffic (default: the newest job)")
    status.add_argument("job_id", nargs="?", default="", metavar="JOB",
                        help="a job's id, a unique prefix of it, or its name (the newest of that name); default: the "
                        "newest job")
    status.add_argument("--json", action="store_true", help="the status as one JSON object")
    _add_coordinator_option(status)

    _add_edges_command(commands)

    stop = commands.add_parser("stop", help="stop a job")
    stop.add_argument("job_id", metavar="JOB",
                      help="a job's id, a unique prefix of it, or its name (the newest of that name)")
    _add_coordinator_option(stop)

    _add_topology_command(commands)
    _add_quarantine_command(commands)

    simulate = commands.add_parser(
        "simulate",
        help="run a job on a virtual clock in this process (same algorithms, simulated devices and network)",
        description="Run every node of JOB.yaml in this process. Local steps are real; time is virtual and comes "
        "from the job's `simulation:` section (step time, relative speeds, jitter, latency, bandwidth, loss, "
        "faults, partitions). Writes the same metrics log as a real run.",
    )
    simulate.add_argument("job_file", type=Path, metavar="JOB.yaml")
    _add_set_option(simulate)
    simulate.add_argument("--runs", type=Path, default=Path("runs"),
                          help="parent of the run directory (default %(default)s)")
    simulate.add_argument("--data-dir", default=os.environ.get("PEERTRAIN_DATA_DIR"),
                          help="directory of the job's data (any data.dataset kind), overriding its data.data_dir "
                          "(env PEERTRAIN_DATA_DIR)")
    simulate.add_argument(
        "--allow-import", action="append", default=[], metavar="PACKAGE.MODULE",
        help="a module the job may name its model factory from ('PACKAGE.MODULE:factory'), as `nodeagent serve "
        "--allow-import`; repeat for several",
    )
    simulate.add_argument("--device", default="cpu", metavar="{cpu,cuda,cuda:N,auto}",
                          help="where the simulated nodes' models, state and data live: every node on this one "
                          "device (default %(default)s; results agree with the CPU's within float rounding)")
    simulate.add_argument("--export", type=Path, metavar="MODEL.pt",
                          help="write the trained model to this file as `coordinator export` writes a job's (the "
                          "consensus: the mean of the ranks' models for peer-to-peer, the server's, or rank 0's for "
                          "all-reduce), which `report --model` evaluates and a job's model.init starts from")

    report = commands.add_parser(
        "report", help="write the figures of one or several runs and an HTML page that shows them",
        description="Figures of each RUN (PNG) and report.html: mean and per-node test accuracy and loss against "
        "time and steps, traffic per edge as a matrix, throughput and computing time ratio per device, parameter-"
        "server traffic. Several runs are overlaid; a 1-node run or one labelled 'reference' is drawn dashed. RUN "
        "is a run directory, or a job (id, unique id prefix or name) whose run directory the coordinator names and "
        "this machine can read. With --model, instead: evaluate a model file `coordinator export` wrote on its "
        "job's test set.",
    )
    report.add_argument("runs", nargs="*", metavar="RUN", help="a run directory or a job")
    report.add_argument("--model", type=Path, metavar="MODEL.pt",
                        help="evaluate this exported model on its job's test set and print its metric (and the one "
                        "the job reported) instead of drawing runs")
    report.add_argument("--data-dir", default=os.environ.get("PEERTRAIN_DATA_DIR"),
                        help="with --model: directory of the job's data, overriding the job's data.data_dir (env "
                        "PEERTRAIN_DATA_DIR)")
    report.add_argument("--allow-import", action="append", default=[], metavar="PACKAGE.MODULE",
                        help="with --model: a module the job's model factory may be imported from, as `coordinator "
                        "simulate --allow-import`")
    report.add_argument("--out", type=Path,
                        help="output directory (default: RUN/report for one run, else ./report)")
    report.add_argument("--labels", nargs="+", metavar="LABEL", default=[],
                        help="one name per RUN for legends and tables (default: each job's name)")
    report.add_argument("--accuracies", default="0.6,0.7,0.8",
                        help="comma-separated accuracies for the table's time-to-reach columns (default %(default)s)")
    _add_coordinator_option(report)

    export = commands.add_parser(
        "export", help="write a job's trained model as a PyTorch file: its state_dict and a manifest",
        description="Fetch a job's trained model from the coordinator (its ranks sent their final models there as "
        "they finished) and write it as one file: torch.save({'state_dict': ..., 'manifest': ...}), which "
        "torch.load(path, weights_only=True) reads. The state_dict's keys are the model's own; the manifest names "
        "the job, its algorithm, the model's name and options, the data, the step and the job's metric. Default: the "
        "job's consensus, the mean of the ranks' models for the peer-to-peer algorithms, the server's model for the "
        "parameter-server ones, rank 0's for all-reduce. docs/operations.md shows how to load it.",
    )
    export.add_argument("job_id", metavar="JOB",
                        help="a job's id, a unique prefix of it, or its name (the newest of that name)")
    export.add_argument("--out", type=Path, required=True, metavar="MODEL.pt", help="the file to write")
    export.add_argument("--rank", type=int, help="this rank's model instead of the job's consensus")
    export.add_argument("--allow-import", action="append", default=[], metavar="PACKAGE.MODULE",
                        help="a module the job's model factory may be imported from ('PACKAGE.MODULE:factory'), as "
                        "`coordinator simulate --allow-import`: the model is rebuilt here to check and lay out what "
                        "the coordinator sends")
    _add_coordinator_option(export)

    inspect = commands.add_parser(
        "inspect", help="show a job's topology and each node's data shard (counts and label histogram)"
    )
    inspect.add_argument("job_file", type=Path, metavar="JOB.yaml")
    _add_set_option(inspect)
    inspect.add_argument("--data-dir", default=os.environ.get("PEERTRAIN_DATA_DIR"),
                         help="directory of the job's data (any data.dataset kind), overriding its data.data_dir "
                         "(env PEERTRAIN_DATA_DIR)")

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
        help="directory of the Fashion-MNIST IDX files (env PEERTRAIN_DATA_DIR; default %(default)s)",
    )
    demo.add_argument("--runs", type=Path, default=Path("runs"),
                      help="parent of the demo's run directory (default %(default)s)")
    demo.add_argument("--timeout", type=float, default=600.0,
                      help="give up after this many seconds (default %(default)s)")
    _add_job_file_commands(commands)
    return parser


def _add_job_file_commands(commands: argparse._SubParsersAction) -> None:
    """schema, init, validate: the job file described and checked, without a coordinator."""
    schema = commands.add_parser(
        "schema", help="print the JSON Schema of a job file (or, with --markdown, the reference docs/jobs.md)",
        description="The JSON Schema (draft 2020-12) of a job file, every algorithm's, topology kind's and split's "
        "options included, for editors that complete and check YAML. With --markdown, the job file reference "
        "(the repository's docs/jobs.md is what it prints).",
    )
    schema.add_argument("--markdown", action="store_true", help="the reference in Markdown instead of the schema")

    init = commands.add_parser(
        "init", help="write a commented job file: every field at its default, the algorithm's options",
        description="Write a job file for ALGORITHM with every field at its default, each under a comment giving its "
        "meaning, and the algorithm's own options at their defaults. It validates as it is.",
    )
    init.add_argument("algorithm", nargs="?", default="dsgd", metavar="ALGORITHM",
                      help="the algorithm, as `algorithm.name` in a job file (default %(default)s; "
                      "`coordinator schema --markdown` lists them)")
    init.add_argument("--out", type=Path, default=Path("job.yaml"), help="the file to write (default %(default)s)")
    init.add_argument("--force", action="store_true", help="overwrite the file if it exists")
    _add_set_option(init)

    validate = commands.add_parser(
        "validate", help="check job files as the coordinator would, without submitting them",
        description="Check each job file as `submit` does before it sends it (schema, algorithm, options, topology, "
        "model); exit 1 at the first that is refused, naming the field.",
    )
    validate.add_argument("job_files", type=Path, nargs="+", metavar="JOB.yaml")
    _add_set_option(validate)


# -- `coordinator topology` (a running job's topology changed) -----------------------------------------------------


def _add_topology_command(commands: argparse._SubParsersAction) -> None:
    from coordinator.topology import DYNAMIC_KINDS, KINDS

    topology = commands.add_parser(
        "topology", help="change a running job's topology: every node switches just before the same step",
        description="Switch a running job to a new topology. The coordinator checks it against the job (its nodes, "
        "its algorithm's needs), picks the step to switch at (the highest step reported so far plus about five "
        "seconds of steps), and assigns every node its new neighbours. Edges that disappear are dropped, edges "
        "that appear start clean. Jobs of the parameter-server and all-reduce algorithms have no topology.",
    )
    topology.add_argument("job_id", metavar="JOB",
                          help="a job's id, a unique prefix of it, or its name (the newest of that name)")
    topology.add_argument("--kind", required=True, choices=KINDS + DYNAMIC_KINDS, metavar="KIND",
                          help=f"the new topology's kind; one of: {', '.join(KINDS + DYNAMIC_KINDS)}")
    topology.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                          help="an option of the kind (as in a job file's topology.options; VALUE is read as JSON "
                          "when it is, else as text), e.g. degree=4; repeat for several")
    topology.add_argument("--seed", type=int, default=0,
                          help="seed of the new edge phases and of a random graph (default %(default)s)")
    _add_coordinator_option(topology)


def topology_options(pairs: list[str]) -> dict[str, object]:
    """`--option KEY=VALUE` pairs as the topology's options; SystemExit naming the one that is wrong."""
    options: dict[str, object] = {}
    for pair in pairs:
        key, separator, value = pair.partition("=")
        if not separator or not key:
            raise SystemExit(f"coordinator: --option {pair[:80]!r}: write KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def cmd_topology(args: argparse.Namespace) -> int:
    options = topology_options(args.option)
    reply = _stub(args).ChangeTopology(
        pb.ChangeTopologyRequest(job_id=args.job_id, kind=args.kind, options_json=json.dumps(options), seed=args.seed),
        timeout=10,
    )
    print(shown(f"{reply.job_id}: topology {reply.previous_kind} -> {args.kind} (version {reply.topology_version}); "
                f"every node switches just before step {reply.switch_step}"))
    return 0


# -- `coordinator quarantine` (a member's contributions dropped, issue 28) ------------------------------------------


def _add_quarantine_command(commands: argparse._SubParsersAction) -> None:
    quarantine = commands.add_parser(
        "quarantine", help="drop a member's contributions from a running job (its edges, or its pushes)",
        description="Quarantine a member of a running job: a peer-to-peer job drops its edges through a live "
        "topology change (every node switches just before the same step; the member runs on alone and the job does "
        "not wait for it), a parameter server ignores its pushes. The job's events say so. A job with "
        "algorithm.robust.quarantine does this on its own for a member whose contributions are persistently outlying "
        "(`status` shows each member's suspicion).",
    )
    quarantine.add_argument("job_id", metavar="JOB",
                            help="a job's id, a unique prefix of it, or its name (the newest of that name)")
    quarantine.add_argument("node", metavar="NODE", help="the member: its node id, or its rank")
    quarantine.add_argument("--release", action="store_true",
                            help="take a quarantined parameter-server worker's pushes again (a peer-to-peer member's "
                            "edges come back only with a topology change: `coordinator topology`)")
    _add_coordinator_option(quarantine)


def cmd_quarantine(args: argparse.Namespace) -> int:
    reply = _stub(args).Quarantine(pb.QuarantineRequest(job_id=args.job_id, node=args.node, release=args.release),
                                   timeout=10)
    print(shown(f"{reply.job_id}: {reply.outcome}"))
    return 0


def _client_settings(args: argparse.Namespace) -> tuple[str, Path | None]:
    """The coordinator's address and the operator's credentials directory (None: insecure), from the flags, the
    environment, the config file, the defaults, in that order."""
    config_path = Path(os.environ.get("PEERTRAIN_CONFIG", DEFAULT_CONFIG)).expanduser()
    config: dict = {}
    if config_path.is_file():
        try:
            config = tomllib.loads(config_path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise SystemExit(f"coordinator: cannot read the config file {config_path}: {error}") from None
    address = with_default_port(str(args.coordinator or os.environ.get("PEERTRAIN_COORDINATOR")
                                    or config.get("coordinator") or COORDINATOR_ADDRESS), COORDINATOR_PORT)
    insecure = args.insecure or os.environ.get("PEERTRAIN_INSECURE", "") not in ("", "0") or \
        bool(config.get("insecure"))
    if insecure:
        return address, None
    tls_dir = args.tls_dir or os.environ.get("PEERTRAIN_TLS_DIR") or config.get("tls_dir") or DEFAULT_TLS_DIR
    return address, Path(tls_dir).expanduser()


def _channel(args: argparse.Namespace) -> grpc.Channel:
    from nodeagent.security.tls import TlsDir, TlsError, Transport

    address, tls_dir = _client_settings(args)
    args.coordinator = address  # errors name it
    if tls_dir is None:
        return grpc.insecure_channel(address)
    if not TlsDir(tls_dir).complete():
        raise SystemExit(
            f"coordinator: no operator credentials in {tls_dir} (ca.crt, tls.crt, tls.key). On the coordinator's "
            f"machine `coordinator cert issue --operator NAME --out {tls_dir}` makes them; or give --tls-dir, "
            "PEERTRAIN_TLS_DIR or tls_dir in the config file; --insecure only reaches a coordinator serving with "
            "--insecure"
        )
    try:
        return Transport(TlsDir(tls_dir)).channel(address)
    except TlsError as error:
        raise SystemExit(f"coordinator: {error}") from None


def _stub(args: argparse.Namespace) -> coordinator_pb2_grpc.CoordinatorStub:
    from nodeagent.compat import versioned

    return coordinator_pb2_grpc.CoordinatorStub(versioned(_channel(args)))


def cmd_serve(args: argparse.Namespace) -> int:
    from coordinator.ca import CAError, ClusterCA
    from coordinator.ps_service import add_coordinator_servicer
    from coordinator.service import SERVER_THREADS, CoordinatorConfig, CoordinatorService, EnrollmentService
    from nodeagent.compat import VersionCheck
    from nodeagent.security.tls import INSECURE_WARNING, TlsDir, Transport
    from nodeagent.signals import wait_for_stop

    logging.basicConfig(level=args.log_level, format="%(asctime)s coordinator %(levelname)s: %(message)s")
    host, _port = split_address(args.listen)
    config = CoordinatorConfig(
        state_dir=args.state_dir, runs_dir=args.runs_dir, heartbeat_timeout_s=args.heartbeat_timeout,
        keep_runs=args.keep_runs, keep_jobs=args.keep_jobs, max_model_memory_mib=args.max_model_memory,
    )
    if args.max_model_memory < 1:
        raise SystemExit("coordinator: --max-model-memory must be at least 1 (MiB)")
    if args.keep_runs < 0:
        raise SystemExit("coordinator: --keep-runs must be >= 0")
    if args.keep_jobs < 0:
        raise SystemExit("coordinator: --keep-jobs must be >= 0")
    with hold_state_dir(config.state_dir):
        writable_directory(config.run_root, "runs directory")
        ca = None
        transport = Transport.insecure()
        if not args.insecure:
            try:
                ca = ClusterCA.load(config.state_dir)
            except CAError as error:
                raise StateDirError(str(error)) from None
            tls_dir = TlsDir(config.state_dir / "tls")
            ca.coordinator_credentials(tls_dir)
            transport = Transport(tls_dir)
        metrics = Metrics()
        service = CoordinatorService(config, metrics, ca=ca, transport=transport)
        authorizer = service.authorizer()
        # Frame limits as on the peer service.
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=SERVER_THREADS, thread_name_prefix="coordinator"),
            options=SERVER_OPTIONS,
            interceptors=[*([authorizer] if authorizer else []), VersionCheck()],
        )
        bound = transport.bind(server, args.listen)
        add_coordinator_servicer(service, server)
        enrollment = None
        enroll_address = ""
        if ca is not None:
            # New nodes have no certificate yet: a server of its own, under TLS with the CA's own certificate
            # (which they pin), serving only Enroll, with a small pool.
            enrollment = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="enroll"),
                                     options=SERVER_OPTIONS, maximum_concurrent_rpcs=16)
            coordinator_pb2_grpc.add_EnrollmentServicer_to_server(EnrollmentService(ca), enrollment)
            enroll_bound = bind_grpc_server(enrollment, args.enroll_listen,
                                            grpc.ssl_server_credentials([(private_key_pem(ca.key), ca.cert_pem)]))
            enroll_address = f"{split_address(args.enroll_listen)[0]}:{enroll_bound}"
        health = HealthServer(args.health_listen) if args.health_listen else None
        health_address = f"{split_address(args.health_listen)[0]}:{health.port}" if health else ""
        metrics_host, metrics_port = split_address(args.metrics_listen)
        metrics_bound = metrics.serve_http(metrics_host, metrics_port)
        metrics.insecure_mode.set(int(args.insecure))
        service.start()
        server.start()
        if enrollment is not None:
            enrollment.start()
        if health is not None:
            health.ready()
        logging.info("serving on %s:%d, metrics on %s:%d, state in %s", host, bound, metrics_host, metrics_bound,
                     args.state_dir)
        if ca is None:
            logging.warning(INSECURE_WARNING)
        else:
            logging.info("mutual TLS with the cluster CA (fingerprint %s); enrollment on %s", ca.fingerprint,
                         enroll_address)
        if args.ready_file:
            tmp = args.ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"listen": f"{host}:{bound}", "metrics": f"{metrics_host}:{metrics_bound}",
                                       "enroll": enroll_address, "health": health_address}))
            os.replace(tmp, args.ready_file)
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        wait_for_stop(stop)
        logging.info("shutting down")
        if health is not None:
            health.stop()
        if enrollment is not None:
            enrollment.stop(grace=1)
        # Calls in flight (an agent leaving) finish before the store closes under them.
        server.stop(grace=2).wait()
        service.stop()
    return 0


def cmd_ca(args: argparse.Namespace) -> int:
    from coordinator.ca import ClusterCA

    exists = (ClusterCA.directory_of(args.state_dir) / "ca.key").exists()
    if args.action == "show" or (args.if_missing and exists):
        ca = ClusterCA.load(args.state_dir)
        if args.action == "init":
            print(f"kept the cluster CA in {ca.directory} (--if-missing)")
    else:
        ca = ClusterCA.init(args.state_dir)
        print(f"created the cluster CA in {ca.directory}")
    print(f"CA fingerprint (sha256): {ca.fingerprint}")
    return 0


def _add_backup_commands(commands: argparse._SubParsersAction) -> None:
    backup = commands.add_parser(
        "backup", help="archive the coordinator's state (database, CA, run directories) to one file, online",
        description="Write the coordinator's state in STATE_DIR to FILE while it runs: the SQLite database (copied "
        "with SQLite's backup API: a consistent snapshot), the cluster CA (key and certificate, issued and revoked "
        "certificates, join tokens), the coordinator's certificate and the run directories in STATE_DIR/runs. FILE "
        "holds the CA's private key: it is written 0600; keep it as you keep the CA. `coordinator restore` puts it "
        "back (docs/operations.md, \"Backups and restore\").",
    )
    backup.add_argument("--out", type=Path, required=True, metavar="FILE", help="the archive to write (.tar.gz)")
    backup.add_argument("--force", action="store_true", help="replace FILE if it exists")
    backup.add_argument("--without-runs", action="store_true",
                        help="leave the run directories (metrics, events, trained models) out: the jobs, their "
                        "results and the CA are kept")
    _add_state_dir_option(backup)

    restore = commands.add_parser(
        "restore", help="put a backup in place as a coordinator's state (the coordinator stopped)",
        description="Check every file of the archive against its manifest (SHA-256), the database's integrity and "
        "the CA, then write them into STATE_DIR; run directories move under STATE_DIR/runs. Refuses a state "
        "directory that holds anything (unless --force, which replaces its state) or that a coordinator uses.",
    )
    restore.add_argument("archive", type=Path, metavar="FILE", help="an archive `coordinator backup` wrote")
    restore.add_argument("--force", action="store_true", help="replace the state in a non-empty STATE_DIR")
    _add_state_dir_option(restore)


def cmd_backup(args: argparse.Namespace) -> int:
    from coordinator.backup import BackupError, write_backup

    try:
        manifest = write_backup(args.state_dir, args.out, args.force, with_runs=not args.without_runs)
    except (BackupError, OSError) as error:
        raise SystemExit(f"coordinator: backup: {error}") from None
    size = sum(size for size, _ in manifest.files.values())
    print(f"backed up {args.state_dir} to {args.out}: {len(manifest.files)} files, {size / 1e6:.1f} MB before "
          "compression (it holds the CA's private key: keep it as you keep the CA)")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from coordinator.backup import BackupError, restore_backup

    try:
        manifest = restore_backup(args.archive, args.state_dir, args.force)
    except (BackupError, OSError) as error:
        raise SystemExit(f"coordinator: restore: {error}") from None
    taken = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(manifest.created_unix))
    print(f"restored {args.archive} (taken {taken} by peertrain {manifest.peertrain_version}, "
          f"{len(manifest.files)} files) into {args.state_dir}; start the coordinator with --state-dir "
          f"{args.state_dir}")
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    reply = _stub(args).CreateJoinToken(pb.CreateJoinTokenRequest(ttl_s=args.ttl), timeout=10)
    print(shown(reply.token))
    # The token goes in the new node's environment (a file only root reads), never on a command line, which every
    # user of the machine can read (docs/operations.md, "Enrolling a node with a join token").
    print(f"valid once, until {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(reply.expires_unix))}. On the new "
          "node, put it in the agent's environment, not on its command line (which other users can read), e.g. in "
          "/etc/peertrain/agent.env (readable by root and the agent only) or the Kubernetes Secret peertrain-join:\n"
          f"  PEERTRAIN_JOIN_TOKEN=TOKEN\n  PEERTRAIN_CA_FINGERPRINT={shown(reply.ca_fingerprint)}\n"
          f"then start it: nodeagent serve --coordinator {args.coordinator} --name NAME", file=sys.stderr)
    return 0


def cmd_cert(args: argparse.Namespace) -> int:
    if args.action == "issue":
        return _issue_offline(args)
    stub = _stub(args)
    if args.action == "revoke":
        reply = stub.RevokeCertificate(pb.RevokeCertificateRequest(serial=args.serial or "", name=args.name or ""),
                                       timeout=10)
        print(shown(f"revoked: {', '.join(reply.serials) or 'nothing new (already revoked)'}"))
        return 0
    reply = stub.ListCertificates(pb.ListCertificatesRequest(), timeout=10)
    if args.json:
        _print_json_lines(reply.certificates)
        return 0
    print(f"{'serial':<42} {'role':<12} {'name':<24} {'expires':<17} revoked")
    for c in reply.certificates:
        expires = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.not_after_unix))
        revoked = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.revoked_unix)) if c.revoked_unix else "-"
        print(shown(f"{c.serial:<42} {c.role:<12} {c.name:<24} {expires:<17} {revoked}"))
    return 0


def _issue_offline(args: argparse.Namespace) -> int:
    import datetime

    from coordinator.ca import ClusterCA
    from nodeagent.security.pki import CertificateError, Role
    from nodeagent.security.tls import TlsDir

    role, name = (Role.NODE, args.node) if args.node else (Role.OPERATOR, args.operator)
    out = args.out or Path(f"tls-{name}")
    lifetime = datetime.timedelta(days=args.days) if args.days else None
    try:
        identity = ClusterCA.load(args.state_dir).issue_files(TlsDir(out), role, name, lifetime)
    except CertificateError as error:
        raise SystemExit(f"coordinator: {error}") from None
    expires = time.strftime("%Y-%m-%d", time.localtime(identity.not_after_unix))
    print(f"{role} certificate for {name} (serial {identity.serial}, expires {expires}) in {out}: ca.crt, tls.crt, "
          "tls.key")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    job = _load_job(args.job_file, args)  # refused here, before anything reaches the coordinator
    # The text as loaded: an edge file the job names is inlined, since the coordinator reads no files.
    stub = _stub(args)
    reply = stub.SubmitJob(pb.SubmitJobRequest(spec_yaml=job.text), timeout=30)
    print(shown(reply.job_id), flush=True)
    print(shown(f"state: {state_name(reply.state)}; run dir: {reply.run_dir}"), file=sys.stderr)
    if reply.warning:
        print(shown(f"warning: {reply.warning}"), file=sys.stderr)
    return follow_job(stub, reply.job_id, args.coordinator) if args.follow else 0


def cmd_follow(args: argparse.Namespace) -> int:
    return follow_job(_stub(args), args.job_id, args.coordinator)


def follow_job(stub: coordinator_pb2_grpc.CoordinatorStub, reference: str, address: str) -> int:
    """Show a job's progress and events until it ends; its outcome as the exit code (FOLLOW_EXIT_HELP)."""
    from nodeagent.jobspec import parse_job_yaml

    status = stub.JobStatus(pb.JobStatusRequest(job_id=reference), timeout=10)
    job_id = status.job_id
    steps = parse_job_yaml(status.spec_yaml).steps
    offset = 0
    lost_since: float | None = None
    try:
        with ProgressView(shown(job_id), steps, status.world_size) as view:
            while True:
                try:
                    reply = stub.JobEvents(pb.JobEventsRequest(job_id=job_id, offset=offset), timeout=10)
                    status = stub.JobStatus(pb.JobStatusRequest(job_id=job_id), timeout=10)
                except grpc.RpcError as error:
                    if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise
                    lost_since = lost_since or time.monotonic()
                    if time.monotonic() - lost_since > FOLLOW_RECONNECT_S:
                        raise
                    view.log(shown(f"coordinator {address}: {rpc_error_line(error, None)}; trying again"))
                    time.sleep(FOLLOW_POLL_S * 5)
                    continue
                lost_since = None
                for event in reply.events:
                    view.log(shown(event_from_proto(job_id, event).line()))
                offset = reply.next_offset
                final = status.state in (pb.JOB_FINISHED, pb.JOB_FAILED, pb.JOB_STOPPED)
                show_progress(view, status)
                if final and not reply.events:  # the events of the end are shown: done
                    break
                if not final:
                    time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        print(shown(f"\nstopped following; job {job_id} goes on (`coordinator follow {job_id}` again, `coordinator "
                    f"stop {job_id}` to stop it)"), file=sys.stderr)
        return EXIT_INTERRUPTED
    print(shown(status_text(status)))
    return {pb.JOB_FINISHED: EXIT_FINISHED, pb.JOB_STOPPED: EXIT_STOPPED}.get(status.state, EXIT_FAILED)


def cmd_logs(args: argparse.Namespace) -> int:
    stub = _stub(args)
    request = pb.JobEventsRequest(job_id=args.job_id, min_level=args.level)
    if args.rank is not None:
        request.rank = args.rank
    while True:
        reply = stub.JobEvents(request, timeout=10)
        for proto in reply.events:
            event = event_from_proto(reply.job_id, proto)
            print(json.dumps(dataclasses.asdict(event)) if args.json else shown(event.line()), flush=True)
        request.job_id = reply.job_id  # the job first named, even if a newer one takes its name
        request.offset = reply.next_offset
        final = reply.state in (pb.JOB_FINISHED, pb.JOB_FAILED, pb.JOB_STOPPED)
        if reply.events:
            continue  # more may be there already
        if not args.follow or final:
            return 0
        time.sleep(FOLLOW_POLL_S)


def cmd_nodes(args: argparse.Namespace) -> int:
    stub = _stub(args)
    if args.action != "list":
        if not args.node_id:
            raise SystemExit(f"coordinator: nodes {args.action} needs a NODE (see `coordinator nodes`)")
        if args.action == "remove":
            stub.RemoveNode(pb.NodeRequest(node_id=args.node_id), timeout=10)
            print(f"{args.node_id}: removed")
        else:
            node = stub.DrainNode(pb.DrainRequest(node_id=args.node_id, drain=not args.undo), timeout=10)
            job = f"; it finishes rank {node.rank} of job {node.job_id} first" if node.job_id and node.draining else ""
            print(shown(f"{args.node_id}: {'draining' if node.draining else 'in service'}{job}"))
        return 0
    reply = stub.ListNodes(pb.ListNodesRequest(), timeout=10)
    if args.json:
        _print_json_lines(reply.nodes)
        return 0
    print(f"{'node':<14} {'name':<16} {'state':<8} {'peer address':<22} {'metrics':<22} {'job':<32} {'rank':<4} "
          "device")
    for n in reply.nodes:
        state = ("up" if n.up else "down") + (", drain" if n.draining else "")
        print(shown(
            f"{n.node_id:<14} {n.name:<16} {state:<8} {n.peer_address:<22} "
            f"{n.metrics_address:<22} {n.job_id or '-':<32} {n.rank if n.job_id else '-'!s:<4} {device_text(n)}"
        ))
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    if args.jobs_command == "delete":
        reply = _stub(args).DeleteJob(pb.DeleteJobRequest(job_id=args.job_id), timeout=10)
        removed = f" and its run directory {reply.run_dir}" if reply.run_dir else ""
        print(shown(f"{reply.job_id}: deleted (its record, results and events{removed})"))
        return 0
    if args.limit < 1:
        raise SystemExit("coordinator: --limit must be at least 1")
    reply = _stub(args).ListJobs(pb.ListJobsRequest(limit=args.limit), timeout=10)
    if args.json:
        for job in reply.jobs:
            print(json.dumps({
                "job_id": job.job_id, "name": job.name, "state": json_state(job.state), "nodes": job.world_size,
                **({"min_nodes": job.min_nodes, "max_nodes": job.max_nodes} if job.max_nodes else {}),
                "submitted_unix": job.created_unix, "started_unix": job.started_unix or None,
                "ended_unix": job.ended_unix or None, "reason": job.reason,
            }))
        return 0
    print(f"{'job':<40} {'name':<20} {'state':<9} {'nodes':>12}  {'submitted':<19}  {'started':<8}  {'ended':<8}  "
          f"{'duration':>8}  reason")
    for job in reply.jobs:
        end = job.ended_unix or (time.time() if job.started_unix else 0.0)
        duration = f"{end - job.started_unix:.0f} s" if job.started_unix else "-"
        # An elastic job: its members now and, in brackets, its least and most.
        nodes = f"{job.world_size} ({job.min_nodes}..{job.max_nodes})" if job.max_nodes else str(job.world_size)
        print(shown(f"{job.job_id:<40} {job.name:<20} {state_name(job.state):<9} {nodes:>12}  "
                    f"{_clock(job.created_unix, '%Y-%m-%d %H:%M:%S'):<19}  {_clock(job.started_unix):<8}  "
                    f"{_clock(job.ended_unix):<8}  {duration:>8}  {' '.join(job.reason.split())[:80]}"))
    return 0


def _clock(unix: float, layout: str = "%H:%M:%S") -> str:
    return time.strftime(layout, time.localtime(unix)) if unix else "-"


def cmd_status(args: argparse.Namespace) -> int:
    status = _stub(args).JobStatus(pb.JobStatusRequest(job_id=args.job_id), timeout=10)
    print(json.dumps(_as_json(status) | {"state": json_state(status.state)}) if args.json else
          shown(status_text(status)))
    return 0


def _as_json(message: Message) -> dict:
    """A reply as JSON: proto field names, every field present; states as their names."""
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _print_json_lines(messages: Iterable[Message]) -> None:
    for message in messages:
        print(json.dumps(_as_json(message)))
# -- coordinator edges: per-edge debugging ------------------------------------------------------------------------


def _add_edges_command(commands: argparse._SubParsersAction) -> None:
    edges = commands.add_parser(
        "edges", help="a job's edges, the troubled first: last message, in flight, messages, bytes, skips, "
        "failures by reason, staleness, consensus distance, outlying share",
        description="Every edge of the job's nodes from their last reports (about once a second), sorted by trouble: "
        f"stalled (no message for {STALL_INTERVALS} of the edge's message intervals, and at least {STALL_MIN_S:g} s), "
        f"failing (a call failed in the last {FAILING_WINDOW_S:g} s), suspect (a robust rule found {SUSPECT_SHARE:.0%} "
        f"or more of the neighbour's contributions so far outlying), stale (the neighbour behind by more than "
        f"{STALE_INTERVALS} message intervals and {STALE_MIN_S:g} s of the node's steps), then ok; flow-control skips "
        "(a send not made while the edge's last exchange was in flight) apart from failures; what a job that does "
        "not move waits on, and the members suspected or quarantined. An ended job's edges are its nodes' last "
        "report, judged at its end.",
    )
    edges.add_argument("job_id", nargs="?", default="", metavar="JOB",
                       help="a job's id, a unique prefix of it, or its name (the newest of that name; default: the "
                       "newest job)")
    edges.add_argument("--json", action="store_true", help="one JSON object: the edges and what the job waits on")
    _add_coordinator_option(edges)


def cmd_edges(args: argparse.Namespace) -> int:
    status = _stub(args).JobStatus(pb.JobStatusRequest(job_id=args.job_id), timeout=10)
    try:
        interval = parse_job_yaml(status.spec_yaml).algorithm.interval  # the expected edge interval, in steps
    except JobSpecError:
        interval = 1
    if args.json:
        print(json.dumps(edges_json(status, interval)))
    else:
        print(shown(edges_text(status, interval)))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    reply = _stub(args).StopJob(pb.StopJobRequest(job_id=args.job_id), timeout=10)
    print(shown(f"{reply.job_id}: {state_name(reply.state)}"))
    return 0


def _load_job(path: Path, args: argparse.Namespace) -> JobFile:
    """The job of `path` with the command's `--set` overrides, validated as the coordinator validates it (schema,
    algorithm, options, topology)."""
    from coordinator.jobs import validate_job

    overrides = _overrides(args)
    try:
        job = load_job_file(path, overrides)
        validate_job(job.spec)
    except OSError as error:
        raise SystemExit(f"coordinator: cannot read {path}: {error.strerror}") from None
    except JobSpecError as error:
        raise SystemExit(f"coordinator: {path}: {error}") from None
    return job


def cmd_simulate(args: argparse.Namespace) -> int:
    from coordinator.control.states import JobState
    from coordinator.simulate import SimulationProgress, simulate, simulated_model
    from nodeagent.runtime.simulator import rare_full_collections
    from nodeagent.training.data import DataError
    from nodeagent.training.device import DeviceError, resolve_device
    from nodeagent.training.modelfile import write_model_file
    from nodeagent.training.models import ModelError

    _check_imports(args.allow_import)
    try:
        device = resolve_device(args.device)
    except DeviceError as error:
        raise SystemExit(f"coordinator: {error}") from None
    spec = _load_job(args.job_file, args).spec.sized()  # an elastic job is simulated at its largest size
    if spec.training.precision == "fp16" and device.type != "cuda":
        raise SystemExit(f"coordinator: {args.job_file}: training.precision fp16 needs a CUDA device (--device cuda)")
    job_id = f"sim-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = (args.runs / job_id).resolve()
    print(f"simulating {spec.nodes} nodes of {spec.algorithm.name} for {spec.steps} steps on {device}; run dir "
          f"{run_dir}")
    try:
        with ProgressView(spec.name, spec.steps, spec.nodes) as view:
            result = simulate(spec, run_dir, args.data_dir, on_progress=SimulationProgress(view, spec.task),
                              allow_imports=tuple(args.allow_import), device=device)
    except ModelError as error:  # an import path not allowed here, or a model.init file that does not fit
        raise SystemExit(f"coordinator: {args.job_file}: {error}") from None
    except DataError as error:
        raise SystemExit(f"coordinator: {error}") from None
    state = result.job.state.event_kind + (f": {result.job.reason}" if result.job.state == JobState.FAILED else "")
    print(f"job {job_id} ({spec.name}): {state}, {spec.nodes} nodes, run dir {run_dir}")
    with rare_full_collections():  # every node's record: a full collection here took 3 s at 5,000 nodes
        print(format_status(result.progress, task=spec.task))
    print(f"virtual time {result.mesh.now:.2f} s, wall time {result.wall_s:.1f} s; metrics log {run_dir}/metrics.jsonl")
    if args.export is not None:
        try:
            state_dict, manifest = simulated_model(result)
            write_model_file(args.export, state_dict, manifest)
        except ValueError as error:
            raise SystemExit(f"coordinator: --export: {error}") from None
        except OSError as error:
            raise SystemExit(f"coordinator: cannot write {args.export}: {error.strerror}") from None
        print(shown(f"wrote {args.export}: {manifest['source']} at step {manifest['step']}"))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from coordinator.export import ExportError, receive_model
    from nodeagent.training.modelfile import write_model_file
    from nodeagent.training.models import ModelError

    _check_imports(args.allow_import)
    if args.rank is not None and args.rank < 0:
        raise SystemExit("coordinator: --rank must be >= 0")
    request = pb.ExportModelRequest(job_id=args.job_id)
    if args.rank is not None:
        request.rank = args.rank
    try:
        state_dict, manifest = receive_model(_stub(args).ExportModel(request, timeout=EXPORT_TIMEOUT_S),
                                             tuple(args.allow_import))
    except (ExportError, ModelError) as error:
        raise SystemExit(f"coordinator: {error}") from None
    try:
        write_model_file(args.out, state_dict, manifest)
    except OSError as error:
        raise SystemExit(f"coordinator: cannot write {args.out}: {error.strerror}") from None
    metric = manifest["metric"]
    parameters = sum(tensor.numel() for tensor in state_dict.values())
    print(shown(f"wrote {args.out}: job {manifest['job_id']} ({manifest['algorithm']}), {manifest['source']} at "
                f"step {manifest['step']}; model {manifest['model']['name']}, {parameters} values in "
                f"{len(state_dict)} tensors; {metric['name']} {metric['value']:.4f} ({metric['of']})"))
    return 0


def _check_imports(modules: list[str]) -> None:
    from nodeagent.training.models import module_problem

    for module in modules:
        if problem := module_problem(module):
            raise SystemExit(f"coordinator: --allow-import {problem}")


def cmd_report(args: argparse.Namespace) -> int:
    if args.model is not None:
        return _report_model(args)
    if not args.runs:
        raise SystemExit("coordinator: report needs a RUN (a run directory or a job), or --model MODEL.pt")
    from coordinator.report import ReportError, write_report

    try:
        accuracies = [float(a) for a in args.accuracies.split(",") if a.strip()]
    except ValueError:
        raise SystemExit(f"coordinator: --accuracies {args.accuracies!r}: not a comma-separated list of numbers") \
            from None
    if any(not 0 < a <= 1 for a in accuracies):
        raise SystemExit("coordinator: --accuracies must lie in (0, 1]")
    try:
        page = write_report([_run_dir(args, run) for run in args.runs], args.out, args.labels, accuracies)
    except ReportError as error:
        raise SystemExit(f"coordinator: {error}") from None
    print(page)
    return 0


def _report_model(args: argparse.Namespace) -> int:
    """`report --model`: the exported model evaluated on its job's test set, beside what the job reported."""
    from coordinator.export import evaluate_model_file
    from nodeagent.training.data import DataError
    from nodeagent.training.modelfile import ModelFileError
    from nodeagent.training.models import ModelError

    _check_imports(args.allow_import)
    try:
        result, manifest = evaluate_model_file(args.model, args.data_dir, tuple(args.allow_import))
    except (ModelFileError, ModelError, DataError) as error:
        raise SystemExit(f"coordinator: {error}") from None
    metric = manifest["metric"]
    measured = {"test_accuracy": result.accuracy, "test_loss": result.loss, "test_perplexity": result.perplexity}
    figures = ", ".join(f"{m.name} {m.text(measured[m.field])}" for m in task_metrics(manifest.get("task", "")))
    print(shown(f"{args.model}: job {manifest['job_id']} ({manifest['algorithm']}), {manifest['source']} at step "
                f"{manifest['step']}: {figures} on {manifest['data']['dataset']}; the job reported {metric['name']} "
                f"{metric['value']:.4f} ({metric['of']})"))
    return 0


def _run_dir(args: argparse.Namespace, run: str) -> Path:
    """RUN as a directory: itself when it is one here, else the run directory of the job it names."""
    path = Path(run)
    if path.is_dir() or os.sep in run:
        return path  # a path; the report says what is wrong with it
    try:
        reply = _stub(args).JobStatus(pb.JobStatusRequest(job_id=run), timeout=10)
    except SystemExit as error:  # no credentials to ask the coordinator
        raise SystemExit(f"coordinator: {run} is no run directory here, and no job can be looked up: "
                         f"{str(error.code).removeprefix('coordinator: ')}") from None
    except grpc.RpcError as error:
        raise SystemExit(f"coordinator: {run} is no run directory here, nor a job the coordinator knows "
                         f"({rpc_error_line(error, args.coordinator)})") from None
    run_dir = Path(reply.run_dir)
    if not run_dir.is_dir():
        raise SystemExit(f"coordinator: job {reply.job_id}'s run directory {run_dir} is not on this machine: run "
                         "the report where the coordinator runs, or copy the directory here and give its path")
    return run_dir


def cmd_inspect(args: argparse.Namespace) -> int:
    from coordinator.jobs import validate_job
    from nodeagent.training.data import DataError
    from nodeagent.training.splits import describe_split, format_split_table
    from nodeagent.training.tasks import task_of
    from nodeagent.training.tokens import TokenDataset

    spec = _load_job(args.job_file, args).spec
    topology = validate_job(spec)
    spec = spec.sized()  # an elastic job at its largest size: its data is split into that many shards
    degrees = [topology.degree(rank) for rank in range(spec.nodes)]
    print(f"topology {spec.topology.kind}: {spec.nodes} nodes, {len(topology.edges)} edges, "
          f"degree {min(degrees)}..{max(degrees)}")
    print("edges: " + " ".join(f"{a}-{b}" for a, b in topology.edges))
    directory = args.data_dir or spec.data.data_dir
    task = task_of(spec)
    try:
        train = task.load(spec, directory, "train")
        shards = task.shards(spec, train)
    except DataError as error:
        raise SystemExit(f"coordinator: {error}") from None
    except ValueError as error:  # a split that does not fit the data (classes_per_node above its classes, ...)
        raise SystemExit(f"coordinator: {args.job_file}: data.split_options: {error}") from None
    info = train.info
    if isinstance(train, TokenDataset):  # a language model's samples are labelled by their source file
        labels, groups = train.groups, int(train.groups.max()) + 1
        print(f"dataset {spec.data.dataset} in {directory}: sequences of {info.input_shape[0]} tokens, vocabulary "
              f"{info.num_classes}, {info.train_samples} training and {info.test_samples} validation sequences from "
              f"{groups} files (the table's labels L0, L1, ...: the files)")
    else:
        labels, groups = train.labels.numpy(), info.num_classes
        print(f"dataset {spec.data.dataset} in {directory}: input {'x'.join(map(str, info.input_shape))}, "
              f"{info.num_classes} classes, {info.train_samples} training and {info.test_samples} test samples")
    print(f"split {spec.data.split} of {spec.data.dataset} ({len(labels)} training samples):")
    print(format_split_table(describe_split(labels, shards, groups)))
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from coordinator.jobschema import markdown_reference, schema_json

    sys.stdout.write(markdown_reference() if args.markdown else schema_json())
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    from coordinator.jobschema import commented_job

    try:
        text = commented_job(args.algorithm, _overrides(args))
    except ValueError as error:
        raise SystemExit(f"coordinator: {error}") from None
    try:
        with args.out.open("w" if args.force else "x", encoding="utf-8") as file:
            file.write(text)
    except FileExistsError:
        raise SystemExit(f"coordinator: {args.out} exists; give --force to overwrite it") from None
    except OSError as error:
        raise SystemExit(f"coordinator: cannot write {args.out}: {error.strerror}") from None
    print(f"wrote {args.out} (algorithm {args.algorithm}); `coordinator validate {args.out}` checks it after your "
          "changes")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    for path in args.job_files:
        spec = _load_job(path, args).spec
        nodes = f"{spec.min_nodes}..{spec.max_nodes} nodes (elastic)" if spec.elastic else f"{spec.nodes} nodes"
        print(f"{path}: valid: {spec.name}, {nodes}, {spec.algorithm.name} on {spec.topology.kind}, "
              f"{spec.steps} steps")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from coordinator.demo import run_demo

    return run_demo(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {
        "serve": cmd_serve, "ca": cmd_ca, "token": cmd_token, "cert": cmd_cert,
        "submit": cmd_submit, "follow": cmd_follow, "logs": cmd_logs, "jobs": cmd_jobs, "nodes": cmd_nodes,
        "status": cmd_status, "stop": cmd_stop, "edges": cmd_edges, "topology": cmd_topology,
        "quarantine": cmd_quarantine,
        "simulate": cmd_simulate, "report": cmd_report, "export": cmd_export, "inspect": cmd_inspect,
        "demo": cmd_demo,
        "backup": cmd_backup, "restore": cmd_restore,
        "schema": cmd_schema, "init": cmd_init, "validate": cmd_validate,
    }
    try:
        exit_code = handlers[args.command](args)
        sys.stdout.flush()  # a reader gone away (`| head`) shows here rather than as a warning at exit
        return exit_code
    except BrokenPipeError:
        # Quiet, as a process killed by SIGPIPE; stdout goes to /dev/null so that Python's flush at exit is quiet too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (ListenError, StateDirError, CAError) as error:
        print(f"coordinator: {error}", file=sys.stderr)
        return 1
    except grpc.RpcError as error:
        print(shown(f"coordinator: {rpc_error_line(error, getattr(args, 'coordinator', None))}"), file=sys.stderr)
        return 1


def rpc_error_line(error: grpc.RpcError, address: str | None) -> str:
    """A failed call in one line: the coordinator's address (for the commands that call one), then the likely cause
    when the coordinator was not reached as expected (nothing listens, another cluster's CA, plaintext against
    TLS, the enrollment port, ...), else its answer's code and words."""
    line = unreachable_cause(error) or f"{error.code().name}: {' '.join((error.details() or '').split())}"
    return f"{address}: {line}" if address else line


if __name__ == "__main__":
    sys.exit(main())
