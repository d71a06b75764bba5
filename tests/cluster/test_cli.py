"""`pdserve up` refuses ports it cannot listen on before it starts Ray or any engine."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import yaml
from ports import free_port

from cluster.cli import main

ROOT = Path(__file__).resolve().parents[2]


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
