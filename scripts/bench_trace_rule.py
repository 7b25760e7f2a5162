"""Benchmark the trace rule: thor, thor_stop and thor_nt on the MNIST-family CNN in one run.

Same seed, data and budget for the three presets. Reports per layer the refreshes / reuses /
freezes, the factor + inverse time they cost, wall time and final test accuracy; writes JSON and a
PNG of the per-layer decisions over time (one row per layer, one panel per preset).

Factor + inverse time: the train step fuses everything, so the cost of one refresh of each layer
is measured apart (``thor_tf.profiling.profile_step``, median of repeats on one batch) and
multiplied by the number of refreshes of that layer; the cheap trace checks are counted the same
way at every cadence point where the layer was not frozen.

    python scripts/bench_trace_rule.py --out runs/bench_trace_rule.json
    python scripts/bench_trace_rule.py --quick            # seconds, for a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import thor_tf  # noqa: E402
from thor_tf_experiments import datasets as data, models as zoo  # noqa: E402
from thor_tf.callbacks import TraceRuleLogger, summary_table  # noqa: E402
from thor_tf.profiling import profile_step  # noqa: E402

PRESETS = ("thor", "thor_stop", "thor_nt")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="auto", choices=["auto", "fashion_mnist", "mnist", "digits"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--max-train", type=int, default=None)
    p.add_argument("--max-test", type=int, default=None)
    p.add_argument("--frequency", type=int, default=10, help="cadence interval in steps")
    p.add_argument("--learning-rate", type=float, default=0.05)
    p.add_argument("--damping", type=float, default=0.03)
    p.add_argument("--trace-smoothing", type=float, default=0.9,
                   help="running estimate of the traces for Δ (the library default 0.9; 0: THOR's "
                        "rule as published)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/bench_trace_rule.json")
    p.add_argument("--quick", action="store_true", help="digits, 1 epoch: a smoke test in seconds")
    return p.parse_args(argv)


def run_preset(preset, ds, args):
    keras.utils.set_random_seed(args.seed)
    model = zoo.build("cnn", ds.input_shape, ds.num_classes)
    wrapped = thor_tf.wrap(model, preset=preset, frequency=args.frequency,
                           learning_rate=args.learning_rate, damping=args.damping,
                           trace_smoothing=args.trace_smoothing, verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    logger = TraceRuleLogger(summary=False)
    keras.utils.set_random_seed(args.seed + 1)
    start = time.perf_counter()
    wrapped.fit(ds.x_train, ds.y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=2,
                callbacks=[logger])
    wall = time.perf_counter() - start
    _, accuracy = wrapped.evaluate(ds.x_test, ds.y_test, verbose=0, batch_size=512)
    profile = profile_step(wrapped, ds.x_train[:args.batch_size], ds.y_train[:args.batch_size],
                           repeats=3 if args.quick else 7)
    stats = wrapped.thor.layer_stats()
    layers = {}
    factor_inverse_seconds = 0.0
    for s in stats:
        cost = profile["layers"][s["name"]]
        evaluated = sum(1 for r in logger.rows if r["layer"] == s["name"] and r["decision"] != "frozen")
        seconds = s["refreshes"] * (cost["factors"] + cost["inverse"]) + evaluated * cost["traces"]
        factor_inverse_seconds += seconds
        layers[s["name"]] = {
            "a_dim": s["a_dim"], "g_dim": s["g_dim"], "refreshes": s["refreshes"],
            "reuses": s["reuses"], "frozen": s["frozen"], "frozen_at_step": s["frozen_at_step"],
            "refresh_seconds": cost["factors"] + cost["inverse"], "trace_seconds": cost["traces"],
            "factor_inverse_seconds_total": seconds,
        }
    print(f"\n[{preset}] test accuracy {accuracy:.4f}, wall {wall:.1f}s")
    print(summary_table(stats))
    return {
        "test_accuracy": float(accuracy), "wall_seconds": wall,
        "steps": int(wrapped.optimizer.iterations.numpy()),
        "cadence_points": wrapped.thor.counters()["cadence_points"],
        "refreshes_total": sum(s["refreshes"] for s in stats),
        "factor_inverse_seconds": factor_inverse_seconds,
        "step_profile": profile, "layers": layers, "timeline": logger.rows,
    }


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {"refresh": "#d62728", "reuse": "#1f77b4", "freeze": "#2ca02c", "frozen": "#cfcfcf"}
    names = list(next(iter(results.values()))["layers"])
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 1.1 + 0.55 * len(names) * len(results)),
                             sharex=True, squeeze=False)
    for ax, (preset, res) in zip(axes[:, 0], results.items()):
        for row, name in enumerate(names):
            points = [r for r in res["timeline"] if r["layer"] == name]
            ax.scatter([r["step"] for r in points], [row] * len(points), marker="s", s=14,
                       c=[colors[r["decision"]] for r in points], linewidths=0)
        ax.set_yticks(range(len(names)), names)
        ax.set_ylim(-0.7, len(names) - 0.3)
        ax.set_title(f"{preset}: {res['refreshes_total']} refreshes, "
                     f"test acc {100 * res['test_accuracy']:.2f}%", fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("training step (cadence points)")
    fig.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], loc="upper right",
               ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if args.quick:
        args.dataset, args.epochs = "digits", 1
        args.max_train = args.max_train or 512
    ds = data.load_dataset(args.dataset, max_train=args.max_train, max_test=args.max_test)
    results = {preset: run_preset(preset, ds, args) for preset in PRESETS}
    nt = results["thor_nt"]
    comparison = {
        preset: {
            "refresh_reduction_vs_thor_nt": 1.0 - res["refreshes_total"] / max(nt["refreshes_total"], 1),
            "accuracy_points_vs_thor_nt": 100.0 * (res["test_accuracy"] - nt["test_accuracy"]),
            "factor_inverse_time_ratio_vs_thor_nt": res["factor_inverse_seconds"] / max(nt["factor_inverse_seconds"], 1e-12),
            "wall_time_ratio_vs_thor_nt": res["wall_seconds"] / nt["wall_seconds"],
        }
        for preset, res in results.items()
    }
    report = {
        "args": vars(args), "dataset": ds.name, "dataset_source": ds.source,
        "date": time.strftime("%Y-%m-%d"), "device": platform.processor() or platform.machine(),
        "tensorflow": tf.__version__, "target": "thor: >= 60% fewer refreshes than thor_nt, accuracy within 0.3 points",
        "comparison": comparison, "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(results, png)
    print("\npreset      refreshes  reduction  test acc  Δacc(pts)  factor+inv s  wall s")
    for preset, res in results.items():
        c = comparison[preset]
        print(f"{preset:<11} {res['refreshes_total']:>9}  {100 * c['refresh_reduction_vs_thor_nt']:>8.1f}%"
              f"  {100 * res['test_accuracy']:>7.2f}%  {c['accuracy_points_vs_thor_nt']:>+9.2f}"
              f"  {res['factor_inverse_seconds']:>12.2f}  {res['wall_seconds']:>6.1f}")
    print(f"wrote {args.out} and {png}")
    return report


if __name__ == "__main__":
    main()
