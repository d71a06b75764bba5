"""`pdserve bench --side-by-side SYSTEMS [--rounds N]`: each system started here in turn, the same workload
on each, then one table and the ratios to the last system (the baseline).

The systems run one at a time: they would share this machine's cores. On a small machine whichever system runs
second can be the slower for reasons of its own (docs/benchmarks.md, "The order of the systems"), so with
`--rounds N` the systems run N times in alternating order (as given, then reversed, ...), each ratio is read
against the baseline's run in the same round, and the median of the rounds is printed with their range.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import cast

from bench.live.report import RATIO_COLUMNS, RunResult, ratio_rows, table
from bench.live.systems import started
from bench.live.targets import Served

# address -> (what it serves, the workload in words, one result per run)
Measure = Callable[[str], tuple[Served, str, list[RunResult]]]


class SystemDidNotStart(Exception):
    pass


def round_orders(systems: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of each round: as given, then reversed, alternately."""
    return [list(systems) if r % 2 == 0 else list(reversed(systems)) for r in range(rounds)]


def measure_systems(
    systems: Sequence[str], rounds: int, base: Path, measure: Measure
) -> tuple[dict[str, tuple[Served, list[RunResult]]], str]:
    """Every system's runs, each started afresh in every round, its results tagged with their round."""
    measured: dict[str, tuple[Served, list[RunResult]]] = {}
    workload = ""
    for number, order in enumerate(round_orders(systems, rounds), 1):
        for system in order:
            of = f" (round {number} of {rounds})" if rounds > 1 else ""
            print(f"starting {system}{of} ...", flush=True)
            try:
                with started(system, base) as address:
                    served, workload, results = measure(address)
            except (RuntimeError, TimeoutError) as exc:
                raise SystemDidNotStart(f"{system} did not start: {exc}") from exc
            tagged = [dataclasses.replace(r, round=number) for r in results]
            measured[system] = (served, measured.get(system, (served, []))[1] + tagged)
    return measured, workload


def summary(runs: Mapping[str, Sequence[RunResult]], baseline: str, rounds: int) -> str:
    """The runs' table, the ratios to the baseline round by round, and with several rounds their medians."""

    def label(system: object, run: object, number: object) -> str:
        return f"{system} {run}" + (f" r{number}" if rounds > 1 else "")

    named = [dataclasses.replace(r, label=label(s, r.label, r.round)) for s, rs in runs.items() for r in rs]
    lines = [table(named)]
    rows = ratio_rows(runs, baseline)
    if not rows:
        return lines[0]
    medians = median_ratios(rows) if rounds > 1 else {}
    labels = [label(row["system"], row["run"], row["round"]) for row in rows]
    width = max(len(x) for x in labels) + 2
    lines += ["", f"ratios to {baseline} (below 1: lower latency, above 1: more throughput)"]
    lines.append(f"{'run':<{width}}" + "".join(f"{name:>10}" for name, _, _ in RATIO_COLUMNS))
    for what, row in zip(labels, rows, strict=True):
        lines.append(f"{what:<{width}}" + "".join(f"{row[name]:>10.2f}" for name, _, _ in RATIO_COLUMNS))
    if medians:
        lines += ["", f"median of {rounds} rounds in alternating order (lowest-highest)"]
        lines.append(f"{'run':<{width}}" + "".join(f"{name:>18}" for name, _, _ in RATIO_COLUMNS))
        for (system, run), columns in medians.items():
            cells = "".join(f"{f'{m:.2f} ({lo:.2f}-{hi:.2f})':>18}" for m, lo, hi in columns.values())
            lines.append(f"{f'{system} {run}':<{width}}{cells}")
    return "\n".join(lines)


# (system, run) -> column -> (median, lowest, highest)
Medians = dict[tuple[str, str], dict[str, tuple[float, float, float]]]


def median_ratios(rows: Sequence[Mapping[str, object]]) -> Medians:
    """Per (system, run): each ratio column's median over the rounds, and its lowest and highest."""
    grouped: dict[tuple[str, str], list[Mapping[str, object]]] = {}
    for row in rows:
        grouped.setdefault((str(row["system"]), str(row["run"])), []).append(row)
    out: Medians = {}
    for key, group in grouped.items():
        columns = {}
        for name, _, _ in RATIO_COLUMNS:
            values = [cast(float, row[name]) for row in group]
            columns[name] = (statistics.median(values), min(values), max(values))
        out[key] = columns
    return out
