"""How far a model's Kronecker factors move in trace and in shape while it trains.

The trace rule compares ``tr A · tr G`` (the sum of the factors' eigenvalues) between the block in
use and the current batch. This script measures what that sum misses: it trains with ``thor_nt``
(every factor recomputed every ``--frequency`` steps, so the factors in use are the current
ones), keeps each layer's factors at a reference step, and at later steps reports per layer and
factor (A, G)

* ``trace``: the relative change of the trace, ``|tr F − tr F₀| / tr F₀``;
* ``shape``: the relative Frobenius change of the factor divided by its trace,
  ``‖F/tr F − F₀/tr F₀‖ / ‖F₀/tr F₀‖`` (0 when only the scale moved).

Both include the sampling noise of one batch's factor (large for G, built from the batch's
per-example gradients); the trend over steps is the drift. An Embedding's A (token frequencies)
is diagonal: its "shape" is that of the frequency vector.

Writes ``<out>.json`` (rows: step, layer, trace_A, shape_A, trace_G, shape_G) and ``<out>.png``
(shape against trace change of A per layer at the last step).

    python scripts/factor_drift.py --model vit --out docs/factor_drift_vit     # ~3 min
    python scripts/factor_drift.py --model cnn --out docs/factor_drift_cnn
"""

from __future__ import annotations

import argparse
import json
import os
import platform

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import thor_tf  # noqa: E402
from thor_tf_experiments import datasets, models  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("vit", "cnn"), default="vit")
    p.add_argument("--dataset", default="fashion_mnist")
    p.add_argument("--max-train", type=int, default=25600)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--frequency", type=int, default=10)
    p.add_argument("--reference-step", type=int, default=11,
                   help="step whose factors are the reference (default 11: the block THOR's rule "
                        "keeps for layers that stop refreshing after the first cadence points)")
    p.add_argument("--steps", default="50,100,200,400,600", help="steps to measure at")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/factor_drift")
    return p.parse_args(argv)


def normalized(factor):
    """The factor divided by its trace (a vector factor: by its sum)."""
    total = np.trace(factor) if factor.ndim == 2 else factor.sum()
    return factor / total, total


def drift(factor, reference):
    """``(trace change, shape change)`` of ``factor`` against ``reference`` (see the docstring)."""
    f, tr = normalized(np.asarray(factor, np.float64))
    f0, tr0 = normalized(np.asarray(reference, np.float64))
    return abs(tr - tr0) / tr0, float(np.linalg.norm(f - f0) / np.linalg.norm(f0))


def main(argv=None):
    args = parse_args(argv)
    ds = datasets.load_dataset(args.dataset, max_train=args.max_train, max_test=1000, seed=0)
    keras.utils.set_random_seed(args.seed)
    if args.model == "vit":
        model = models.vit(ds.input_shape, ds.num_classes, dim=64, depth=2, heads=4, mlp_dim=128)
    else:
        model = models.build("cnn", ds.input_shape, ds.num_classes)
    wrapped = thor_tf.wrap(model, preset="thor_nt", learning_rate=args.lr, damping=0.03,
                           frequency=args.frequency, verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    steps = sorted(int(s) for s in args.steps.split(","))
    reference, rows = {}, []

    class Measure(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.step = 0

        def on_train_batch_end(self, batch, logs=None):
            self.step += 1
            if self.step != args.reference_step and self.step not in steps:
                return
            for stats in wrapped.thor.layer_stats():
                name = stats["name"]
                factors = wrapped.thor.factors(name)
                if self.step == args.reference_step:
                    reference[name] = factors
                    continue
                row = {"step": self.step, "layer": name, "kind": stats["kind"]}
                for key in ("A", "G"):
                    row[f"trace_{key}"], row[f"shape_{key}"] = drift(factors[key], reference[name][key])
                rows.append(row)
                print(f"step {self.step:4d} {name:36s} A: trace {row['trace_A']:.3f} shape "
                      f"{row['shape_A']:.3f}   G: trace {row['trace_G']:.3f} shape {row['shape_G']:.3f}",
                      flush=True)

    wrapped.fit(ds.x_train, ds.y_train, batch_size=args.batch_size, epochs=args.epochs,
                verbose=2, callbacks=[Measure()])
    out = {"args": vars(args), "rows": rows, "tensorflow": tf.__version__,
           "keras": keras.__version__, "platform": platform.platform()}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as fh:
        json.dump(out, fh, indent=1)
    plot(rows, args.out + ".png", f"{args.model}: factor drift since step {args.reference_step}")
    print(f"wrote {args.out}.json and {args.out}.png")


def plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = max(r["step"] for r in rows)
    final = [r for r in rows if r["step"] == last]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key in zip(axes, ("A", "G")):
        for r in final:
            ax.scatter(r[f"trace_{key}"], r[f"shape_{key}"], s=18)
            ax.annotate(r["layer"].replace("_attention", "").replace("block", "b"),
                        (r[f"trace_{key}"], r[f"shape_{key}"]), fontsize=6)
        ax.set_xscale("symlog", linthresh=0.01)
        ax.set_xlabel(f"relative change of tr {key} (what the trace rule sees)")
        ax.set_ylabel(f"relative change of {key}/tr {key} (shape)")
        ax.set_title(f"{key} at step {last}")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
