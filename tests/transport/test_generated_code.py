"""The committed generated code is exactly what ``scripts/gen_proto.sh`` makes from ``proto/``."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "gradloc" / "transport" / "_generated"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def test_generated_files_match_a_fresh_generation(tmp_path: Path):
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, env=env,
                   capture_output=True, timeout=120)
    fresh, committed = _files(tmp_path / "gradloc"), _files(GENERATED / "gradloc")
    assert sorted(fresh) == sorted(committed), "run scripts/gen_proto.sh and commit the result"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"generated files differ from proto/: {stale}; run scripts/gen_proto.sh"
    assert {"v1/gradloc_pb2.py", "v1/gradloc_pb2.pyi", "v1/gradloc_pb2_grpc.py"} <= set(fresh)


def test_generated_modules_import_as_plain_packages():
    grpc_mod = importlib.import_module("gradloc.transport._generated.gradloc.v1.gradloc_pb2_grpc")
    pb2 = importlib.import_module("gradloc.transport._generated.gradloc.v1.gradloc_pb2")
    assert grpc_mod.gradloc_dot_v1_dot_gradloc__pb2 is pb2
    assert pb2.DESCRIPTOR.name == "gradloc/v1/gradloc.proto" and pb2.DESCRIPTOR.package == "gradloc.v1"
    assert hasattr(grpc_mod, "IngestServiceStub")
