"""bench.router_batch_cpu: the router alone, measured in a process of its own for the revision asked, against
an earlier revision in turn."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> str:
    """The bench's output for a small run with `args`; it must succeed."""
    small = ["--pairs", "1", "--requests", "16", "--batches", "4"]
    run = subprocess.run(
        [sys.executable, "-m", "bench.router_batch_cpu", *args, *small],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_it_measures_the_tree_and_an_earlier_revision_in_turn() -> None:
    lines = _bench("--rev", "HEAD").splitlines()
    medians = [line for line in lines if "median" in line]
    assert [line.split()[0] for line in medians] == ["HEAD", "tree"]
    assert all(float(line.split()[2]) > 0 for line in medians)  # µs per batch, measured
    assert lines[-1].startswith("tree / HEAD: ")


def test_it_measures_the_http_door() -> None:
    out = _bench("--door", "http")
    assert "http door, 16 clients" in out
    (median,) = [line for line in out.splitlines() if "median" in line]
    assert float(median.split()[2]) > 0
