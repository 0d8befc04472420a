"""Regenerate the Python gRPC code from proto/flashmap/v1/*.proto.

python proto/generate.py            # writes flashmap/v1/*_pb2*.py
python proto/generate.py --out DIR  # writes elsewhere (the staleness test compares)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
FILES = sorted(
    p.relative_to(PROTO_ROOT).as_posix() for p in (PROTO_ROOT / "flashmap" / "v1").glob("*.proto")
)


def generate(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *FILES,
    ]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=REPO_ROOT)
    generate(ap.parse_args().out)
