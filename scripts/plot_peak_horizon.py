"""THOR's peak against the run's length: the measurements behind the default's reference_steps.

Two panels, written as ``<out>.png`` and ``<out>.json``:

1. The Fashion-MNIST main job (``experiments/mnist.py``, 3 epochs of 469 steps = 1,407 steps):
   THOR's final test accuracy at each peak it ran (one dot per seed, the median as a line), the
   baselines' median finals at their best rate as horizontal lines, and the default's peak for
   this length (``3e-2·sqrt(256/1407)`` = 1.28e-2) as a vertical line.
2. The default peak against the run length T (``thor_tf.schedules.horizon_scale``), beside the
   best peak measured per workload at its own length (``--best LABEL=T:PEAK``, from docs/suite.md
   and docs/lm.md: each workload's best of the peaks it ran).

    python scripts/plot_peak_horizon.py --main-job runs/peak_fashion/metrics.csv \\
        runs/peak_fashion2/metrics.csv runs/mainjob_horizon/metrics.csv --out docs/peak_horizon \\
        --best "digits=220:0.01" --best "LM=2000:0.01" ...

Reads ``metrics.csv`` files of the main job (columns optimizer, lr, seed, epoch, test_acc); the
last epoch of each (optimizer, lr, seed) is its final.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def finals(paths):
    """``{(optimizer, lr): {seed: final test accuracy}}`` over the main job's metrics.csv files
    (a later file's row for the same run replaces an earlier one)."""
    last = {}
    for path in paths:
        with open(path, newline="") as handle:
            for row in csv.DictReader(handle):
                key = (row["optimizer"], round(float(row["lr"]), 6), int(row["seed"]))
                if key not in last or int(row["epoch"]) >= last[key][0]:
                    last[key] = (int(row["epoch"]), float(row["test_acc"]))
    out = defaultdict(dict)
    for (name, lr, seed), (_, acc) in last.items():
        out[(name, lr)][seed] = acc
    return out


def parse_best(items):
    """``["LABEL=T:PEAK", ...]`` → ``[(label, T, peak), ...]``."""
    best = []
    for item in items or ():
        label, rest = item.split("=", 1)
        steps, peak = rest.split(":", 1)
        best.append((label, int(steps), float(peak)))
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--main-job", nargs="+", required=True, metavar="CSV",
                        help="metrics.csv files of experiments/mnist.py runs on Fashion-MNIST")
    parser.add_argument("--steps", type=int, default=1407, help="the main job's run length")
    parser.add_argument("--best", action="append", metavar="LABEL=T:PEAK",
                        help="a workload's best measured peak at its length (repeatable)")
    parser.add_argument("--out", default="docs/peak_horizon")
    args = parser.parse_args(argv)

    from thor_tf.rules import Eigenbasis
    from thor_tf.schedules import horizon_scale

    rule = Eigenbasis()
    peak0, reference = rule.default_learning_rate, rule.reference_steps
    default_here = peak0 * horizon_scale(args.steps, reference)

    runs = finals(args.main_job)
    thor = sorted((lr, seeds) for (name, lr), seeds in runs.items() if name == "thor")
    baselines = {}
    for (name, lr), seeds in runs.items():
        if name == "thor":
            continue
        median = statistics.median(seeds.values())
        if name not in baselines or median > baselines[name][1]:
            baselines[name] = (lr, median, dict(seeds))

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for lr, seeds in thor:
        left.scatter([lr] * len(seeds), [100 * v for v in seeds.values()], color="C0", s=14,
                     alpha=0.6)
    left.plot([lr for lr, _ in thor], [100 * statistics.median(s.values()) for _, s in thor],
              color="C0", marker="o", label="THOR, median over seeds")
    for k, (name, (lr, median, _)) in enumerate(sorted(baselines.items())):
        left.axhline(100 * median, color=f"C{k + 2}", linestyle="--",
                     label=f"{name} {lr:g} (best rate), median")
    left.axvline(default_here, color="k", linestyle=":",
                 label=f"default at {args.steps} steps: {default_here:.3g}")
    left.set_xscale("log")
    left.set_xlabel("THOR's peak learning rate")
    left.set_ylabel("final test accuracy, %")
    left.set_title(f"Fashion-MNIST main job ({args.steps} steps)")
    left.legend(fontsize=7)

    lengths = [2 ** (k / 4) for k in range(24, 56)]  # 64 ... ~13k steps
    right.plot(lengths, [peak0 * horizon_scale(t, reference) for t in lengths], color="k",
               label=f"default: {peak0:g}·min(1, sqrt({reference}/T))")
    best = parse_best(args.best)
    groups = []  # workloads at the same peak within 1.6x of each other's length: one label
    for label, steps, peak in best:
        for group in groups:
            if group["peak"] == peak and max(steps, group["steps"]) <= 1.6 * min(steps, group["steps"]):
                group["labels"].append(label)
                break
        else:
            groups.append({"peak": peak, "steps": steps, "labels": [label]})
    for label, steps, peak in best:
        right.scatter([steps], [peak], s=22, color="C0")
    for k, group in enumerate(groups):  # alternately above and below: neighbours stay apart
        right.annotate(", ".join(group["labels"]), (group["steps"], group["peak"]), fontsize=7,
                       xytext=(4, 4 if k % 2 == 0 else -11), textcoords="offset points")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("run length T, optimizer steps")
    right.set_ylabel("peak learning rate")
    right.set_title("best measured peak per workload vs the default")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{args.out}.png", dpi=120)

    report = {
        "default": {"peak": peak0, "reference_steps": reference,
                    "rule": "peak * min(1, sqrt(reference_steps / T))",
                    "at_main_job_length": default_here},
        "main_job_steps": args.steps,
        "thor": [{"peak": lr, "median": statistics.median(s.values()),
                  "per_seed": {str(k): v for k, v in sorted(s.items())}} for lr, s in thor],
        "baselines": {name: {"lr": lr, "median": median,
                             "per_seed": {str(k): v for k, v in sorted(s.items())}}
                      for name, (lr, median, s) in sorted(baselines.items())},
        "best_peaks": [{"workload": label, "steps": steps, "best_peak": peak,
                        "default_peak": peak0 * horizon_scale(steps, reference)}
                       for label, steps, peak in best],
    }
    with open(f"{args.out}.json", "w") as handle:
        json.dump(report, handle, indent=1)
    for row in report["thor"]:
        print(f"THOR peak {row['peak']:g}: median {100 * row['median']:.2f} % "
              f"({', '.join(f'{100 * v:.2f}' for v in row['per_seed'].values())})")
    for name, row in report["baselines"].items():
        print(f"{name} {row['lr']:g}: median {100 * row['median']:.2f} %")
    print(f"wrote {args.out}.png and {args.out}.json")


if __name__ == "__main__":
    main()
