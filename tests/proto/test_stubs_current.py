"""The committed gRPC stubs in pdserve_client/api match proto/pdserve/v1/pdserve.proto."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_check(repo: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "scripts/gen_protos.sh", "--check"],
        cwd=repo,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        check=False,
    )


def test_generated_stubs_are_current() -> None:
    result = run_check(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_fails_with_a_clear_message_when_stubs_are_stale(tmp_path: Path) -> None:
    for part in ("scripts/gen_protos.sh", "proto", "pdserve_client/api"):
        source, target = ROOT / part, tmp_path / part
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy2(source, target)
    proto = tmp_path / "proto/pdserve/v1/pdserve.proto"
    proto.write_text(proto.read_text() + "\nmessage AddedLater {}\n")

    result = run_check(tmp_path)
    assert result.returncode == 1
    assert "stale gRPC stubs: pdserve_client/api/pdserve_pb2.py" in result.stderr
    assert "run scripts/gen_protos.sh" in result.stderr


def test_stubs_import_as_a_package() -> None:
    from pdserve_client.api import pdserve_pb2, pdserve_pb2_grpc

    request = pdserve_pb2.GenerateRequest(prompt="hi", sampling=pdserve_pb2.SamplingParams(max_tokens=3))
    assert pdserve_pb2.GenerateRequest.FromString(request.SerializeToString()) == request
    assert hasattr(pdserve_pb2_grpc, "PdserveStub")
    assert pdserve_pb2.DESCRIPTOR.package == "pdserve.v1"
