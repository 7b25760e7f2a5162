"""What THOR costs over SGD-momentum and Adam: tracing, steady steps, refreshes, amortized steps.

One worker process per (model, optimizer), so that every figure is a fresh process's (tracing and
compiling included, peak memory per optimizer), all in one run of this script on one machine:

* ``first_step_s``: the first ``train_on_batch`` (trace + compile + one step), as a user pays it
  (median over ``--first-step-repeats`` fresh processes);
  ``trace_python_s``: the part of it spent in Python building the graph (the first call of
  ``train_step``); the rest is TensorFlow optimizing and running it;
* ``steady_step_s``: median of later steps that do no curvature work (THOR: no cadence point);
* ``cadence_step_s`` (THOR): median step when every block refreshes (``preset="thor_nt"``,
  ``frequency=1``: factors, traces and inversion at every step);
* ``amortized_step_s`` (THOR): mean step over ``--amortize-steps`` steps with THOR's defaults
  (trace rule, ``frequency=10``);
* ``long_run_step_s`` (CNN, every optimizer): mean step over ``--long-run-steps`` steps on
  Fashion-MNIST after a one-epoch warm-up: the amortized cost of a long ``fit``, where the trace
  rule refreshes rarely (skipped, and said so, without an offline copy of the dataset);
* ``refresh_over_step``: (cadence − steady) / steady: what a refresh of all blocks costs in steps;
* ``peak_rss_mb``: the worker's peak resident memory;
* ``time_to_target``: THOR's wall time to the best first-order baseline's final accuracy over the
  baseline's, from the main job's record (``docs/results/main_job_fashion.json``: whole
  training runs, not re-run here); ``goals``: issue 12's table, each
  row with the measured figure and whether it meets its goal.

Ratios against SGD and Adam come from the same run. Inputs are random (timing does not depend on
the data). Writes JSON (``--out``) and a PNG of the ratios next to it.

    python scripts/bench_overhead.py --out docs/results/bench_overhead.json
    python scripts/bench_overhead.py --models cnn --quick      # seconds, a smoke test
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

from experiments.timing import train_step_seconds
from experiments.worker import report, run_self, write_results

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODELS = {
    # name: (input shape, classes, batch size)
    "cnn": ((28, 28, 1), 10, 128),
    "resnet20": ((32, 32, 1), 10, 128),
    "resnet50": ((32, 32, 3), 10, 32),
}
OPTIMIZERS = ("sgd", "adam", "muon", "thor", "thor_inverse")  # muon: when this Keras has it (>= 3.10)
#: thor: thor_tf's default update rule (eigenbasis); thor_inverse: update_rule="inverse".


def build(model_name):
    import keras

    shape, classes, _ = MODELS[model_name]
    if model_name == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=shape, classes=classes)
    from experiments import models

    return models.build(model_name, shape, classes)


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _compiled(model_name, optimizer, seed=0, **thor_options):
    import keras
    import thor_tf

    keras.utils.set_random_seed(seed)
    model = build(model_name)
    loss = "sparse_categorical_crossentropy"
    if optimizer == "sgd":
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss=loss)
        return model
    if optimizer == "adam":
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
        return model
    if optimizer == "muon":
        # As the experiments run it: the output layer on Muon's AdamW step.
        model.compile(optimizer=keras.optimizers.Muon(3e-3, exclude_layers=["predictions"]),
                      loss=loss)
        return model
    if optimizer == "thor_inverse":
        thor_options = dict(thor_options, update_rule="inverse")
    wrapped = thor_tf.wrap(model, learning_rate=0.01, verbose=False, **thor_options)
    wrapped.compile(loss=loss)
    return wrapped


def worker(model_name, optimizer, steps, amortize_steps, long_run_steps=0, first_only=False):
    """Measure one (model, optimizer) in this process; returns a dict (``first_only``: the first
    step and its Python tracing only, for the repeats of that figure)."""
    import numpy as np

    shape, classes, batch = MODELS[model_name]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, *shape)).astype("float32")
    y = rng.integers(0, classes, size=batch)
    out = {"model": model_name, "optimizer": optimizer, "batch": batch}
    # THOR: a cadence point at step 0 only, so later steps are plain preconditioned steps.
    options = {"frequency": 10 ** 9} if optimizer.startswith("thor") else {}
    model = _compiled(model_name, optimizer, **options)
    traced = train_step_seconds(model)
    out["first_step_s"] = _timed(lambda: model.train_on_batch(x, y))
    out["trace_python_s"] = traced[0] if traced else None
    if first_only:
        return out
    times = [_timed(lambda: model.train_on_batch(x, y)) for _ in range(steps)]
    out["steady_step_s"] = statistics.median(times[1:])
    if optimizer.startswith("thor"):
        out["blocks"] = len(model.thor.blocks)
        cadence = _compiled(model_name, optimizer, preset="thor_nt", frequency=1)
        cadence.train_on_batch(x, y)
        times = [_timed(lambda: cadence.train_on_batch(x, y)) for _ in range(steps)]
        out["cadence_step_s"] = statistics.median(times[1:])
        out["refresh_over_step"] = (out["cadence_step_s"] - out["steady_step_s"]) / out["steady_step_s"]
        default = _compiled(model_name, optimizer)
        default.train_on_batch(x, y)
        # Fresh random batches: the trace rule sees batch-to-batch variation as in training.
        batches = [(rng.normal(size=x.shape).astype("float32"), rng.integers(0, classes, size=batch))
                   for _ in range(8)]
        times = [_timed(lambda b=batches[i % 8]: default.train_on_batch(*b))
                 for i in range(amortize_steps)]
        out["amortized_step_s"] = statistics.fmean(times)
        stats = default.thor.layer_stats()
        out["amortized_refreshes"] = sum(s["refreshes"] for s in stats) - len(stats)  # after step 0
        out["amortized_cadence_points"] = default.thor.counters()["cadence_points"] - 1
    if long_run_steps and model_name in LONG_RUN_DATA:
        out.update(long_run(model_name, optimizer, long_run_steps))
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return out


#: Models whose long-run step is measured on real data (the dataset the README run trains on).
LONG_RUN_DATA = {"cnn": "fashion_mnist"}


def long_run(model_name, optimizer, steps):
    """The step cost of a long run: train on the real dataset (shuffled batches, as ``fit``
    does) for one epoch as a warm-up, then time ``steps`` more steps (mean, cadence points and
    refreshes included, with THOR's defaults). Where early training is over, the trace rule
    refreshes rarely, so this is the amortized cost a long ``fit`` pays; the 60-step window
    above is dominated by the first cadence points' refreshes. Needs the dataset offline."""
    import numpy as np

    from experiments.datasets import load_dataset

    try:
        data = load_dataset(LONG_RUN_DATA[model_name], verbose=False, download=False)
    except Exception as error:  # no offline copy: say so in the JSON instead of failing the run
        return {"long_run_skipped": f"{type(error).__name__}: {error}"}
    batch = MODELS[model_name][2]
    model = _compiled(model_name, optimizer)
    rng = np.random.default_rng(1)
    order = rng.permutation(len(data.x_train))
    warmup = len(order) // batch

    def batch_at(k):
        idx = order[(k % warmup) * batch:(k % warmup + 1) * batch]
        return data.x_train[idx], data.y_train[idx]

    for k in range(warmup):
        model.train_on_batch(*batch_at(k))
    before = model.thor.counters()["cadence_points"] if optimizer.startswith("thor") else 0
    refreshes = (sum(s["refreshes"] for s in model.thor.layer_stats()) if optimizer.startswith("thor")
                 else 0)
    start = time.perf_counter()
    for k in range(warmup, warmup + steps):
        model.train_on_batch(*batch_at(k))
    out = {"long_run_step_s": (time.perf_counter() - start) / steps, "long_run_steps": steps,
           "long_run_warmup_steps": warmup}
    if optimizer.startswith("thor"):
        out["long_run_cadence_points"] = model.thor.counters()["cadence_points"] - before
        out["long_run_refreshes"] = sum(s["refreshes"] for s in model.thor.layer_stats()) - refreshes
    return out


def run_worker(args, model_name, optimizer, first_only=False):
    return run_self(__file__, ["--worker", model_name, optimizer, "--steps", args.steps,
                               "--amortize-steps", args.amortize_steps,
                               "--long-run-steps", args.long_run_steps]
                    + (["--first-only"] if first_only else []), timeout=args.timeout)


def measure(args, model_name, optimizer):
    """One full worker, plus ``--first-step-repeats − 1`` fresh processes measuring the first
    step only: the first step and its Python tracing are the medians over all of them (a
    single fresh process varies by ±20 % on a shared machine)."""
    result = run_worker(args, model_name, optimizer)
    runs = [result] + [run_worker(args, model_name, optimizer, first_only=True)
                       for _ in range(args.first_step_repeats - 1)]
    for key in ("first_step_s", "trace_python_s"):
        values = [r[key] for r in runs if r.get(key) is not None]
        result[key + "_runs"] = values
        result[key] = statistics.median(values) if values else None
    return result


def ratios(results):
    """Per model (and per THOR rule: ``model`` for the default rule, ``model/thor_inverse`` for
    the inverse rule): THOR's figures over SGD's and Adam's (same run)."""
    table = {}
    for model_name, variant in sorted({(r["model"], o) for r in results
                                       for o in ("thor", "thor_inverse")}):
        by_opt = {r["optimizer"]: r for r in results if r["model"] == model_name}
        thor = by_opt.get(variant)
        if thor is None:
            continue
        row = {}
        for base in ("sgd", "adam", "muon"):
            if base not in by_opt:
                continue
            ref = by_opt[base]
            row[f"first_step_vs_{base}"] = thor["first_step_s"] / ref["first_step_s"]
            if thor.get("trace_python_s") and ref.get("trace_python_s"):
                row[f"trace_python_vs_{base}"] = thor["trace_python_s"] / ref["trace_python_s"]
            row[f"steady_step_vs_{base}"] = thor["steady_step_s"] / ref["steady_step_s"]
            row[f"amortized_step_vs_{base}"] = thor["amortized_step_s"] / ref["steady_step_s"]
            row[f"peak_rss_vs_{base}"] = thor["peak_rss_mb"] / ref["peak_rss_mb"]
            if thor.get("long_run_step_s") and ref.get("long_run_step_s"):
                row[f"long_run_step_vs_{base}"] = thor["long_run_step_s"] / ref["long_run_step_s"]
        row["refresh_over_step"] = thor["refresh_over_step"]
        table[model_name if variant == "thor" else f"{model_name}/{variant}"] = row
    return table


#: The summary of the main job (experiments/mnist.py) whose wall time to the best first-order
#: baseline's final accuracy issue 12 tracks (ResNet-20's row is the suite's,
#: docs/results/suite.json).
TIME_TO_TARGET = {"cnn": "docs/results/main_job_fashion.json"}


def time_to_target(paths):
    """Per model: THOR's seconds to the target (the best first-order baseline's median final
    accuracy) over that baseline's own, from the main job's record (``main_job.json``: whole
    training runs, minutes each, measured by ``experiments/mnist.py``, reported here; None when
    their loads made the seconds not comparable)."""
    import json

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = {}
    for model_name, path in paths.items():
        path = os.path.join(root, path)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            record = json.load(f)
        summary = record["workload"]
        runs, baseline = summary["optimizers"], summary["best_baseline"]
        out[model_name] = {
            "source": os.path.relpath(path, root), "date": record.get("date"),
            "target": summary["target"], "seeds": len(record["seeds"]), "baseline": baseline,
            "thor_s": runs["thor"]["median_seconds"], "baseline_s": runs[baseline]["median_seconds"],
            "ratio": summary.get("seconds_ratio"),
        }
    return out


#: Issue 12's table: (measure, model, key in the ratios or "time_to_target", goal: at most).
GOALS = [
    ("first step (trace + compile), ResNet-50 at 32x32, THOR / SGD", "resnet50",
     "first_step_vs_sgd", 2.0),
    ("first step (trace + compile), ResNet-20, THOR / SGD", "resnet20", "first_step_vs_sgd", 2.0),
    ("amortized step, Fashion CNN batch 128, THOR / SGD steady step (first 60 steps)", "cnn",
     "amortized_step_vs_sgd", 1.10),
    ("amortized step of a long run, Fashion CNN batch 128, THOR / SGD (after one epoch)", "cnn",
     "long_run_step_vs_sgd", 1.10),
    ("refresh of all CNN blocks, in steady steps", "cnn", "refresh_over_step", 2.5),
    ("ResNet-20 wall time to the baseline's final accuracy, THOR / baseline", "resnet20",
     "time_to_target", 0.75),
    ("Fashion CNN wall time to the baseline's final accuracy, THOR / baseline", "cnn",
     "time_to_target", 0.70),
]


def goals(table, targets):
    """Issue 12's rows with the measured figure and whether it meets the goal (None: not
    measured in this run, or the target was never reached)."""
    rows = []
    for measure, model_name, key, goal in GOALS:
        if key == "time_to_target":
            value = targets.get(model_name, {}).get("ratio")
        else:
            value = table.get(model_name, {}).get(key)
        rows.append({"measure": measure, "value": value, "goal_at_most": goal,
                     "met": None if value is None else value <= goal})
    return rows


def plot(table, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["first_step_vs_sgd", "steady_step_vs_sgd", "amortized_step_vs_sgd", "peak_rss_vs_sgd"]
    names = sorted(table)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(keys)
    for k, key in enumerate(keys):
        ax.bar([i + k * width for i in range(len(names))], [table[n].get(key, 0) for n in names],
               width, label=key.replace("_vs_sgd", ""))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.set_ylabel("THOR / SGD-momentum")
    ax.set_title("THOR's overhead against SGD-momentum (same run)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="cnn,resnet20,resnet50")
    p.add_argument("--optimizers", default=",".join(
        o for o in OPTIMIZERS if o != "muon" or hasattr(__import__("keras").optimizers, "Muon")))
    p.add_argument("--steps", type=int, default=12, help="timed steps per measure (median)")
    p.add_argument("--amortize-steps", type=int, default=60,
                   help="steps of the amortized THOR measure (mean)")
    p.add_argument("--long-run-steps", type=int, default=300,
                   help="steps timed after a one-epoch warm-up on the real dataset (models in "
                        "LONG_RUN_DATA; 0: skip)")
    p.add_argument("--first-step-repeats", type=int, default=3,
                   help="fresh processes per (model, optimizer) whose first step is timed; the "
                        "median is reported")
    p.add_argument("--first-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="few steps, for a smoke test")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per worker")
    p.add_argument("--out", default="runs/bench_overhead.json")
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "OPTIMIZER"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.amortize_steps, args.long_run_steps, args.first_step_repeats = 4, 12, 0, 1
    if args.worker:
        report(worker(*args.worker, args.steps, args.amortize_steps, args.long_run_steps,
                      args.first_only))
        return

    results = []
    for model_name in args.models.split(","):
        for optimizer in args.optimizers.split(","):
            result = measure(args, model_name, optimizer)
            results.append(result)
            print(f"{model_name:9s} {optimizer:5s} first {result['first_step_s']:7.2f}s (python "
                  f"{result['trace_python_s'] or float('nan'):6.2f}s)  steady "
                  f"{result['steady_step_s'] * 1e3:8.1f}ms"
                  + (f"  cadence {result['cadence_step_s'] * 1e3:8.1f}ms  amortized "
                     f"{result['amortized_step_s'] * 1e3:8.1f}ms" if optimizer.startswith("thor") else "")
                  + (f"  long run {result['long_run_step_s'] * 1e3:8.1f}ms"
                     if "long_run_step_s" in result else "")
                  + f"  peak {result['peak_rss_mb']:7.0f} MB", flush=True)
    table = ratios(results)
    for model_name, row in sorted(table.items()):
        print(model_name + ": " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(row.items())))
    targets = time_to_target(TIME_TO_TARGET)
    rows = goals(table, targets)
    for row in rows:
        value = "not measured" if row["value"] is None else f"{row['value']:.2f}"
        verdict = {True: "met", False: "missed", None: "-"}[row["met"]]
        print(f"{row['measure']}: {value} (goal <= {row['goal_at_most']}: {verdict})")
    summary = {
        "results": results, "ratios": table, "time_to_target": targets, "goals": rows,
        "settings": {"steps": args.steps, "amortize_steps": args.amortize_steps,
                     "first_step_repeats": args.first_step_repeats,
                     "long_run_steps": args.long_run_steps,
                     "batches": {m: MODELS[m][2] for m in MODELS}},
    }
    write_results(args.out, summary, __file__, argv, plot, table)


if __name__ == "__main__":
    main()
