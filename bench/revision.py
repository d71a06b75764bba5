"""An earlier git revision of this repository, extracted to a folder: what the before/after benchmarks
(`bench.compare_routing_decision`, `pdserve bench --side-by-side NAME@REV`) run as "before"."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def extract(rev: str, into: Path, *paths: str) -> None:
    """`paths` of the repository (all of it when none) as of `rev`, written under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, *paths], capture_output=True, check=False
    )
    if archive.returncode != 0:
        raise RuntimeError(f"git archive {rev}: {archive.stderr.decode(errors='replace').strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
