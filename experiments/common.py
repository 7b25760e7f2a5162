"""Shared machinery of the comparison scripts (``mnist.py``, ``resnet.py``).

One *run* trains one optimizer configuration (optimizer, learning rate, seed) for ``--epochs``
epochs. After every epoch the test set is evaluated (not timed) and one row goes to
``metrics.csv``. When all runs are done, ``summary.json``, the plots and a table are written.

Optimizers (``--optimizers``, comma separated):

==============  ===============================================================================
``thor``        ``thor_tf.wrap(model, preset="thor")``: empirical Fisher, trace rule (ω1, ω2) =
                (0.01, 0) at every ``--frequency``-th step
``thor_stop``   preset ``"thor_stop"``: (ω1, ω2) = (0.01, 0.001), layers may freeze
``thor_nt``     preset ``"thor_nt"``: refresh every layer at every cadence point (no trace rule)
``kfac``        K-FAC as the engine can do it: ``fisher="sampled"`` (true Fisher, labels drawn from
                the model), ``factor_decay=0.95`` (running average of the factors),
                preset ``"thor_nt"``, frequent refreshes (``--kfac-frequency``)
``sgd``         ``keras.optimizers.SGD(lr, momentum=0.9)`` on the plain (unwrapped) model
``adam``        ``keras.optimizers.Adam(lr)`` on the plain model
==============  ===============================================================================

Fairness rules: for a given seed every optimizer starts from the same initial weights
(``keras.utils.set_random_seed(seed)`` right before the model is built) and sees the training
examples in the same order (one NumPy permutation per epoch drawn from ``seed``). SGD and Adam get
a small learning-rate grid (``--lr-grid``); the THOR variants get the learning rates of
``--thor-lr`` (one value by default). Every run of the grid is kept in ``metrics.csv``; the summary
reports, per optimizer, the learning rate with the best median (over seeds) final test accuracy.

``metrics.csv`` columns: optimizer, lr (initial lr under a schedule), seed, epoch (from 1),
train_loss (Keras' mean over the epoch's batches), test_loss, test_acc, epoch_seconds (training
only), cumulative_seconds, refreshes (Kronecker-block refreshes so far, summed over layers; 0 for
SGD/Adam). The ``--max-train``/``--max-test`` subsets do not depend on the seed.

Time-to-target (:func:`time_to_target`): the first epoch whose test accuracy is ``>= target`` and
the cumulative *training* wall time at the end of that epoch (evaluation excluded, graph tracing
of the first epoch included, as a user would pay it). Accuracy is only measured at epoch ends, so
the answer is an upper bound with epoch granularity; no interpolation between epochs is done.
The default target is the final test accuracy of the best first-order baseline (SGD or Adam) of
the same run, so no guessed number enters the comparison; ``--target-acc`` overrides it.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python experiments/x.py` works without PYTHONPATH
    sys.path.insert(0, str(ROOT))

OPTIMIZERS = ("thor", "thor_stop", "thor_nt", "kfac", "sgd", "adam")
THOR_FAMILY = ("thor", "thor_stop", "thor_nt", "kfac")
FIRST_ORDER = ("sgd", "adam")
DEFAULT_LR_GRID = {"sgd": (0.01, 0.03, 0.1), "adam": (3e-4, 1e-3, 3e-3)}
QUICK_LR_GRID = {"sgd": (0.03, 0.1), "adam": (1e-3, 3e-3)}
CSV_FIELDS = ("optimizer", "lr", "seed", "epoch", "train_loss", "test_loss", "test_acc",
              "epoch_seconds", "cumulative_seconds", "refreshes")
PLOT_FILES = ("accuracy_vs_epoch.png", "accuracy_vs_time.png", "loss_vs_epoch.png",
              "loss_vs_time.png", "curves.png")
LOSS = "sparse_categorical_crossentropy"
WEIGHT_DECAY_EXCLUDE = ["bias", "gamma", "beta"]

# MindSpore's THOR ResNet-50 (GPU config) schedule shape, rescaled to the run (see lr_schedule()).
THOR_LR_POWER = 4.9687            # lr = lr0 · (1 − epoch/end_epoch)^power
THOR_LR_END_FACTOR = 50 / 40      # end_epoch = 1.25 × the run's epochs (50 for 40 epochs)
THOR_DAMPING_TOTAL_DECAY = 0.5467 ** 4  # damping at the last epoch / λ0 (0.5467 per 10 of 40 epochs)


# --------------------------------------------------------------------------------------------
# Pure helpers
# --------------------------------------------------------------------------------------------

def time_to_target(accuracies, cumulative_seconds, target):
    """``(epochs, seconds)`` of the FIRST epoch whose accuracy is ``>= target``.

    Args:
      accuracies: test accuracy after each epoch (epoch 1 first).
      cumulative_seconds: cumulative training seconds at the end of each epoch (same length).
      target: the accuracy to reach (``None``: no target, returns ``(None, None)``).

    Returns:
      ``(epoch, seconds)`` with epochs counted from 1, or ``(None, None)`` if no epoch reaches the
      target (NaN accuracies never do). No interpolation: accuracy is known only at epoch ends.
    """
    accuracies = list(accuracies)
    cumulative_seconds = list(cumulative_seconds)
    if len(accuracies) != len(cumulative_seconds):
        raise ValueError(
            f"accuracies and cumulative_seconds must have the same length; got "
            f"{len(accuracies)} and {len(cumulative_seconds)}")
    if target is None:
        return None, None
    for i, (acc, seconds) in enumerate(zip(accuracies, cumulative_seconds)):
        if acc is not None and not _isnan(acc) and acc >= target:
            return i + 1, float(seconds)
    return None, None


def _isnan(value):
    return isinstance(value, float) and math.isnan(value)


def median_or_none(values):
    """Median where ``None`` counts as "never" (+inf); ``None`` if the median is never/empty."""
    values = [math.inf if v is None or _isnan(v) else float(v) for v in values]
    if not values:
        return None
    m = statistics.median(values)
    return None if math.isinf(m) or math.isnan(m) else m


def parse_floats(text):
    try:
        values = [float(v) for v in str(text).replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers; got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers; got {text!r}")
    return values


def parse_ints(text):
    try:
        values = [int(v) for v in str(text).replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers; got {text!r}")
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one integer; got {text!r}")
    return values


def parse_optimizers(text):
    names = [v for v in str(text).replace(" ", "").split(",") if v]
    bad = [n for n in names if n not in OPTIMIZERS]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"optimizers must be a comma list from {', '.join(OPTIMIZERS)}; got {text!r}")
    return list(dict.fromkeys(names))


def parse_lr_grid(specs, base):
    """``["sgd=0.01,0.1", "adam=1e-3"]`` (or ``"sgd=...;adam=..."``) over the ``base`` grid."""
    grid = {k: tuple(v) for k, v in base.items()}
    for spec in specs or []:
        for part in str(spec).split(";"):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise argparse.ArgumentTypeError(
                    f"--lr-grid takes NAME=LR[,LR...] with NAME sgd or adam, e.g. "
                    f"'sgd=0.01,0.03;adam=1e-3'; got {part!r}")
            name, values = part.split("=", 1)
            name = name.strip()
            if name not in FIRST_ORDER:
                raise argparse.ArgumentTypeError(
                    f"--lr-grid applies to sgd and adam (THOR variants use --thor-lr); got {name!r}")
            grid[name] = tuple(parse_floats(values))
    return grid


def grid_text(grid, quick_grid):
    """Help text of a script's default and --quick grids."""
    def one(g):
        return " ".join(f"{k}={','.join(f'{v:g}' for v in vs)}" for k, vs in g.items())
    return f"{one(grid)}; --quick: {one(quick_grid)}"


def _split_dim(text):
    try:
        return int(text)
    except ValueError:
        return str(text)  # a calibration JSON path; thor_tf validates it


def _kl_clip(text):
    if str(text).lower() in ("none", "off", "0"):
        return "none"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--kl-clip takes a float > 0 or 'none'; got {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--kl-clip takes a float > 0 or 'none'; got {text!r}")
    return value


def parse_frequency(text):
    """``10``, ``adaptive`` or ``0:10,2:50`` (epoch:interval pairs) -> int, str or list of pairs."""
    text = str(text).replace(" ", "")
    if text == "adaptive":
        return text
    try:
        if ":" not in text:
            value = int(text)
            if value < 1:
                raise ValueError
            return value
        pairs = [tuple(int(x) for x in p.split(":")) for p in text.split(",") if p]
        if any(len(p) != 2 for p in pairs):
            raise ValueError
        return pairs
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"frequency must be an int >= 1, 'adaptive' or epoch:interval pairs such as 0:10,2:50; "
            f"got {text!r}")


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def add_common_arguments(parser, *, out, epochs, batch_size, thor_lr, thor_damping, frequency,
                         kfac_frequency, lr_schedule, lr_grid_text, max_train=None, max_test=None):
    """The flags both scripts share (script-specific defaults passed in)."""
    g = parser.add_argument_group("comparison")
    g.add_argument("--optimizers", type=parse_optimizers, default=["thor"],
                   help=f"comma list from {','.join(OPTIMIZERS)} (default: thor)")
    g.add_argument("--seeds", type=parse_ints, default=[0],
                   help="comma list of seeds; medians over seeds are reported (default: 0)")
    g.add_argument("--epochs", type=int, default=epochs, help=f"default {epochs}")
    g.add_argument("--batch-size", type=int, default=batch_size, help=f"default {batch_size}")
    g.add_argument("--target-acc", type=float, default=None,
                   help="test accuracy for time-to-target (default: the final test accuracy of "
                        "the best first-order baseline, sgd/adam, of this run)")
    g.add_argument("--lr-grid", action="append", default=None, metavar="NAME=LR,...",
                   help="learning rates for sgd/adam, e.g. 'sgd=0.01,0.03,0.1;adam=3e-4,1e-3' "
                        f"(repeatable; default {lr_grid_text})")
    g.add_argument("--lr-schedule", choices=("constant", "poly"), default=lr_schedule,
                   help="learning-rate schedule of every optimizer: constant, or THOR's "
                        "polynomial decay lr0*(1-epoch/(1.25*epochs))^4.9687 "
                        f"(default {lr_schedule})")
    g.add_argument("--baseline-lr-schedule", choices=("constant", "poly"), default=None,
                   help="schedule of SGD/Adam when it should differ from --lr-schedule (THOR's "
                        "steep polynomial decay stalls first-order methods on short runs)")
    g.add_argument("--weight-decay", type=float, default=0.0,
                   help="L2 weight decay on kernels (THOR: coupled, added to the update; "
                        "SGD: Keras weight_decay; Adam becomes AdamW). Default 0")
    g.add_argument("--max-train", type=int, default=max_train,
                   help="use a random training subset of this size (default: all)")
    g.add_argument("--max-test", type=int, default=max_test,
                   help="use a random test subset of this size (default: all)")
    g.add_argument("--out", default=out, help=f"output directory (default {out})")
    g.add_argument("--quick", action="store_true",
                   help="tiny smoke run (< 2 min on 2 CPU cores)")
    g.add_argument("--verbose", action="store_true",
                   help="Keras progress bars and the THOR registration table of every model")

    t = parser.add_argument_group("THOR / K-FAC")
    t.add_argument("--thor-lr", type=parse_floats, default=[thor_lr],
                   help=f"learning rate(s) of the THOR variants, comma list (default {thor_lr})")
    t.add_argument("--thor-damping", type=float, default=thor_damping,
                   help=f"damping λ (initial value when --lr-schedule poly) (default {thor_damping})")
    t.add_argument("--frequency", type=parse_frequency, default=frequency,
                   help=f"THOR cadence: int, 'adaptive' or epoch:interval pairs (default {frequency})")
    t.add_argument("--split-dim", type=_split_dim, default=None,
                   help="split inverse block size, or a calibration JSON from "
                        "scripts/calibrate_split_dim.py (default: thor_tf's default)")
    t.add_argument("--kl-clip", type=_kl_clip, default=None,
                   help="K-FAC trust region κ on the preconditioned step, or 'none' to turn it "
                        "off (default: thor_tf's default)")
    t.add_argument("--trace-filter", choices=("mean", "none"), default=None,
                   help="trace-rule noise filter; none: the rule as published (default: "
                        "thor_tf's default)")
    t.add_argument("--factor-examples", type=int, default=None,
                   help="factors from the first k examples of each batch (K-FAC sub-batch; "
                        "default: the whole batch)")
    t.add_argument("--kfac-frequency", type=parse_frequency, default=kfac_frequency,
                   help=f"K-FAC cadence (default {kfac_frequency})")
    t.add_argument("--kfac-lr", type=float, default=None, help="K-FAC learning rate (default --thor-lr)")
    t.add_argument("--kfac-damping", type=float, default=None,
                   help="K-FAC damping (default --thor-damping)")
    return parser


# --------------------------------------------------------------------------------------------
# Models and optimizers
# --------------------------------------------------------------------------------------------

def lr_schedule(kind, lr0, epochs, steps_per_epoch):
    """The learning rate (float or schedule) of every optimizer for ``--lr-schedule``."""
    if kind == "constant":
        return float(lr0)
    from thor_tf.schedules import ThorPolynomialDecay
    # MindSpore's ResNet-50 THOR: 40 epochs, end_epoch 50, power 4.9687. The late double halving
    # (decay_epochs 39) is left out: at 39/40 of the run the polynomial has already decayed lr
    # to ~1e-4·lr0.
    return ThorPolynomialDecay(float(lr0), THOR_LR_END_FACTOR * epochs, THOR_LR_POWER,
                               steps_per_epoch)


def damping_schedule(kind, damping0, epochs, steps_per_epoch):
    """THOR's damping (float or ``ThorDampingDecay``), rescaled so the decay over the run equals
    MindSpore's over 40 epochs (×0.5467⁴ ≈ 0.089): rate per 10 epochs = 0.5467^(40/epochs)."""
    if kind == "constant":
        return float(damping0)
    from thor_tf.schedules import ThorDampingDecay
    rate = THOR_DAMPING_TOTAL_DECAY ** (10.0 / max(epochs, 1))
    return ThorDampingDecay(float(damping0), rate, steps_per_epoch)


def make_model(optimizer, lr, build_model, args, steps_per_epoch, show_table):
    """Build the model (the caller has seeded), wrap/compile it for ``optimizer``."""
    import keras
    import thor_tf

    model = build_model()
    kind = args.lr_schedule
    if optimizer in FIRST_ORDER and args.baseline_lr_schedule is not None:
        kind = args.baseline_lr_schedule
    lr_value = lr_schedule(kind, lr, args.epochs, steps_per_epoch)
    metrics = ["accuracy"]
    if optimizer in THOR_FAMILY:
        damping = args.thor_damping
        options = dict(preset=optimizer, frequency=args.frequency)
        if optimizer == "kfac":
            damping = args.kfac_damping if args.kfac_damping is not None else args.thor_damping
            options = dict(preset="thor_nt", fisher="sampled", factor_decay=0.95,
                           frequency=args.kfac_frequency)
        if args.weight_decay:
            options.update(weight_decay=args.weight_decay,
                           weight_decay_exclude=WEIGHT_DECAY_EXCLUDE)
        if args.split_dim is not None:
            options.update(split_dim=args.split_dim)
        if args.trace_filter is not None:
            options.update(trace_filter=args.trace_filter)
        if args.kl_clip is not None:
            options.update(kl_clip=None if args.kl_clip == "none" else args.kl_clip)
        if args.factor_examples is not None:
            options.update(factor_examples=args.factor_examples)
        wrapped = thor_tf.wrap(
            model, learning_rate=lr_value, momentum=0.9,
            damping=damping_schedule(args.lr_schedule, damping, args.epochs, steps_per_epoch),
            verbose=show_table, **options)
        wrapped.compile(loss=LOSS, metrics=metrics)
        return wrapped
    if optimizer == "sgd":
        opt = keras.optimizers.SGD(lr_value, momentum=0.9,
                                   weight_decay=args.weight_decay or None)
    elif optimizer == "adam":
        if args.weight_decay:
            opt = keras.optimizers.AdamW(lr_value, weight_decay=args.weight_decay)
        else:
            opt = keras.optimizers.Adam(lr_value)
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}")
    if args.weight_decay:
        opt.exclude_from_weight_decay(var_names=WEIGHT_DECAY_EXCLUDE)
    model.compile(optimizer=opt, loss=LOSS, metrics=metrics)
    return model


def thor_totals(model):
    """``(refreshes, reuses, frozen layers)`` summed over layers; zeros for first-order models."""
    engine = getattr(model, "thor", None)
    if engine is None:
        return 0, 0, 0
    stats = engine.layer_stats()  # zeros before the optimizer state exists
    return (sum(s["refreshes"] for s in stats), sum(s["reuses"] for s in stats),
            sum(bool(s["frozen"]) for s in stats))


def _epoch_timer():
    import keras

    class EpochTimer(keras.callbacks.Callback):
        """Wall time of the training part of one epoch (on_epoch_begin -> on_epoch_end)."""

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds = time.perf_counter() - self.start
            self.logs = dict(logs or {})

    return EpochTimer()


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------

@dataclass
class RunResult:
    optimizer: str
    lr: float
    seed: int
    rows: list = field(default_factory=list)
    steps_per_epoch: int = 0
    layer_stats: list = None
    counters: dict = None

    @property
    def accuracies(self):
        return [r["test_acc"] for r in self.rows]

    @property
    def cumulative(self):
        return [r["cumulative_seconds"] for r in self.rows]

    @property
    def final_acc(self):
        return self.rows[-1]["test_acc"] if self.rows else float("nan")

    def mean_step_seconds(self):
        """Training seconds per step, without the first epoch (tracing) when there are more."""
        rows = self.rows[1:] if len(self.rows) > 1 else self.rows
        steps = self.steps_per_epoch * len(rows)
        return sum(r["epoch_seconds"] for r in rows) / steps if steps else None


class CsvLog:
    """``metrics.csv``: header once, one flushed row per epoch (a killed run keeps its rows)."""

    def __init__(self, path):
        self.path = Path(path)
        self._fh = open(self.path, "w", newline="")
        self._writer = csv.DictWriter(self._fh, fieldnames=CSV_FIELDS)
        self._writer.writeheader()
        self._fh.flush()

    def write(self, row):
        self._writer.writerow({k: row[k] for k in CSV_FIELDS})
        self._fh.flush()

    def close(self):
        self._fh.close()


class _NoRetracingWarning:
    """Drops TF's "triggered tf.function retracing" warning: every run builds a fresh model, and
    TF counts their train functions together, so the warning is noise here."""

    @staticmethod
    def filter(record):
        return "triggered tf.function retracing" not in record.getMessage()


def train_run(optimizer, lr, seed, build_model, ds, args, csv_log, show_table=False):
    """Train one configuration; one CSV row and one printed line per epoch."""
    import keras
    import numpy as np
    import tensorflow as tf

    logger = tf.get_logger()
    if not any(isinstance(f, _NoRetracingWarning) for f in logger.filters):
        logger.addFilter(_NoRetracingWarning())
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)  # same initial weights for every optimizer
    n = ds.x_train.shape[0]
    steps_per_epoch = math.ceil(n / args.batch_size)
    model = make_model(optimizer, lr, build_model, args, steps_per_epoch, show_table)
    order = np.random.default_rng([seed, 2024])  # same data order for every optimizer
    result = RunResult(optimizer, float(lr), int(seed), steps_per_epoch=steps_per_epoch)
    tag = f"[{optimizer} lr={lr:g} seed={seed}]"
    cumulative = 0.0
    for epoch in range(args.epochs):
        perm = order.permutation(n)
        x, y = ds.x_train[perm], ds.y_train[perm]
        timer = _epoch_timer()
        model.fit(x, y, batch_size=args.batch_size, epochs=epoch + 1, initial_epoch=epoch,
                  shuffle=False, verbose=1 if args.verbose else 0, callbacks=[timer])
        cumulative += timer.seconds
        evaluation = model.evaluate(ds.x_test, ds.y_test, batch_size=1024, verbose=0,
                                    return_dict=True)
        refreshes, reuses, frozen = thor_totals(model)
        row = {
            "optimizer": optimizer, "lr": float(lr), "seed": int(seed), "epoch": epoch + 1,
            "train_loss": float(timer.logs.get("loss", float("nan"))),
            "test_loss": float(evaluation["loss"]),
            "test_acc": float(evaluation.get("accuracy", evaluation.get("compile_metrics", 0))),
            "epoch_seconds": round(timer.seconds, 4),
            "cumulative_seconds": round(cumulative, 4),
            "refreshes": int(refreshes),
        }
        result.rows.append(row)
        csv_log.write(row)
        extra = ""
        if optimizer in THOR_FAMILY:
            extra = f"  refreshes {refreshes} reuses {reuses} frozen {frozen}"
            nonfinite = model.thor.counters()["nonfinite_steps"]
            if nonfinite:  # THOR skips such steps; many of them mean the run has diverged
                extra += f"  NON-FINITE STEPS SKIPPED {nonfinite}"
        print(f"{tag} epoch {epoch + 1}/{args.epochs}  train_loss {row['train_loss']:.4f}  "
              f"test_loss {row['test_loss']:.4f}  test_acc {row['test_acc']:.4f}  "
              f"time {timer.seconds:.1f}s (total {cumulative:.1f}s){extra}", flush=True)
    if optimizer in THOR_FAMILY:
        result.layer_stats = model.thor.layer_stats()
        result.counters = model.thor.counters()
    return result


def run_grid(args):
    """``[(optimizer, lr), ...]`` in the order of ``--optimizers``."""
    grid = []
    for name in args.optimizers:
        if name in FIRST_ORDER:
            lrs = args.lr_grid[name]
        elif name == "kfac" and args.kfac_lr is not None:
            lrs = [args.kfac_lr]
        else:
            lrs = args.thor_lr
        grid += [(name, float(lr)) for lr in lrs]
    return grid


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------

def _by_config(results):
    configs = {}
    for r in results:
        configs.setdefault((r.optimizer, r.lr), []).append(r)
    return configs


def _score(value):
    return -math.inf if value is None or _isnan(value) else value


def best_configs(results):
    """``{optimizer: (lr, [RunResult per seed])}`` with the best median final accuracy."""
    best = {}
    for (name, lr), runs in _by_config(results).items():
        acc = median_or_none([r.final_acc for r in runs])
        if name not in best or _score(acc) > _score(best[name][2]):
            best[name] = (lr, runs, acc)
    return {k: (lr, runs) for k, (lr, runs, _) in best.items()}


def choose_target(results, target_acc):
    """``(target, source text)``: ``--target-acc``, else the best sgd/adam final accuracy."""
    if target_acc is not None:
        return float(target_acc), "--target-acc"
    best = best_configs(results)
    candidates = [(median_or_none([r.final_acc for r in runs]), name, lr)
                  for name, (lr, runs) in best.items() if name in FIRST_ORDER]
    candidates = [c for c in candidates if c[0] is not None]
    if not candidates:
        return None, ("no first-order baseline (sgd/adam) in this run and no --target-acc, so no "
                      "time-to-target")
    acc, name, lr = max(candidates)
    return acc, f"final test accuracy of the best first-order baseline ({name}, lr={lr:g})"


def _jsonable(value):
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            return _jsonable(value.item())
        except (TypeError, ValueError):
            pass
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def environment_info():
    import keras
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        names = []
        for g in gpus:
            try:
                names.append(tf.config.experimental.get_device_details(g).get("device_name", g.name))
            except Exception:  # noqa: BLE001 - details are best effort
                names.append(g.name)
        device = "GPU: " + ", ".join(names)
    else:
        device = f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    return {"device": device, "tensorflow": tf.__version__, "keras": keras.__version__,
            "python": platform.python_version(), "platform": platform.platform()}


def summarize(results, args, dataset_info, model_name):
    target, source = choose_target(results, args.target_acc)
    optimizers = {}
    for name, (lr, runs) in best_configs(results).items():
        per_seed = []
        for r in runs:
            epochs, seconds = time_to_target(r.accuracies, r.cumulative, target)
            per_seed.append({
                "seed": r.seed, "final_acc": r.final_acc, "epochs_to_target": epochs,
                "seconds_to_target": seconds, "total_seconds": r.cumulative[-1] if r.rows else None,
                "mean_step_seconds": r.mean_step_seconds(),
                "first_epoch_seconds": r.rows[0]["epoch_seconds"] if r.rows else None,
                "refreshes": r.rows[-1]["refreshes"] if r.rows else 0,
            })
        entry = {
            "lr": lr,
            "epochs_to_target": median_or_none([s["epochs_to_target"] for s in per_seed]),
            "seconds_to_target": median_or_none([s["seconds_to_target"] for s in per_seed]),
            "final_acc": median_or_none([s["final_acc"] for s in per_seed]),
            "mean_step_seconds": median_or_none([s["mean_step_seconds"] for s in per_seed]),
            "total_seconds": median_or_none([s["total_seconds"] for s in per_seed]),
            # includes graph tracing (THOR's train step traces much longer than a plain one)
            "first_epoch_seconds": median_or_none([s["first_epoch_seconds"] for s in per_seed]),
            "refreshes": median_or_none([s["refreshes"] for s in per_seed]),
            "target": target,
            "steps_per_epoch": runs[0].steps_per_epoch,
            "per_seed": per_seed,
            "grid": [{"lr": clr, "final_acc": median_or_none([r.final_acc for r in cruns])}
                     for (cname, clr), cruns in _by_config(results).items() if cname == name],
        }
        if runs[0].layer_stats is not None:
            entry["layer_stats"] = runs[0].layer_stats  # first seed of the best config
            entry["counters"] = runs[0].counters
        optimizers[name] = entry
    args_dict = {k: (v if not isinstance(v, tuple) else list(v)) for k, v in vars(args).items()}
    summary = {
        "target": target,
        "target_source": source,
        "optimizers": {k: optimizers[k] for k in args.optimizers if k in optimizers},
        "dataset": dataset_info,
        "model": model_name,
        "args": args_dict,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        **environment_info(),
    }
    return _jsonable(summary)


def write_summary(summary, out_dir):
    path = Path(out_dir) / "summary.json"
    path.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    return path


def median_curves(runs):
    """Per-epoch medians over seeds: epoch, test_acc, train_loss, cumulative_seconds."""
    epochs = min(len(r.rows) for r in runs)
    curves = {"epoch": list(range(1, epochs + 1))}
    for key in ("test_acc", "train_loss", "test_loss", "cumulative_seconds"):
        curves[key] = [statistics.median(r.rows[e][key] for r in runs) for e in range(epochs)]
    return curves


def plot_curves(results, summary, out_dir, title):
    """The four PNGs (and ``curves.png``, all four panels): best config per optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_configs(results)
    target = summary.get("target")
    curves = {name: (lr, median_curves(runs)) for name, (lr, runs) in best.items()}
    panels = [
        ("accuracy_vs_epoch.png", "epoch", "test_acc", "epoch", "test accuracy"),
        ("accuracy_vs_time.png", "cumulative_seconds", "test_acc",
         "training wall time (s, cumulative)", "test accuracy"),
        ("loss_vs_epoch.png", "epoch", "train_loss", "epoch", "train loss (epoch mean)"),
        ("loss_vs_time.png", "cumulative_seconds", "train_loss",
         "training wall time (s, cumulative)", "train loss (epoch mean)"),
    ]
    nseeds = len({r.seed for r in results})
    suffix = f" (median of {nseeds} seeds)" if nseeds > 1 else ""

    def draw(ax, xkey, ykey, xlabel, ylabel):
        for name in [n for n in OPTIMIZERS if n in curves]:
            lr, c = curves[name]
            ax.plot(c[xkey], c[ykey], marker="o", markersize=4, label=f"{name} (lr {lr:g})")
        if ykey == "test_acc" and target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1,
                       label=f"target {target:.4f}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if xkey == "epoch":
            ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)

    paths = []
    for fname, xkey, ykey, xlabel, ylabel in panels:
        fig, ax = plt.subplots(figsize=(6, 4.2))
        draw(ax, xkey, ykey, xlabel, ylabel)
        ax.set_title(f"{title}{suffix}", fontsize=10)
        fig.tight_layout()
        path = Path(out_dir) / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (_, xkey, ykey, xlabel, ylabel) in zip(axes.flat, panels):
        draw(ax, xkey, ykey, xlabel, ylabel)
    fig.suptitle(f"{title}{suffix}")
    fig.tight_layout()
    path = Path(out_dir) / "curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


def _fmt(value, spec, none="never"):
    if value is None:
        return none
    return format(value, spec)


def summary_table(summary):
    """The table printed at the end (best config per optimizer, medians over seeds)."""
    target = summary["target"]
    head = ("optimizer", "lr", "final acc", "epochs->target", "s->target", "s/step",
            "train s", "refreshes")
    rows = [head]
    for name, e in summary["optimizers"].items():
        rows.append((name, _fmt(e["lr"], "g"), _fmt(e["final_acc"], ".4f", "nan"),
                     _fmt(e["epochs_to_target"], "g", "never" if target is not None else "-"),
                     _fmt(e["seconds_to_target"], ".1f", "never" if target is not None else "-"),
                     _fmt(e["mean_step_seconds"], ".4f", "-"),
                     _fmt(e["total_seconds"], ".1f", "-"), _fmt(e["refreshes"], "g", "-")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    if target is None:
        lines.insert(0, f"no target accuracy ({summary['target_source']})")
    else:
        lines.insert(0, f"target accuracy {target:.4f}: {summary['target_source']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------

def finish_args(args, default_grid=None, quick_grid=None):
    """Validate and complete the shared arguments (after the script applied --quick).

    ``--lr-grid`` entries override the script's grid (``quick_grid`` under ``--quick``, else
    ``default_grid``; both default to this module's grids)."""
    if args.epochs < 1:
        raise SystemExit("--epochs must be >= 1")
    if args.batch_size < 1:
        raise SystemExit("--batch-size must be >= 1")
    try:
        base = (quick_grid or QUICK_LR_GRID) if args.quick else (default_grid or DEFAULT_LR_GRID)
        args.lr_grid = parse_lr_grid(args.lr_grid, base)
    except argparse.ArgumentTypeError as err:
        raise SystemExit(f"error: {err}")
    return args


def run_experiment(args, ds, build_model, model_name, title):
    """Train every (optimizer, lr, seed), then write summary.json, plots, and print the table."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grid = run_grid(args)
    steps = math.ceil(ds.x_train.shape[0] / args.batch_size)
    print(f"{title}: {len(grid)} configuration(s) x {len(args.seeds)} seed(s), {args.epochs} "
          f"epoch(s) of {steps} steps (batch {args.batch_size}), lr schedule {args.lr_schedule}"
          f"{'' if args.baseline_lr_schedule is None else ' (sgd/adam: ' + args.baseline_lr_schedule + ')'}; "
          f"output in {out}", flush=True)
    if any(name in THOR_FAMILY for name, _ in grid):
        from thor_tf import ThorOptimizer

        defaults = ThorOptimizer()  # what thor_tf uses for the options not given here
        split = args.split_dim if args.split_dim is not None else defaults.split_dim
        trace_filter = (args.trace_filter if args.trace_filter is not None
                        else getattr(defaults, "trace_filter", "none"))
        kl_clip = args.kl_clip if args.kl_clip is not None else getattr(defaults, "kl_clip", None)
        print(f"THOR: lr {','.join(f'{v:g}' for v in args.thor_lr)}, damping {args.thor_damping:g}, "
              f"frequency {args.frequency}, momentum 0.9, split_dim {split}, "
              f"trace_filter {trace_filter}, kl_clip {kl_clip}, "
              f"factor_examples {args.factor_examples or 'all'}", flush=True)
    csv_log = CsvLog(out / "metrics.csv")
    results = []
    shown = False
    try:
        for seed in args.seeds:
            for name, lr in grid:
                show = args.verbose or (name in THOR_FAMILY and not shown)
                shown = shown or name in THOR_FAMILY
                results.append(train_run(name, lr, seed, build_model, ds, args, csv_log,
                                         show_table=show))
    finally:
        csv_log.close()
    dataset_info = {"name": ds.name, "source": ds.source, "num_train": int(ds.x_train.shape[0]),
                    "num_test": int(ds.x_test.shape[0]), "input_shape": list(ds.input_shape),
                    "num_classes": int(ds.num_classes)}
    summary = summarize(results, args, dataset_info, model_name)
    write_summary(summary, out)
    plot_curves(results, summary, out, title)
    print()
    print(summary_table(summary))
    print(f"\nwrote {out / 'metrics.csv'}, {out / 'summary.json'} and "
          f"{', '.join(PLOT_FILES)} in {out}")
    return summary
