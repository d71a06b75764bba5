"""bench.router_batch_cpu: the router alone, measured in a process of its own for the revision asked, against
an earlier revision in turn."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_it_measures_the_tree_and_an_earlier_revision_in_turn() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.router_batch_cpu", "--rev", "HEAD", "--pairs", "1",
         "--requests", "16", "--batches", "4"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    medians = [line for line in lines if "median" in line]
    assert [line.split()[0] for line in medians] == ["HEAD", "tree"]
    assert all(float(line.split()[2]) > 0 for line in medians)  # µs per batch, measured
    assert lines[-1].startswith("tree / HEAD: ")


def test_it_measures_the_http_door() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.router_batch_cpu", "--door", "http", "--pairs", "1",
         "--requests", "16", "--batches", "4"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "http door, 16 clients" in run.stdout
    (median,) = [line for line in run.stdout.splitlines() if "median" in line]
    assert float(median.split()[2]) > 0
