"""`pdserve up` refuses ports it cannot listen on before it starts Ray or any engine."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from ports import free_port

from cluster.cli import main

ROOT = Path(__file__).resolve().parents[2]
PDSERVE = str(Path(sys.executable).with_name("pdserve"))


@pytest.mark.parametrize(
    "section, field", [("server", "grpc_port"), ("server", "metrics_port"), ("ray", "dashboard_port")]
)
def test_up_refuses_a_port_in_use_before_starting_anything(
    section: str, field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topo = yaml.safe_load((ROOT / "deploy" / "local.yaml").read_text())
    topo["server"]["grpc_port"], topo["server"]["metrics_port"] = free_port(), free_port()
    topo["ray"]["dashboard_port"] = free_port()
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(topo))
    port = topo[section][field]
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        t0 = time.monotonic()
        code = main(["up", "-f", str(path)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"pdserve up: {section}.{field}: cannot listen on 127.0.0.1:{port} (")
    assert "Traceback" not in err
    assert time.monotonic() - t0 < 10  # refused up front, not after the engines started


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PDSERVE, *args], input=stdin, capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_version_names_pdserve_and_what_it_runs_on() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert re.fullmatch(r"pdserve \S+ \(vllm(-cpu)? \S+, ray \S+, nixl \S+\)\n", result.stdout), result.stdout


def test_status_json_without_a_cluster_is_json(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    result = run_cli("status", "--json")  # the test session's own cache folder: no cluster is up there
    assert result.returncode == 2
    assert json.loads(result.stdout) == {"error": "no cluster is up (start one with `pdserve up`)"}


def test_a_reader_that_goes_away_ends_the_output_quietly() -> None:
    """`pdserve export | head`: the reader closes the pipe early; no BrokenPipeError traceback."""
    proc = subprocess.Popen(
        [PDSERVE, "export", "-f", str(ROOT / "deploy" / "h200-kimi-k2.yaml")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before it writes: its first write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE
    assert err == ""


def test_topology_from_standard_input() -> None:
    local = (ROOT / "deploy" / "local.yaml").read_text()
    result = run_cli("validate", "-f", "-", stdin=local)
    assert (result.returncode, result.stdout) == (0, "<stdin>: ok\n")
    bad = run_cli("validate", "-f", "-", stdin="model: {dtype: bf16}\n")
    assert bad.returncode == 2
    assert bad.stderr == (
        "pdserve validate: <stdin>: model.dtype: invalid value 'bf16' "
        "(allowed: float32, bfloat16, float16, auto)\n"
    )
    exported = run_cli("export", "-f", "-", stdin=local)
    assert exported.returncode == 0 and "applications:" in exported.stdout


def test_an_empty_topology_file_does_not_validate(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    result = run_cli("validate", "-f", str(path))
    assert result.returncode == 2
    assert result.stderr.startswith(f"pdserve validate: {path}: the file is empty")


def test_joining_a_cluster_without_a_token_says_what_to_do_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """pdserve makes a token only for a Ray head it starts; a cluster it joins has its own."""
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    topo = yaml.safe_load((ROOT / "deploy" / "local.yaml").read_text())
    topo["server"]["grpc_port"], topo["server"]["metrics_port"] = free_port(), free_port()
    topo["ray"]["address"] = f"127.0.0.1:{free_port()}"
    path = tmp_path / "join.yaml"
    path.write_text(yaml.safe_dump(topo))
    assert main(["up", "-f", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(
        f"pdserve up: joining the Ray cluster at {topo['ray']['address']}: no Ray auth token:"
    )
    assert str(tmp_path / ".ray" / "auth_token") in err and "RAY_AUTH_TOKEN" in err
    assert not (tmp_path / ".ray").exists()  # nothing made up for someone else's cluster


def test_export_names_the_image_every_pod_runs() -> None:
    h200 = str(ROOT / "deploy" / "h200-kimi-k2.yaml")
    out = run_cli("export", "-f", h200, "--format", "rayservice", "--image", "registry.example/pdserve:1.2")
    assert out.returncode == 0, out.stderr
    images = {line.split("image:")[1].strip() for line in out.stdout.splitlines() if "image:" in line}
    assert images == {"registry.example/pdserve:1.2"}


def test_a_dashboard_call_keeps_pdserves_own_errors_and_names_the_dashboards_refusals() -> None:
    from cluster import cli
    from cluster.apply import ApplyError

    def refused() -> None:
        raise RuntimeError("Request failed with status code 500: boom")

    def restart_needed() -> None:
        raise ApplyError("these changes need a restart of pdserve: " + "x" * 400)

    with pytest.raises(
        cli._UserError, match="the Ray dashboard at http://h:8265 refused the request: Request"
    ):
        cli._reach("http://h:8265", refused)
    with pytest.raises(ApplyError) as kept:  # not reworded as the dashboard's refusal, nor cut short
        cli._reach("http://h:8265", restart_needed)
    assert str(kept.value).endswith("x" * 400)
