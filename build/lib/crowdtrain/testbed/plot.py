"""PNG plots: each link's upload over time with the gradient rounds, and the suite's bars."""

from __future__ import annotations

import json
from pathlib import Path

from crowdtrain.testbed.counters import rates


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def timeline(ax, raw: dict, summary: dict, title: str) -> None:
    """Upload rate of every peer (1 s average) and the gradient rounds (shaded: from the last
    member's start to the end), plus kills and joins."""
    t0 = raw["t0"]
    for p in raw["plan"]["peers"]:
        times, up, _ = rates(raw["counters"], p["name"], 1.0)
        ax.plot([t - t0 for t in times], [u / 1e6 for u in up], lw=0.8, label=f"{p['name']} ({p['link']})")
    for r in summary["rounds"]["rounds"]:
        if r.get("start_unix"):
            ax.axvspan(r["start_unix"] - t0, r["done_unix"] - t0, color="tab:orange", alpha=0.15, lw=0)
    for e in raw["events"]:
        if e["event"] in ("kill", "join") and e["unix"] > t0:
            ax.axvline(e["unix"] - t0, color="red" if e["event"] == "kill" else "green", ls="--", lw=1)
            ax.text(e["unix"] - t0, ax.get_ylim()[1] * 0.95, f" {e['event']} {e['peer']}", fontsize=7)
    ax.set_xlim(left=0)
    ax.set_xlabel("seconds since every peer was training")
    ax.set_ylabel("upload, Mbit/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6, loc="upper right")


def plot_run(raw: dict, summary: dict, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 4))
    r = summary["rounds"]
    ratio = f"{r['ratio_median']:.2f}x floor" if r.get("ratio_median") else "no full rounds"
    util = summary["utilization_mean"]
    util = f"{util:.2f}" if util is not None else "-"
    timeline(ax, raw, summary, f"{summary['name']}: gradient rounds (shaded) {ratio}, utilization {util}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_suite(results: dict, out_dir: Path, path: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    ax = axes[0][0]
    width = 0.35
    for k, rate in enumerate(("100", "10")):
        ratios = [(results.get(f"r{rate}-n{n}") or {}).get("rounds", {}).get("ratio_median") or 0 for n in (2, 4, 8)]
        ax.bar([i + (k - 0.5) * width for i in range(3)], ratios, width, label=f"{rate} Mbit/s")
    ax.axhline(1.5, color="grey", ls="--", lw=1)
    ax.text(2.4, 1.52, "target 1.5x", fontsize=7, color="grey")
    ax.set_xticks(range(3), ["N=2", "N=4", "N=8"])
    ax.set_ylabel("round time / bandwidth floor")
    ax.set_title("Gradient all-reduce vs the floor 2(N-1)/N x model / uplink", fontsize=9)
    ax.legend(fontsize=7)

    ax = axes[0][1]
    for k, (suffix, label) in enumerate((("", "delayed updates"), ("-nodelay", "no delay"))):
        vals = [(results.get(f"r{rate}-n4{suffix}") or {}).get("utilization_mean") or 0 for rate in ("100", "10")]
        ax.bar([i + (k - 0.5) * width for i in range(2)], vals, width, label=label)
    hetero = results.get("hetero") or {}
    if hetero.get("ratio_to_solo_sum"):
        ax.bar([2], [hetero["ratio_to_solo_sum"]], width, color="tab:green", label="heterogeneous: swarm/solos")
    ax.axhline(0.8, color="grey", ls="--", lw=1)
    ax.set_xticks(range(3), ["100 Mbit/s", "10 Mbit/s", "mixed"])
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("compute utilization (N=4) / throughput ratio")
    ax.set_title("Share of wall time spent computing gradients", fontsize=9)
    ax.legend(fontsize=7)

    from crowdtrain.testbed import analysis

    for ax, name in ((axes[1][0], "r100-n4"), (axes[1][1], "churn")):
        raw_path = out_dir / name / "run.json"
        if raw_path.is_file() and "rounds" in (results.get(name) or {}):
            raw = json.loads(raw_path.read_text())
            timeline(ax, raw, analysis.summarize(raw), f"{name}: upload per peer, gradient rounds shaded")
        else:
            ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
