"""The engine-argument names the topology checks `engine.extra` against are those of the installed vLLM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cluster.topology_checks import vllm_engine_arg_names

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_list_is_the_installed_vllms() -> None:
    check = subprocess.run(
        [sys.executable, "scripts/gen_vllm_engine_args.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr[-2000:]
    assert {"max_logprobs", "structured_outputs_config", "enable_prefix_caching"} <= vllm_engine_arg_names()
