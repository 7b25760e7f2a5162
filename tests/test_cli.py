"""The drivers' shared argument parsing (experiments/cli.py): each parser's values and the error
that names what it takes. No TensorFlow except the default peak, checked in
tests/test_experiments.py against what ``wrap`` gives a run."""

import argparse
import types

import pytest

from experiments import cli


def test_numbers_and_names():
    assert cli.parse_floats("1e-3, 3e-3,") == [1e-3, 3e-3]
    assert cli.parse_ints("0,1, 2") == [0, 1, 2]
    assert cli.parse_optimizers("adam,thor,adam") == ["adam", "thor"]
    for parse, text in ((cli.parse_floats, "0.1,-1"), (cli.parse_floats, "x"),
                        (cli.parse_floats, ""), (cli.parse_ints, "1.5"), (cli.parse_ints, ""),
                        (cli.parse_optimizers, "adam,lion")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_thor_option_values_are_literals_or_strings():
    assert cli.parse_thor_option("peak=0.01") == ("peak", 0.01)
    assert cli.parse_thor_option("rule={'beta_2': 0.99}") == ("rule", {"beta_2": 0.99})
    assert cli.parse_thor_option("preset=thor_nt") == ("preset", "thor_nt")
    for bad in ("peak", "=1", "2x=1"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=VALUE"):
            cli.parse_thor_option(bad)


def test_lr_grid_overrides_named_baselines_only():
    base = {"adam": (1e-3,), "muon": (1e-2, 3e-2)}
    grid = cli.parse_lr_grid(["adam=1e-2,3e-2", "muon=1e-3; sgd=0.1"], base)
    assert grid == {"adam": (1e-2, 3e-2), "muon": (1e-3,), "sgd": (0.1,)}
    assert base == {"adam": (1e-3,), "muon": (1e-2, 3e-2)}          # not changed
    assert cli.parse_lr_grid(None, base) == base
    with pytest.raises(argparse.ArgumentTypeError, match="NAME=LR"):
        cli.parse_lr_grid(["adam"], base)
    with pytest.raises(argparse.ArgumentTypeError, match="applies to adamw, muon"):
        cli.parse_lr_grid(["adam=0.1"], base, allowed=("adamw", "muon"))
    assert cli.grid_help({"adamw": (1e-3, 3e-3)}, {"adamw": (1e-2,)}) == (
        "adamw=0.001,0.003; --quick: adamw=0.01")


def test_require_positive_names_the_argument():
    cli.require_positive(types.SimpleNamespace(steps=1, eval_every=3), ["steps", "eval_every"])
    with pytest.raises(SystemExit, match="--eval-every must be >= 1"):
        cli.require_positive(types.SimpleNamespace(steps=1, eval_every=0),
                             ["steps", "eval_every"])
