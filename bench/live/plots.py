"""PNG plots of a benchmark's runs (matplotlib, from the `bench` extra): latency percentiles and goodput
against the offered rate (open-loop runs), and CDFs of TTFT, TPOT and end-to-end latency (every run).
The runs of several systems (a side-by-side benchmark) share each plot, one colour per system."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.live.report import RunResult

METRICS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end"))
QUANTILES = (("p50", "-"), ("p95", "--"), ("p99", ":"))


class PlotsUnavailable(Exception):
    pass


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only; PlotsUnavailable (with what to do) when not installed."""
    try:
        import matplotlib
    except ImportError:
        raise PlotsUnavailable(
            "PNG plots need matplotlib: scripts/install.sh installs it (pip install -e '.[bench]')"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(runs: Mapping[str, Sequence[RunResult]], out_dir: Path) -> list[Path]:
    """`runs`: each system's runs (one system: any name). The files written."""
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    colours = {system: f"C{i}" for i, system in enumerate(runs)}
    written = []
    rated = {
        s: sorted((r for r in rs if r.offered_rate), key=lambda r: r.offered_rate or 0)
        for s, rs in runs.items()
    }
    if any(len(rs) >= 2 for rs in rated.values()):
        fig, axes = plt.subplots(1, len(METRICS), figsize=(15, 4.2))
        for ax, (key, name) in zip(axes, METRICS, strict=True):
            for system, rs in rated.items():
                rates = [r.offered_rate for r in rs]
                for q, style in QUANTILES:
                    ms = [1e3 * getattr(r, key)[q] for r in rs]
                    ax.plot(rates, ms, style, marker="o", color=colours[system], label=f"{system} {q}")
            ax.set(title=f"{name} vs offered rate", xlabel="requests / s", ylabel="ms")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        written.append(_save(fig, out_dir / "latency_vs_rate.png", plt))
        fig, ax = plt.subplots(figsize=(6, 4.2))
        for system, rs in rated.items():
            rates = [r.offered_rate for r in rs]
            ax.plot(
                rates,
                [r.goodput_rps for r in rs],
                "-",
                marker="o",
                color=colours[system],
                label=f"{system} goodput",
            )
            ax.plot(
                rates,
                [r.throughput_rps for r in rs],
                "--",
                color=colours[system],
                label=f"{system} throughput",
            )
        top = max(r.offered_rate or 0.0 for rs in rated.values() for r in rs)
        ax.plot([0, top], [0, top], ":", color="grey", label="offered")
        ax.set(
            title="goodput (within the SLO) vs offered rate",
            xlabel="requests / s offered",
            ylabel="requests / s",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        written.append(_save(fig, out_dir / "goodput_vs_rate.png", plt))
    fig, axes = plt.subplots(1, len(METRICS), figsize=(15, 4.2))
    for ax, (key, name) in zip(axes, METRICS, strict=True):
        for system, all_runs in runs.items():
            for i, r in enumerate(all_runs):
                values = sorted(1e3 * v for v in r.samples_s.get(key, []))
                if values:
                    share = [(j + 1) / len(values) for j in range(len(values))]
                    ax.step(
                        values,
                        share,
                        where="post",
                        color=colours[system],
                        alpha=0.4 + 0.6 * (i + 1) / len(all_runs),
                        label=f"{system} {r.label}",
                    )
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="share of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    written.append(_save(fig, out_dir / "latency_cdf.png", plt))
    return written


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
