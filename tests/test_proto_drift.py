"""The committed generated modules must be exactly what `make proto` produces from proto/."""

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest

from nodeagent._proto import wire_pb2
from nodeagent.wire.message import Encoding, Kind

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def test_generated_modules_match_the_proto_sources(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), str(tmp_path)], check=True,
                   capture_output=True)
    committed = ROOT / "nodeagent" / "_proto"
    generated = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert generated == sorted(p.name for p in committed.iterdir() if p.is_file() and p.suffix in (".py", ".pyi"))
    drifted = [name for name in generated if not filecmp.cmp(tmp_path / name, committed / name, shallow=False)]
    assert not drifted, f"run `make proto`: {drifted} differ from proto/ sources"


def test_the_wire_enums_have_the_proto_values():
    for member in Kind:
        assert member == wire_pb2.MessageKind.Value(f"KIND_{member.name}"), member
    for member in Encoding:
        assert member == wire_pb2.Encoding.Value(f"ENCODING_{member.name}"), member
