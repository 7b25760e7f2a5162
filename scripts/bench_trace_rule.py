"""Benchmark the trace rule: refreshes saved against accuracy, per setting, over seeds.

Settings (all with the same data, budget and seeds):

* ``thor_nt``: refresh every layer at every cadence point (frequency 10);
* ``published_0.01`` / ``_0.03`` / ``_0.1``: THOR's rule as published (``trace_filter="none"``:
  the current batch's traces, immediate freeze) with ω1 = 0.01, 0.03, 0.1 and ω2 = 0;
* ``thor`` / ``thor_stop``: the filtered rule (``trace_filter="mean"``, the default) with the
  presets' (ω1, ω2) = (0.01, 0) and (0.01, 0.001);
* ``thor_adaptive``: ``thor`` with ``frequency="adaptive"`` (base 10, cap 80) instead of 10.

Per run: refreshes per layer and in total, cadence points, factor + inverse seconds, final test
accuracy, wall time. Factor + inverse seconds (the factors and the update rule's refresh from
them: its inverses or bases): the train step fuses everything, so the cost of one
refresh of each layer is measured apart once per model (``thor_tf.profiling.profile_step``, median
of repeats on one batch, after the first run) and multiplied by that layer's refreshes; the cheap
trace checks are counted at every cadence point where the layer was not frozen.

Writes ``<out>.json`` after every run (partial results survive an interrupted grid) and
``<out>.png`` (total refreshes against test accuracy, mean ± sd over seeds, one point per setting).

    python scripts/bench_trace_rule.py --model cnn --seeds 0,1,2 --out docs/results/bench_trace_rule_cnn.json
    python scripts/bench_trace_rule.py --model resnet20 --max-train 8192 --max-test 2000 \\
        --seeds 0,1,2 --out docs/results/bench_trace_rule_resnet20.json
    python scripts/bench_trace_rule.py --quick            # seconds, for a smoke test
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import thor_tf  # noqa: E402
from experiments import datasets as data, models as zoo, record  # noqa: E402
from thor_tf.callbacks import TraceRuleLogger  # noqa: E402
from thor_tf.profiling import profile_step  # noqa: E402
from thor_tf.schedules import ThorDampingDecay, ThorPolynomialDecay  # noqa: E402

# The rule alone (max_block_age=None), as docs/trace_rule.md's tables were measured; "thor_age50"
# is the library's default since issue 18 (a block refreshed at least every 50 steps).
SETTINGS = {
    "thor_nt": dict(preset="thor_nt", frequency=10),
    "thor": dict(preset="thor", trace_filter="mean", frequency=10, max_block_age=None),
    "thor_age50": dict(preset="thor", trace_filter="mean", frequency=10, max_block_age=50),
    "thor_stop": dict(preset="thor_stop", trace_filter="mean", frequency=10, max_block_age=None),
    "thor_adaptive": dict(preset="thor", trace_filter="mean", frequency="adaptive",
                          max_block_age=None),
    "published_0.01": dict(preset="thor", omega1=0.01, trace_filter="none", frequency=10,
                           max_block_age=None),
    "published_0.03": dict(preset="thor", omega1=0.03, trace_filter="none", frequency=10,
                           max_block_age=None),
    "published_0.1": dict(preset="thor", omega1=0.1, trace_filter="none", frequency=10,
                          max_block_age=None),
}
TARGETS = {
    "thor": "thor: >= 60 % fewer refreshes than thor_nt, mean accuracy within 0.3 points",
    "thor_stop": "thor_stop: >= 80 % fewer refreshes than thor_nt, within 0.5 points",
    "thor_adaptive": "adaptive: >= 50 % fewer cadence points than frequency 10 (thor), within 0.3 points",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cnn", choices=["cnn", "resnet20"])
    p.add_argument("--dataset", default="fashion_mnist", choices=["auto", "fashion_mnist", "mnist", "digits"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--max-train", type=int, default=None)
    p.add_argument("--max-test", type=int, default=None)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset of " + ", ".join(SETTINGS))
    p.add_argument("--out", default="runs/bench_trace_rule.json")
    p.add_argument("--quick", action="store_true", help="digits, 1 epoch, one seed: a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.dataset, args.epochs, args.seeds = "digits", 1, "0"
        args.max_train = args.max_train or 512
    for name in args.settings.split(","):
        if name not in SETTINGS:
            p.error(f"--settings: unknown {name!r}; choose from {', '.join(SETTINGS)}")
    return args


def optimizer_options(args, steps_per_epoch):
    """CNN: constant lr 0.05, λ 0.03, KL clip 0.001 (the library defaults but lr). ResNet-20: the
    README's run (THOR's polynomial lr from 0.2 and damping decay from 0.03 scaled to the run, KL
    clip off)."""
    if args.model == "cnn":
        return dict(learning_rate=0.05, damping=0.03)
    epochs = args.epochs
    return dict(
        learning_rate=ThorPolynomialDecay(0.2, 1.25 * epochs, 4.9687, steps_per_epoch),
        damping=ThorDampingDecay(0.03, (0.5467 ** 4) ** (10.0 / epochs), steps_per_epoch),
        kl_clip=None)


def run_one(setting, seed, ds, args, costs):
    steps_per_epoch = -(-len(ds.x_train) // args.batch_size)
    keras.utils.set_random_seed(seed)
    model = zoo.build(args.model, ds.input_shape, ds.num_classes)
    options = dict(SETTINGS[setting], **optimizer_options(args, steps_per_epoch))
    wrapped = thor_tf.wrap(model, verbose=False, **options)
    wrapped.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    logger = TraceRuleLogger(summary=False)
    keras.utils.set_random_seed(seed + 1000)
    start = time.perf_counter()
    wrapped.fit(ds.x_train, ds.y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=0,
                callbacks=[logger])
    wall = time.perf_counter() - start
    _, accuracy = wrapped.evaluate(ds.x_test, ds.y_test, verbose=0, batch_size=512)
    if not costs:
        profile = profile_step(wrapped, ds.x_train[:args.batch_size], ds.y_train[:args.batch_size],
                               repeats=3 if args.quick else 5)
        costs.update(profile["layers"])
    stats = wrapped.thor.layer_stats()
    layers, seconds_total = {}, 0.0
    for s in stats:
        cost = costs[s["name"]]
        evaluated = sum(1 for r in logger.rows if r["layer"] == s["name"] and r["decision"] != "frozen")
        seconds = s["refreshes"] * (cost["factors"] + cost["refresh"]) + evaluated * cost["traces"]
        seconds_total += seconds
        layers[s["name"]] = {"refreshes": s["refreshes"], "reuses": s["reuses"],
                             "frozen_at_step": s["frozen_at_step"] if s["frozen"] else None,
                             "factor_inverse_seconds": seconds}
    counters = wrapped.thor.counters()
    result = {
        "setting": setting, "seed": seed, "test_accuracy": float(accuracy), "wall_seconds": wall,
        "steps": int(wrapped.optimizer.iterations.numpy()),
        "cadence_points": counters["cadence_points"],
        "refreshes_total": int(sum(s["refreshes"] for s in stats)),
        "factor_inverse_seconds": seconds_total, "layers": layers,
    }
    print(f"[{setting} seed {seed}] acc {100 * accuracy:.2f}%  refreshes {result['refreshes_total']}  "
          f"cadence points {result['cadence_points']}  factor+inv {seconds_total:.2f}s  "
          f"wall {wall:.0f}s  per layer {[l['refreshes'] for l in layers.values()]}", flush=True)
    return result


def mean_sd(values):
    values = np.asarray(values, np.float64)
    return [float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else 0.0]


def summarize(runs):
    """Per setting: mean ± sd (over seeds) of every reported quantity, and per layer refreshes."""
    summary = {}
    for setting in dict.fromkeys(r["setting"] for r in runs):
        rs = [r for r in runs if r["setting"] == setting]
        names = list(rs[0]["layers"])
        summary[setting] = {
            "seeds": [r["seed"] for r in rs],
            "test_accuracy": mean_sd([r["test_accuracy"] for r in rs]),
            "refreshes_total": mean_sd([r["refreshes_total"] for r in rs]),
            "cadence_points": mean_sd([r["cadence_points"] for r in rs]),
            "factor_inverse_seconds": mean_sd([r["factor_inverse_seconds"] for r in rs]),
            "wall_seconds": mean_sd([r["wall_seconds"] for r in rs]),
            "refreshes_per_layer": {n: mean_sd([r["layers"][n]["refreshes"] for r in rs]) for n in names},
        }
    return summary


def targets(summary):
    out = {}
    nt, thor = summary.get("thor_nt"), summary.get("thor")

    def check(name, base, key, reduction, points):
        s = summary.get(name)
        if s is None or base is None:
            return
        red = 1.0 - s[key][0] / max(base[key][0], 1e-12)
        dacc = 100.0 * (s["test_accuracy"][0] - base["test_accuracy"][0])
        out[name] = {"target": TARGETS[name], "reduction": red, "accuracy_points": dacc,
                     "met": bool(red >= reduction and dacc >= -points)}

    check("thor", nt, "refreshes_total", 0.60, 0.3)
    check("thor_stop", nt, "refreshes_total", 0.80, 0.5)
    check("thor_adaptive", thor, "cadence_points", 0.50, 0.3)
    for name in ("published_0.01", "published_0.03", "published_0.1"):
        s = summary.get(name)
        if s is not None and nt is not None:
            out[name] = {"reduction": 1.0 - s["refreshes_total"][0] / max(nt["refreshes_total"][0], 1e-12),
                         "accuracy_points": 100.0 * (s["test_accuracy"][0] - nt["test_accuracy"][0])}
    return out


def plot(summary, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, s in summary.items():
        (x, xe), (y, ye) = s["refreshes_total"], s["test_accuracy"]
        marker = "s" if name.startswith("published") else ("D" if name == "thor_nt" else "o")
        ax.errorbar(x, 100 * y, xerr=xe, yerr=100 * ye, fmt=marker, capsize=3, label=name)
    ax.set_xlabel("block refreshes (all layers), mean ± sd over seeds")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    pad_to = 32 if args.model == "resnet20" else None
    ds = data.load_dataset(args.dataset, max_train=args.max_train, max_test=args.max_test,
                           pad_to=pad_to, verbose=False, seed=0)
    seeds = [int(s) for s in args.seeds.split(",")]
    settings = args.settings.split(",")
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    png = os.path.splitext(out)[0] + ".png"
    runs, costs = [], {}
    report = {}
    for seed in seeds:  # seed-major: a partial grid still has every setting
        for setting in settings:
            runs.append(run_one(setting, seed, ds, args, costs))
            summary = summarize(runs)
            report = {
                "args": vars(args), "dataset": ds.name, "train_examples": int(len(ds.x_train)),
                "test_examples": int(len(ds.x_test)), "tensorflow": tf.__version__,
                "settings": {k: {kk: str(vv) for kk, vv in SETTINGS[k].items()} for k in settings},
                "complete": len(runs) == len(seeds) * len(settings),
                "refresh_costs": costs, "summary": summary, "targets": targets(summary),
                "runs": runs,
            }
            record.write(out, report, argv=argv, script=__file__)  # after every run
    plot(report["summary"], png, f"{args.model} on {ds.name} ({len(ds.x_train)} train, "
         f"{args.epochs} epochs, batch {args.batch_size}), seeds {args.seeds}")
    print("\nsetting          refreshes          cadence pts     test acc (%)      factor+inv s")
    for name, s in report["summary"].items():
        print(f"{name:<16} {s['refreshes_total'][0]:>7.1f} ± {s['refreshes_total'][1]:<6.1f}  "
              f"{s['cadence_points'][0]:>6.1f} ± {s['cadence_points'][1]:<5.1f}  "
              f"{100 * s['test_accuracy'][0]:>6.2f} ± {100 * s['test_accuracy'][1]:<5.2f}  "
              f"{s['factor_inverse_seconds'][0]:>7.2f} ± {s['factor_inverse_seconds'][1]:.2f}")
    for name, t in report["targets"].items():
        print(name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in t.items()})
    print(f"wrote {out} and {png}")
    return report


if __name__ == "__main__":
    main()
