"""A replica's start, phase by phase (`ReplicaInfo.start_phases`: /metrics and `pdserve status` show it).

The phases, in order:
- actor: the replica's process starting, to its constructor (Ray's worker, imports);
- weights: vLLM loading the model's weights (the slowest worker's, with tensor parallelism);
- engine_init: profiling memory and allocating the KV cache (vLLM's `_initialize_kv_caches`), less compile;
- compile: torch.compile and CUDA-graph capture (vLLM's `compile_or_warm_up_model`);
- engine_other: the rest of the engine's start (engine-core process, tokenizer, NIXL agent);
- nixl_handshake: the first NIXL handshake with a prefill engine (decode; at the first KV transfer).

vLLM runs its phases in its engine-core and worker processes: the plugin (engine/vllm_plugin.py) appends each
phase's time to a file the engine host names in PDSERVE_START_PHASES, which the host reads back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "PDSERVE_START_PHASES"
ORDER = ("actor", "weights", "engine_init", "compile", "engine_other", "nixl_handshake")


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc)."""
    stat = Path("/proc/self/stat").read_text()
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime, in clock ticks after boot
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def record(phase: str, seconds: float) -> None:
    """Append a phase's time to the host's file (a line each: several workers may write)."""
    path = os.environ.get(ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"phase": phase, "s": seconds}) + "\n")


def read(path: Path) -> dict[str, float]:
    """Each phase's time, the slowest writer's, in start order (missing file: nothing yet)."""
    if not path.exists():
        return {}
    phases: dict[str, float] = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        phases[entry["phase"]] = max(phases.get(entry["phase"], 0.0), float(entry["s"]))
    return {p: phases[p] for p in ORDER if p in phases}


def start_s(phases: dict[str, float]) -> float:
    """The whole start: every phase but the handshake, which comes later, at the first transfer."""
    return sum(s for phase, s in phases.items() if phase != "nixl_handshake")


def engine_phases(recorded: dict[str, float], engine_s: float) -> dict[str, float]:
    """The engine's phases from what vLLM's processes recorded and the engine's whole start: engine_init
    less its compile, and what no phase covers as engine_other."""
    out = dict(recorded)
    if "engine_init" in out and "compile" in out:
        out["engine_init"] = max(0.0, out["engine_init"] - out["compile"])
    counted = sum(out.get(p, 0.0) for p in ("weights", "engine_init", "compile"))
    out["engine_other"] = max(0.0, engine_s - counted)
    out.pop("nixl_handshake", None)  # after the start: read apart (`read`)
    return {p: out[p] for p in ORDER if p in out}
