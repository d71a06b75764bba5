"""`python -m bench.replay_vs_live`: the replay checked against real engines, on one workload.

    .venv/bin/python -m bench.engine_timing --out engine-timing.json
    .venv/bin/python -m bench.replay_vs_live --timing engine-timing.json \\
        --systems aggregated2,aggregated2:least_loaded --sessions 8 --max-turns 8 --gap-scale 0.1 --rate 2 \\
        --rounds 3

1. The topology: deploy/local.yaml (or `--topology`) with `router.service_time.measured` from `--timing`
   (bench.engine_timing's JSON), so the live router and the replay's policies estimate with the same times.
2. Live: `pdserve bench --side-by-side SYSTEMS --mode sessions --rounds N ...` on it, every system started
   in turn, N rounds in alternating order (`--live REPORT` reuses the JSON report of such a run instead).
3. Replay: the same sessions (the same scaled prompts, output lengths and gaps, bench/replay/live_sessions.py)
   started at the live run's start times, on each system's topology (its replica counts and
   `router.policy`), the engines timed by the fit: by each of several `--timing` files in turn, the median
   and range of the replays then stated (one timing is one sample of a machine whose speed drifts).
4. The table: per system, live (the median of the rounds, and their range) against replay for TTFT and TPOT
   P50/P99, the cached share and the share prefilled on decode, the error of each; per topology, pdserve's
   ratio to each cache-blind policy (live: read within each round, then the median) against the replay's
   prediction.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgspec
import yaml

from bench.live import cli as live_cli
from bench.live.arrivals import Arrivals
from bench.live.sessions import plan_sessions
from bench.live.systems import VLLM_SYSTEMS, _parts, known, overrides, topology
from bench.replay.live_compare import Outcome, compare, format_comparison
from bench.replay.live_requests import LivePlacement, format_tails, request_tail
from bench.replay.live_sessions import trace_of_plan
from bench.replay.policies import available_policies
from bench.replay.runner import replay_policy
from bench.replay.sim import RequestRecord, SimConfig
from bench.replay.traces import DEFAULT_TRACES_DIR, infinite_cache_hit_ratio
from cluster.topology import Topology, TopologyError
from cluster.topology_file import parse_topology
from router.service_time import MeasuredTiming

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SYSTEMS = ("aggregated2", "aggregated2:least_loaded", "pd-auto", "pd-auto:round_robin")


def with_timing(base: Path, fit: MeasuredTiming) -> dict[str, Any]:
    """`base` with `router.service_time.measured` set to `fit`."""
    topo = yaml.safe_load(base.read_text())
    router = topo.setdefault("router", {})
    router.setdefault("service_time", {})["measured"] = msgspec.to_builtins(fit)
    return topo


def load_fit(path: Path) -> MeasuredTiming:
    """The fit of bench.engine_timing's JSON."""
    try:
        doc = json.loads(path.read_text())
        return msgspec.convert(doc["fit"], MeasuredTiming)
    except (OSError, ValueError, KeyError, msgspec.ValidationError) as exc:
        raise ValueError(f"--timing {path}: not a bench.engine_timing report ({exc})") from None


def system_topology(base: Path, system: str, fit: MeasuredTiming | None = None) -> Topology:
    """`system`'s topology from `base`, with `fit` as its measured service time when given."""
    changes = overrides(system)
    if fit is not None:
        changes |= {"router.service_time.measured": msgspec.to_builtins(fit)}
    return parse_topology(topology(base, changes), source=f"{base} as {system}")


def replay_system(
    base: Path,
    system: str,
    args: argparse.Namespace,
    max_model_len: int,
    fit: MeasuredTiming | None = None,
    placed: Sequence[dict[str, Any]] | None = None,
) -> tuple[Outcome, list[RequestRecord]]:
    """The replay of `system` on the sessions the live run sent (timed by `fit`, default `base`'s), and its
    requests; with `placed` (a live round's `requests_sent`), every request where that round put it."""
    topo = system_topology(base, system, fit)
    plan = plan_sessions(
        num_sessions=args.sessions,
        max_turns=args.max_turns,
        max_model_len=max_model_len,
        max_output=args.output_len,
        gap_scale=args.gap_scale,
        seed=args.seed,
        traces_dir=args.traces_dir,
    )
    starts = args.arrival.offsets(len(plan.sessions), args.rate, args.seed)
    trace = trace_of_plan(plan, starts, topo.model.block_size)
    router = topo.router
    cfg = SimConfig(
        prefill_replicas=topo.pools.prefill.replicas,
        decode_replicas=topo.pools.decode.replicas,
        # The engines' caches hold far more than a slice this size (a 1 GiB cache is 512k tokens of the
        # tiny model): nothing is evicted live, so nothing is here.
        capacity_blocks=None,
        gap_scale=1.0,  # the plan's gaps are already scaled and capped
        max_gap_s=math.inf,
        seed=args.seed,
        timing=router.service_time.timing(),
        readback_ttl_s=float(topo.pools.kv_readback_ttl_s) or None,
        readback_exports=router.kv_readback_exports,
    )
    factory = available_policies(router)[router.policy]
    if placed is not None:
        as_live = LivePlacement(placed)
        factory = lambda _: as_live  # noqa: E731
    bound = infinite_cache_hit_ratio(trace)
    _, records = replay_policy(trace, router.policy, factory, cfg, bound)
    return Outcome.of_replay(records), records


def _systems(text: str) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in chosen if not known(s) or _parts(s)[0] in (*VLLM_SYSTEMS, "doubles") or _parts(s)[2]]
    if bad or not chosen:
        raise argparse.ArgumentTypeError(
            f"{', '.join(bad) or text!r}: pdserve systems on real engines, NAME or NAME:POLICY"
        )
    return chosen


def _paths(text: str) -> list[Path]:
    paths = [Path(p.strip()) for p in text.split(",") if p.strip()]
    if not paths:
        raise argparse.ArgumentTypeError(f"{text!r}: one or more files, separated by commas")
    return paths


def _rounds(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of rounds, at least 1")
    return int(text)


def _system_timing(text: str) -> tuple[str, MeasuredTiming]:
    name, eq, path = text.partition("=")
    if not eq or not known(name) or _parts(name)[1] is not None or name in (*VLLM_SYSTEMS, "doubles"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME=FILE, NAME a pdserve system on real engines"
        )
    try:
        return name, load_fit(Path(path))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.replay_vs_live", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--timing",
        type=_paths,
        required=True,
        metavar="FILE[,FILE...]",
        help="bench.engine_timing's or bench.served_timing's JSON reports: the replay runs on each and "
        "states the median and range (a timing is one sample of a machine whose speed drifts); the live "
        "router estimates with the first",
    )
    p.add_argument(
        "--timing-for",
        type=_system_timing,
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="the replay of system NAME (with any policy) is timed by FILE instead, e.g. aggregated2=a2.json "
        "(`bench.served_timing --system aggregated2`); the live router keeps --timing's",
    )
    p.add_argument("--topology", type=Path, default=REPO / "deploy" / "local.yaml")
    p.add_argument("--systems", type=_systems, default=list(DEFAULT_SYSTEMS))
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--gap-scale", type=float, default=0.1)
    p.add_argument("--rate", type=float, default=2.0, help="sessions started per second")
    p.add_argument("--arrival", type=Arrivals.parse, default=Arrivals("poisson"))
    p.add_argument("--output-len", type=int, default=32, help="most output tokens of a turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--traces-dir", type=Path, default=DEFAULT_TRACES_DIR)
    p.add_argument(
        "--rounds", type=_rounds, default=1, help="live: the systems this many times, in alternating order"
    )
    p.add_argument("--live", type=Path, default=None, help="a `pdserve bench --json` report of this run")
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help="write the comparison here, and a live run's report beside it (NAME.live.json, for --live)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        fits = [load_fit(path) for path in args.timing]
        fit = fits[0]
        base = with_timing(args.topology, fit)
        parse_topology(base, source=str(args.topology))
    except (ValueError, TopologyError, OSError) as exc:
        parser.error(str(exc))
    with tempfile.TemporaryDirectory() as tmp:
        topo_file = Path(tmp) / "topology.yaml"
        topo_file.write_text(yaml.safe_dump(base))
        report = _live_report(args, topo_file, Path(tmp))
        if report is None:
            return 1
        systems = [s for s in args.systems if s in report["systems"]]
        if missing := sorted(set(args.systems) - set(systems)):
            parser.error(f"--live {args.live}: no run of {', '.join(missing)}")
        max_model_len = next(iter(report["systems"].values()))["model"]["max_model_len"]
        live_results = {s: report["systems"][s]["results"] for s in systems}
        live_rounds = {s: [Outcome.of_live(r) for r in results] for s, results in live_results.items()}
        timing_for = dict(args.timing_for)
        replay: dict[str, list[Outcome]] = {}
        as_placed: dict[str, list[Outcome]] = {}  # each live round's placements, on each timing
        tails = {}
        for s in systems:
            fits_s = [timing_for[_parts(s)[0]]] if _parts(s)[0] in timing_for else fits
            replayed = [replay_system(topo_file, s, args, max_model_len, f) for f in fits_s]
            replay[s] = [outcome for outcome, _ in replayed]
            # Request by request on the first timing's replay.
            tails[s] = [request_tail(r.get("requests_sent", []), replayed[0][1]) for r in live_results[s]]
            rows = [r.get("requests_sent") for r in live_results[s]]
            if all(rows) and all(row["decode_replica"] for round_rows in rows for row in round_rows):
                as_placed[s] = [
                    replay_system(topo_file, s, args, max_model_len, f, placed)[0]
                    for placed in rows
                    for f in fits_s
                ]
    result = compare(live_rounds, replay, systems)
    placed_result = compare(live_rounds, as_placed, systems) if len(as_placed) == len(systems) else None
    service_time = parse_topology(base).router.service_time
    print(f"service time: {service_time.describe()}")
    for path, other in list(zip(args.timing, fits, strict=True))[1:]:
        print(f"  and {path}: {msgspec.structs.replace(service_time, measured=other).describe()}")
    for name, fit_for in args.timing_for:
        print(f"  {name}: {msgspec.structs.replace(service_time, measured=fit_for).describe()}")
    print(format_comparison(result))
    print()
    if placed_result is not None:
        print("the replay with every request where each live round put it (rounds x timings):")
        print(format_comparison(placed_result, "rounds x timings"))
    else:
        print("(no replay with the live placements: the live report does not place every request)")
    print()
    print(format_tails(tails))
    if args.json is not None:
        result |= {
            "as_placed": placed_result,
            "tails": tails,
            "live": {k: [asdict(o) for o in v] for k, v in live_rounds.items()},
            "replay": {k: [asdict(o) for o in v] for k, v in replay.items()},
            "fit": msgspec.to_builtins(fit),
            "fits": [msgspec.to_builtins(f) for f in fits],
            "fit_for": {name: msgspec.to_builtins(f) for name, f in args.timing_for},
        }
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def _live_report(args: argparse.Namespace, topo_file: Path, tmp: Path) -> dict[str, Any] | None:
    """The live side-by-side's JSON report: `--live`, or a run now."""
    if args.live is not None:
        return json.loads(args.live.read_text())  # type: ignore[no-any-return]
    out = tmp / "live.json"
    code = live_cli.main(
        [
            "--side-by-side", ",".join(args.systems), "--topology", str(topo_file),
            "--mode", "sessions", "--sessions", str(args.sessions), "--max-turns", str(args.max_turns),
            "--gap-scale", str(args.gap_scale), "--rate", str(args.rate), "--arrival", str(args.arrival),
            "--output-len", f"fixed:{args.output_len}", "--seed", str(args.seed),
            "--traces-dir", str(args.traces_dir), "--rounds", str(args.rounds), "--json", str(out),
        ]
    )  # fmt: skip
    if code != 0 or not out.exists():
        print(f"the live run failed (pdserve bench exit {code})", file=sys.stderr)
        return None
    if args.json is not None:  # so the same live run can be replayed again with another timing
        shutil.copyfile(out, args.json.with_suffix(".live.json"))
    return json.loads(out.read_text())  # type: ignore[no-any-return]


if __name__ == "__main__":
    sys.exit(main())
