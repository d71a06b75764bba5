"""How a test session leaves (tests/conftest.py): a run that loads no native runtime (torch, vLLM, Ray's core
worker) finalizes the interpreter normally, so atexit handlers run; only runs that load one skip it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_run_without_native_runtimes_runs_its_atexit_handlers(tmp_path: Path) -> None:
    marker = tmp_path / "atexit-ran"
    plugin = tmp_path / "atexit_plugin.py"
    plugin.write_text(f"import atexit, pathlib\natexit.register(pathlib.Path({str(marker)!r}).touch)\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "atexit_plugin",
            "tests/router/policy/test_policy_cost.py",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "torch" not in done.stdout
    assert marker.exists(), "the session skipped interpreter finalization"
