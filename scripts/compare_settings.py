"""Compare settings across experiment runs over seeds: tables, JSON and a plot.

Each experiment script (``experiments/mnist.py``, ``resnet.py``, ``transformer.py``) writes
``metrics.csv`` (one row per optimizer, lr, seed and epoch) into its ``--out`` directory. A
*setting* is one optimizer's rows in one such directory, e.g. THOR from a run with
``--damping-split pi``; settings of one model must share seeds (same initial weights and data
order), which the scripts guarantee for equal ``--seeds``.

Per model, the target is the best first-order baseline's final accuracy: among the baselines'
(optimizer, lr) configurations, the one with the highest median final accuracy over seeds, and
that median. Per setting: final accuracy and accuracy after each epoch (mean ± sd over seeds),
epochs and seconds to the target per seed (median over the seeds that reach it), block refreshes.

    python scripts/compare_settings.py --out docs/bench_damping_split \\
        --model "cnn|sqrt=runs/cnn:thor|pi=runs/cnn_pi:thor|baselines=runs/cnn" \\
        --model "vit|sqrt=runs/vit:thor|pi=runs/vit_pi:thor|baselines=runs/vit"

``--model`` is ``NAME|LABEL=DIR:OPTIMIZER|...|baselines=DIR[,DIR]``: settings in order, then the
run directories whose first-order optimizers (sgd, adam, adamw, muon) set the target and get rows
of their own (the best lr of each). Writes ``<out>.json`` and ``<out>.png`` (accuracy against
epoch, mean ± sd, one panel per model) and prints a Markdown table per model.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
from collections import defaultdict

FIRST_ORDER = ("sgd", "adam", "adamw", "muon")


def read_metrics(directory):
    """``{(optimizer, lr): {seed: [row per epoch, in order]}}`` from ``directory/metrics.csv``."""
    runs = defaultdict(lambda: defaultdict(list))
    with open(os.path.join(directory, "metrics.csv")) as fh:
        for row in csv.DictReader(fh):
            key = (row["optimizer"], float(row["lr"]))
            runs[key][int(row["seed"])].append({
                "epoch": int(row["epoch"]), "acc": float(row["test_acc"]),
                "seconds": float(row["cumulative_seconds"]),
                "refreshes": int(float(row["refreshes"] or 0))})
    for seeds in runs.values():
        for rows in seeds.values():
            rows.sort(key=lambda r: r["epoch"])
    return runs


def mean_sd(values):
    values = [float(v) for v in values]
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def best_config(runs, optimizer):
    """The lr of ``optimizer`` with the highest median final accuracy, and its seeds' rows."""
    configs = {lr: seeds for (opt, lr), seeds in runs.items() if opt == optimizer}
    if not configs:
        return None, None
    lr = max(configs, key=lambda k: statistics.median(r[-1]["acc"] for r in configs[k].values()))
    return lr, configs[lr]


def summarize(seeds, target):
    """Figures of one setting (``{seed: rows}``) against ``target``."""
    finals = [rows[-1]["acc"] for rows in seeds.values()]
    epochs = max(len(rows) for rows in seeds.values())
    per_epoch = [mean_sd([rows[e]["acc"] for rows in seeds.values() if len(rows) > e])
                 for e in range(epochs)]
    reach = {}
    for seed, rows in sorted(seeds.items()):
        hit = next((r for r in rows if r["acc"] >= target), None)
        reach[seed] = None if hit is None else {"epochs": hit["epoch"], "seconds": hit["seconds"]}
    reached = [r for r in reach.values() if r is not None]
    mean, sd = mean_sd(finals)
    return {
        "seeds": sorted(seeds), "final_acc": finals, "final_mean": mean, "final_sd": sd,
        "acc_per_epoch": [{"mean": m, "sd": s} for m, s in per_epoch],
        "to_target": reach,
        "epochs_to_target_median": statistics.median(r["epochs"] for r in reached) if reached else None,
        "seconds_to_target_median": statistics.median(r["seconds"] for r in reached) if reached else None,
        "total_seconds_median": statistics.median(rows[-1]["seconds"] for rows in seeds.values()),
        "refreshes": [rows[-1]["refreshes"] for rows in seeds.values()],
    }


def paired(seeds, baseline_rows):
    """Per seed: the best baseline *of that seed* (highest final accuracy), the epoch and seconds
    at which it first reached its own final accuracy, and the setting's epoch and seconds to the
    same accuracy with their ratios (None where the setting never reaches it)."""
    out = {}
    for seed, rows in sorted(seeds.items()):
        candidates = {o: s[seed] for o, (_, s) in baseline_rows.items() if seed in s}
        if not candidates:
            continue
        best = max(candidates, key=lambda o: candidates[o][-1]["acc"])
        base = candidates[best]
        target = base[-1]["acc"]
        own = next(r for r in base if r["acc"] >= target)
        hit = next((r for r in rows if r["acc"] >= target), None)
        out[seed] = {"baseline": best, "target": target, "baseline_epochs": own["epoch"],
                     "baseline_seconds": own["seconds"],
                     "epochs": None if hit is None else hit["epoch"],
                     "seconds": None if hit is None else hit["seconds"],
                     "epochs_ratio": None if hit is None else hit["epoch"] / own["epoch"],
                     "seconds_ratio": None if hit is None else hit["seconds"] / own["seconds"]}
    return out


def parse_model(spec):
    parts = spec.split("|")
    name, settings, baselines = parts[0], [], []
    for part in parts[1:]:
        label, _, value = part.partition("=")
        if label == "baselines":
            baselines = [d for d in value.split(",") if d]
            continue
        directory, _, optimizer = value.rpartition(":")
        if not directory or not optimizer:
            raise SystemExit(f"error: setting {part!r} of --model {spec!r} must be LABEL=DIR:OPTIMIZER")
        settings.append((label, directory, optimizer))
    if not settings:
        raise SystemExit(f"error: --model {spec!r} names no setting")
    return name, settings, baselines


def compare(name, settings, baselines):
    baseline_rows = {}
    for directory in baselines:
        runs = read_metrics(directory)
        for optimizer in FIRST_ORDER:
            lr, seeds = best_config(runs, optimizer)
            if seeds is not None:
                baseline_rows[optimizer] = (lr, seeds)
    if not baseline_rows:
        raise SystemExit(f"error: no first-order baseline in {baselines} for {name}")
    best = max(baseline_rows, key=lambda o: statistics.median(
        r[-1]["acc"] for r in baseline_rows[o][1].values()))
    target = statistics.median(r[-1]["acc"] for r in baseline_rows[best][1].values())
    rows = {}
    for label, directory, optimizer in settings:
        runs = read_metrics(directory)
        lr, seeds = best_config(runs, optimizer)
        if seeds is None:
            raise SystemExit(f"error: no {optimizer} rows in {directory}/metrics.csv")
        rows[label] = {"optimizer": optimizer, "lr": lr, "dir": directory, "_seeds": seeds,
                       **summarize(seeds, target)}
    for optimizer, (lr, seeds) in baseline_rows.items():
        rows[optimizer] = {"optimizer": optimizer, "lr": lr, "dir": "baseline", **summarize(seeds, target)}
    for label, directory, optimizer in settings:
        rows[label]["paired"] = paired(rows[label]["_seeds"], baseline_rows)
    for row in rows.values():
        row.pop("_seeds", None)
    best_seconds = rows[best]["seconds_to_target_median"]
    best_epochs = rows[best]["epochs_to_target_median"]
    for row in rows.values():
        s, e = row["seconds_to_target_median"], row["epochs_to_target_median"]
        row["seconds_vs_best_baseline"] = s / best_seconds if s and best_seconds else None
        row["epochs_vs_best_baseline"] = e / best_epochs if e and best_epochs else None
    return {"model": name, "target": target, "target_from": f"{best} lr {baseline_rows[best][0]:g}",
            "settings": rows}


def markdown(result):
    lines = [f"{result['model']}: target {100 * result['target']:.2f} % "
             f"(median final of {result['target_from']})", "",
             "| setting | final acc, mean ± sd (per seed) | after epoch 1 | epochs to target, per seed "
             "(median) | seconds to target (median) | × best baseline's time | refreshes |",
             "|---|---|---|---|---|---|---|"]
    for label, row in result["settings"].items():
        per_seed = " / ".join(f"{100 * a:.2f}" for a in row["final_acc"])
        first = row["acc_per_epoch"][0]
        reach = " / ".join("never" if r is None else str(r["epochs"]) for r in row["to_target"].values())
        seconds = row["seconds_to_target_median"]
        ratio = row["seconds_vs_best_baseline"]
        lines.append(
            f"| {label} | {100 * row['final_mean']:.2f} ± {100 * row['final_sd']:.2f} % ({per_seed}) | "
            f"{100 * first['mean']:.2f} ± {100 * first['sd']:.2f} % | {reach} "
            f"({row['epochs_to_target_median'] if row['epochs_to_target_median'] is not None else '–'}) | "
            f"{'–' if seconds is None else f'{seconds:.1f}'} | {'–' if ratio is None else f'{ratio:.2f}×'} | "
            f"{' / '.join(str(r) for r in row['refreshes']) if row['optimizer'] not in FIRST_ORDER else '–'} |")
    for label, row in result["settings"].items():
        pairs = row.get("paired")
        if not pairs:
            continue

        def fmt(key):
            return " / ".join("never" if p[key] is None else f"{p[key]:.2f}" for p in pairs.values())

        targets = " / ".join(f"{p['baseline']} {100 * p['target']:.2f} %" for p in pairs.values())
        lines.append(f"\n{label}, seed by seed against that seed's best baseline ({targets}): "
                     f"epochs × {fmt('epochs_ratio')}, wall time × {fmt('seconds_ratio')}")
    return "\n".join(lines)


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 4.2), squeeze=False)
    for ax, result in zip(axes[0], results):
        for label, row in result["settings"].items():
            means = [100 * p["mean"] for p in row["acc_per_epoch"]]
            sds = [100 * p["sd"] for p in row["acc_per_epoch"]]
            epochs = list(range(1, len(means) + 1))
            ax.errorbar(epochs, means, yerr=sds, marker="o", capsize=3, label=label)
            ax.set_xticks(epochs)
        ax.axhline(100 * result["target"], color="gray", ls="--", lw=1, label="target")
        ax.set_title(result["model"])
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy, mean ± sd over seeds (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", action="append", required=True, metavar="SPEC")
    p.add_argument("--out", required=True, help="output path without extension")
    p.add_argument("--note", default="", help="free text stored in the JSON (what was run, when)")
    args = p.parse_args(argv)
    results = [compare(*parse_model(spec)) for spec in args.model]
    for result in results:
        print(markdown(result) + "\n")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as fh:
        json.dump({"note": args.note, "models": results}, fh, indent=1)
    plot(results, args.out + ".png")
    print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
