"""Checks of the deployment files under deploy/: systemd units, Dockerfiles, docker-compose, Prometheus
configuration and alert rules, the Grafana dashboard, the Kubernetes manifests and the job specs.

Every command line in them is parsed with the real CLI parsers (`nodeagent.cli.build_parser`,
`coordinator.cli.build_parser`), every metric a query names must be defined by `nodeagent.metrics.Metrics`,
and where the tool is installed the files go through it (systemd-analyze, promtool, prometheus, kubectl).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SYSTEMD = DEPLOY / "systemd"
PROMETHEUS = DEPLOY / "prometheus"
GRAFANA = DEPLOY / "grafana"
K8S = DEPLOY / "k8s"
K8S_CUDA = DEPLOY / "k8s-cuda"  # the CUDA variant: a kustomize overlay of K8S
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
COMPOSE_CUDA_FILE = DEPLOY / "docker-compose.cuda.yml"  # merged over COMPOSE_FILE: the agents on GPUs
DASHBOARD = GRAFANA / "dashboards" / "peertrain.json"
SCRAPE_JOBS = {"peertrain-agent", "peertrain-coordinator"}

UNITS = {
    "peertrain-agent.service": ("nodeagent", "agent.env.example", "/var/lib/peertrain/agent"),
    "peertrain-coordinator.service": ("coordinator", "coordinator.env.example", "/var/lib/peertrain/coordinator"),
}


# ----------------------------------------------------------------------------------------------------
# Helpers


def cli_parser(script: str) -> argparse.ArgumentParser:
    """The real parser behind a console script (pyproject's [project.scripts])."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert script in scripts, f"{script!r} is not a console script of pyproject.toml ({sorted(scripts)})"
    module = importlib.import_module(scripts[script].split(":")[0])
    return module.build_parser()


def parse_cli(script: str, args: list[str], where: str) -> argparse.Namespace:
    try:
        return cli_parser(script).parse_args(args)
    except SystemExit as error:
        pytest.fail(f"{where}: `{script} {shlex.join(args)}` does not parse (exit {error.code})")


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def host_of(address: str) -> str:
    return address.rsplit(":", 1)[0]


def need(tool: str) -> str:
    path = shutil.which(tool)
    assert path is not None, f"{tool} is not installed (`make test` installs it: see deploy/bootstrap.sh)"
    return path


def run(command: list[str], cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_yaml_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


# --- systemd unit files


def read_unit(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) of a unit file, in order, with continuation lines joined."""
    entries: list[tuple[str, str, str]] = []
    section = ""
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if pending:
            line = f"{pending} {line}"
            pending = ""
        elif not line or line.startswith(("#", ";")):
            continue
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        entries.append((section, key.strip(), value.strip()))
    return entries


def unit_values(entries: list[tuple[str, str, str]], key: str) -> list[str]:
    return [value for _, k, value in entries if k == key]


def unit_value(entries: list[tuple[str, str, str]], key: str) -> str:
    values = unit_values(entries, key)
    assert values, f"{key}= is missing"
    return values[-1]


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not VAR=value: {raw!r}"
        assert re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"{path.name}: bad variable name {key!r}"
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key] = value
    return env


def expand_exec(command: str, env: dict[str, str]) -> list[str]:
    """systemd's ExecStart= expansion: ${VAR} stays one word, a bare $VAR word splits at whitespace."""
    words: list[str] = []
    for word in shlex.split(command):
        bare = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if bare:
            words.extend(env.get(bare.group(1), "").split())
        else:
            words.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m.group(1), ""), word))
    return words


def unit_environment(entries: list[tuple[str, str, str]]) -> dict[str, str]:
    env = {}
    for value in unit_values(entries, "Environment"):
        key, _, val = value.partition("=")
        env[key] = val
    return env


# --- Dockerfiles


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        line = f"{pending} {line}" if pending else line
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        pending = ""
        keyword, _, rest = line.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def dockerfile_entrypoint(path: Path) -> list[str]:
    entrypoints = [rest for keyword, rest in dockerfile_instructions(path) if keyword == "ENTRYPOINT"]
    assert entrypoints, f"{path.name} has no ENTRYPOINT"
    return json.loads(entrypoints[-1])


# --- metrics and PromQL


def defined_metrics() -> dict[str, set[str]]:
    """Exposed series name -> label names, for every metric of nodeagent.metrics.Metrics()."""
    from prometheus_client.metrics import MetricWrapperBase

    from nodeagent.metrics import DEVICE_GAUGES, DEVICE_LABELS, Metrics

    metrics = Metrics()
    labels_by_family: dict[str, set[str]] = {}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            for family in value.describe():
                labels_by_family[family.name] = set(getattr(value, "_labelnames", ()))
    names: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        labels = labels_by_family[family.name]
        if family.type == "counter":
            names[f"{family.name}_total"] = labels
        elif family.type == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                names[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
        else:
            names[family.name] = labels
    # The device gauges: a collector registers them for an agent's CUDA device (Metrics.watch_device).
    names |= {name: set(DEVICE_LABELS) for name in DEVICE_GAUGES}
    assert names, "Metrics() defines no metric"
    return names


PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "offset",
    "bool",
    "inf",
    "nan",
}
GROUPING = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"
# Labels every series has after a scrape by deploy/prometheus (job and instance from the target,
# job_id from metric_relabel_configs).
TARGET_LABELS = {"job", "instance", "job_id"}


def promql_references(expr: str) -> tuple[set[str], set[str], set[str]]:
    """(metric names, label names, string literals) an expression uses."""
    literals = set(re.findall(r'"((?:[^"\\]|\\.)*)"', expr))
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    labels: set[str] = set()
    for body in re.findall(r"\{([^}]*)\}", text):
        labels |= set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", body))
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    for clause in re.findall(GROUPING, text):
        labels |= {name.strip() for name in clause.split(",") if name.strip()}
    text = re.sub(GROUPING, " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.$])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?", text):
        word, call = match.group(1), match.group(2)
        if not call and word.lower() not in PROMQL_WORDS:
            names.add(word)
    return names, labels, literals


def check_promql(expr: str, where: str, metrics: dict[str, set[str]]) -> set[str]:
    """Every metric and label an expression uses exists; returns the metric names."""
    names, labels, literals = promql_references(expr)
    assert names, f"{where}: no metric in {expr!r}"
    unknown = {name for name in names if name not in metrics and name != "up"}
    assert not unknown, f"{where}: metrics not defined in nodeagent/metrics.py: {sorted(unknown)} in {expr!r}"
    known_labels = TARGET_LABELS | set().union(*(metrics.get(name, set()) for name in names))
    # label_replace / label_join create labels named by a string argument.
    stray = {label for label in labels if label not in known_labels and label not in literals}
    assert not stray, f"{where}: unknown labels {sorted(stray)} in {expr!r}"
    return names


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(PROMETHEUS / "alerts.yml")["groups"] for rule in group["rules"]]


# --- Grafana


def dashboard_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (panel["title"], target)
        for panel in dashboard_panels(dashboard)
        if panel["type"] != "row"
        for target in panel.get("targets", [])
    ]


def grafana_substitute(expr: str, job: str = ".*") -> str:
    return expr.replace("$__rate_interval", "10s").replace("$__interval", "5s").replace("$job", job)


# --- compose and k8s


def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE_FILE)


SHELLS = {"sh", "/bin/sh"}


def console_scripts() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])


def shell_commands(script: str) -> list[tuple[str, list[str]]]:
    """(console script, arguments) of every command of a shell script that runs one: each part of a line
    between `||`, `&&` and `;` whose first word is a console script, after `exec` if any."""
    commands = []
    for line in script.splitlines():
        for part in re.split(r"\|\||&&|;", line):
            words = shlex.split(part, comments=True)
            if words[:1] == ["exec"]:
                words = words[1:]
            if words and words[0] in console_scripts():
                commands.append((words[0], words[1:]))
    return commands


def compose_entrypoint(name: str, service: dict[str, Any]) -> list[str]:
    if "entrypoint" in service:
        entrypoint = service["entrypoint"]
    else:
        assert "build" in service, f"{name}: neither entrypoint nor build"
        entrypoint = dockerfile_entrypoint(ROOT / service["build"]["dockerfile"])
    return shlex.split(entrypoint) if isinstance(entrypoint, str) else list(entrypoint)


def compose_command(name: str, service: dict[str, Any]) -> tuple[str, list[str]]:
    """(console script, arguments) a compose service runs."""
    entrypoint = compose_entrypoint(name, service)
    command = service.get("command", [])
    command = shlex.split(command) if isinstance(command, str) else list(command)
    assert len(entrypoint) == 1, f"{name}: entrypoint {entrypoint} is not one console script"
    return entrypoint[0], command


def compose_shell_commands(name: str, service: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """The console-script commands of a service whose entrypoint is `sh -c` (its command is the script)."""
    entrypoint = compose_entrypoint(name, service)
    assert entrypoint[0] in SHELLS and entrypoint[-1].startswith("-") and "c" in entrypoint[-1], entrypoint
    [script] = service["command"]
    return shell_commands(script)


def compose_volume(volume: str) -> tuple[str, str]:
    """(source, target) of a short-syntax compose volume; the source may be ${VAR:-default}."""
    source = ""
    if volume.startswith("${"):
        source, volume = volume[: volume.index("}") + 1], volume[volume.index("}") + 2 :]
        return source, volume.split(":")[0]
    source, target = volume.split(":")[:2]
    return source, target


def compose_volume_path(name: str, service: dict[str, Any], path: str | Path) -> tuple[str, str]:
    """(volume, path inside it) of a path in a service's container: through the deepest mount that holds it."""
    path = Path(path)
    mounts = [(source, Path(target)) for source, target in map(compose_volume, service.get("volumes", []))]
    holding = [(source, target) for source, target in mounts if path.is_relative_to(target)]
    assert holding, f"{name}: {path} is on no volume, so it is lost with the container"
    source, target = max(holding, key=lambda mount: len(mount[1].parts))
    return source, str(path.relative_to(target))


def compose_environment(service: dict[str, Any]) -> dict[str, str]:
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return {key: str(value) for key, value in environment.items()}


def peertrain_services(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services of the peertrain image that run one console script (not the `pki` shell script)."""
    return {
        name: service
        for name, service in spec["services"].items()
        if "build" in service and compose_entrypoint(name, service)[0] not in SHELLS
    }


def k8s_documents() -> list[dict[str, Any]]:
    kustomization = load_yaml(K8S / "kustomization.yaml")
    documents = []
    for resource in kustomization["resources"]:
        documents.extend(load_yaml_all(K8S / resource))
    return documents


def k8s_env(container: dict[str, Any], documents: list[dict[str, Any]], pod_name: str) -> dict[str, str]:
    config_maps = {doc["metadata"]["name"]: doc.get("data", {}) for doc in documents if doc["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in config_maps, f"envFrom names ConfigMap {name!r}, which the manifests do not define"
        env.update(config_maps[name])
    fields = {"metadata.name": pod_name, "metadata.namespace": "peertrain"}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "secretKeyRef" in item["valueFrom"]:
            # Secrets are made by the commands of docs/operations.md, never shipped: a stand-in value.
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = f"secret-{ref['name']}-{ref['key']}"
        else:
            env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def k8s_command(container: dict[str, Any], env: dict[str, str]) -> tuple[str, list[str]]:
    """(console script, arguments) a container runs: its command, or `sh -c SCRIPT NAME` whose script ends by
    exec-ing one console script with the container's arguments ("$@")."""
    command = container["command"]
    args = [k8s_expand(arg, env) for arg in container.get("args", [])]
    if command[0] not in SHELLS:
        [script] = command
        return script, args
    flag, script, _name = command[1:]
    assert flag == "-c", command
    [(console_script, script_args)] = shell_commands(script)
    assert script_args == ["$@"], f"the shell must pass the container's args on as they are: {script_args}"
    assert script.rstrip().splitlines()[-1].startswith("exec "), "the daemon must replace the shell (signals)"
    return console_script, args


def k8s_pod_volumes(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A workload's volumes by name, its volumeClaimTemplates included (as {"claimTemplate": ...})."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
    for claim in workload["spec"].get("volumeClaimTemplates", []):
        volumes[claim["metadata"]["name"]] = {"name": claim["metadata"]["name"], "claimTemplate": claim}
    return volumes


def k8s_mount(container: dict[str, Any], path: str | Path) -> tuple[str, str]:
    """(volume name, path inside it) of a path in a container: through the deepest mount that holds it."""
    path = Path(path)
    holding = [m for m in container.get("volumeMounts", []) if path.is_relative_to(m["mountPath"])]
    assert holding, f"{container['name']}: {path} is on no volume"
    mount = max(holding, key=lambda m: len(Path(m["mountPath"]).parts))
    return mount["name"], str(path.relative_to(mount["mountPath"]))


def k8s_strings(value: Any) -> Iterator[str]:
    """Every string in a manifest, keys and values."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from k8s_strings(key)
            yield from k8s_strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from k8s_strings(item)


def k8s_expand(arg: str, env: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) is not defined for the container"
        return env[match.group(1)]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", replace, arg)


# ----------------------------------------------------------------------------------------------------
# systemd


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_systemd_unit_verifies(unit: str, tmp_path: Path) -> None:
    tool = need("systemd-analyze")
    entries = read_unit(SYSTEMD / unit)
    script = UNITS[unit][0]
    exec_start = unit_value(entries, "ExecStart")
    assert exec_start.split()[0] == f"/opt/peertrain/.venv/bin/{script}"
    # The venv is not installed here: point ExecStart at an executable that exists, keep the rest.
    stand_in = shutil.which("true") or "/bin/true"
    text = (SYSTEMD / unit).read_text().replace(f"/opt/peertrain/.venv/bin/{script}", stand_in)
    (tmp_path / unit).write_text(text)
    result = run([tool, "verify", "--man=no", str(tmp_path / unit)], cwd=tmp_path)
    output = result.stdout + result.stderr
    ours = [line for line in output.splitlines() if unit in line or str(tmp_path) in line]
    assert result.returncode == 0 and not ours, f"systemd-analyze verify {unit}:\n{output}"


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_systemd_unit_settings(unit: str) -> None:
    entries = read_unit(SYSTEMD / unit)
    _, env_example, state_dir = UNITS[unit]
    sections = {section for section, _, _ in entries}
    assert sections == {"Unit", "Service", "Install"}
    assert "network-online.target" in unit_value(entries, "After").split()
    assert "network-online.target" in unit_value(entries, "Wants").split()
    expected = {
        "Type": "simple",
        "User": "peertrain",
        "Group": "peertrain",
        "Restart": "on-failure",
        "KillSignal": "SIGTERM",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "EnvironmentFile": f"-/etc/peertrain/{env_example.removesuffix('.example')}",
        "StateDirectory": state_dir.removeprefix("/var/lib/"),
        "WantedBy": "multi-user.target",
    }
    for key, value in expected.items():
        assert unit_value(entries, key) == value, f"{unit}: {key}="
    assert state_dir in unit_value(entries, "ReadWritePaths").split()
    assert 10 <= int(unit_value(entries, "TimeoutStopSec")) <= 120
    assert f"--state-dir {state_dir}" in unit_value(entries, "ExecStart")
    # EnvironmentFile= must come after the defaults so that it overrides them (systemd applies it last
    # anyway; keeping the order in the file says so to the reader).
    keys = [key for _, key, _ in entries]
    assert keys.index("EnvironmentFile") > max(i for i, key in enumerate(keys) if key == "Environment")


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_systemd_unit_exposure_is_low(unit: str, tmp_path: Path) -> None:
    tool = need("systemd-analyze")
    script = UNITS[unit][0]
    text = (SYSTEMD / unit).read_text().replace(f"/opt/peertrain/.venv/bin/{script}", "/bin/true")
    (tmp_path / unit).write_text(text)
    result = run([tool, "security", "--offline=true", "--threshold=30", str(tmp_path / unit)], cwd=tmp_path)
    assert "unrecognized option" not in result.stderr, "this check needs systemd-analyze --offline (systemd >= 250)"
    exposure = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert exposure, result.stdout + result.stderr
    assert result.returncode == 0 and float(exposure.group(1)) <= 3.0, result.stdout[-2000:]


def read_from_environment(script: str, key: str, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether `script serve` takes a setting from the environment variable `key` (an argument's default)."""
    marker = f"from-{key.lower()}"
    with monkeypatch.context() as patch:
        patch.setenv(key, marker)
        args = cli_parser(script).parse_args(["serve"])
    return marker in {str(value) for value in vars(args).values()}


@pytest.mark.parametrize("unit", sorted(UNITS))
@pytest.mark.parametrize("with_env_file", [True, False], ids=["env-example", "defaults"])
def test_systemd_exec_start_parses(unit: str, with_env_file: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    entries = read_unit(SYSTEMD / unit)
    script, env_example, state_dir = UNITS[unit]
    env = unit_environment(entries)
    example = read_env_file(SYSTEMD / env_example)
    exec_start = unit_value(entries, "ExecStart")
    used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", exec_start))
    # Secrets (the join token) stay off the command line, where every local user can read them: the daemon
    # reads those variables from its environment itself.
    unused = {key for key in example if key not in used and not read_from_environment(script, key, monkeypatch)}
    assert not unused, f"{env_example} sets {sorted(unused)}, which {unit} never passes to {script}"
    missing_defaults = {key for key in used if key not in env}
    assert not missing_defaults, f"{unit}: no Environment= default for {sorted(missing_defaults)}"
    if with_env_file:
        env |= example
    argv = expand_exec(exec_start, env)
    args = parse_cli(script, argv[1:], f"{unit} ExecStart")
    assert args.command == "serve"
    assert str(args.state_dir) == state_dir
    assert not args.insecure, f"{unit} runs {script} with --insecure"
    if with_env_file:
        for key, value in example.items():
            if key in used and not key.endswith("_ARGS"):
                assert value in argv, f"{key}={value} did not reach the command line"


def test_systemd_agent_keeps_its_credentials_in_its_state_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's tls dir is under its StateDirectory (writable, kept across restarts, where renewal writes), and
    the first start's enrollment settings come from the env file, never from the command line."""
    entries = read_unit(SYSTEMD / "peertrain-agent.service")
    script, env_example, state_dir = UNITS["peertrain-agent.service"]
    example = read_env_file(SYSTEMD / env_example)
    env = unit_environment(entries) | example
    exec_start = unit_value(entries, "ExecStart")
    args = parse_cli(script, expand_exec(exec_start, env)[1:], "peertrain-agent.service ExecStart")
    tls_dir = Path(args.tls_dir or Path(args.state_dir) / "tls")
    assert tls_dir == Path(state_dir) / "tls"
    assert any(tls_dir.is_relative_to(path) for path in unit_value(entries, "ReadWritePaths").split())
    for key in ("PEERTRAIN_JOIN_TOKEN", "PEERTRAIN_CA_FINGERPRINT"):
        assert key in example, f"{env_example} does not show {key}"
        assert example[key] == "", f"{env_example} ships a value for {key}"
        assert key not in exec_start, f"{key} must not be on the command line"
        assert read_from_environment(script, key, monkeypatch), f"{script} serve does not read {key}"


BACKUP_SERVICE, BACKUP_TIMER = "peertrain-coordinator-backup.service", "peertrain-coordinator-backup.timer"


def test_systemd_backup_units_verify_and_expose_little(tmp_path: Path) -> None:
    tool = need("systemd-analyze")
    text = (SYSTEMD / BACKUP_SERVICE).read_text().replace("/opt/peertrain/.venv/bin/coordinator", "/bin/true")
    (tmp_path / BACKUP_SERVICE).write_text(text)
    shutil.copy(SYSTEMD / BACKUP_TIMER, tmp_path / BACKUP_TIMER)
    result = run([tool, "verify", "--man=no", BACKUP_SERVICE, BACKUP_TIMER], cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "peertrain" not in output, f"systemd-analyze verify:\n{output}"
    result = run([tool, "security", "--offline=true", "--threshold=30", str(tmp_path / BACKUP_SERVICE)], cwd=tmp_path)
    exposure = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert exposure and result.returncode == 0 and float(exposure.group(1)) <= 2.0, result.stdout[-2000:]


def test_systemd_backup_archives_the_coordinators_state_where_it_may_write() -> None:
    """The timer starts the backup service, whose `coordinator backup` reads the state directory the coordinator
    serves from and writes its archive into a directory of its own that only it reads."""
    service, timer = read_unit(SYSTEMD / BACKUP_SERVICE), read_unit(SYSTEMD / BACKUP_TIMER)
    assert unit_value(timer, "Unit") == BACKUP_SERVICE and unit_value(timer, "Persistent") == "yes"
    assert unit_value(timer, "WantedBy") == "timers.target"
    assert (unit_value(service, "Type"), unit_value(service, "User")) == ("oneshot", "peertrain")
    argv = shlex.split(unit_value(service, "ExecStart"))
    assert argv[0] == "/opt/peertrain/.venv/bin/coordinator"
    backup = parse_cli("coordinator", argv[1:], f"{BACKUP_SERVICE} ExecStart")
    assert backup.command == "backup" and backup.force, "each run replaces the archive (atomically)"
    assert str(backup.state_dir) == UNITS["peertrain-coordinator.service"][2]
    writable = [Path(path) for path in unit_value(service, "ReadWritePaths").split()]
    state_directory = Path("/var/lib") / unit_value(service, "StateDirectory")
    assert backup.out.parent == state_directory and state_directory in writable
    assert unit_value(service, "StateDirectoryMode") == "0700" and unit_value(service, "UMask") == "0077"


def test_systemd_coordinator_creates_its_ca_once() -> None:
    """ExecStartPre= creates the CA in the state directory serve uses, and can never replace one."""
    entries = read_unit(SYSTEMD / "peertrain-coordinator.service")
    script, env_example, state_dir = UNITS["peertrain-coordinator.service"]
    [pre] = unit_values(entries, "ExecStartPre")
    argv = shlex.split(pre)
    assert argv[0] == f"/opt/peertrain/.venv/bin/{script}"
    args = parse_cli(script, argv[1:], "peertrain-coordinator.service ExecStartPre")
    assert (args.command, args.action, args.if_missing) == ("ca", "init", True)
    assert str(args.state_dir) == state_dir
    env = unit_environment(entries) | read_env_file(SYSTEMD / env_example)
    serve = parse_cli(script, expand_exec(unit_value(entries, "ExecStart"), env)[1:], "ExecStart")
    assert port_of(serve.enroll_listen) == 7071, "agents enroll at the coordinator's host on port 7071 by default"


# --- the GPU template: one agent per GPU, instance N on cuda:N

GPU_TEMPLATE = "peertrain-agent@.service"
GPU_ENV_EXAMPLE = "agent-gpu.env.example"
# What the template adds to peertrain-agent.service: its devices, and CUDA's numbering of them.
GPU_ONLY_SETTINGS = {("Service", "DevicePolicy"), ("Service", "DeviceAllow"), ("Service", "Environment")}


def gpu_instance(instance: str) -> list[tuple[str, str, str]]:
    """The template's entries for one instance (%i expanded)."""
    return [(section, key, value.replace("%i", instance)) for section, key, value in read_unit(SYSTEMD / GPU_TEMPLATE)]


def test_systemd_gpu_template_verifies(tmp_path: Path) -> None:
    tool = need("systemd-analyze")
    stand_in = shutil.which("true") or "/bin/true"
    text = (SYSTEMD / GPU_TEMPLATE).read_text().replace("/opt/peertrain/.venv/bin/nodeagent", stand_in)
    (tmp_path / GPU_TEMPLATE).write_text(text)
    # A template is verified through an instance, which systemd-analyze loads from the template beside it.
    result = run([tool, "verify", "--man=no", str(tmp_path / "peertrain-agent@0.service")], cwd=tmp_path)
    output = result.stdout + result.stderr
    ours = [line for line in output.splitlines() if "peertrain-agent@" in line or str(tmp_path) in line]
    assert result.returncode == 0 and not ours, f"systemd-analyze verify peertrain-agent@0.service:\n{output}"
    result = run([tool, "security", "--offline=true", "--threshold=30", str(tmp_path / "peertrain-agent@0.service")],
                 cwd=tmp_path)
    exposure = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert exposure, result.stdout + result.stderr
    assert result.returncode == 0 and float(exposure.group(1)) <= 3.0, result.stdout[-2000:]


def test_systemd_gpu_template_keeps_the_agent_units_settings_per_instance() -> None:
    """Every setting of peertrain-agent.service (hardening, restarts, limits) is in the template, with the state and
    cache directories of the instance; what it adds is about the GPUs only."""
    plain = read_unit(SYSTEMD / "peertrain-agent.service")
    template = read_unit(SYSTEMD / GPU_TEMPLATE)
    own = {"Description", "Environment", "EnvironmentFile", "ExecStart"}
    expected = {(section, key, value.replace("peertrain/agent", "peertrain/agent-gpu%i"))
                for section, key, value in plain if key not in own}
    assert expected <= set(template), f"missing from the template: {sorted(expected - set(template))}"
    added = {(section, key) for section, key, _ in set(template) - expected} - {("Unit", "Description")}
    added -= {("Service", key) for key in ("EnvironmentFile", "ExecStart")}
    assert added <= GPU_ONLY_SETTINGS, sorted(added - GPU_ONLY_SETTINGS)
    entries = gpu_instance("0")
    assert unit_value(entries, "DevicePolicy") == "closed"
    assert {value.split()[0] for value in unit_values(entries, "DeviceAllow")} == {
        "char-nvidia", "char-nvidia-frontend", "char-nvidia-uvm", "char-nvidia-caps"}
    assert unit_environment(entries)["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID", "cuda:N must be the GPU nvidia-smi calls N"


@pytest.mark.parametrize("instance", ["0", "1", "7"])
def test_systemd_gpu_instance_runs_an_agent_of_its_own_on_its_gpu(instance: str, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """Instance N: --device cuda:N, its own state directory (node id, checkpoints, its certificate) and cache, and the
    ports of /etc/peertrain/agent-gpuN.env, a file the instance cannot start without (no default ports two instances
    would share). The example is GPU 0's, by the scheme it states: peers 7100+N, lanes 7200+N, metrics 9401+N."""
    entries = gpu_instance(instance)
    state_dir = f"/var/lib/peertrain/agent-gpu{instance}"
    assert unit_value(entries, "EnvironmentFile") == f"/etc/peertrain/agent-gpu{instance}.env"
    assert unit_value(entries, "StateDirectory") == state_dir.removeprefix("/var/lib/")
    assert state_dir in unit_value(entries, "ReadWritePaths").split()
    env = unit_environment(entries)
    assert env["XDG_CACHE_HOME"] == f"/var/cache/{unit_value(entries, 'CacheDirectory')}"
    assert unit_value(entries, "CacheDirectory") == f"peertrain/agent-gpu{instance}"
    example = read_env_file(SYSTEMD / GPU_ENV_EXAMPLE)
    n = int(instance)
    # This instance's file, made from the example as it says: its ports moved by N, its own name.
    instance_file = example | {
        "PEERTRAIN_LISTEN": f"0.0.0.0:{7100 + n}", "PEERTRAIN_LANE_PORT": str(7200 + n),
        "PEERTRAIN_METRICS_LISTEN": f"0.0.0.0:{9401 + n}",
        "PEERTRAIN_AGENT_ARGS": example["PEERTRAIN_AGENT_ARGS"].replace(":7100", f":{7100 + n}").replace(
            "-gpu0", f"-gpu{instance}"),
    }
    if n == 0:
        assert instance_file == example, "agent-gpu.env.example is not GPU 0's by its own scheme"
    exec_start = unit_value(entries, "ExecStart")
    used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", exec_start))
    assert used <= set(env) | set(example), f"no value anywhere for {sorted(used - set(env) - set(example))}"
    unused = {key for key in example if key not in used and not read_from_environment("nodeagent", key, monkeypatch)}
    assert not unused, f"{GPU_ENV_EXAMPLE} sets {sorted(unused)}, which the template never passes to nodeagent"
    for key in ("PEERTRAIN_JOIN_TOKEN", "PEERTRAIN_CA_FINGERPRINT"):
        assert example[key] == "" and key not in exec_start
    args = parse_cli("nodeagent", expand_exec(exec_start, env | instance_file)[1:], f"peertrain-agent@{instance}")
    assert args.command == "serve" and not args.insecure
    assert args.device == f"cuda:{instance}"
    assert (str(args.state_dir), str(args.tls_dir)) == (state_dir, f"{state_dir}/tls")
    assert (port_of(args.listen), args.lane_port, port_of(args.metrics_listen)) == (7100 + n, 7200 + n, 9401 + n)
    assert port_of(args.advertise) == port_of(args.listen)
    assert args.name.endswith(f"-gpu{instance}")


def test_sysusers_creates_the_service_user(tmp_path: Path) -> None:
    tool = need("systemd-sysusers")
    result = run([tool, f"--root={tmp_path}", "--dry-run", str(SYSTEMD / "peertrain.sysusers.conf")])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Creating user 'peertrain'" in output or "Creating user peertrain" in output, output


# ----------------------------------------------------------------------------------------------------
# Prometheus


def k8s_prometheus_config() -> dict[str, Any]:
    [config_map] = [
        doc for doc in load_yaml_all(K8S / "configmap.yaml") if doc["metadata"]["name"] == "peertrain-prometheus"
    ]
    return yaml.safe_load(config_map["data"]["prometheus.yml"])


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-cluster.yml", "k8s"])
def test_promtool_check_config(config: str, tmp_path: Path) -> None:
    promtool = need("promtool")
    if config == "k8s":
        path = tmp_path / "prometheus.yml"
        path.write_text(yaml.safe_dump(k8s_prometheus_config()))
    else:
        path = PROMETHEUS / config
    result = run([promtool, "check", "config", str(path)], cwd=path.parent)
    if config == "k8s" and "field kubernetes_sd_configs not found" in result.stdout + result.stderr:
        # Debian builds Prometheus without Kubernetes discovery: check everything else of the config
        # (the relabelling) with static targets in its place.
        loaded = k8s_prometheus_config()
        for scrape in loaded["scrape_configs"]:
            assert scrape.pop("kubernetes_sd_configs")
            scrape["static_configs"] = [{"targets": ["pod.example:9401"]}]
        path.write_text(yaml.safe_dump(loaded))
        result = run([promtool, "check", "config", str(path)], cwd=path.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_promtool_check_rules() -> None:
    promtool = need("promtool")
    result = run([promtool, "check", "rules", "alerts.yml"], cwd=PROMETHEUS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout + result.stderr


def test_promtool_test_rules() -> None:
    promtool = need("promtool")
    result = run([promtool, "test", "rules", "alerts_test.yml"], cwd=PROMETHEUS, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_unit_tested_and_documented() -> None:
    tests = load_yaml(PROMETHEUS / "alerts_test.yml")
    firing = {
        case["alertname"]
        for test in tests["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    alerts = {rule["alert"] for rule in alert_rules()}
    assert alerts - firing == set(), f"alerts never shown firing in alerts_test.yml: {sorted(alerts - firing)}"
    operations = (ROOT / "docs" / "operations.md").read_text()
    undocumented = {alert for alert in alerts if alert not in operations}
    assert not undocumented, f"alerts missing from docs/operations.md: {sorted(undocumented)}"


def test_alert_rules_use_defined_metrics() -> None:
    metrics = defined_metrics()
    rules = alert_rules()
    assert len({rule["alert"] for rule in rules}) == len(rules), "duplicate alert names"
    for rule in rules:
        check_promql(rule["expr"], rule["alert"], metrics)
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert {"summary", "description"} <= set(rule["annotations"])
    jobs = {job for rule in rules for job in re.findall(r'job="([^"]+)"', rule["expr"])}
    assert jobs <= SCRAPE_JOBS, f"rules select scrape jobs {sorted(jobs - SCRAPE_JOBS)} that no config defines"


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-cluster.yml", "k8s"])
def test_scrape_configs_define_both_jobs(config: str) -> None:
    loaded = k8s_prometheus_config() if config == "k8s" else load_yaml(PROMETHEUS / config)
    scrape = {job["job_name"]: job for job in loaded["scrape_configs"]}
    assert set(scrape) >= SCRAPE_JOBS
    if config != "k8s":
        assert loaded["rule_files"] == ["alerts.yml"]


def test_compose_prometheus_scrapes_the_compose_services() -> None:
    spec = compose()
    services = peertrain_services(spec)
    expected: dict[str, set[str]] = {"peertrain-agent": set(), "peertrain-coordinator": set()}
    for name, service in services.items():
        if "profiles" in service:
            continue
        script, command = compose_command(name, service)
        args = parse_cli(script, command, f"compose service {name}")
        job = "peertrain-agent" if script == "nodeagent" else "peertrain-coordinator"
        expected[job].add(f"{name}:{port_of(args.metrics_listen)}")
    config = load_yaml(PROMETHEUS / "prometheus.yml")
    scraped = {
        job["job_name"]: {target for static in job["static_configs"] for target in static["targets"]}
        for job in config["scrape_configs"]
    }
    for job, targets in expected.items():
        assert scraped[job] == targets, f"prometheus.yml job {job}"
    # The cluster example's file_sd targets exist and use the default metrics ports.
    for pattern, port in (("agents", 9401), ("coordinator", 9400)):
        files = sorted((PROMETHEUS / "targets").glob(f"{pattern}*.yml"))
        assert files, f"no targets/{pattern}*.yml"
        for path in files:
            for group in load_yaml(path):
                assert group["targets"] and all(port_of(t) == port for t in group["targets"]), path.name


# ----------------------------------------------------------------------------------------------------
# Grafana


def test_grafana_provisioning_matches_compose() -> None:
    spec = compose()
    grafana = spec["services"]["grafana"]
    mounts = dict(compose_volume(volume) for volume in grafana["volumes"])
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    [datasource] = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    assert datasource["type"] == "prometheus"
    url = urllib.parse.urlsplit(datasource["url"])
    assert url.hostname in spec["services"], f"datasource host {url.hostname} is no compose service"
    container_ports = {int(str(p).split(":")[-1]) for p in spec["services"][url.hostname]["ports"]}
    assert url.port in container_ports
    [provider] = load_yaml(GRAFANA / "provisioning" / "dashboards" / "peertrain.yml")["providers"]
    assert provider["type"] == "file"
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    home = grafana["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert home == f"{provider['options']['path']}/{DASHBOARD.name}"


def test_dashboard_queries_use_defined_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    metrics = defined_metrics()
    panels = dashboard_panels(dashboard)
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 20
    used: set[str] = set()
    for title, target in queries:
        expr = target["expr"]
        for variable in re.findall(r"\$\{?(\w+)", expr):
            assert variable in variables or variable.startswith("__") or variable.isdigit(), (
                f"{title}: ${variable} is not a dashboard variable"
            )
        used |= check_promql(expr, title, metrics)
        assert target["datasource"]["uid"] == "${datasource}", title
    # What the dashboard is for: every agent metric shows up somewhere.
    families = {re.sub(r"_(bucket|sum|count)$", "", name) for name in used}
    wanted = {re.sub(r"_(bucket|sum|count)$", "", name) for name in metrics}
    # The coordinator's own counters of heartbeats and of refused (impossible) reports, and its series per running
    # job, are for alerts and debugging, not panels.
    missing = wanted - families - {"peertrain_coordinator_heartbeats_total",
                                   "peertrain_coordinator_refused_reports_total",
                                   "peertrain_coordinator_job_running"}
    assert not missing, f"metrics without a panel: {sorted(missing)}"


def test_dashboard_has_the_operator_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    by_title = {panel["title"]: panel for panel in dashboard_panels(dashboard)}
    exprs = {title: " ".join(t["expr"] for t in panel.get("targets", [])) for title, panel in by_title.items()}
    assert "sum by (src, dst) (rate(peertrain_edge_bytes_sent_total" in exprs["Per-edge traffic sent"]
    assert "peertrain_test_accuracy" in exprs["Test accuracy per node"]
    assert "peertrain_training_loss" in exprs["Training loss per node"]
    latency = exprs["Exchange latency p50 / p99"]
    assert "histogram_quantile(0.5," in latency and "histogram_quantile(0.99," in latency
    assert "sum by (reason) (rate(peertrain_exchange_failures_total" in exprs["Exchange failures by reason"]
    assert "peertrain_local_steps_total" in exprs["Local step rate per node"]
    assert "peertrain_wait_seconds_total" in exprs["Wait time (fraction of wall time)"]
    graph = by_title["Topology and live edge traffic"]
    assert graph["type"] == "nodegraph"
    # The node graph panel tells its frames apart by refId, and needs id (+ source, target) fields.
    refs = {target["refId"]: target for target in graph["targets"]}
    assert set(refs) == {"nodes", "edges"}
    assert all(t["format"] == "table" and t["instant"] for t in refs.values())
    _, node_labels, _ = promql_references(refs["nodes"]["expr"])
    assert {"id", "title"} <= node_labels
    assert {'"id"', '"source"', '"target"'} <= set(re.findall(r'"\w+"', refs["edges"]["expr"]))
    [organize] = graph["transformations"]
    assert set(organize["options"]["renameByName"].values()) == {"mainstat"}
    memory = exprs["Device memory per node"]
    for gauge in ("allocated", "reserved", "peak"):
        assert f"max by (node, device) (peertrain_device_memory_{gauge}_bytes)" in memory
    assert by_title["Device memory per node"]["fieldConfig"]["defaults"]["unit"] == "bytes"
    assert "max by (node, device) (peertrain_device_utilization_ratio)" in exprs["Device utilisation per node"]
    assert by_title["Device utilisation per node"]["fieldConfig"]["defaults"]["unit"] == "percentunit"


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    promtool = need("promtool")
    dashboard = json.loads(DASHBOARD.read_text())
    rules = [
        {"record": f"peertrain:dashboard_query_{i}", "expr": grafana_substitute(target["expr"])}
        for i, (_, target) in enumerate(dashboard_queries(dashboard))
    ]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run([promtool, "check", "rules", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr


# --- the dashboard and rules against a real Prometheus scraping real Metrics() registries


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(registry: Any) -> Iterator[int]:
    from prometheus_client import start_http_server

    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield int(server.server_port)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def feed(agent: Any, coordinator: Any, job: str, stop: threading.Event) -> None:
    """Metrics of two nodes n0, n1 on one edge each way, moving like a training job's."""
    coordinator.coordinator_nodes.labels("up").set(2)
    coordinator.coordinator_nodes.labels("down").set(0)
    coordinator.coordinator_jobs.labels("running").set(1)
    for index, node in enumerate(("n0", "n1")):
        agent.agent_info.labels(node, node, "0.1.0", f"127.0.0.1:{7100 + index}", "cpu").set(1)
    step = 0
    while not stop.wait(0.05):
        step += 1
        coordinator.coordinator_heartbeats.inc()
        for src, dst in (("n0", "n1"), ("n1", "n0")):
            agent.edge_bytes_sent.labels(job, src, dst).inc(4096)
            agent.edge_bytes_received.labels(job, dst, src).inc(4096)
            agent.edge_messages_sent.labels(job, src, dst).inc()
            agent.edge_messages_received.labels(job, dst, src).inc()
            agent.exchange_seconds.labels(job, src, dst).observe(0.004 * (1 + step % 5))
            agent.edge_last_message.labels(job, src, dst).set(time.time() - 0.05 * (step % 3))
            agent.edge_message_interval.labels(job, src, dst).set(0.05)
            agent.edge_in_flight_since.labels(job, src, dst).set(time.time() - 0.01)
            agent.neighbor_staleness.labels(job, src, dst).set(step % 4)
            agent.consensus_distance.labels(job, src, dst).set(1.0 / step)
            if step % 7 == 0:
                agent.exchange_failures.labels(job, src, dst, "unavailable").inc()
                agent.stream_rejections.labels(src, dst, "bad_manifest").inc()
        for node in ("n0", "n1"):
            agent.local_steps.labels(job, node).inc()
            agent.step_seconds.labels(job, node).observe(0.002)
            agent.wait_seconds.labels(job, node).inc(0.01)
            agent.training_loss.labels(job, node).set(1.0 / step)
            agent.test_accuracy.labels(job, node).set(min(0.9, 0.1 + step / 100))
            agent.test_loss.labels(job, node).set(1.0 / step)
            agent.test_perplexity.labels(job, node).set(math.exp(1.0 / step))  # as a language model's node
            # An all-reduce quorum that loses a member now and then.
            agent.quorum_size.labels(job, node).set(2 if step % 20 else 1)
            if step % 20 == 0:
                agent.aborted_steps.labels(job, node).inc()
            # The parameter server the coordinator hosts for centralised jobs.
            coordinator.ps_bytes_upstream.labels(job, node).inc(1024)
            coordinator.ps_bytes_downstream.labels(job, node).inc(4096)
        coordinator.ps_pushes.labels(job, "applied").inc(2)
        coordinator.ps_updates_clipped.labels(job).inc()
        coordinator.robust_clipped.labels(job, "n1", "coordinator").inc()  # a member whose updates a robust rule clips
        coordinator.coordinator_member_suspicion.labels(job, "n1").set(0.9)  # ... flagged, then quarantined
        coordinator.coordinator_member_suspected.labels(job, "n1").set(1)
        coordinator.coordinator_member_quarantined.labels(job, "n1").set(1)
        coordinator.ps_version.labels(job).set(2 * step)
        coordinator.ps_staleness.labels(job).observe(step % 3)


def prometheus_query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as reply:
        body = json.load(reply)
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for(condition: Callable[[], bool], timeout: float, what: str, seen: dict | None = None) -> None:
    """Until `condition()` holds; else fails saying `what`, formatted with `seen` (what the condition last saw)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, AssertionError):
            if condition():
                return
        time.sleep(0.25)
    pytest.fail(f"timed out waiting for {what if seen is None else what.format(seen=seen)}")


def test_dashboard_and_rules_against_live_prometheus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prometheus = need("prometheus")
    from fakecuda import fake_cuda, fake_pynvml

    from nodeagent.metrics import Metrics

    job = "job-0001"
    agent, coordinator = Metrics(), Metrics()
    # n0 on a (faked) GPU: its device gauges, read at each scrape.
    fake_cuda(monkeypatch, index=0)
    fake_pynvml(monkeypatch, utilization_percent=60)
    agent.watch_device("n0", "cuda:0")
    stop = threading.Event()
    feeder = threading.Thread(target=feed, args=(agent, coordinator, job, stop), daemon=True)
    with serving(agent.registry) as agent_port, serving(coordinator.registry) as coordinator_port:
        # The scrape jobs of deploy/prometheus/prometheus.yml, relabelling included, aimed at these ports.
        config = load_yaml(PROMETHEUS / "prometheus.yml")
        ports = {"peertrain-agent": agent_port, "peertrain-coordinator": coordinator_port}
        scrape_configs = []
        for scrape in config["scrape_configs"]:
            if scrape["job_name"] in ports:
                scrape["static_configs"] = [{"targets": [f"127.0.0.1:{ports[scrape['job_name']]}"]}]
                scrape_configs.append(scrape)
        config["scrape_configs"] = scrape_configs
        config["global"] |= {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(PROMETHEUS / "alerts.yml")]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        feeder.start()
        process = subprocess.Popen(
            [
                prometheus,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "prometheus.log").open("w"),
        )
        try:
            scrapes = "min(count_over_time(peertrain_local_steps_total[1m]))"
            wait_for(
                lambda: any(float(r["value"][1]) >= 3 for r in prometheus_query(base, scrapes)),
                60,
                "three scrapes of the agent",
            )
            up = {r["metric"]["job"]: r["value"][1] for r in prometheus_query(base, "up")}
            assert up == {"peertrain-agent": "1", "peertrain-coordinator": "1"}
            # The training job's label is job_id; nothing collides with the scrape job's label.
            assert prometheus_query(base, f'peertrain_local_steps_total{{job_id="{job}"}}')
            assert not prometheus_query(base, '{exported_job!=""}')
            dashboard = json.loads(DASHBOARD.read_text())
            empty = []
            for title, target in dashboard_queries(dashboard):
                result = prometheus_query(base, grafana_substitute(target["expr"], job))
                if not result:
                    empty.append(f"{title}: {target['expr']}")
            assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
            nodes = prometheus_query(
                base,
                grafana_substitute(
                    next(t["expr"] for _, t in dashboard_queries(dashboard) if t["refId"] == "nodes"), job
                ),
            )
            assert {r["metric"]["id"] for r in nodes} == {"n0", "n1"}
            edges = prometheus_query(
                base,
                grafana_substitute(
                    next(t["expr"] for _, t in dashboard_queries(dashboard) if t["refId"] == "edges"), job
                ),
            )
            assert {(r["metric"]["source"], r["metric"]["target"], r["metric"]["id"]) for r in edges} == {
                ("n0", "n1", "n0->n1"),
                ("n1", "n0", "n1->n0"),
            }

            def rules_evaluated() -> bool:
                with urllib.request.urlopen(f"{base}/api/v1/rules", timeout=10) as reply:
                    groups = json.load(reply)["data"]["groups"]
                rules = [rule for group in groups for rule in group["rules"]]
                assert len(rules) == len(alert_rules())
                assert all(rule["health"] != "err" for rule in rules), [r for r in rules if r["health"] == "err"]
                return all(rule["health"] == "ok" for rule in rules)

            wait_for(rules_evaluated, 30, "every alert rule evaluated without error")
        finally:
            stop.set()
            stop_process(process)
            feeder.join(5)


def start_prometheus(tmp_path: Path, targets: dict[str, list[str]], rule_files: list[str]) -> tuple[Any, str]:
    """A real Prometheus with the scrape jobs of deploy/prometheus/prometheus.yml aimed at `targets`."""
    config = load_yaml(PROMETHEUS / "prometheus.yml")
    scrape_configs = []
    for scrape in config["scrape_configs"]:
        if scrape["job_name"] in targets:
            scrape["static_configs"] = [{"targets": targets[scrape["job_name"]]}]
            scrape_configs.append(scrape)
    config["scrape_configs"] = scrape_configs
    config["global"] |= {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = rule_files
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    process = subprocess.Popen(
        [
            need("prometheus"),
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("w"),
    )
    return process, f"http://127.0.0.1:{port}"


def stop_process(process: Any) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# The dashboard's panels of per-edge debugging, whose series come from the agents' progress reports.
EDGE_DEBUGGING_PANELS = ("Edge last message age and call in flight", "Neighbour staleness",
                         "Consensus distance per edge", "Edge message interval")


def test_prometheus_scrapes_a_local_cluster(tmp_path: Path, fashion_mnist_dir: Path, cluster) -> None:
    """The real server scrapes a coordinator and 4 agents on loopback (the shared cluster) while they train."""
    need("prometheus")
    from nodeagent._proto import coordinator_pb2

    job = {
        # Far more steps than the test needs (it stops the job), paced at 100 steps/s (`min_step_s`) to spare the CPU.
        "name": "scraped", "nodes": 4, "steps": 100_000, "eval_every": 250, "min_step_s": 0.01,
        "algorithm": {"name": "dsgd", "interval": 4}, "topology": {"kind": "ring"},
        "data": {"data_dir": str(fashion_mnist_dir), "split": "iid", "batch_size": 50, "test_limit": 1000},
    }
    # The job's members are scraped: the shared cluster also holds agents that other modules' tests stopped, which
    # the coordinator counts up until their heartbeat timeout.
    job_id = cluster.submit(yaml.safe_dump(job))
    members = {m.rank: m.node_id for m in cluster.status(job_id).nodes}
    metrics_of = {n.node_id: n.metrics_address for n in cluster.nodes()}
    process, base = start_prometheus(
        tmp_path,
        {"peertrain-agent": [metrics_of[node_id] for node_id in members.values()],
         "peertrain-coordinator": [cluster.metrics_address]},
        [str(PROMETHEUS / "alerts.yml")],
    )
    try:
        ring = {(members[r], members[(r + 1) % 4]) for r in range(4)}
        ring |= {(b, a) for a, b in ring}

        def edges_seen() -> bool:
            # This job's: the shared cluster's agents ran other jobs, on other graphs, before it.
            query = f'sum by (src, dst) (peertrain_edge_bytes_sent_total{{job_id="{job_id}"}}) > 0'
            rows = prometheus_query(base, query)
            return {(r["metric"]["src"], r["metric"]["dst"]) for r in rows} == ring

        seen: dict[str, object] = {}  # the last answers, for the failure's message

        def cluster_seen() -> bool:
            # Every target scraped (the members and the coordinator), and the coordinator's count of the nodes up as
            # it answers now.
            seen["up"] = sorted((r["metric"]["instance"], r["value"][1]) for r in prometheus_query(base, "up"))
            seen["accuracy"] = sorted(r["metric"]["node"] for r in prometheus_query(
                base, f'peertrain_test_accuracy{{job_id="{job_id}"}}'))
            seen["nodes_up"] = [r["value"][1] for r in prometheus_query(
                base, 'peertrain_coordinator_nodes{state="up"}')]
            seen["exchanges"] = [r["value"][1] for r in prometheus_query(
                base, "sum(peertrain_exchange_seconds_count)")]
            return (
                len(seen["up"]) == len(members) + 1 and all(value == "1" for _, value in seen["up"])
                and set(seen["accuracy"]) == set(members.values())
                and seen["nodes_up"] == [str(sum(n.up for n in cluster.nodes()))]
                and bool(seen["exchanges"]) and float(seen["exchanges"][0]) > 0
            )

        wait_for(edges_seen, 90, "traffic on every edge of the ring")
        wait_for(cluster_seen, 90, "every target up, accuracy of every node, the coordinator's node count: last "
                 "seen {seen}", seen)
        # The per-edge debugging panels answer from the agents' own gauges, for every edge of the ring.
        dashboard = json.loads(DASHBOARD.read_text())
        for title in EDGE_DEBUGGING_PANELS:
            expr = next(t["expr"] for panel_title, t in dashboard_queries(dashboard) if panel_title == title)

            def answered(expr: str = expr) -> bool:
                rows = prometheus_query(base, grafana_substitute(expr, job_id))
                return {(r["metric"]["src"], r["metric"]["dst"]) for r in rows} == ring

            wait_for(answered, 30, f"the panel {title!r} on every edge")
    finally:
        cluster.stub().StopJob(coordinator_pb2.StopJobRequest(job_id=job_id), timeout=10)
        stop_process(process)


# ----------------------------------------------------------------------------------------------------
# Dockerfiles


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile(dockerfile: str) -> None:
    path = DEPLOY / "docker" / dockerfile
    instructions = dockerfile_instructions(path)
    args = {}
    for keyword, rest in instructions:
        if keyword == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name] = default
    [base] = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest) for k, rest in instructions if k == "FROM"]
    if dockerfile == "Dockerfile.cpu":
        assert base == "python:3.11-slim"
    else:
        assert re.fullmatch(r"nvidia/cuda:\d+\.\d+(\.\d+)?-(runtime|base)-ubuntu\d+\.\d+", base), base
        cuda = re.match(r"nvidia/cuda:(\d+)\.(\d+)", base)
        assert cuda and args["TORCH_INDEX"].endswith(f"/cu{cuda.group(1)}{cuda.group(2)}"), (
            "the torch CUDA index must match the base image's CUDA version"
        )

    copied: set[str] = set()
    for keyword, rest in instructions:
        if keyword not in {"COPY", "ADD"}:
            continue
        words = [w for w in rest.split() if not w.startswith("--")]
        assert not rest.startswith("--from"), "multi-stage copies are not expected here"
        for source in words[:-1]:
            assert (ROOT / source).exists(), f"{dockerfile}: COPY source {source} does not exist"
            copied.add(source)
    assert {"constraints.txt", "pyproject.toml", "nodeagent", "coordinator"} <= copied
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("readme")
    if readme:
        assert readme in copied, "pyproject.toml names a readme the build needs"

    installs = [rest for keyword, rest in instructions if keyword == "RUN" and "pip install" in rest]
    commands = [
        c.strip() for rest in installs for c in rest.split("&&") if "pip install" in c and "--upgrade pip" not in c
    ]
    torch = [c for c in commands if re.search(r"\btorch\b", c)]
    assert torch and all("-c constraints.txt" in c and "--index-url" in c for c in torch), torch
    assert any(re.search(r"pip install -c constraints\.txt \.(\s|$)", c) for c in commands), commands
    # torch is installed before peertrain, so that peertrain's torch==2.13.* finds the right build.
    assert commands.index(torch[0]) < next(i for i, c in enumerate(commands) if c.endswith(" ."))
    order = [rest.split()[0] for keyword, rest in instructions if keyword == "COPY"]
    assert order.index("constraints.txt") == 0, "constraints.txt is copied before the first install"

    users = [rest for keyword, rest in instructions if keyword == "USER"]
    assert users and users[-1] not in {"root", "0"}
    assert dockerfile_entrypoint(path)[0] in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    exposed = {int(p) for keyword, rest in instructions if keyword == "EXPOSE" for p in rest.split()}
    # The daemons' ports (nodeagent/defaults.py): gRPC, enrollment, health, peers, lanes, metrics.
    assert exposed == {7070, 7071, 7072, 7100, 7200, 7300, 9400, 9401}

    ignore = (path.parent / f"{dockerfile}.dockerignore").read_text().split()
    assert ".venv" in ignore and ".git" in ignore
    assert not copied & set(ignore), "the .dockerignore hides a COPY source"


def test_dockerfile_copies_enough_to_build_the_package(tmp_path: Path) -> None:
    """`pip install .` inside the image sees only what the Dockerfile copies: build a wheel from just that."""
    context = tmp_path / "context"
    context.mkdir()
    for keyword, rest in dockerfile_instructions(DEPLOY / "docker" / "Dockerfile.cpu"):
        if keyword == "COPY":
            *sources, destination = rest.split()
            if destination.startswith("/"):
                continue  # outside the build directory (the example jobs)
            for source in sources:
                if (ROOT / source).is_dir():
                    shutil.copytree(ROOT / source, context / source, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy2(ROOT / source, context / source)
    python = Path(sys.executable)
    result = run(
        [str(python), "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=context,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    [wheel] = tmp_path.glob("peertrain-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = archive.read(entry_points).decode()
    for package in ("nodeagent", "coordinator"):
        modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / package).rglob("*.py")}
        assert modules <= names, f"the wheel lacks {sorted(modules - names)[:5]}"
    assert "nodeagent = nodeagent.cli:main" in scripts and "coordinator = coordinator.cli:main" in scripts


# ----------------------------------------------------------------------------------------------------
# docker-compose


def test_compose_services_build_and_images() -> None:
    spec = compose()
    for name, service in spec["services"].items():
        assert "image" in service or "build" in service, name
        if "build" in service:
            context = (COMPOSE_FILE.parent / service["build"]["context"]).resolve()
            assert context == ROOT, f"{name}: the build context must be the repository root"
            assert (context / service["build"]["dockerfile"]).is_file(), name
        else:
            image = service["image"]
            assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image version ({image})"
        for dependency in service.get("depends_on", []):
            assert dependency in spec["services"], f"{name} depends on unknown service {dependency}"


def test_no_shipped_file_forces_one_dataset_directory_on_every_kind() -> None:
    """A bare --data-dir DIR (or PEERTRAIN_DATA_DIR=DIR) serves every job from one directory whatever its dataset:
    every shipped deployment maps datasets (DATASET=DIR) or gives a root with one directory per dataset."""
    shipped = [path for path in DEPLOY.rglob("*") if path.is_file() and path.suffix not in {".json", ".png"}]
    assert len(shipped) > 10
    forced, per_dataset = [], 0
    for path in shipped:
        text = path.read_text()
        for value in re.findall(r"--data-dir[= ]+(\S+)", text) + re.findall(r"PEERTRAIN_DATA_DIR=(\S+)", text):
            per_dataset += 1
            forced += [f"{path.relative_to(ROOT)}: {entry}" for entry in value.split(",") if entry and "=" not in entry]
        per_dataset += len(re.findall(r"--data-root[= ]+\S+|PEERTRAIN_DATA_ROOT=\S+", text))
    assert not forced, f"one directory for every dataset: {forced}"
    assert per_dataset >= 6  # compose, its CUDA variant, the StatefulSet and both env examples say where data is


def test_compose_commands_parse_with_the_cli() -> None:
    spec = compose()
    services = peertrain_services(spec)
    assert {"coordinator", "submit", "agent-0", "agent-1", "agent-2", "agent-3"} <= set(services)
    parsed = {}
    for name, service in services.items():
        script, command = compose_command(name, service)
        parsed[name] = (script, parse_cli(script, command, f"compose service {name}"))
    coordinator_script, coordinator = parsed["coordinator"]
    assert coordinator_script == "coordinator" and coordinator.command == "serve"
    agents = sorted(name for name, (script, _) in parsed.items() if script == "nodeagent")
    assert agents == [f"agent-{i}" for i in range(4)]
    for name in agents:
        args = parsed[name][1]
        assert args.command == "serve"
        assert args.advertise == f"{name}:{port_of(args.listen)}", f"{name} must advertise its service name"
        assert host_of(args.coordinator) == "coordinator"
        assert port_of(args.coordinator) == port_of(coordinator.listen)
        assert args.name == name
        mounts = dict(compose_volume(v) for v in services[name]["volumes"])
        assert mounts[f"{name}-state"] == str(args.state_dir)
        assert args.data_root in mounts.values(), f"{name}: --data-root is not mounted"
        # Its credentials live on its state volume, where pki puts them and where it writes its renewals.
        tls_dir = args.tls_dir or Path(args.state_dir) / "tls"
        assert compose_volume_path(name, services[name], tls_dir) == (f"{name}-state", "tls")
        health = " ".join(services[name]["healthcheck"]["test"])
        assert f":{port_of(args.metrics_listen)}/metrics" in health
    health = " ".join(services["coordinator"]["healthcheck"]["test"])
    assert f":{port_of(coordinator.metrics_listen)}/metrics" in health
    submit_script, submit = parsed["submit"]
    assert submit_script == "coordinator" and submit.command == "submit"
    assert host_of(submit.coordinator) == "coordinator"
    # The job file the one-shot submits is deploy/jobs/demo.yaml, through the ./jobs mount.
    [jobs_mount] = [v for v in services["submit"]["volumes"] if v.startswith("./jobs:")]
    target = compose_volume(jobs_mount)[1]
    relative = Path(str(submit.job_file)).relative_to(target)
    assert (DEPLOY / "jobs" / relative).is_file()


def test_compose_ports_and_volumes() -> None:
    spec = compose()
    published: dict[tuple[str, int], str] = {}
    daemons = peertrain_services(spec)
    for name, service in spec["services"].items():
        listens: set[int] = set()
        if name in daemons:
            script, command = compose_command(name, service)
            args = parse_cli(script, command, name)
            flags = ("listen", "enroll_listen", "metrics_listen")
            listens = {port_of(a) for a in (getattr(args, flag, None) for flag in flags) if a}
        for mapping in service.get("ports", []):
            parts = str(mapping).split(":")
            host_ip, host_port, container_port = ("0.0.0.0", *parts) if len(parts) == 2 else parts
            key = (host_ip, int(host_port))
            assert key not in published, f"{name} and {published.get(key)} both publish {key}"
            published[key] = name
            assert host_ip == "127.0.0.1", f"{name}: publish on loopback only (metrics have no TLS): {mapping}"
            if listens:
                assert int(container_port) in listens, f"{name} publishes {container_port}, listens on {listens}"
        declared = set(spec.get("volumes") or {})
        for volume in service.get("volumes", []):
            source = compose_volume(volume)[0]
            if source.startswith("$"):
                continue  # a host path from the environment (the dataset)
            if source.startswith((".", "/")):
                assert (COMPOSE_FILE.parent / source).exists(), f"{name}: bind source {source} does not exist"
            else:
                assert source in declared, f"{name}: volume {source} is not declared at the top level"
    # Each agent has its own state volume.
    agent_volumes = [
        compose_volume(volume)[0]
        for name, service in spec["services"].items()
        if name.startswith("agent-")
        for volume in service["volumes"]
        if compose_volume(volume)[1].startswith("/var/lib/peertrain")
    ]
    assert len(agent_volumes) == len(set(agent_volumes)) == 4


def test_compose_pki_issues_every_credential_before_the_daemons() -> None:
    """The one-shot `pki` creates the CA where the coordinator keeps it, a node certificate for each agent in that
    agent's tls dir (named as the agent), and the operator certificate the CLI in the coordinator and `submit` use;
    each only when missing; and every daemon starts only after it succeeded."""
    spec = compose()
    services = spec["services"]
    pki = services["pki"]
    assert pki["restart"] == "no" and pki["network_mode"] == "none", "pki is a one-shot that needs no network"
    commands = [(script, parse_cli(script, args, f"compose pki: {shlex.join([script, *args])}"))
                for script, args in compose_shell_commands("pki", pki)]
    assert commands and {script for script, _ in commands} == {"coordinator"}
    coordinator_service = services["coordinator"]
    coordinator = parse_cli(*compose_command("coordinator", coordinator_service), "compose coordinator")
    init = commands[0][1]
    assert (init.command, init.action, init.if_missing) == ("ca", "init", True), "the CA first, never replaced"
    ca_volume = compose_volume_path("pki", pki, init.state_dir)
    assert ca_volume == compose_volume_path("coordinator", coordinator_service, coordinator.state_dir)
    issued = [args for _, args in commands[1:]]
    assert all(args.command == "cert" and args.action == "issue" for args in issued)
    assert all(compose_volume_path("pki", pki, args.state_dir) == ca_volume for args in issued)
    [script] = pki["command"]
    for args in issued:
        assert f"test -f {args.out}/tls.crt || " in script, f"pki re-issues {args.out} at every start"

    agents = {name: service for name, service in peertrain_services(spec).items() if name.startswith("agent-")}
    nodes = {args.node: args for args in issued if args.node}
    assert set(nodes) == set(agents), "one node certificate per agent"
    for name, service in agents.items():
        agent = parse_cli(*compose_command(name, service), f"compose {name}")
        assert agent.name == name, f"{name}: its --name differs from the node id in its certificate"
        tls_dir = agent.tls_dir or Path(agent.state_dir) / "tls"
        assert compose_volume_path("pki", pki, nodes[name].out) == compose_volume_path(name, service, tls_dir)

    [operator] = [args for args in issued if args.operator]
    operator_volume = compose_volume_path("pki", pki, operator.out)
    for name in ("coordinator", "submit"):
        service = services[name]
        tls_dir = compose_environment(service)["PEERTRAIN_TLS_DIR"]
        assert compose_volume_path(name, service, tls_dir) == operator_volume, f"{name}: no operator certificate"
        [mount] = [v for v in service["volumes"] if compose_volume(v)[0] == operator_volume[0]]
        assert mount.endswith(":ro"), f"{name} mounts the operator credentials writable"

    for name in ("coordinator", "submit", *agents):
        condition = services[name]["depends_on"].get("pki", {}).get("condition")
        assert condition == "service_completed_successfully", f"{name} may start before pki has finished"


def test_compose_never_runs_insecure() -> None:
    spec = compose()
    services = spec["services"]
    commands = [(name, *compose_command(name, service)) for name, service in peertrain_services(spec).items()]
    commands += [("pki", *command) for command in compose_shell_commands("pki", services["pki"])]
    for name, script, args in commands:
        assert not getattr(parse_cli(script, args, f"compose {name}"), "insecure", False), f"{name} runs --insecure"
    for name, service in services.items():
        assert compose_environment(service).get("PEERTRAIN_INSECURE", "") in {"", "0"}, name


# What a service of the CUDA file may set. Compose merges a mapping (build, deploy) key by key and replaces the
# rest, `command` whole; `merge_compose` does the same for these keys.
COMPOSE_CUDA_KEYS = {"image", "build", "command", "deploy"}


def merge_compose(base: Any, override: Any) -> Any:
    """`docker compose -f base -f override` for mappings and the keys of COMPOSE_CUDA_KEYS: mappings merge, anything
    else in the override replaces the base's."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {key: merge_compose(base[key], value) if key in base else value for key, value in override.items()} | {
            key: value for key, value in base.items() if key not in override}
    return override


def test_compose_cuda_file_puts_each_agent_on_a_gpu_of_its_own() -> None:
    """Merged over the CPU file, the CUDA file runs every agent from the CUDA image with one GPU reserved (a distinct
    one each, by nvidia-smi index) and --device=cuda: the container sees only its GPU, as cuda:0. Nothing else of the
    agents changes, and the other services stay as they are."""
    base = compose()
    override = load_yaml(COMPOSE_CUDA_FILE)
    merged = merge_compose(base, override)
    agents = {name for name, service in peertrain_services(base).items() if compose_command(name, service)[0] ==
              "nodeagent"}
    assert set(override["services"]) == agents, "every agent, and only the agents, on a GPU"
    assert {name: merged["services"][name] for name in set(base["services"]) - agents} == {
        name: base["services"][name] for name in set(base["services"]) - agents}
    reserved: list[str] = []
    for name in sorted(agents):
        assert set(override["services"][name]) <= COMPOSE_CUDA_KEYS, f"{name}: merged here as compose would not"
        service = merged["services"][name]
        assert service["image"] == "peertrain:cuda"
        assert service["build"]["dockerfile"] == "deploy/docker/Dockerfile.cuda"
        assert (COMPOSE_CUDA_FILE.parent / service["build"]["context"]).resolve() == ROOT
        script, command = compose_command(name, service)
        args = parse_cli(script, command, f"compose (cuda) {name}")
        assert args.device == "cuda", f"{name}: --device={args.device}"
        _, base_command = compose_command(name, base["services"][name])
        assert [a for a in command if not a.startswith("--device=")] == [
            a for a in base_command if not a.startswith("--device=")], f"{name}: more than --device differs"
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert "count" not in device, f"{name}: reserve a GPU by index, one per agent"
        [index] = device["device_ids"]
        assert isinstance(index, str) and index.isdigit(), f"{name}: device_ids are strings of nvidia-smi indices"
        reserved.append(index)
    assert len(set(reserved)) == len(agents), f"agents share GPUs: {reserved}"


def test_compose_prometheus_and_grafana_mounts() -> None:
    spec = compose()
    prometheus = spec["services"]["prometheus"]
    [config_flag] = [a for a in prometheus["command"] if a.startswith("--config.file=")]
    config_path = Path(config_flag.split("=", 1)[1])
    mounts = {Path(target): source for source, target in map(compose_volume, prometheus["volumes"])}
    source = mounts[config_path.parent]
    assert (COMPOSE_FILE.parent / source / config_path.name).is_file()
    assert (COMPOSE_FILE.parent / source / "alerts.yml").is_file()


# ----------------------------------------------------------------------------------------------------
# Job specs


JOB_FILES = sorted((DEPLOY / "jobs").glob("*.yaml"))


@pytest.mark.parametrize("path", JOB_FILES, ids=[p.name for p in JOB_FILES])
def test_job_spec_validates(path: Path) -> None:
    """The shipped job files pass the coordinator's own validation (schema, algorithm and options, topology)."""
    from coordinator.jobs import validate_job
    from nodeagent.jobspec import load_job_file
    from nodeagent.training.models import MODELS

    spec = load_job_file(path).spec
    assert spec.name == path.stem
    assert spec.model.name in MODELS or ":" in spec.model.name
    assert spec.eval_every <= spec.steps
    graph = validate_job(spec)
    assert graph.nodes == spec.nodes and graph.is_connected()


def test_demo_job_is_the_compose_demo() -> None:
    from nodeagent.jobspec import load_job_file

    spec = load_job_file(DEPLOY / "jobs" / "demo.yaml").spec
    assert (spec.nodes, spec.steps) == (4, 400)
    assert (spec.algorithm.name, spec.algorithm.mode) == ("dsgd", "async")
    assert (spec.model.name, spec.data.split, spec.topology.kind) == ("logistic", "class-window", "ring")
    agents = [name for name in compose()["services"] if name.startswith("agent-")]
    assert len(agents) == spec.nodes
    statefulset = next(doc for doc in k8s_documents() if doc["kind"] == "StatefulSet")
    assert statefulset["spec"]["replicas"] == spec.nodes


# ----------------------------------------------------------------------------------------------------
# Kubernetes


def test_k8s_manifests() -> None:
    kustomization = load_yaml(K8S / "kustomization.yaml")
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk, "kustomization.yaml must list every manifest"
    documents = k8s_documents()
    kinds = sorted(doc["kind"] for doc in documents)
    assert kinds == sorted(
        [
            "Namespace",
            "ConfigMap",
            "ConfigMap",
            "PersistentVolumeClaim",
            "Deployment",
            "Service",
            "Service",
            "StatefulSet",
            "PodDisruptionBudget",
            "NetworkPolicy",
            "NetworkPolicy",
            "PersistentVolumeClaim",
            "CronJob",
        ]
    )
    for doc in documents:
        assert doc["apiVersion"] and doc["metadata"]["name"]
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "peertrain"
    workloads = [doc for doc in documents if doc["kind"] in {"Deployment", "StatefulSet"}]
    services = {doc["metadata"]["name"]: doc for doc in documents if doc["kind"] == "Service"}
    claims = {doc["metadata"]["name"] for doc in documents if doc["kind"] == "PersistentVolumeClaim"}
    for workload in workloads:
        name = workload["metadata"]["name"]
        template = workload["spec"]["template"]
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items(), f"{name}: selector/labels"
        pod = template["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        volumes |= {t["metadata"]["name"]: t for t in workload["spec"].get("volumeClaimTemplates", [])}
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
        [container] = pod["containers"]
        for each in [container, *pod.get("initContainers", [])]:
            for mount in each.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{name}: volume {mount['name']} is not defined"
            assert each["securityContext"]["allowPrivilegeEscalation"] is False
            assert each["securityContext"]["readOnlyRootFilesystem"] is True
            assert each["image"] == container["image"], f"{name}: {each['name']} runs another image"
        assert pod["securityContext"]["runAsNonRoot"] is True
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert int(annotations["prometheus.io/port"]) == ports["metrics"]
        matching = [
            s for s in services.values() if s["spec"]["selector"].items() <= template["metadata"]["labels"].items()
        ]
        assert matching, f"{name}: no Service selects its pods"
        for service in matching:
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in ports, f"{service['metadata']['name']}: targetPort {port['targetPort']}"
        if workload["kind"] == "StatefulSet":
            headless = services[workload["spec"]["serviceName"]]
            assert headless["spec"]["clusterIP"] == "None"


def test_k8s_args_parse_with_the_cli() -> None:
    documents = k8s_documents()
    services = {doc["metadata"]["name"]: doc for doc in documents if doc["kind"] == "Service"}
    parsed = {}
    for workload in (doc for doc in documents if doc["kind"] in {"Deployment", "StatefulSet"}):
        name = workload["metadata"]["name"]
        [container] = workload["spec"]["template"]["spec"]["containers"]
        pod_name = f"{name}-0" if workload["kind"] == "StatefulSet" else name
        env = k8s_env(container, documents, pod_name)
        script, args = k8s_command(container, env)
        parsed[workload["kind"]] = (workload, container, parse_cli(script, args, f"k8s {name}"))
    _, coordinator_container, coordinator = parsed["Deployment"]
    statefulset, agent_container, agent = parsed["StatefulSet"]
    coordinator_ports = {p["name"]: p["containerPort"] for p in coordinator_container["ports"]}
    agent_ports = {p["name"]: p["containerPort"] for p in agent_container["ports"]}
    assert port_of(coordinator.listen) == coordinator_ports["grpc"]
    assert port_of(coordinator.metrics_listen) == coordinator_ports["metrics"]
    assert port_of(agent.listen) == agent_ports["peer"] == port_of(agent.advertise)
    assert port_of(agent.metrics_listen) == agent_ports["metrics"]
    # Agents reach the coordinator through its Service, and advertise their stable per-pod DNS name.
    service, port = host_of(agent.coordinator), port_of(agent.coordinator)
    assert service in services and port in {p["port"] for p in services[service]["spec"]["ports"]}
    headless = statefulset["spec"]["serviceName"]
    assert agent.advertise.startswith(f"peertrain-agent-0.{headless}.")
    assert agent.name == "peertrain-agent-0"
    mounts = {m["mountPath"] for m in agent_container["volumeMounts"]}
    assert str(agent.state_dir) in mounts and agent.data_root in mounts
    assert str(coordinator.state_dir) in {m["mountPath"] for m in coordinator_container["volumeMounts"]}


def test_k8s_daemons_carry_their_credentials() -> None:
    """The coordinator's CA on its persistent volume (made there by its initContainer) and the operator Secret for
    the CLI in its pod; each agent's credentials on its own persistent volume, enrolled with the join token the
    Secret peertrain-join holds under its pod name, through the coordinator Service's enrollment port."""
    documents = k8s_documents()
    workloads = {doc["kind"]: doc for doc in documents if doc["kind"] in {"Deployment", "StatefulSet"}}
    services = {doc["metadata"]["name"]: doc for doc in documents if doc["kind"] == "Service"}

    deployment = workloads["Deployment"]
    name = deployment["metadata"]["name"]
    pod = deployment["spec"]["template"]["spec"]
    volumes = k8s_pod_volumes(deployment)
    [container] = pod["containers"]
    env = k8s_env(container, documents, name)
    coordinator = parse_cli(*k8s_command(container, env), f"k8s {name}")
    state = k8s_mount(container, coordinator.state_dir)
    assert "persistentVolumeClaim" in volumes[state[0]], "the CA and the database need a persistent volume"
    [init] = pod["initContainers"]
    ca = parse_cli(*k8s_command(init, k8s_env(init, documents, name)), f"k8s {name} initContainer")
    assert (ca.command, ca.action, ca.if_missing) == ("ca", "init", True), "the CA: created once, never replaced"
    assert k8s_mount(init, ca.state_dir) == state
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert port_of(coordinator.enroll_listen) == ports["enroll"]
    operator = k8s_mount(container, env["PEERTRAIN_TLS_DIR"])
    assert operator[1] == "." and volumes[operator[0]]["secret"]["secretName"] == "peertrain-operator-tls"

    statefulset = workloads["StatefulSet"]
    name = statefulset["metadata"]["name"]
    volumes = k8s_pod_volumes(statefulset)
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    env = k8s_env(container, documents, f"{name}-0")
    agent = parse_cli(*k8s_command(container, env), f"k8s {name}")
    tls_dir = agent.tls_dir or Path(agent.state_dir) / "tls"
    assert "claimTemplate" in volumes[k8s_mount(container, tls_dir)[0]], "an agent's credentials: on its own PVC"
    # It enrolls at the coordinator's host, port 7071 unless --enroll-address: the Service's enrollment port.
    enroll = agent.enroll_address or f"{host_of(agent.coordinator)}:7071"
    ports = [p for p in services[host_of(enroll)]["spec"]["ports"] if p["port"] == port_of(enroll)]
    assert len(ports) == 1 and ports[0]["targetPort"] == "enroll", f"agents cannot enroll at {enroll}"
    # Its join token is the one stored under its pod name, which is also the node id it enrolls as.
    assert agent.name == env["POD_NAME"]
    script = container["command"][2]
    token_file = re.search(r'token="([^"]+)"', script)
    assert token_file and token_file.group(1) == "/etc/peertrain/join/$POD_NAME"
    assert 'read -r PEERTRAIN_JOIN_TOKEN < "$token"' in script and "export PEERTRAIN_JOIN_TOKEN" in script
    join = k8s_mount(container, "/etc/peertrain/join")
    assert join[1] == "." and volumes[join[0]]["secret"]["secretName"] == "peertrain-join"
    assert volumes[join[0]]["secret"]["optional"] is True, "enrolled pods must start once the Secret is deleted"
    [fingerprint] = [e for e in container["env"] if e["name"] == "PEERTRAIN_CA_FINGERPRINT"]
    assert fingerprint["valueFrom"]["secretKeyRef"] == {"name": "peertrain-join", "key": "ca-fingerprint",
                                                        "optional": True}
    # No secret in the manifests: Secrets are made by commands, never shipped.
    assert "Secret" not in {doc["kind"] for doc in documents}


@pytest.mark.parametrize("case", ["token", "token with newline", "no token"])
def test_k8s_agent_shell_hands_the_pods_token_to_the_agent(case: str, tmp_path: Path) -> None:
    """The agent container's shell, run here with a stand-in `nodeagent` that reports its environment and
    arguments: the pod's token (the file named as the pod) reaches PEERTRAIN_JOIN_TOKEN, the arguments pass as
    they are, and without a token file the agent starts without one (it then uses its certificate)."""
    statefulset = next(doc for doc in k8s_documents() if doc["kind"] == "StatefulSet")
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    sh, flag, script, name = container["command"]
    join = tmp_path / "join"
    join.mkdir()
    script = script.replace("/etc/peertrain/join", str(join))
    (join / "peertrain-agent-1").write_text("not-this-pods-token")
    if case != "no token":
        (join / "peertrain-agent-0").write_text("tok-0" + ("\n" if case == "token with newline" else ""))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / name
    stand_in.write_text('#!/bin/sh\nprintf "token=%s\\n" "${PEERTRAIN_JOIN_TOKEN-unset}"\nprintf "arg=%s\\n" "$@"\n')
    stand_in.chmod(0o755)
    args = ["serve", "--name=peertrain-agent-0", "--advertise=a b"]
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "POD_NAME": "peertrain-agent-0"}
    result = subprocess.run([need(sh), flag, script, name, *args], env=env, capture_output=True, text=True,
                            timeout=10, check=False)
    assert result.returncode == 0, result.stderr
    token = "unset" if case == "no token" else "tok-0"
    assert result.stdout.splitlines() == [f"token={token}", *(f"arg={arg}" for arg in args)]


def test_k8s_never_runs_insecure() -> None:
    documents = k8s_documents()
    for doc in documents:
        strings = set(k8s_strings(doc))
        assert not any("--insecure" in s for s in strings), f"{doc['metadata']['name']} passes --insecure"
        assert "PEERTRAIN_INSECURE" not in strings, f"{doc['metadata']['name']} sets PEERTRAIN_INSECURE"


def test_kubectl_kustomize_renders() -> None:
    kubectl = need("kubectl")
    result = run([kubectl, "kustomize", str(K8S)], timeout=60)
    assert result.returncode == 0, result.stderr
    rendered = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert len(rendered) == len(k8s_documents())


# --- the CUDA variant (deploy/k8s-cuda): an overlay of the base whose agents run on a GPU each


def strategic_merge(base: Any, patch: Any) -> Any:
    """A strategic merge patch as kustomize applies these: mappings merge key by key; lists of mappings that all have
    a name (containers, env, volumes) merge item by item by name; any other value of the patch replaces the base's."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = strategic_merge(base[key], value) if key in base else value
        return merged
    named = isinstance(base, list) and isinstance(patch, list) and all(
        isinstance(item, dict) and "name" in item for item in [*base, *patch])
    if named:
        by_name = {item["name"]: item for item in patch}
        merged_list = [strategic_merge(item, by_name.pop(item["name"])) if item["name"] in by_name else item
                       for item in base]
        return merged_list + list(by_name.values())
    return patch


def k8s_cuda_documents() -> list[dict[str, Any]]:
    """The overlay built here as kustomize builds it: its base's documents with its patches merged in."""
    kustomization = load_yaml(K8S_CUDA / "kustomization.yaml")
    assert kustomization["resources"] == [str(Path("..") / K8S.name)], "the overlay's base is deploy/k8s"
    documents = k8s_documents()
    for entry in kustomization["patches"]:
        patch = load_yaml(K8S_CUDA / entry["path"])
        key = (patch["kind"], patch["metadata"]["name"])
        [index] = [i for i, doc in enumerate(documents) if (doc["kind"], doc["metadata"]["name"]) == key]
        documents[index] = strategic_merge(documents[index], patch)
    return documents


def check_cuda_variant(base: list[dict[str, Any]], cuda: list[dict[str, Any]]) -> None:
    """The CUDA variant of `base`: the agents run the CUDA image with --device cuda and one GPU each (the NVIDIA device
    plugin's resource nvidia.com/gpu, in their limits), tolerate the GPU nodes' taint, and nothing else changes."""
    def by_key(documents: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
        return {(doc["kind"], doc["metadata"]["name"]): doc for doc in documents}

    base_docs, cuda_docs = by_key(base), by_key(cuda)
    assert set(cuda_docs) == set(base_docs)
    config, agents = ("ConfigMap", "peertrain-config"), ("StatefulSet", "peertrain-agent")
    for key in set(base_docs) - {config, agents}:
        assert cuda_docs[key] == base_docs[key], f"the CUDA variant changes {key}"
    assert cuda_docs[config]["data"] == base_docs[config]["data"] | {"PEERTRAIN_DEVICE": "cuda"}
    assert base_docs[config]["data"]["PEERTRAIN_DEVICE"] == "cpu", "the base stays CPU"

    statefulset = cuda_docs[agents]
    pod = statefulset["spec"]["template"]["spec"]
    [container] = pod["containers"]
    [base_container] = base_docs[agents]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "peertrain:cuda" and base_container["image"] == "peertrain:cpu"
    assert "-t peertrain:cuda" in (DEPLOY / "docker" / "Dockerfile.cuda").read_text(), "the image the overlay names"
    limits = container["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == 1, "one GPU per agent"
    assert "nvidia.com/gpu" not in base_container["resources"]["limits"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    # Without those, the agents are the base's.
    undone = json.loads(json.dumps(statefulset))
    undone_pod = undone["spec"]["template"]["spec"]
    del undone_pod["tolerations"]
    undone_pod["containers"][0]["image"] = base_container["image"]
    del undone_pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert undone == base_docs[agents]
    agent = parse_cli(*k8s_command(container, k8s_env(container, cuda, "peertrain-agent-0")), "k8s-cuda agent")
    assert agent.device == "cuda", "the container sees its one GPU as cuda:0"


def test_k8s_cuda_overlay_puts_each_agent_on_a_gpu() -> None:
    check_cuda_variant(k8s_documents(), k8s_cuda_documents())


def test_kubectl_kustomize_renders_the_cuda_overlay_as_built_here() -> None:
    kubectl = need("kubectl")
    rendered = {}
    for directory in (K8S, K8S_CUDA):
        result = run([kubectl, "kustomize", str(directory)], timeout=60)
        assert result.returncode == 0, result.stderr
        rendered[directory] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    check_cuda_variant(rendered[K8S], rendered[K8S_CUDA])
    built = sorted(k8s_cuda_documents(), key=lambda doc: (doc["kind"], doc["metadata"]["name"]))
    assert sorted(rendered[K8S_CUDA], key=lambda doc: (doc["kind"], doc["metadata"]["name"])) == built


def test_operations_guide_runs_the_gpu_files_that_ship() -> None:
    """docs/operations.md, "Running on GPUs": its commands name the GPU deployment files, and every file under deploy/
    it names exists."""
    guide = (ROOT / "docs" / "operations.md").read_text()
    section = guide[guide.index("## Running on GPUs"):]
    section = section[:section.index("\n## ", 1)]
    for command in ("systemctl enable --now peertrain-agent@0 peertrain-agent@1",
                    "docker compose -f deploy/docker-compose.yml -f deploy/docker-compose.cuda.yml up",
                    "kubectl apply -k deploy/k8s-cuda"):
        assert command in section, command
    named = {path.rstrip(".,)") for path in re.findall(r"deploy/[\w./@-]+", section)}
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"the guide names files that do not ship: {missing}"
    assert "nvidia.com/gpu" in section, "the device plugin's resource name"


# --- Kubernetes that holds: schema, probes, lane ports, network policies, disruption budget

# The oldest Kubernetes the manifests support (native gRPC probes are stable since 1.27), and the newest schema the
# validator knows.
K8S_VERSIONS = ("1.27.0", None)


def k8s_schema_errors(document: dict[str, Any]) -> list[str]:
    """What the Kubernetes OpenAPI schema of each supported version refuses in a document (strict: unknown fields
    too); empty when it is valid."""
    import kubernetes_validate

    errors = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(document, version or kubernetes_validate.latest_version(), strict=True)
        except kubernetes_validate.ValidationError as error:
            errors.append(f"{document['kind']} {document['metadata']['name']} ({version or 'latest'}): "
                          f"{error.message} at {'.'.join(map(str, error.path))}")
    return errors


def test_k8s_manifests_validate_against_the_kubernetes_schema() -> None:
    errors = [error for doc in [*k8s_documents(), *k8s_cuda_documents()] for error in k8s_schema_errors(doc)]
    assert not errors, "\n".join(errors)
    # The check can fail: a grpc probe names its port by number only, and a misspelt field is refused.
    statefulset = json.loads(json.dumps(next(doc for doc in k8s_documents() if doc["kind"] == "StatefulSet")))
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    container["readinessProbe"]["grpc"]["port"] = "health"
    container["livenessProbe"]["periodSecond"] = 5
    assert len(k8s_schema_errors(statefulset)) == len(K8S_VERSIONS)


def k8s_workloads() -> dict[str, tuple[dict[str, Any], dict[str, Any], argparse.Namespace]]:
    """Workload name -> (workload, its container, its parsed command line)."""
    documents = k8s_documents()
    workloads = {}
    for workload in (doc for doc in documents if doc["kind"] in {"Deployment", "StatefulSet"}):
        name = workload["metadata"]["name"]
        [container] = workload["spec"]["template"]["spec"]["containers"]
        pod_name = f"{name}-0" if workload["kind"] == "StatefulSet" else name
        args = parse_cli(*k8s_command(container, k8s_env(container, documents, pod_name)), f"k8s {name}")
        workloads[name] = (workload, container, args)
    return workloads


def test_k8s_readiness_asks_each_daemons_grpc_health_service() -> None:
    """Both daemons serve grpc.health.v1 on a port of their own (--health-listen) and the kubelet asks it natively
    (`grpc:`, SERVING once ready: tests/test_health.py); no TCP probe is left."""
    from nodeagent.defaults import AGENT_HEALTH_PORT, COORDINATOR_HEALTH_PORT

    expected = {"peertrain-coordinator": COORDINATOR_HEALTH_PORT, "peertrain-agent": AGENT_HEALTH_PORT}
    workloads = k8s_workloads()
    assert set(workloads) == set(expected)
    for name, (_workload, container, args) in workloads.items():
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert args.health_listen, f"{name} serves no health service"
        assert port_of(args.health_listen) == ports["health"] == expected[name]
        assert container["readinessProbe"]["grpc"] == {"port": ports["health"]}, name
        assert not any("tcpSocket" in container.get(probe, {}) for probe in
                       ("readinessProbe", "livenessProbe", "startupProbe")), f"{name} keeps a TCP probe"


def test_every_shipped_agent_uses_the_fixed_lane_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """A firewall or a NetworkPolicy can open the lanes only when their port is known: every shipped agent (compose,
    its CUDA variant, Kubernetes, the systemd unit with and without its env file) sets --lane-port to 7200."""
    from nodeagent.defaults import AGENT_LANE_PORT

    lane_ports: dict[str, int] = {}
    cuda = load_yaml(COMPOSE_CUDA_FILE)["services"]
    for name, service in [*peertrain_services(compose()).items(), *((f"cuda {n}", s) for n, s in cuda.items())]:
        if "command" in service and service["command"][0] == "serve" and "--coordinator=coordinator:7070" in \
                service["command"]:
            lane_ports[f"compose {name}"] = parse_cli("nodeagent", service["command"], name).lane_port
    _workload, _container, agent = k8s_workloads()["peertrain-agent"]
    lane_ports["k8s"] = agent.lane_port
    entries = read_unit(SYSTEMD / "peertrain-agent.service")
    env = unit_environment(entries)
    for label, environment in (("defaults", env), ("env file", env | read_env_file(SYSTEMD / "agent.env.example"))):
        argv = expand_exec(unit_value(entries, "ExecStart"), environment)
        lane_ports[f"systemd {label}"] = parse_cli("nodeagent", argv[1:], "peertrain-agent.service").lane_port
    assert len(lane_ports) == 8 + 1 + 2, sorted(lane_ports)
    assert lane_ports == dict.fromkeys(lane_ports, AGENT_LANE_PORT)


def policy_admits(policy: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    """Port -> the `from` peers an ingress NetworkPolicy admits on it ([] : from anywhere)."""
    admitted: dict[int, list[dict[str, Any]]] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            assert port.get("protocol", "TCP") == "TCP"
            admitted.setdefault(port["port"], []).extend(rule.get("from", []))
    return admitted


def test_k8s_network_policies_admit_only_the_ports_each_role_serves() -> None:
    """Each daemon's pods are selected by one ingress policy that admits exactly the ports its container serves;
    the lanes and enrollment only from the agents, the peer port from the agents and the coordinator."""
    documents = k8s_documents()
    policies = [doc for doc in documents if doc["kind"] == "NetworkPolicy"]
    agent_pods = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "peertrain",
                                                  "app.kubernetes.io/component": "agent"}}}
    coordinator_pods = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "peertrain",
                                                        "app.kubernetes.io/component": "coordinator"}}}
    admits = {}
    for name, (workload, container, _args) in k8s_workloads().items():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        [policy] = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        admits[name] = policy_admits(policy)
        served = {p["containerPort"] for p in container["ports"]}
        assert set(admits[name]) == served, f"{name}: admits {sorted(admits[name])}, serves {sorted(served)}"
    coordinator, agent = admits["peertrain-coordinator"], admits["peertrain-agent"]
    assert coordinator[7071] == [agent_pods], "enrollment: the agents only"
    assert agent[7200] == [agent_pods], "the tensor lanes: the other agents only"
    assert agent[7100] == [agent_pods, coordinator_pods]
    assert coordinator[7070] == [{"podSelector": {}}], "the control plane: pods of the namespace"


def test_k8s_backup_cronjob_archives_the_coordinators_state_volume() -> None:
    """The CronJob runs `coordinator backup` on the coordinator's state volume, at the path the coordinator serves
    it from, on the coordinator's node (the volume is ReadWriteOnce), one run at a time, onto a volume of its own."""
    documents = k8s_documents()
    [cronjob] = [doc for doc in documents if doc["kind"] == "CronJob"]
    claims = {doc["metadata"]["name"] for doc in documents if doc["kind"] == "PersistentVolumeClaim"}
    assert cronjob["spec"]["concurrencyPolicy"] == "Forbid"
    pod = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"][:2] == ["/bin/sh", "-c"]
    [(script, args)] = shell_commands(container["args"][0])
    backup = parse_cli(script, args, "k8s backup CronJob")
    assert backup.command == "backup"
    coordinator_workload, coordinator_container, coordinator = k8s_workloads()["peertrain-coordinator"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    coordinator_volumes = k8s_pod_volumes(coordinator_workload)
    state, inside = k8s_mount(container, backup.state_dir)
    served, served_inside = k8s_mount(coordinator_container, coordinator.state_dir)
    assert volumes[state]["persistentVolumeClaim"] == coordinator_volumes[served]["persistentVolumeClaim"]
    assert inside == served_inside
    archive_volume, _ = k8s_mount(container, backup.out)
    assert volumes[archive_volume]["persistentVolumeClaim"]["claimName"] in claims
    assert archive_volume != state
    [term] = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= \
        coordinator_workload["spec"]["template"]["metadata"]["labels"].items()
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}, "the database's snapshot goes to /tmp"


def test_k8s_a_drain_takes_one_agent_at_a_time() -> None:
    documents = k8s_documents()
    [budget] = [doc for doc in documents if doc["kind"] == "PodDisruptionBudget"]
    statefulset = next(doc for doc in documents if doc["kind"] == "StatefulSet")
    assert budget["spec"]["selector"] == statefulset["spec"]["selector"]
    assert budget["spec"]["maxUnavailable"] == 1
