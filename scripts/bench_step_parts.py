"""What THOR's steady CNN step costs beyond SGD's, part by part, measured side by side.

One process, the Fashion-MNIST CNN (batch 128, random data), five variants trained in turn
``--repeats`` times (so a slow spell of a shared machine hits all of them alike):

* ``sgd``: Keras' SGD-momentum, the reference;
* ``thor``: THOR at its defaults;
* ``thor_no_precondition``: THOR with the preconditioning replaced by the identity;
* ``thor_no_curvature``: THOR without its cadence points (no traces, factors or inverses);
* ``thor_neither``: both removed: what is left is capture, the finiteness checks, THOR's own
  momentum update and the masked apply.

Each variant: one epoch of warm-up (tracing, the first refreshes), then ``--epochs`` epochs of 40
steps with every step timed (Keras' batch callbacks; the median is the steady step, the mean
includes the cadence points). Writes ``--out`` (JSON): per variant the median over repeats of
both, and the ratios to SGD.

    python scripts/bench_step_parts.py --out docs/bench_step_parts.json     # ~4 min
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import thor_tf  # noqa: E402
from thor_tf_experiments import models  # noqa: E402

VARIANTS = ("sgd", "thor", "thor_no_precondition", "thor_no_curvature", "thor_neither")


class StepTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.start)


def build(variant):
    keras.utils.set_random_seed(0)
    model = models.build("cnn", (28, 28, 1), 10)
    loss = "sparse_categorical_crossentropy"
    if variant == "sgd":
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss=loss)
        return model
    wrapped = thor_tf.wrap(model, learning_rate=0.01, verbose=False)
    wrapped.compile(loss=loss)
    engine = wrapped.thor
    # Replace parts of the traced step before its first trace (the engine's own methods).
    if variant in ("thor_no_precondition", "thor_neither"):
        engine.precondition = lambda active, records, grads, variables, ok=True: grads
    if variant in ("thor_no_curvature", "thor_neither"):
        engine.curvature_step = lambda *args, **kwargs: None
    return wrapped


def steady(model, x, y, epochs):
    model.fit(x, y, batch_size=128, epochs=1, verbose=0)  # trace + the first refreshes
    timer = StepTimer()
    model.fit(x, y, batch_size=128, epochs=epochs, verbose=0, callbacks=[timer])
    return 1e3 * statistics.median(timer.times), 1e3 * statistics.fmean(timer.times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--out", default="runs/bench_step_parts.json")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    x = rng.random((128 * 40, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, len(x))
    runs = {v: [] for v in VARIANTS}
    for repeat in range(args.repeats):
        for variant in VARIANTS:
            median, mean = steady(build(variant), x, y, args.epochs)
            runs[variant].append({"median_ms": median, "mean_ms": mean})
            print(f"repeat {repeat} {variant:22s} step median {median:6.2f} ms, mean {mean:6.2f} ms",
                  flush=True)
    summary = {v: {"median_ms": statistics.median(r["median_ms"] for r in rs),
                   "mean_ms": statistics.median(r["mean_ms"] for r in rs)} for v, rs in runs.items()}
    sgd = summary["sgd"]
    for row in summary.values():
        row["median_vs_sgd"] = row["median_ms"] / sgd["median_ms"]
        row["mean_vs_sgd"] = row["mean_ms"] / sgd["mean_ms"]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"summary": summary, "runs": runs, "args": vars(args),
                   "tensorflow": tf.__version__, "keras": keras.__version__,
                   "machine": platform.platform(), "cpus": os.cpu_count(),
                   "date": time.strftime("%Y-%m-%d")}, fh, indent=1)
    for v, row in summary.items():
        print(f"{v:22s} median {row['median_ms']:6.2f} ms ({row['median_vs_sgd']:.2f}x SGD), "
              f"mean {row['mean_ms']:6.2f} ms ({row['mean_vs_sgd']:.2f}x)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
