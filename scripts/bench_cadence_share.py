"""THOR's steady step against each suite workload's best baseline, with and without its cadence
points: how much of the gap is the step itself and how much the curvature work every 10 steps.

Per workload, THOR (defaults) and the workload's best baseline at its best rate
(``docs/results/suite_grid.json``: the optimizer and rate the suite's grid chose, with the suite's own
schedule) are built and called once (tracing), then ``--steps`` ``train_on_batch`` calls each,
alternating between the two in one process (the first of each pair alternates too), so a slow
spell of a shared machine hits both alike. Per repeat (a seed: weights and batch order):

* ``noncadence_ratio``: THOR's median step away from its cadence points (steps that are not a
  multiple of ``frequency`` = 10) over the baseline's median step;
* ``amortized_ratio``: THOR's mean step over the baseline's, both from step 5 on: THOR's cadence
  points (trace rule, refreshes, moment carries) included, as a run pays them;
* the same in CPU time of the process (all threads).

Reported: per workload the median and the spread over repeats, JSON in ``--out`` and a PNG beside
it. The first steps include the first refreshes of every block (the cadence points are heaviest
then), so ``amortized_ratio`` over a short window is an upper bound of a long run's.

    python scripts/bench_cadence_share.py --out docs/results/bench_cadence_share.json   # ~12 min
    python scripts/bench_cadence_share.py --quick     # one small workload, 12 steps: the harness
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

FREQUENCY = 10  # THOR's default cadence interval (steps)


def best_baselines(path):
    """``{workload: (optimizer, rate)}`` as the suite's grid chose them."""
    summary = json.loads(Path(path).read_text())
    return {w["workload"]: (w["best_baseline"], float(w["optimizers"][w["best_baseline"]]["lr"]))
            for w in summary["workloads"] if w.get("best_baseline")}


def ratios(thor_wall, base_wall, thor_cpu, base_cpu, first_step=1, skip=4):
    """The step ratios of one repeat from per-step times (ms; index ``i`` is step
    ``first_step + i``): THOR's median non-cadence step and mean step over the baseline's median
    and mean, from step ``first_step + skip`` on; CPU the same on means."""
    steps = range(first_step, first_step + len(thor_wall))
    keep = [i for i, s in enumerate(steps) if i >= skip]
    plain = [i for i in keep if steps[i] % FREQUENCY != 0]
    cadence = [i for i in keep if steps[i] % FREQUENCY == 0]
    mean = lambda xs, idx: statistics.fmean(xs[i] for i in idx)
    median = lambda xs, idx: statistics.median(xs[i] for i in idx)
    out = {"thor_noncadence_median_ms": median(thor_wall, plain),
           "thor_cadence_mean_ms": mean(thor_wall, cadence) if cadence else None,
           "thor_mean_ms": mean(thor_wall, keep),
           "base_median_ms": median(base_wall, keep), "base_mean_ms": mean(base_wall, keep),
           "thor_cpu_mean_ms": mean(thor_cpu, keep), "base_cpu_mean_ms": mean(base_cpu, keep)}
    out["noncadence_ratio"] = out["thor_noncadence_median_ms"] / out["base_median_ms"]
    out["amortized_ratio"] = out["thor_mean_ms"] / out["base_mean_ms"]
    out["cpu_amortized_ratio"] = out["thor_cpu_mean_ms"] / out["base_cpu_mean_ms"]
    return out


def one_repeat(name, baseline, rate, steps, seed, quick):
    import keras
    from thor_tf_experiments import suite, workloads

    workload = workloads.WORKLOADS[name]
    data = workload.load(quick)
    order = suite.batch_order(data.num_train, workload.batch_size, workload.epochs, seed,
                              workload.single_pass)
    models = []
    for optimizer, lr in (("thor", 0.0), (baseline, rate)):
        keras.utils.set_random_seed(seed)
        model = suite.compiled_model(optimizer, lr, workload, data, quick, len(order), {})
        model.train_on_batch(data.x_train[order[0]], data.y_train[order[0]])  # tracing
        models.append(model)
    wall, cpu = ([], []), ([], [])
    for i in range(1, steps + 1):
        batch = order[i % len(order)]
        for k in ((0, 1) if (i + seed) % 2 else (1, 0)):
            t0, c0 = time.perf_counter(), time.process_time()
            models[k].train_on_batch(data.x_train[batch], data.y_train[batch])
            wall[k].append((time.perf_counter() - t0) * 1e3)
            cpu[k].append((time.process_time() - c0) * 1e3)
    return ratios(wall[0], wall[1], cpu[0], cpu[1])


def summarize(repeats):
    keys = ("noncadence_ratio", "amortized_ratio", "cpu_amortized_ratio",
            "thor_noncadence_median_ms", "thor_cadence_mean_ms", "base_median_ms")
    out = {}
    for key in keys:
        values = [r[key] for r in repeats if r[key] is not None]
        out[key] = {"median": statistics.median(values),
                    "sd": statistics.stdev(values) if len(values) > 1 else 0.0}
    return out


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for shift, key, label in ((-0.2, "noncadence_ratio", "between cadence points"),
                              (0.2, "amortized_ratio", "cadence points amortized")):
        ax.bar([i + shift for i in x], [results[n]["summary"][key]["median"] for n in names],
               0.4, yerr=[results[n]["summary"][key]["sd"] for n in names], label=label)
    finish_workload_axes(fig, ax, results, "THOR step / best baseline's (wall)", path)


def finish_workload_axes(fig, ax, results, ylabel, path):
    """The workload plots' common end: parity line, one tick per workload of ``results`` (in its
    order, with its baseline), ``ylabel``, legend; saved to ``path``."""
    names = list(results)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([f"{n}\nvs {results[n]['baseline']}" for n in names], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="digits_cnn,tabular_mlp,fashion_cnn,char_gpt,vit,"
                        "resnet20,autoencoder")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=3, help="seeds 0..repeats-1")
    parser.add_argument("--suite", default=str(ROOT / "docs" / "results" / "suite_grid.json"))
    parser.add_argument("--out", default="runs/bench_cadence_share.json")
    parser.add_argument("--quick", action="store_true",
                        help="the tabular MLP, 12 steps, 2 repeats, small data: the harness")
    args = parser.parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    steps, repeats = args.steps, args.repeats
    if args.quick:
        names, steps, repeats = ["tabular_mlp"], 12, 2
    if steps < 6 or repeats < 1:
        parser.error(f"--steps must be >= 6 (the first 4 steps are skipped) and --repeats >= 1; "
                     f"got {steps} and {repeats}")
    if steps < FREQUENCY + 5:
        print(f"note: --steps {steps} reaches at most one cadence point")
    chosen = best_baselines(args.suite)
    unknown = [n for n in names if n not in chosen]
    if unknown:
        parser.error(f"--workloads: unknown {', '.join(unknown)}; allowed: "
                     f"{', '.join(sorted(chosen))}")
    results = {}
    for name in names:
        baseline, rate = chosen[name]
        runs = []
        for seed in range(repeats):
            runs.append(one_repeat(name, baseline, rate, steps, seed, args.quick))
            r = runs[-1]
            print(f"{name} seed {seed}: THOR / {baseline} step {r['noncadence_ratio']:.2f}x "
                  f"between cadence points, {r['amortized_ratio']:.2f}x amortized", flush=True)
        results[name] = {"baseline": baseline, "lr": rate, "repeats": runs,
                         "summary": summarize(runs)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": steps, "repeats": repeats, "frequency": FREQUENCY,
                               "quick": args.quick, "machine": platform.platform(),
                               "cpus": os.cpu_count(), "results": results}, indent=1))
    plot(results, out.with_suffix(".png"))
    for name, r in results.items():
        s = r["summary"]
        print(f"{name:12s} vs {r['baseline']:5s}: between cadence points "
              f"{s['noncadence_ratio']['median']:.2f}x ± {s['noncadence_ratio']['sd']:.2f}, "
              f"amortized {s['amortized_ratio']['median']:.2f}x ± {s['amortized_ratio']['sd']:.2f}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return results


if __name__ == "__main__":
    main()
