"""The committed gRPC code is what the .proto files generate (fails when stale)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path):
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    fresh = sorted((tmp_path / "flashmap" / "v1").glob("*_pb2*.py*"))
    assert fresh, "protoc wrote nothing"
    for f in fresh:
        committed = ROOT / "flashmap" / "v1" / f.name
        assert committed.is_file(), f"{committed} missing: run python proto/generate.py"
        assert committed.read_text() == f.read_text(), (
            f"{committed.name} is stale: run python proto/generate.py"
        )
    committed_names = {p.name for p in (ROOT / "flashmap" / "v1").glob("*_pb2*.py*")}
    assert committed_names == {f.name for f in fresh}, "generated files without a .proto"


def test_generated_code_imports():
    from flashmap.v1 import drafter_pb2, serving_pb2, serving_pb2_grpc  # noqa: F401

    req = serving_pb2.GenerateRequest(text="hi", max_new_tokens=3)
    assert req.WhichOneof("prompt") == "text"
    assert not req.HasField("top_p")
