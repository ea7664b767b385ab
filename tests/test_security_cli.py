"""The trust plane from the command line: the CA, offline issuance, where the CLI finds an operator's credentials,
and what a daemon without credentials says. Each expected error is one line naming what to do."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
import urllib.request

import pytest
from test_cli_edges import assert_one_line_error, nowhere, run

from nodeagent.security.pki import Role
from nodeagent.security.tls import TlsDir, Transport

pytestmark = pytest.mark.system


def test_ca_init_show_and_offline_issuance(tmp_path):
    state = tmp_path / "state"
    created = run("coordinator.cli", "ca", "init", "--state-dir", str(state))
    assert created.returncode == 0, created.stderr
    fingerprint = created.stdout.splitlines()[-1].rsplit(" ", 1)[1]
    assert len(fingerprint) == 64
    assert stat.S_IMODE((state / "ca" / "ca.key").stat().st_mode) == 0o600
    again = run("coordinator.cli", "ca", "init", "--state-dir", str(state))
    assert_one_line_error(again, f"coordinator: {state / 'ca'} already holds a CA; its certificates would all be "
                                 "lost with it")
    shown = run("coordinator.cli", "ca", "show", "--state-dir", str(state))
    assert shown.stdout.strip().endswith(fingerprint)
    out = tmp_path / "alice"
    issued = run("coordinator.cli", "cert", "issue", "--operator", "alice", "--out", str(out),
                 "--state-dir", str(state))
    assert issued.returncode == 0, issued.stderr
    assert stat.S_IMODE((out / "tls.key").stat().st_mode) == 0o600
    identity = Transport(TlsDir(out)).identity
    assert (identity.role, identity.name) == (Role.OPERATOR, "alice")
    bad = run("coordinator.cli", "cert", "issue", "--node", "Not A Name", "--out", str(tmp_path / "x"),
              "--state-dir", str(state))
    assert bad.returncode != 0 and "must be 1 to 63 characters" in bad.stderr and "Traceback" not in bad.stderr


def test_serve_without_a_ca_says_how_to_make_one(tmp_path):
    state = tmp_path / "state"
    result = run("coordinator.cli", "serve", "--listen", "127.0.0.1:0", "--enroll-listen", "127.0.0.1:0",
                 "--metrics-listen", "127.0.0.1:0", "--state-dir", str(state))
    assert_one_line_error(result, f"coordinator: no cluster CA in {state / 'ca'}: create it with `coordinator ca init "
                                  f"--state-dir {state}` (or serve with --insecure, for local experiments only)")


def test_operator_commands_without_credentials_say_where_they_looked(tmp_path):
    missing = tmp_path / "none"
    result = run("coordinator.cli", "nodes", "--coordinator", nowhere(), "--tls-dir", str(missing))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(f"coordinator: no operator credentials in {missing} (ca.crt, tls.crt, tls.key)")
    assert "coordinator cert issue --operator NAME" in line


def test_the_config_file_names_the_coordinator_and_the_credentials(tmp_path):
    state = tmp_path / "state"
    run("coordinator.cli", "ca", "init", "--state-dir", str(state))
    run("coordinator.cli", "cert", "issue", "--operator", "alice", "--out", str(tmp_path / "alice"),
        "--state-dir", str(state))
    address = nowhere()
    config = tmp_path / "cli.toml"
    config.write_text(f'coordinator = "{address}"\ntls_dir = "{tmp_path / "alice"}"\n')
    result = subprocess.run([sys.executable, "-m", "coordinator.cli", "nodes"], capture_output=True, text=True,
                            timeout=60, env={"PATH": "/usr/bin:/bin", "PEERTRAIN_CONFIG": str(config),
                                             "HOME": str(tmp_path)}, check=False)
    [line] = result.stderr.splitlines()
    assert line.startswith(f"coordinator: {address}: nothing listens there"), line  # its address, under TLS


def test_an_agent_without_credentials_says_how_to_enroll(tmp_path):
    state = tmp_path / "state"
    result = run("nodeagent.cli", "serve", "--coordinator", nowhere(), "--listen", "127.0.0.1:0",
                 "--metrics-listen", "127.0.0.1:0", "--state-dir", str(state), "--device", "cpu")
    assert_one_line_error(
        result, f"nodeagent: no certificate in {state / 'tls'}: enroll with --join-token TOKEN --ca-fingerprint "
        "SHA256 (from `coordinator token create`), or put one there from `coordinator cert issue --node NAME`; "
        "--insecure runs without, for local experiments only")
    bad = run("nodeagent.cli", "serve", "--coordinator", nowhere(), "--listen", "127.0.0.1:0",
              "--metrics-listen", "127.0.0.1:0", "--state-dir", str(state), "--device", "cpu",
              "--join-token", "t", "--ca-fingerprint", "not-hex")
    assert_one_line_error(bad, "nodeagent: --ca-fingerprint must be a SHA-256 (64 hex digits), as `coordinator token "
                               "create` or `coordinator ca show` print it")


def test_insecure_mode_is_loud_in_the_log_and_the_metrics(tmp_path):
    """An insecure coordinator says so at start and exports peertrain_insecure_mode 1."""
    ready = tmp_path / "ready.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "serve", "--insecure", "--listen", "127.0.0.1:0",
         "--metrics-listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "state"), "--ready-file", str(ready)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        metrics = json.loads(ready.read_text())["metrics"]
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as response:
            assert "peertrain_insecure_mode 1.0" in response.read().decode()
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    assert "INSECURE MODE" in output
