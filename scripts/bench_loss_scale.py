"""How THOR's step depends on a constant factor on the loss: keras-io's imbalanced-classification
recipe (class weights ``1/count``), side by side with the same weights times ``N/2`` (mean weight
about 1), and with Adam and SGD-momentum, over seeds.

Data: a synthetic stand-in for the recipe's credit-card table (offline): 30 standard-normal
features, 2 % positives shifted by 1.5 along a random direction, 2,042 training examples (so the
recipe's weights are 1/2000 and 1/42, the 5e-4 and 2.4e-2 of issue 17). Model as the recipe's:
Dense(64, relu) ×2 with Dropout(0.3), Dense(1, sigmoid), binary cross-entropy, batch 256.

Reported per setting (mean ± sd over seeds): the class-weighted training loss after the last
epoch relative to the first epoch's start (lower is better), the recall of positives on held-out
data, and for THOR the ratio of G's mean eigenvalue ``tr(G)/dim`` to the per-factor damping
``√λ`` (averaged over layers) at the end: far below 1 means the damping swamps G and the step is
SGD's divided by ``√λ``.

    python scripts/bench_loss_scale.py --out docs/results/bench_loss_scale.json   # ~2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import thor_tf  # noqa: E402


def make_data(seed, n_neg=2000, n_pos=42, n_test=4000, dim=30):
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=dim)
    direction /= np.linalg.norm(direction)

    def draw(neg, pos):
        x = rng.normal(size=(neg + pos, dim))
        x[neg:] += 1.5 * direction
        y = np.r_[np.zeros(neg), np.ones(pos)]
        order = rng.permutation(neg + pos)
        return x[order].astype("float32"), y[order].astype("float32")

    return draw(n_neg, n_pos), draw(int(n_test * 0.98), n_test - int(n_test * 0.98))


def build(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((30,)), keras.layers.Dense(64, activation="relu", name="h1"),
        keras.layers.Dropout(0.3), keras.layers.Dense(64, activation="relu", name="h2"),
        keras.layers.Dropout(0.3), keras.layers.Dense(1, activation="sigmoid", name="out")])


SETTINGS = {
    "thor, recipe weights": ("thor", 1.0),
    "thor, weights x N/2": ("thor", None),
    "adam 1e-2, recipe weights": ("adam", 1.0),
    "sgd 0.05, recipe weights": ("sgd", 1.0),
}


def run(setting, seed, epochs):
    kind, factor = SETTINGS[setting]
    (x, y), (xt, yt) = make_data(seed)
    counts = np.bincount(y.astype(int))
    weights = {0: 1.0 / counts[0], 1: 1.0 / counts[1]}
    if factor is None:
        factor = len(y) / 2.0
    weights = {k: v * factor for k, v in weights.items()}
    model = build(seed)
    loss = keras.losses.BinaryCrossentropy()
    if kind == "thor":
        model = thor_tf.wrap(model, learning_rate=0.05, verbose=False)
        model.compile(loss=loss)
    else:
        optimizer = (keras.optimizers.Adam(1e-2) if kind == "adam"
                     else keras.optimizers.SGD(0.05, momentum=0.9))
        model.compile(optimizer=optimizer, loss=loss)
    sample_w = np.where(y > 0, weights[1], weights[0]).astype("float32")

    def weighted_loss():
        p = np.clip(model.predict(x, verbose=0)[:, 0], 1e-7, 1 - 1e-7)
        per = -(y * np.log(p) + (1 - y) * np.log(1 - p))
        return float(np.mean(per * sample_w) / factor)  # in the recipe's units

    start = weighted_loss()
    model.fit(x, y, batch_size=256, epochs=epochs, class_weight=weights, verbose=0, shuffle=True)
    p_test = model.predict(xt, verbose=0)[:, 0]
    recall = float(np.mean(p_test[yt > 0] > 0.5))
    out = {"loss_ratio": weighted_loss() / start, "recall": recall}
    if kind == "thor":
        damping = float(np.sqrt(model.thor_optimizer.current_damping().numpy()))
        ratios = []
        for stat in model.thor.layer_stats():
            g = model.thor.factors(stat["name"])["G"]
            ratios.append(float(np.trace(g)) / g.shape[0] / damping)
        out["g_over_damping"] = float(np.mean(ratios))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--out", default="docs/results/bench_loss_scale.json")
    args = parser.parse_args()
    results = {}
    for setting in SETTINGS:
        runs = []
        for seed in range(args.seeds):
            runs.append(run(setting, seed, args.epochs))
            print(f"{setting:28s} seed {seed}: " + ", ".join(
                f"{k} {v:.3g}" for k, v in runs[-1].items()), flush=True)
        summary = {}
        for key in runs[0]:
            values = [r[key] for r in runs]
            summary[key] = {"mean": statistics.mean(values),
                            "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
                            "runs": values}
        results[setting] = summary
    with open(args.out, "w") as fh:
        json.dump({"command": " ".join(sys.argv), "epochs": args.epochs, "seeds": args.seeds,
                   "results": results}, fh, indent=1)
    print(f"\n{'setting':28s} {'loss ratio':>16s} {'recall':>16s} {'tr(G)/dim / sqrt(lambda)':>26s}")
    for setting, summary in results.items():
        g = summary.get("g_over_damping")
        print(f"{setting:28s} {summary['loss_ratio']['mean']:8.3f} ± {summary['loss_ratio']['sd']:5.3f}"
              f" {summary['recall']['mean']:8.3f} ± {summary['recall']['sd']:5.3f}"
              + (f" {g['mean']:14.3g}" if g else ""))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
