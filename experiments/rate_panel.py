"""THOR's rate sensitivity beside the baselines' grids: the suite's median finals against the peak.

    python experiments/rate_panel.py --baselines docs/results/suite_metrics.csv \\
        --thor 0.01=runs/p1/metrics.csv --thor 0.03=runs/p3/metrics.csv ... --default 0.03 \\
        --out docs/rate_panel

Per workload of the suite: THOR's median final metric over the seeds at each peak rate given
(one ``metrics.csv`` of ``experiments/suite.py --optimizers thor --thor-option peak=X`` per peak;
a file may hold several workloads, several files may make up one peak), and each baseline's median
final at every rate of its grid (from ``--baselines``, the suite's own rows). The default is
trustworthy when its neighbours (1/3 and 3 times it) still lead the best baseline.

Outputs in ``--out``: ``rate_panel.png`` (one panel per workload: median final against the rate,
log scale, THOR red, the best baseline's median final dashed), ``rate_panel.json`` and
``rate_panel.md`` (a table: per peak, THOR's median final per workload, bold where it is ahead of
the best baseline's median final, and the count of workloads where it is).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from experiments import suite as suite_mod  # noqa: E402
from experiments import workloads as wl  # noqa: E402

COLORS = suite_mod.COLORS


def finals(rows):
    """``{(workload, optimizer, lr): [final metric per seed]}`` (the last evaluation of a run)."""
    last = {}
    for r in rows:
        key = (r["workload"], r["optimizer"], r["lr"], r["seed"])
        if key not in last or r["step"] > last[key]["step"]:
            last[key] = r
    out = {}
    for (workload, optimizer, lr, _), r in sorted(last.items()):
        out.setdefault((workload, optimizer, lr), []).append(r["metric"])
    return out


def ahead(workload, value, target):
    """Strictly better than ``target`` (a tie is not a lead)."""
    return value > target if workload.higher_is_better else value < target


def panel(baseline_rows, thor_rows_by_peak, workload_names):
    """The panel's data: per workload, the baselines' grids and THOR's peaks (median finals)."""
    base = finals(baseline_rows)
    thor = {peak: finals(rows) for peak, rows in thor_rows_by_peak.items()}
    out = []
    for name in workload_names:
        workload = wl.WORKLOADS[name]
        sign = 1 if workload.higher_is_better else -1
        grids = {}
        for (w, optimizer, lr), values in base.items():
            if w == name and optimizer != "thor":
                grids.setdefault(optimizer, []).append((lr, statistics.median(values), len(values)))
        if not grids:
            continue
        best = {o: max(g, key=lambda t: sign * t[1]) for o, g in grids.items()}
        leader = max(best, key=lambda o: sign * best[o][1])
        target = best[leader][1]
        peaks = []
        for peak in sorted(thor):
            values = [v for (w, o, _), vs in thor[peak].items() if w == name and o == "thor"
                      for v in vs]
            if values:
                median = statistics.median(values)
                peaks.append({"peak": peak, "median": median, "finals": values,
                              "ahead": ahead(workload, median, target)})
        out.append({"workload": name, "metric": workload.metric,
                    "higher_is_better": workload.higher_is_better, "target": target,
                    "best_baseline": leader, "best_baseline_lr": best[leader][0],
                    "grids": {o: [{"lr": lr, "median": m, "seeds": n} for lr, m, n in sorted(g)]
                              for o, g in grids.items()},
                    "thor": peaks})
    return out


def _fmt(workload, value):
    return f"{100 * value:.2f} %" if workload["metric"] == "accuracy" else f"{value:.4g}"


def markdown(data, default):
    peaks = sorted({p["peak"] for w in data for p in w["thor"]})
    lines = ["| peak | " + " | ".join(w["workload"] for w in data) + " | ahead of the best baseline |",
             "|---" * (len(data) + 2) + "|"]
    lines.append("| best baseline | " + " | ".join(
        f"{w['best_baseline']} {w['best_baseline_lr']:g}: {_fmt(w, w['target'])}" for w in data)
        + " | |")
    for peak in peaks:
        cells, count, total = [], 0, 0
        for w in data:
            entry = next((p for p in w["thor"] if p["peak"] == peak), None)
            if entry is None:
                cells.append("–")
                continue
            total += 1
            count += entry["ahead"]
            text = _fmt(w, entry["median"])
            cells.append(f"**{text}**" if entry["ahead"] else text)
        label = f"**{peak:g}** (default)" if default is not None and peak == default else f"{peak:g}"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {count} of {total} |")
    return "\n".join(lines)


def plot(data, default, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(data))
    rows = -(-len(data) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, w in zip(axes.flat, data):
        for optimizer, grid in w["grids"].items():
            ax.plot([g["lr"] for g in grid], [g["median"] for g in grid], "o-",
                    color=COLORS.get(optimizer, "gray"), label=optimizer, alpha=0.8)
        if w["thor"]:
            ax.plot([p["peak"] for p in w["thor"]], [p["median"] for p in w["thor"]], "s-",
                    color=COLORS["thor"], label="thor (peak)", linewidth=2)
        ax.axhline(w["target"], color="black", linestyle="--", linewidth=1,
                   label="best baseline")
        if default is not None:
            ax.axvline(default, color=COLORS["thor"], linestyle=":", linewidth=1)
        ax.set_xscale("log")
        # Diverged rates off the chart: the panel is about the neighbourhood of the target.
        if w["higher_is_better"]:
            ax.set_ylim(w["target"] - 0.06, None)
        else:
            ax.set_yscale("log")
            ax.set_ylim(None, w["target"] * 8)
        ax.set_title(w["workload"], fontsize=10)
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel(("test " if w["metric"] == "accuracy" else "") + w["metric"]
                      + (" (higher is better)" if w["higher_is_better"] else " (lower is better)"),
                      fontsize=8)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(data):]:
        ax.axis("off")
    fig.suptitle("median final over seeds against the peak rate (THOR's default dotted)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _peak_file(text):
    peak, sep, path = str(text).partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--thor takes PEAK=METRICS_CSV; got {text!r}")
    return float(peak), path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baselines", required=True, help="the suite's metrics.csv with the "
                        "baselines' rows (e.g. docs/results/suite_metrics.csv)")
    parser.add_argument("--thor", type=_peak_file, action="append", required=True,
                        metavar="PEAK=CSV", help="THOR's metrics.csv at a peak (repeat)")
    parser.add_argument("--default", type=float, default=None, help="THOR's default peak")
    parser.add_argument("--workloads", default=",".join(wl.WORKLOADS))
    parser.add_argument("--out", default="runs/rate_panel")
    args = parser.parse_args(argv)
    baseline_rows = [r for r in suite_mod._read_rows(args.baselines) if r["optimizer"] != "thor"]
    thor_rows = {}
    for peak, path in args.thor:
        thor_rows.setdefault(peak, []).extend(
            r for r in suite_mod._read_rows(path) if r["optimizer"] == "thor")
    data = panel(baseline_rows, thor_rows, [w for w in args.workloads.split(",") if w])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rate_panel.json").write_text(json.dumps({"default": args.default, "workloads": data},
                                                    indent=1))
    table = markdown(data, args.default)
    (out / "rate_panel.md").write_text(table + "\n")
    plot(data, args.default, out / "rate_panel.png")
    print(table)
    print(f"wrote {out}/rate_panel.png, rate_panel.json, rate_panel.md")


if __name__ == "__main__":
    main()
