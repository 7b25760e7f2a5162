#!/usr/bin/env python
"""Calibrate THOR's split dimension on this machine, for the update rule that trains (the H of THOR).

Trains the model wrapped with THOR for a few warm-up steps, then for each candidate split weighs
what the split costs the rule against what it keeps, and takes the crossing of the two curves
(DESIGN.md §2, "Hardware-aware splitting"):

  * --rule eigenbasis (the default rule; thor_tf/split/calibrate.py): per factor dimension
    and candidate (1 = that side not rotated, 16, 32, … up to --max-split), the seconds of the
    rule's own traced work — the rotations into the split bases and back every step, the basis
    refresh at the warm-up's measured refresh rate — against the step's forward and backward
    pass; and how well a split basis from one batch's factor diagonalizes the next batch's. One
    split per factor dimension (a plan), also what wrap(model, split_dim="auto") does in fit;
  * --rule inverse (THOR's inverse rule, the seed's calibration;
    thor_tf/split/inverse_calibration.py): the fraction of factor matrices whose information
    loss L = 1 − sqrt(λmax(ÂÂᵀ)/λmax(AAᵀ)) (Â: block-diagonal part) is below --threshold,
    against the time to invert all the damped factors split at that candidate; one split for
    the model.

Writes --out (JSON; pass it to ``thor_tf.wrap(model, split_dim="that.json")``) and a plot of the
curves next to it (same stem, .png), and prints a table.

Examples:
  python scripts/calibrate_split_dim.py --workload fashion_cnn --out docs/results/calibration_fashion_cnn.json
  python scripts/calibrate_split_dim.py --model cnn --data auto --steps 50 --out runs/calibration_cnn.json
  python scripts/calibrate_split_dim.py --rule inverse --model resnet20 --steps 30
  python scripts/calibrate_split_dim.py --model path/to/model.keras --data random
  python scripts/calibrate_split_dim.py --model cnn --quick --out /tmp/cal.json   # seconds, for CI
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ZOO_MODELS = ("cnn", "resnet20", "resnet50")
RULES = ("eigenbasis", "inverse")
DATA_CHOICES = ("auto", "fashion_mnist", "digits", "mnist", "random")
#: split_dim used during the warm-up: larger than any factor, so every inverse is exact.
EXACT_SPLIT = 1 << 30


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rule", choices=RULES, default="eigenbasis",
                        help="the update rule to calibrate for (default: eigenbasis, thor_tf's "
                             "default rule)")
    parser.add_argument("--workload", default=None,
                        help="a workload of experiments/workloads.py (its model, data, loss and "
                             "batch size; --model, --data and --batch-size are then ignored), "
                             "e.g. fashion_cnn, resnet20, char_gpt; --rule eigenbasis only")
    parser.add_argument("--max-split", type=int, default=None,
                        help="--rule eigenbasis: the largest candidate split (default 256)")
    parser.add_argument(
        "--model", default="cnn",
        help=f"a zoo model ({', '.join(ZOO_MODELS)}) or the path of a saved .keras model "
             "(default: cnn)")
    parser.add_argument(
        "--data", choices=DATA_CHOICES, default=None,
        help="training data for the warm-up: a experiments.datasets dataset, or 'random' (random inputs "
             "of the model's input shape, random labels). Default: 'auto' (Fashion-MNIST if "
             "installed, else digits) for cnn/resnet20, 'random' for resnet50 and saved models; "
             "'digits' with --quick")
    parser.add_argument(
        "--image-size", type=int, default=None,
        help="image side: random data size (default 64 for resnet50, 32 otherwise) or, for "
             "real data, the size images are padded to (default: native for cnn, 32 for "
             "resnet20/resnet50); a saved model's own input size always wins")
    parser.add_argument("--num-classes", type=int, default=None,
                        help="classes of random labels (default: 1000 for resnet50, else 10)")
    parser.add_argument("--steps", type=int, default=50,
                        help="THOR warm-up steps before the factors are collected (default 50)")
    parser.add_argument("--batch-size", type=int, default=64, help="warm-up batch size (default 64)")
    parser.add_argument("--max-train", type=int, default=10000,
                        help="examples of real data kept for the warm-up (default 10000)")
    parser.add_argument("--frequency", type=int, default=10,
                        help="THOR cadence during the warm-up; every layer is refreshed at every "
                             "cadence point (preset thor_nt), so the factors come from the last "
                             "one (default 10)")
    parser.add_argument("--learning-rate", type=float, default=0.01,
                        help="THOR learning rate of the warm-up (default 0.01: with the cadence of "
                             "10, lr 0.05 diverges on the zoo cnn within ~30 steps)")
    parser.add_argument("--damping", type=float, default=0.03,
                        help="λ for the warm-up; timing damps every factor by sqrt(λ) (default 0.03)")
    parser.add_argument("--candidates", type=str, default=None,
                        help="comma-separated split dimensions, e.g. 1,16,32,64,128 (default: 1, "
                             "16, 32, … doubling, then the largest factor dimension)")
    parser.add_argument("--threshold", type=float, default=0.01,
                        help="information loss below which a factor counts as kept (default 0.01)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs per candidate, median reported (default 5)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed runs per candidate after tracing (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--out", default=None,
                        help="JSON output path; the plot goes next to it with a .png suffix "
                             "(default runs/calibration_<model>.json)")
    parser.add_argument("--allow-download", action="store_true",
                        help="let experiments.datasets download a dataset that is not installed")
    parser.add_argument("--replot", metavar="JSON", default=None,
                        help="only redraw the plot (and print the table) of an existing calibration "
                             "JSON; no training, no timing")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run for CI: digits data unless --data is given, at most 3 steps, "
                             "batch 32, 256 examples, 2 repeats, 1 warm-up run")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "max_train", "frequency", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.damping <= 0 or args.learning_rate <= 0 or args.threshold <= 0:
        parser.error("--damping, --learning-rate and --threshold must be > 0")
    if args.candidates is not None:
        try:
            args.candidates = [int(c) for c in args.candidates.split(",") if c.strip()]
        except ValueError:
            parser.error(f"--candidates must be comma-separated ints; got {args.candidates!r}")
        if not args.candidates or any(c < 1 for c in args.candidates) or any(
                b <= a for a, b in zip(args.candidates, args.candidates[1:])):
            parser.error("--candidates must be increasing ints >= 1")
    if args.workload is not None and args.rule != "eigenbasis":
        parser.error("--workload is for --rule eigenbasis")
    if args.max_split is not None and args.max_split < 1:
        parser.error("--max-split must be >= 1")
    if args.replot is not None and not os.path.exists(args.replot):
        parser.error(f"--replot: no such file {args.replot!r}")
    if args.model not in ZOO_MODELS and not os.path.exists(args.model):
        parser.error(f"--model must be one of {', '.join(ZOO_MODELS)} or an existing .keras file; "
                     f"got {args.model!r}")
    if args.quick:
        args.steps = min(args.steps, 3)
        args.batch_size = min(args.batch_size, 32)
        args.max_train = min(args.max_train, 256)
        args.repeats = min(args.repeats, 2)
        args.warmup = min(args.warmup, 1)
        args.frequency = 1
    return args


# ------------------------------------------------------------------------------------ data / model

def _load_saved(path):
    import keras
    from thor_tf.model import ThorModel

    model = keras.models.load_model(path)
    if isinstance(model, ThorModel):  # a saved wrapped model: calibrate its inner model
        model.thor.detach()
        model = model.model
    return model


def _real_data(name, args, image_size, channels=None):
    """``(x, y, num_classes)`` from experiments.datasets, padded/upsampled to ``image_size``."""
    import numpy as np
    from experiments import datasets as data

    ds = data.load_dataset(name, max_train=args.max_train, max_test=1, pad_to=image_size,
                           seed=args.seed, download=args.allow_download)
    x, y = ds.x_train, ds.y_train
    if channels is not None and x.shape[-1] != channels:
        if x.shape[-1] != 1:
            raise SystemExit(f"dataset {ds.name} has {x.shape[-1]} channels, the model wants "
                             f"{channels}; use --data random")
        x = np.repeat(x, channels, axis=-1)
    return x, y, ds.num_classes, ds.name


def _random_data(shape, num_classes, n, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.random((n, *shape), dtype=np.float32)
    y = rng.integers(0, num_classes, size=n).astype(np.int64)
    return x, y


def prepare(args):
    """``(keras model, x, y, description)`` for the warm-up."""
    from experiments import models as zoo

    saved = args.model not in ZOO_MODELS
    data_name = args.data or ("digits" if args.quick and not saved else
                              "random" if saved or args.model == "resnet50" else "auto")
    if saved:
        model = _load_saved(args.model)
        shape = tuple(int(s) for s in model.input_shape[1:])
        num_classes = int(model.output_shape[-1])
        if data_name == "random":
            x, y = _random_data(shape, num_classes, args.max_train, args.seed)
            used = "random"
        else:
            if len(shape) != 3 or shape[0] != shape[1]:
                raise SystemExit(f"model input {shape} is not a square image; use --data random")
            x, y, classes, used = _real_data(data_name, args, shape[0], channels=shape[2])
            if classes > num_classes:
                raise SystemExit(f"{used} has {classes} classes, the model outputs {num_classes}")
        return model, x, y, f"{args.model} on {used} {shape}"

    if data_name == "random":
        size = args.image_size or (64 if args.model == "resnet50" else 32)
        channels = 1 if args.model == "cnn" else 3
        num_classes = args.num_classes or (1000 if args.model == "resnet50" else 10)
        shape = (size, size, channels)
        x, y = _random_data(shape, num_classes, args.max_train, args.seed)
        used = "random"
    else:
        size = args.image_size or (None if args.model == "cnn" else 32)
        x, y, num_classes, used = _real_data(data_name, args, size)
        shape = tuple(x.shape[1:])
    model = zoo.build(args.model, shape, num_classes)
    return model, x, y, f"{args.model} on {used} {shape}, {num_classes} classes"


def warm_up(model, x, y, args):
    """Wrap with exact inverses, train ``args.steps`` THOR steps; returns the ThorModel."""
    import tensorflow as tf
    import thor_tf

    wrapped = thor_tf.wrap(model, split_dim=EXACT_SPLIT, preset="thor_nt",
                           frequency=args.frequency, learning_rate=args.learning_rate,
                           damping=args.damping)
    wrapped.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    ds = (tf.data.Dataset.from_tensor_slices((x, y))
          .shuffle(min(len(x), 10000), seed=args.seed).repeat().batch(args.batch_size))
    history = wrapped.fit(ds, epochs=1, steps_per_epoch=args.steps, shuffle=False, verbose=2)
    return wrapped, float(history.history["loss"][-1])


# ------------------------------------------------------------------------------------ output

def format_table(result):
    lines = [f"{'candidate':>9}  {'loss fraction':>13}  {'seconds':>10}  {'speed p1/pn':>11}"]
    for c, f, s, v in zip(result["candidates"], result["loss_fraction"],
                          result["inversion_seconds"], result["speed_normalized"]):
        mark = "  <- split_dim" if c == result["split_dim"] else ""
        lines.append(f"{c:>9d}  {f:>13.3f}  {s:>10.5f}  {v:>11.3f}{mark}")
    return "\n".join(lines)


def plot(result, path, title):
    """Both normalized curves against the dimension (log2 axis), the crossing marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cands = np.asarray(result["candidates"], float)
    info = np.asarray(result["loss_fraction"], float)
    speed = np.asarray(result["speed_normalized"], float)
    # Straight segments on the log2 axis: the interpolation find_crossing uses, so the crossing
    # marker sits exactly on both curves.
    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=120)
    ax.plot(cands, info, "o-", color="tab:blue", lw=2,
            label=f"information: fraction of factors with loss < {result['threshold']:.0%}")
    ax.plot(cands, speed, "s-", color="tab:orange", lw=2,
            label="speed: $p_1/p_n$ (inversion time at 1 / at n)")
    split = result["split_dim"]
    if result["crossing"] is not None:
        x = result["crossing"]
        y = float(np.interp(np.log2(x), np.log2(cands), info))
        ax.axvline(x, color="black", ls="--", lw=1)
        ax.plot([x], [y], "k*", ms=13, zorder=5)
        text = f"crossing {x:.1f}\n→ split_dim {split}"
    else:
        x, y = float(split), float(np.interp(np.log2(split), np.log2(cands), info))
        text = f"no crossing\n→ split_dim {split}"
    ax.axvline(split, color="green", ls=":", lw=2, label=f"chosen split_dim {split}")
    # Straight above or below the crossing: the wedges between the two curves there are empty.
    above = y < 0.5
    ax.annotate(text, xy=(x, y), xytext=(0, 55 if above else -55), textcoords="offset points",
                ha="center", va="bottom" if above else "top", fontsize=10,
                bbox=dict(boxstyle="round", fc="white", ec="gray"),
                arrowprops=dict(arrowstyle="->", color="black"))
    ax.set_xscale("log", base=2)
    ax.set_xticks(cands)
    # A label closer than 0.8 octave to the previous one goes one line lower (e.g. 512 and 576).
    labels, gaps = [], np.diff(np.log2(cands), prepend=-np.inf)
    for c, gap in zip(cands, gaps):
        lower = gap < 0.8 and not (labels and labels[-1].startswith("\n"))
        labels.append(("\n" if lower else "") + str(int(c)))
    ax.set_xticklabels(labels)
    ax.minorticks_off()
    ax.set_ylim(-0.03, max(1.08, 1.05 * float(np.max(speed))))
    ax.set_xlabel("split dimension (block size)")
    ax.set_ylabel("normalized value")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    # Below the axes, so that it never hides a curve.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def title_of(result):
    dims = sorted(set(result["factor_dims"]))
    return (f"THOR split calibration: {result.get('data', result.get('model', ''))}\n"
            f"{result['device']}, {result['num_factors']} factors, dims {dims[0]}…{dims[-1]}")


def report(result):
    print(f"{result['num_factors']} factor matrices, dims {result['factor_dims']}")
    print(f"device: {result['device']}; TensorFlow {result['tensorflow_version']}")
    print(format_table(result))
    print(f"{result['reason']}")
    print(f"split_dim = {result['split_dim']}  (crossing: "
          f"{'none' if result['crossing'] is None else format(result['crossing'], '.1f')})")


def write_result(result, args, name):
    """Write ``result`` as JSON to ``--out`` (default ``runs/calibration_<name>.json``);
    returns ``(json path, png path beside it)``."""
    stem = os.path.splitext(os.path.basename(name))[0]
    out = args.out or os.path.join("runs", f"calibration_{stem}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")
    return out, os.path.splitext(out)[0] + ".png"


# ------------------------------------------------------------------- the rule's calibration

def workload_setup(name, seed):
    """``(keras model, (x, y), loss, batch size, description)`` of a suite workload."""
    import keras
    from experiments import workloads as wl

    if name not in wl.ALL_WORKLOADS:
        raise SystemExit(f"--workload must be one of {sorted(wl.ALL_WORKLOADS)}; got {name!r}")
    workload = wl.ALL_WORKLOADS[name]
    data = workload.load(False)
    keras.utils.set_random_seed(seed)
    return (workload.build(data, False), (data.x_train, data.y_train), workload.loss(),
            workload.batch_size, workload.title)


def calibrate_rule_main(args, argv):
    """``--rule eigenbasis``: warm up at the default split, probe two batches, calibrate."""
    import keras
    import numpy as np
    import thor_tf
    from thor_tf.split import calibrate, timing

    start = time.time()
    if args.workload is not None:
        model, (x, y), loss, batch_size, description = workload_setup(args.workload, args.seed)
    else:
        keras.utils.set_random_seed(args.seed)
        model, x, y, description = prepare(args)
        loss, batch_size = "sparse_categorical_crossentropy", args.batch_size
    steps = min(args.steps, max(1, len(x) // batch_size - 2))
    print(f"calibrate_split_dim: {description}; {steps} THOR warm-up steps (batch {batch_size}, "
          f"rule {args.rule})", flush=True)
    wrapped = thor_tf.wrap(model, update_rule=args.rule, verbose=False)
    wrapped.compile(loss=loss)
    order = np.random.default_rng(args.seed).permutation(len(x))
    take = lambda k: (x[order[k * batch_size:(k + 1) * batch_size]],
                      y[order[k * batch_size:(k + 1) * batch_size]])
    warm = order[:steps * batch_size]
    wrapped.fit(x[warm], y[warm], batch_size=batch_size, epochs=1, shuffle=False, verbose=2)
    stats = wrapped.thor.layer_stats()
    rate = sum(r["refreshes"] for r in stats) / max(1, len(stats) * steps)
    options = {} if args.max_split is None else {"max_split": args.max_split}
    plan, report = calibrate.auto_split(wrapped, [take(steps), take(steps + 1)],
                                        refresh_rate=rate, repeats=args.repeats, verbose=True,
                                        **options)
    result = {
        "rule": args.rule,
        "split_plan": plan.get_config(),
        "split_dim": plan.default,
        "dims": {str(d): v for d, v in report["dims"].items()},
        "layers": report["layers"],
        "base_seconds": report["base_seconds"],
        "refresh_rate": report["refresh_rate"],
        "calibration_seconds": round(report["calibration_seconds"], 2),
        "load_average_1min": report["load_average_1min"],
        "device": timing.device_description(),
        "tensorflow_version": __import__("tensorflow").__version__,
        "model": args.workload or args.model,
        "data": description,
        "steps": steps,
        "batch_size": batch_size,
        "seed": args.seed,
        "quick": bool(args.quick),
        "total_seconds": round(time.time() - start, 2),
        "command": " ".join([os.path.basename(sys.argv[0])] + (sys.argv[1:] if argv is None else list(argv))),
    }
    out, png = write_result(result, args, args.workload or args.model)
    plot_rule(result, png)
    print(f"split_dim = {thor_tf.SplitPlan.from_config(result['split_plan'])}")
    print(f"wrote {out} and {png} in {time.time() - start:.1f} s")
    return result


def plot_rule(result, path):
    """One panel per factor dimension: the information and speed curves over its candidates
    (log2 axis), the chosen split marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    dims = sorted(result["dims"].items(), key=lambda kv: int(kv[0]))
    cols = min(4, len(dims))
    rows = -(-len(dims) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.7 * rows), dpi=110,
                             squeeze=False)
    for ax, (dim, d) in zip(axes.flat, dims):
        cands = np.asarray(d["candidates"], float)
        ax.plot(cands, d["information"], "o-", color="tab:blue", label="information")
        ax.plot(cands, d["speed"], "s-", color="tab:orange", label="speed")
        ax.axvline(d["split"], color="green", ls=":", lw=2)
        ax.set_xscale("log", base=2)
        ax.set_xticks(cands)
        ax.set_xticklabels(["none" if c == 1 else str(int(c)) for c in cands], fontsize=7,
                           rotation=45)
        ax.minorticks_off()
        ax.set_ylim(-0.03, 1.08)
        chosen = "none" if d["split"] == 1 else d["split"]
        count = len(d["sides"])
        ax.set_title(f"dim {dim} ({count} side{'s' if count > 1 else ''}) → {chosen}", fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(dims):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"split calibrated for the {result['rule']} rule: {result['data']}\n"
                 f"{result['device']}; step {1e3 * result['base_seconds']:.1f} ms, "
                 f"refresh rate {result['refresh_rate']:.3f}/step", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    if args.replot is not None:
        with open(args.replot) as fh:
            result = json.load(fh)
        png = os.path.splitext(args.replot)[0] + ".png"
        if "split_plan" in result:
            plot_rule(result, png)
        else:
            plot(result, png, title_of(result))
            report(result)
        print(f"wrote {png}")
        return result
    if args.rule != "inverse":
        return calibrate_rule_main(args, argv)
    import keras

    from thor_tf.split import inverse_calibration

    keras.utils.set_random_seed(args.seed)
    start = time.time()
    model, x, y, description = prepare(args)
    print(f"calibrate_split_dim: {description}; {args.steps} THOR warm-up steps "
          f"(batch {args.batch_size}, exact inverses)", flush=True)
    wrapped, loss = warm_up(model, x, y, args)
    warm_seconds = time.time() - start
    nonfinite = int(wrapped.thor.counters()["nonfinite_steps"])
    if nonfinite:
        print(f"warning: {nonfinite} of {args.steps} warm-up steps were non-finite (diverged); the "
              f"factors are those of the last finite refresh. Try a smaller --learning-rate.")
    result = inverse_calibration.calibrate(wrapped, cands=args.candidates, damping=args.damping,
                                   threshold=args.threshold, repeats=args.repeats,
                                   warmup=args.warmup)
    result.update({
        "model": args.model,
        "data": description,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "frequency": args.frequency,
        "seed": args.seed,
        "quick": bool(args.quick),
        "learning_rate": args.learning_rate,
        "warmup_mean_loss": loss,
        "warmup_nonfinite_steps": nonfinite,
        "warmup_seconds": round(warm_seconds, 2),
        "total_seconds": round(time.time() - start, 2),
        "command": " ".join([os.path.basename(sys.argv[0])] + (sys.argv[1:] if argv is None else list(argv))),
    })
    if result["skipped_layers"]:
        print(f"warning: layers never refreshed, left out: {result['skipped_layers']}")

    out, png = write_result(result, args, args.model)
    plot(result, png, title_of(result))
    report(result)
    print(f"wrote {out} and {png} in {time.time() - start:.1f} s")
    return result


if __name__ == "__main__":
    main()
