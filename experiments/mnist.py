"""The main job: THOR at its defaults against Adam and Muon at their best rates, on the CNN.

    python experiments/mnist.py                         # Fashion-MNIST, seed 0 (~10 min, 2 cores)
    python experiments/mnist.py --seeds 0,1,2 --tune-first-seed   # the README's row
    python experiments/mnist.py --quick                 # digits, tiny: a smoke run (CI)
    python experiments/mnist.py --optimizers thor,sgd,adam --lr-grid sgd=0.03,0.1,0.3

The suite's harness (``experiments/suite.py``) on one workload: the suite's Fashion-MNIST CNN
(``workloads.fashion_cnn``'s model, loss and baselines' recipe) on the whole data set (60,000
training and 10,000 test images) for 3 epochs of batch 128 (1,404 steps), or, where Fashion-MNIST
is not on the machine and cannot be downloaded, the suite's digits CNN for 10 epochs of batch 64
on 3 seeds (one test image is 0.28 points there, so one seed's verdict is luck).

Fashion-MNIST comes from a local copy first (Debian's ``dataset-fashion-mnist`` in
/usr/share/datasets/fashion-mnist, Keras' cache ~/.keras/datasets/fashion-mnist), else from a
download through ``keras.datasets.fashion_mnist`` when the network allows (tried for a few
seconds at most; ``--no-download`` skips it); else digits, with one line saying so and how to get
Fashion-MNIST.

What runs is the suite's: THOR is what a user gets, ``thor_tf.wrap(model, learning_rate=
thor_tf.schedules.WarmupCosine(total_steps))`` with every other option at thor_tf's default
(``--thor-option NAME=VALUE`` changes one, ``peak=X`` its peak rate); the baselines run their
standard schedule (linear warmup over 5 % of the steps, then cosine to 0) over ``--lr-grid``
(Adam and Muon at 3e-3, 1e-2 and 3e-2 on Fashion-MNIST, which bracket each one's best at
1,404 steps: 1e-2 for both; on digits the suite's three rates each, which bracket them). For a
seed every run starts from the same weights and sees the same batches; the runs of a seed train
back to back, THOR first on every other seed (``--tune-first-seed``: the grids on the first seed
only, then THOR and the best baseline); the test accuracy is measured at step 0 and ``--evals``
evenly spaced steps (untimed); seconds are training seconds, the first tracing included, with
the load other processes put on the machine, so that THOR's seconds are compared with the best
baseline's only when both had about the same CPU (docs/timing.md).

Printed: where the data came from, THOR's registration table, a line per evaluation of each run,
and the table: each optimizer's median final accuracy at its best rate, and steps and seconds to
the **target**, the best baseline's median final accuracy. Outputs in ``--out`` (default
``runs/mnist``): ``metrics.csv`` (every evaluation of every run), ``main_job.json`` (the summary,
the record README's rows are made from), ``main_job.md`` (the table) and ``main_job.png`` (the
median curves).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from experiments import cli, suite, workloads as wl  # noqa: E402

DATASETS = ("auto", "fashion_mnist", "mnist", "digits")
MODELS = ("mlp", "mlp_wide", "cnn")
#: The baselines' rates on Fashion-MNIST: three a factor ~3 apart, which bracket Adam's and Muon's
#: best (1e-2 for both at 1,404 steps, seed 0: docs/results/main_job_fashion.json).
LR_GRID = {"sgd": (0.03, 0.1, 0.3), "adam": (3e-3, 1e-2, 3e-2), "adamw": (3e-3, 1e-2, 3e-2),
           "muon": (3e-3, 1e-2, 3e-2)}
#: On digits the suite's bracketing grids (Adam's best 3e-2 between 1e-2 and 0.1, Muon's 1e-2
#: between 3e-3 and 3e-2): its runs are short enough to afford three rates.
DIGITS_LR_GRID = {"sgd": (0.03, 0.1, 0.3), "adam": (1e-2, 3e-2, 0.1), "adamw": (1e-2, 3e-2, 0.1),
                  "muon": (3e-3, 1e-2, 3e-2)}
QUICK_LR_GRID = {"sgd": (0.1,), "adam": (1e-2,), "adamw": (1e-2,), "muon": (1e-2,)}
#: Fashion-MNIST / MNIST: 3 epochs of 128; digits: 3 epochs of 128 would be 33 steps, too few to
#: compare optimizers by: 10 of 64, on 3 seeds.
EPOCHS, BATCH = 3, 128
DIGITS_EPOCHS, DIGITS_BATCH = 10, 64
DIGITS_SEEDS = (0, 1, 2)
#: Muon joins when this Keras has it (3.10 and later).
MAIN_JOB_OPTIMIZERS = ("thor", "adam", "muon") if cli.muon_available() else ("thor", "adam")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--dataset", choices=DATASETS, default=None,
                        help="default auto: fashion_mnist when installed or downloadable, else "
                             "digits (--quick: digits)")
    parser.add_argument("--model", choices=MODELS, default="cnn", help="default cnn")
    parser.add_argument("--no-download", action="store_true",
                        help="never download Fashion-MNIST (auto: digits when it is not local)")
    parser.add_argument("--optimizers", type=cli.parse_optimizers,
                        default=list(MAIN_JOB_OPTIMIZERS),
                        help=f"comma list from {','.join(cli.OPTIMIZERS)} (default "
                             f"{','.join(MAIN_JOB_OPTIMIZERS)})")
    parser.add_argument("--seeds", type=cli.parse_ints, default=None,
                        help="comma list (default 0 on Fashion-MNIST and under --quick, "
                             "0,1,2 on digits)")
    parser.add_argument("--epochs", type=int, default=None,
                        help=f"default {EPOCHS} ({DIGITS_EPOCHS} on digits, 2 under --quick)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"default {BATCH} ({DIGITS_BATCH} on digits and under --quick)")
    parser.add_argument("--max-train", type=int, default=None,
                        help="a training subset of this size, the same for every seed "
                             "(default all; --quick 1024 on datasets other than digits)")
    parser.add_argument("--max-test", type=int, default=None,
                        help="a test subset of this size (default all; --quick 512 likewise)")
    parser.add_argument("--evals", type=int, default=None,
                        help="evaluations per run after step 0 (default 10; --quick 4)")
    parser.add_argument("--lr-grid", action="append", default=[], metavar="NAME=LR,...",
                        help="a baseline's rates, e.g. adam=3e-3,1e-2 (repeatable; default "
                             + ", ".join(f"{k}={','.join(f'{v:g}' for v in g)}"
                                         for k, g in LR_GRID.items())
                             + " on Fashion-MNIST; digits: higher)")
    parser.add_argument("--thor-option", type=cli.parse_thor_option, action="append",
                        default=[], metavar="NAME=VALUE",
                        help="a thor_tf.wrap option other than its default, e.g. "
                             "update_rule=inverse or peak=0.01 (repeatable)")
    parser.add_argument("--tune-first-seed", action="store_true",
                        help="the grids on the first seed only, then THOR and the best baseline "
                             "at its rate on the others (as lm.py and finetune.py)")
    parser.add_argument("--out", default="runs/mnist", help="output directory (runs/mnist)")
    parser.add_argument("--quick", action="store_true",
                        help="digits, 2 epochs of 64, one rate per baseline, seed 0 (CI)")
    args = parser.parse_args(argv)
    if "muon" in args.optimizers:
        cli.require_muon()
    from experiments import datasets

    if args.quick and args.dataset is None:
        args.dataset = "digits"
    if args.dataset in (None, "auto"):  # local Fashion-MNIST, else a Keras download, else digits
        args.dataset = datasets.resolve_auto(download=not args.no_download)
    digits = args.dataset == "digits"
    if args.quick and not digits:
        args.max_train = args.max_train or 1024
        args.max_test = args.max_test or 512
    defaults = dict(epochs=2 if args.quick else DIGITS_EPOCHS if digits else EPOCHS,
                    batch_size=DIGITS_BATCH if digits or args.quick else BATCH,
                    seeds=[0] if args.quick or not digits else list(DIGITS_SEEDS),
                    evals=4 if args.quick else 10)
    for name, value in defaults.items():  # what the command line left unsaid: the dataset's
        if getattr(args, name) is None:
            setattr(args, name, value)
    cli.require_positive(args, ("epochs", "batch_size", "evals"))
    default = QUICK_LR_GRID if args.quick else DIGITS_LR_GRID if digits else LR_GRID
    try:
        args.lr_grid = {**default, **cli.parse_lr_grid(args.lr_grid, {})}
    except argparse.ArgumentTypeError as err:
        raise SystemExit(f"error: {err}")
    args.thor_option = dict(args.thor_option)
    args.argv = argv
    return args


def main_job_workload(args, ds):
    """The suite's CNN workload (digits' or Fashion-MNIST's: model, loss, metric, baselines'
    recipe) on ``ds`` at this run's epochs, batch, model and grids."""
    from experiments import models

    base = wl.WORKLOADS["digits_cnn" if ds.name == "digits" else "fashion_cnn"]
    data = wl.Data(ds.x_train, ds.y_train, ds.x_test, ds.y_test,
                   f"{ds.name}: {ds.num_train} train / {ds.num_test} test ({ds.source})")
    grids = {b: args.lr_grid[b] for b in args.optimizers if b != "thor"}
    return dataclasses.replace(
        base, name="main_job", title=f"{args.model} on {ds.name}", load=lambda quick: data,
        build=lambda data, quick: models.build(args.model, ds.input_shape, ds.num_classes),
        epochs=args.epochs, batch_size=args.batch_size, baselines=grids, quick={}), data


def main(argv=None):
    args = parse_args(argv)
    from experiments import datasets

    ds = datasets.load_dataset(args.dataset, max_train=args.max_train, max_test=args.max_test,
                               verbose=True, seed=0, download=not args.no_download)
    workload, data = main_job_workload(args, ds)
    dataset = {"name": ds.name, "source": ds.source, "num_train": int(ds.num_train),
               "num_test": int(ds.num_test), "input_shape": list(ds.input_shape)}
    return suite.drive(workload, data, args, args.out, "main_job", "experiments/mnist.py",
                       tuned=args.tune_first_seed, epochs=args.epochs,
                       batch_size=args.batch_size, model=args.model,
                       dataset=dataset)


if __name__ == "__main__":
    main()
