"""The steady step of keras.applications' ResNet-50: THOR against SGD, Adam and Muon.

At 32x32 inputs (batch 32, 10 classes, random data) the model's own work is small, so the
optimizers' differ most: THOR's step is mostly the orthogonalization of its convolutions' steps,
which Keras' Muon does not do (it gives every variable that is not 2-D to its AdamW). The
variants:

* ``sgd`` (momentum 0.9), ``adam``, ``muon`` (Keras >= 3.10): the first-order references;
* ``thor``: ``thor_tf.wrap`` at its defaults;
* ``thor_conv_adam``: THOR with ``Eigenbasis(adam_kinds=("conv2d",))``: the convolutions keep
  the Adam step in their eigenbases, only the dense head is orthogonalized.

All in one process, one model per variant in turn, in an order that rotates over ``--repeats``
(a slow spell of a shared machine hits each alike). Per variant and repeat: ``--warmup`` steps
(tracing, the first refreshes), then ``--steps`` timed ``train_on_batch`` calls (wall and this
process's CPU time, all threads); the median step is the steady one. Writes ``--out`` (JSON):
per variant the median over repeats and its ratios to SGD, Adam and Muon.

    python scripts/bench_resnet50_step.py --out docs/results/bench_resnet50_step.json   # ~5 min
    python scripts/bench_resnet50_step.py --quick    # a small CNN, 2 steps: the harness only
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from experiments import record  # noqa: E402
from experiments.worker import thor_defaults  # noqa: E402

VARIANTS = ("sgd", "adam", "muon", "thor", "thor_conv_adam")
REFERENCES = ("sgd", "adam", "muon")


def build(quick):
    """ResNet-50 at 32x32x3 with 10 classes (``quick``: a two-convolution CNN of that input)."""
    import keras

    if quick:
        return keras.Sequential([
            keras.Input((32, 32, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.MaxPooling2D(4), keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.Flatten(), keras.layers.Dense(10)])
    return keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)


def compiled(variant, quick):
    """A fresh model compiled with ``variant``'s optimizer (same initial weights for all)."""
    import keras

    import thor_tf

    keras.utils.set_random_seed(0)
    model = build(quick)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=quick)
    if variant.startswith("thor"):
        options = {}
        if variant == "thor_conv_adam":
            options["update_rule"] = thor_tf.rules.Eigenbasis(adam_kinds=("conv2d",))
        model = thor_tf.wrap(model, learning_rate=0.01, verbose=False, **options)
        model.compile(loss=loss)
        return model
    optimizer = {"sgd": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
                 "adam": lambda: keras.optimizers.Adam(1e-3),
                 "muon": lambda: keras.optimizers.Muon(1e-3)}[variant]()
    model.compile(optimizer=optimizer, loss=loss)
    return model


def time_steps(model, x, y, warmup, steps):
    """``(wall ms, CPU ms)``: the medians of ``steps`` timed steps after ``warmup`` untimed."""
    for _ in range(warmup):
        model.train_on_batch(x, y)
    wall, cpu = [], []
    for _ in range(steps):
        c, t = time.process_time(), time.perf_counter()
        model.train_on_batch(x, y)
        cpu.append(1e3 * (time.process_time() - c))
        wall.append(1e3 * (time.perf_counter() - t))
    return statistics.median(wall), statistics.median(cpu)


def summarize(runs, variants):
    """Per variant: median wall and CPU ms over its repeats, and their ratios to each reference
    that ran (``cpu_vs_sgd``, ``wall_vs_muon``, ...)."""
    medians = {}
    for v in variants:
        mine = [r for r in runs if r["variant"] == v]
        medians[v] = {"wall_ms": statistics.median(r["wall_ms"] for r in mine),
                      "cpu_ms": statistics.median(r["cpu_ms"] for r in mine)}
    for v in variants:
        for ref in REFERENCES:
            if ref in medians:
                for kind in ("wall", "cpu"):
                    medians[v][f"{kind}_vs_{ref}"] = round(
                        medians[v][f"{kind}_ms"] / medians[ref][f"{kind}_ms"], 3)
    return medians


def available(variants):
    """``variants`` without ``muon`` where this Keras has no Muon (< 3.10)."""
    import keras

    return [v for v in variants if v != "muon" or hasattr(keras.optimizers, "Muon")]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="docs/results/bench_resnet50_step.json")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; allowed: {list(VARIANTS)}")
    variants = available(variants)
    if args.quick:
        args.repeats, args.warmup, args.steps = 1, 1, 2

    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=32)
    runs = []
    for repeat in range(args.repeats):
        shift = repeat % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            wall, cpu = time_steps(compiled(variant, args.quick), x, y, args.warmup, args.steps)
            runs.append({"variant": variant, "repeat": repeat, "wall_ms": wall, "cpu_ms": cpu})
            print(f"repeat {repeat} {variant:15s} step {wall:8.1f} ms wall, {cpu:8.1f} ms CPU",
                  flush=True)
    summary = summarize(runs, variants)
    for v, row in summary.items():
        ratios = ", ".join(f"{k} {row[k]}" for k in row if k.startswith("cpu_vs"))
        print(f"{v:15s} {row['wall_ms']:8.1f} ms wall, {row['cpu_ms']:8.1f} ms CPU ({ratios})")
    result = {"model": "small CNN (--quick)" if args.quick else
              "keras.applications.ResNet50, 32x32x3, 10 classes, batch 32, random data",
              "warmup": args.warmup, "steps": args.steps, "repeats": args.repeats,
              "tensorflow": tf.__version__, "summary": summary, "runs": runs,
              # Both THOR variants run at wrap's defaults (thor_conv_adam: but for adam_kinds);
              # a changed default fails tests/test_bench_records.py until re-measured.
              "thor_defaults": thor_defaults()}
    return record.write(args.out, result, argv=argv, script=__file__)


if __name__ == "__main__":
    main()
