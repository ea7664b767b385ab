"""A program forked from the fork server (coordinator/zygote.py) is `python -m MODULE ARGS` as a fresh interpreter
would run it: its arguments, its environment and path, its working directory, its log, its exit status, signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from coordinator.zygote import ForkedProcess

pytestmark = pytest.mark.integration

PROGRAM = textwrap.dedent("""
    import os, sys, time
    print("args", sys.argv[1:])
    print("cwd", os.getcwd())
    print("env", os.environ.get("ZYGOTE_TEST"))
    print("main", __name__)
    print("torch already imported", "torch" in sys.modules)
    sys.stderr.write("to stderr\\n")
    if sys.argv[1] == "sleep":
        time.sleep(60)
    sys.exit(int(sys.argv[1]))
""")


@pytest.fixture
def program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A module the fork server cannot see on its own path: the child finds it through its PYTHONPATH."""
    (tmp_path / "zygote_program.py").write_text(PROGRAM)
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
            "ZYGOTE_TEST": "from the caller"}


def test_a_forked_program_runs_as_its_own_main_with_its_arguments_environment_directory_and_log(program, tmp_path):
    log = tmp_path / "program.log"
    log.write_text("earlier\n")
    process = ForkedProcess("zygote_program", ["3", "two words"], log, program)
    assert process.wait(60) == 3 and process.poll() == 3 and process.returncode == 3
    assert process.pid != os.getpid()
    lines = log.read_text().splitlines()
    assert lines[0] == "earlier"  # appended to, as the cluster's logs are across restarts
    assert "args ['3', 'two words']" in lines
    assert f"cwd {tmp_path / 'work'}" in lines
    assert "env from the caller" in lines
    assert "main __main__" in lines
    assert "torch already imported True" in lines  # what makes a start cheap
    assert "to stderr" in lines


def test_a_forked_program_is_ended_by_signals_and_waits_time_out_like_popens(program, tmp_path):
    log = tmp_path / "sleep.log"
    process = ForkedProcess("zygote_program", ["sleep"], log, program)
    deadline = time.monotonic() + 60
    while not log.exists() or "cwd" not in log.read_text():
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(0.1)
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == -signal.SIGTERM
    process.kill()  # already ended: nothing is signalled
    assert process.returncode == -signal.SIGTERM


def test_an_exception_fails_the_program_with_its_traceback_in_the_log(program, tmp_path):
    process = ForkedProcess("zygote_program", ["not a number"], tmp_path / "bad.log", program)
    assert process.wait(60) == 1
    assert "ValueError: invalid literal for int()" in (tmp_path / "bad.log").read_text()
    assert sys.modules.get("zygote_program") is None  # it ran there, not here


def say_prepared() -> None:
    """A `prepare` step: runs in the child, before the module, with the child's log as its output."""
    print("prepared in", os.getpid())


def test_a_prepare_step_runs_in_the_child_before_the_module(program, tmp_path):
    log = tmp_path / "prepared.log"
    process = ForkedProcess("zygote_program", ["0"], log, program, prepare=say_prepared)
    assert process.wait(60) == 0
    lines = log.read_text().splitlines()
    assert lines[0] == f"prepared in {process.pid}" and lines[1] == "args ['0']"
