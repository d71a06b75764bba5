"""`bench.routing_decision` for an earlier revision's router and the working tree's, in ONE process.

On a shared 2-core machine two separate runs of the same code differ by more than a refactor changes, so
both routers are loaded side by side (the old one extracted with `git archive` and imported as `oldrouter`)
and timed in alternating rounds on identical cases; CPU microseconds per decision, pooled over the rounds.

    .venv/bin/python -m bench.compare_routing_decision --rev 3c57f82 [--rounds 4] [--cases 8:8192 128:8192]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import re
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import numpy as np

from bench.revision import extract

_IMPORT = re.compile(r"^(\s*)(from|import) router\b", re.M)


def load_old(rev: str, into: Path) -> ModuleType:
    """bench.routing_decision as of `rev`, importing that revision's router (as `oldrouter`)."""
    extract(rev, into, "router", "bench/routing_decision.py")
    (into / "router").rename(into / "oldrouter")
    (into / "oldbench").mkdir()
    (into / "oldbench" / "__init__.py").touch()
    (into / "bench" / "routing_decision.py").rename(into / "oldbench" / "routing_decision.py")
    for path in [*(into / "oldrouter").rglob("*.py"), into / "oldbench" / "routing_decision.py"]:
        path.write_text(_IMPORT.sub(r"\1\2 oldrouter", path.read_text()))
    sys.path.insert(0, str(into))
    return importlib.import_module("oldbench.routing_decision")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="the earlier revision (git)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cases", nargs="+", default=["8:8192", "8:131072", "32:8192", "128:8192", "128:131072"])
    ap.add_argument("--indexed-blocks", type=int, default=1_000_000)
    args = ap.parse_args()
    import bench.routing_decision as new

    with tempfile.TemporaryDirectory(prefix="pdserve-old-router-") as tmp:
        old = load_old(args.rev, Path(tmp))
        print(
            f"CPU us per decision, {args.rev} -> working tree, {args.rounds} alternating rounds, one process"
        )
        print("replicas prompt | first turn p50 / p99 | next turn p50 / p99")
        for case in args.cases:
            n, pt = (int(x) for x in case.split(":"))
            sides = {}
            for tag, mod in (("old", old), ("new", new)):
                rng = np.random.default_rng(0)
                index, docs, _ = mod.build_index(n, args.indexed_blocks, 16, pt, rng)
                sides[tag] = (mod, index, docs, rng)
            res: dict[str, dict[str, list[float]]] = {t: {"first_cpu": [], "next_cpu": []} for t in sides}
            iters = max(20, 150 * 8192 // pt)
            for _ in range(args.rounds):
                for tag, (mod, index, docs, rng) in sides.items():
                    gc.collect()
                    gc.disable()
                    try:
                        r = mod.run_case(n, pt, index, docs, 16, iters, 256, rng, "incremental", False, False)
                    finally:
                        gc.enable()
                    for k in res[tag]:
                        res[tag][k] += r[k]
            cells = []
            for k in ("first_cpu", "next_cpu"):
                b, a = (np.percentile(np.array(res[t][k]) * 1e6, [50, 99]) for t in ("old", "new"))
                cells.append(f"{b[0]:.0f} / {b[1]:.0f} -> {a[0]:.0f} / {a[1]:.0f} (p99 {a[1] / b[1]:.2f}x)")
            print(f"{n:>8} {pt:>6} | " + " | ".join(cells), flush=True)
            del sides
            gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
