"""Where THOR's steady step goes, part by part, beside SGD, AdamW and Muon, measured side by side.

One process per model; the variants train in turn ``--repeats`` times, in an order that rotates
across repeats (a slow spell of a shared machine hits all of them alike):

* ``sgd`` (momentum 0.9), ``adamw``, ``muon`` (Keras >= 3.10): the first-order references;
* ``thor``: THOR at its defaults (the orthogonalized eigenbasis step);
* ``thor_adam_step``: ``update_rule="eigenbasis_adam"``: the same without Newton–Schulz;
* ``thor_no_precondition``: THOR with the rule's ``precondition`` replaced by the identity
  (every variable takes the rule's AdamW): what is left is capture, the checks, the cadence
  points (traces, factors, refreshes) and the apply;
* ``thor_no_curvature``: THOR without its cadence points (no traces, factors or refreshes; the
  bases stay the identity, the rotations and Newton–Schulz still run);
* ``thor_neither``: both removed;
* ``thor_muon_set``: a method variant, not THOR's default: Newton–Schulz only on the blocks
  whose kernels Keras' Muon orthogonalizes (Dense and Conv; EinsumDense and Embedding blocks
  keep the eigenbasis Adam step, ``Eigenbasis(adam_kinds=("einsum_dense", "embedding"))``):
  what the orthogonalization of the other blocks costs per step;
* ``thor_split128``: THOR with every factor split at 128 (the default before factors wider than
  512 were left unrotated).

Differences between them attribute the step: rotations + moments (``thor_adam_step`` −
``thor_no_precondition``), Newton–Schulz (``thor`` − ``thor_adam_step``), cadence points
(``thor`` − ``thor_no_curvature``, in the mean only), capture and the rest (``thor_neither`` −
``adamw``).

Each variant: one warm-up epoch (tracing, the first refreshes), then ``--epochs`` epochs of
``--steps`` steps with every step timed (Keras' batch callbacks): the median is the steady step,
the mean includes the cadence points. Inputs are random (timing does not depend on the data).
Writes ``--out`` (JSON): per model and variant the median over repeats, and ratios to SGD/AdamW.

    python scripts/bench_step_parts.py --models fashion_cnn,resnet20,char_gpt \\
        --out docs/results/bench_step_parts.json                                 # ~10 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import thor_tf  # noqa: E402
from experiments import workloads  # noqa: E402

VARIANTS = ("sgd", "adamw", "muon", "thor", "thor_adam_step", "thor_no_precondition",
            "thor_no_curvature", "thor_neither", "thor_muon_set", "thor_split128")
#: Per model: the suite workload it comes from and random data of its shapes.
MODELS = tuple(n for n, w in workloads.WORKLOADS.items() if w.random is not None)


class StepTimer(keras.callbacks.Callback):
    """Each step's wall seconds (``times``) and this process's CPU seconds (``cpu``: all its
    threads; less disturbed than the wall clock when other processes share the cores)."""

    def __init__(self):
        super().__init__()
        self.times, self.cpu = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.start, self.start_cpu = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.start)
        self.cpu.append(time.process_time() - self.start_cpu)


def random_data(name, steps):
    """``(workload, Data)``: ``steps`` batches of random arrays of the workload's shapes
    (``Workload.random``)."""
    w = workloads.WORKLOADS[name]
    return w, w.random(w.batch_size * steps, np.random.default_rng(0))


def build(variant, workload, data):
    keras.utils.set_random_seed(0)
    model = workload.build(data, False)
    loss = workload.loss()
    if variant == "sgd":
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss=loss)
        return model
    if variant == "adamw":
        model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss=loss)
        return model
    if variant == "muon":
        model.compile(optimizer=keras.optimizers.Muon(1e-2, exclude_layers=[workload.head]),
                      loss=loss)
        return model
    rule = "eigenbasis_adam" if variant == "thor_adam_step" else "eigenbasis"
    if variant == "thor_muon_set":
        rule = thor_tf.rules.Eigenbasis(adam_kinds=("einsum_dense", "embedding"))
    # thor_split128: every factor split at 128, the eigenbasis rule's default split before
    # factors wider than 512 were left unrotated (docs/split_dim.md).
    split = {"split_dim": 128} if variant == "thor_split128" else {}
    wrapped = thor_tf.wrap(model, learning_rate=1e-3, update_rule=rule, verbose=False, **split)
    wrapped.compile(loss=loss)
    engine = wrapped.thor
    # Replace parts of the traced step before its first trace (the engine's own methods).
    if variant in ("thor_no_precondition", "thor_neither"):
        engine.precondition = (lambda active, rows, grads, variables, ok=True, use_grads=None:
                               (grads, ()))  # nothing preconditioned, nothing marked
    if variant in ("thor_no_curvature", "thor_neither"):
        engine.curvature_step = lambda *args, **kwargs: None
    return wrapped


def steady(model, data, batch, epochs):
    fit = dict(batch_size=batch, verbose=0, shuffle=False)
    model.fit(data.x_train, data.y_train, epochs=1, **fit)  # trace + the first refreshes
    timer = StepTimer()
    model.fit(data.x_train, data.y_train, epochs=epochs, callbacks=[timer], **fit)
    return {"median_ms": 1e3 * statistics.median(timer.times),
            "mean_ms": 1e3 * statistics.fmean(timer.times),
            "cpu_median_ms": 1e3 * statistics.median(timer.cpu),
            "cpu_mean_ms": 1e3 * statistics.fmean(timer.cpu)}


def _line(row):
    return (f"step median {row['median_ms']:7.2f} ms (CPU {row['cpu_median_ms']:7.2f}), "
            f"mean {row['mean_ms']:7.2f} ms (CPU {row['cpu_mean_ms']:7.2f})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="fashion_cnn,resnet20,char_gpt",
                   help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=40, help="steps per epoch")
    p.add_argument("--out", default="runs/bench_step_parts.json")
    args = p.parse_args(argv)
    names = args.models.split(",")
    variants = args.variants.split(",")
    for bad in [n for n in names if n not in MODELS] + [v for v in variants if v not in VARIANTS]:
        raise SystemExit(f"unknown model or variant {bad!r}; models: {MODELS}, variants: {VARIANTS}")
    if not hasattr(keras.optimizers, "Muon"):
        variants = [v for v in variants if v != "muon"]
    results = {}
    for name in names:
        workload, data = random_data(name, args.steps)
        runs = {v: [] for v in variants}
        for repeat in range(args.repeats):
            order = variants[repeat % len(variants):] + variants[:repeat % len(variants)]
            for variant in order:
                row = steady(build(variant, workload, data), data, workload.batch_size,
                             args.epochs)
                runs[variant].append(row)
                print(f"{name} repeat {repeat} {variant:22s} " + _line(row), flush=True)
        keys = ("median_ms", "mean_ms", "cpu_median_ms", "cpu_mean_ms")
        summary = {v: {k: statistics.median(r[k] for r in rs) for k in keys}
                   for v, rs in runs.items()}
        for ref in ("sgd", "adamw"):
            if ref in summary:
                for row in summary.values():
                    for k in keys:
                        row[f"{k[:-3]}_vs_{ref}"] = row[k] / summary[ref][k]
        results[name] = {"summary": summary, "runs": runs, "batch": workload.batch_size}
        for v, row in summary.items():
            ratios = ", ".join(f"{row[k]:.2f}x {k.split('_vs_')[1]}" for k in row
                               if k.startswith("median_vs") or k.startswith("cpu_median_vs"))
            print(f"{name:12s} {v:22s} {_line(row)} ({ratios})", flush=True)
    import tensorflow as tf

    from experiments import record

    record.write(args.out, {"models": results, "args": vars(args), "tensorflow": tf.__version__,
                            "keras": keras.__version__}, argv=argv, script=__file__)


if __name__ == "__main__":
    main()
