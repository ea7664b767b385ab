"""Generate the Python modules of proto/peertrain/v1/*.proto into a package directory.

Usage: python proto/generate.py OUT_DIR   (make proto: OUT_DIR = nodeagent/_proto)

protoc writes absolute imports (`from peertrain.v1 import wire_pb2`); they are rewritten to relative
imports so the generated modules live inside the nodeagent package. tests/test_proto_drift.py regenerates
into a temporary directory and compares with the committed modules.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
SOURCES = sorted((PROTO_ROOT / "peertrain" / "v1").glob("*.proto"))
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as raw:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={raw}",
            f"--pyi_out={raw}",
            f"--grpc_python_out={raw}",
            *(str(path) for path in SOURCES),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        written = []
        for path in sorted(Path(raw, "peertrain", "v1").iterdir()):
            if not path.name.endswith(GENERATED_SUFFIXES):
                continue
            text = re.sub(r"^from peertrain\.v1 import ", "from . import ", path.read_text(), flags=re.M)
            target = out_dir / path.name
            target.write_text(text)
            written.append(target)
    init = out_dir / "__init__.py"
    init.write_text('"""Generated from proto/peertrain/v1 by `make proto`; do not edit."""\n')
    return [init, *written]


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    out_dir = Path(sys.argv[1])
    for stale in out_dir.glob("*_pb2*.py*"):
        stale.unlink()
    shutil.rmtree(out_dir / "__pycache__", ignore_errors=True)
    for path in generate(out_dir):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
