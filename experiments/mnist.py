"""THOR on the MNIST family: train, compare with SGD / Adam / K-FAC, plot.

With no arguments this is thor_tf's "main job": it trains a small CNN on Fashion-MNIST for 3
epochs with THOR, Adam and Muon, side by side from the same initial weights and data order,
prints per-epoch loss, accuracy and time, and ends with a table of final accuracy and epochs /
seconds to the best baseline's final accuracy, plus the plots (a few minutes on 2 CPU cores)::

    python experiments/mnist.py

Fashion-MNIST comes from a local copy first (Debian's ``dataset-fashion-mnist`` in
/usr/share/datasets/fashion-mnist, Keras' cache ~/.keras/datasets/fashion-mnist), else from a
download through ``keras.datasets.fashion_mnist`` when the network allows (tried for a few
seconds at most; ``--no-download`` skips it); else the main job runs scikit-learn's digits, one
line saying so and how to get Fashion-MNIST: 10 epochs of batch 64 and 3 seeds (one test image is
0.28 points there, so one seed's verdict is luck), reporting medians over the seeds.

Seconds are measured honestly (``experiments/timing.py``, docs/timing.md): the optimizers of a
seed run back to back in this process, THOR first on the 1st and 3rd seed and last on the 2nd;
each run's first epoch (tracing) and steady seconds per step are apart, and the load other
processes put on the machine is recorded per run. THOR's seconds are compared with the best
baseline's only when those loads leave both about the same CPU (else "not comparable", and why).

THOR is what a user gets: ``thor_tf.wrap(model, learning_rate=
thor_tf.schedules.WarmupCosine(total_steps))`` with every other option at thor_tf's default
(the default update rule at its peak rate, a cadence point every 10 steps;
``--update-rule inverse --thor-lr 0.05`` for THOR's inverse rule). Adam and Muon run with
their standard schedule (linear warmup over 5 % of the steps, then cosine to 0) at their best
rates: the main job runs 3e-3 and 1e-2 for each on Fashion-MNIST, 1e-2 and 3e-2 on digits
(``--lr-grid`` to change; the summary reports the better; the suite, ``experiments/suite.py``,
brackets them with a third rate: docs/suite.md).

A comparison (medians over seeds)::

    python experiments/mnist.py --optimizers thor,thor_stop,kfac,sgd,adam --seeds 0,1,2 --epochs 10

Muon (``keras.optimizers.Muon``, Keras >= 3.10) and AdamW are baselines too, e.g.
``--optimizers thor,adam,muon``.

Outputs in ``--out`` (default ``runs/mnist``): ``metrics.csv`` (one row per epoch x optimizer x
seed x lr), ``summary.json`` (best configuration per optimizer, time-to-target, run metadata),
``accuracy_vs_epoch.png``, ``accuracy_vs_time.png``, ``loss_vs_epoch.png``, ``loss_vs_time.png``
and ``curves.png`` (all four). See ``experiments/runner.py`` for the rules of the comparison.
``--lr-schedule poly`` gives THOR MindSpore's polynomial decay sized to the run instead (the main
job's default before issue 24: lr0 0.02; it lost badly on digits).
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from experiments import cli, runner  # noqa: E402

DATASETS = ("auto", "fashion_mnist", "mnist", "digits")
MODELS = ("mlp", "mlp_wide", "cnn")
#: The main job compares THOR with Adam and Muon under warmup + cosine at 3e-3 and 1e-2, the
#: rates that hold the best of each on the Fashion-MNIST and digits CNNs (docs/suite.md).
LR_GRID = {"sgd": (0.03, 0.1, 0.3), "adam": (3e-3, 1e-2), "muon": (3e-3, 1e-2)}
#: On digits the best rates sit higher (the suite's digits CNN: Adam 3e-2 over 1e-2, Muon 1e-2).
DIGITS_LR_GRID = {"sgd": (0.03, 0.1, 0.3), "adam": (1e-2, 3e-2), "muon": (1e-2, 3e-2)}
#: The digits fallback trains longer than Fashion-MNIST's 3 epochs: 3 epochs of digits are 36
#: steps of 128, too few to compare optimizers by.
DIGITS_EPOCHS, DIGITS_BATCH = 10, 64
#: On digits one test image is 0.28 points: the main job runs 3 seeds there and reports medians.
DIGITS_SEEDS = (0, 1, 2)


#: Muon joins when this Keras has it (3.10 and later).
MAIN_JOB_OPTIMIZERS = ("thor", "adam", "muon") if cli.muon_available() else ("thor", "adam")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="THOR vs SGD / Adam / K-FAC on MNIST-family datasets.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--dataset", choices=DATASETS, default=None,
                        help="default auto: fashion_mnist when installed, else digits "
                             "(--quick: digits)")
    parser.add_argument("--model", choices=MODELS, default="cnn", help="default cnn")
    parser.add_argument("--no-download", action="store_true",
                        help="never download Fashion-MNIST (auto: digits when it is not local)")
    cli.add_common_arguments(
        parser, out="runs/mnist", epochs=None, batch_size=None, thor_lr=None,
        thor_damping=0.03,
        frequency=10, kfac_frequency=2, lr_schedule="cosine", optimizers=MAIN_JOB_OPTIMIZERS,
        lr_grid_text=cli.grid_text(LR_GRID, cli.QUICK_LR_GRID),
        seeds_text="0,1,2 on digits, 0 on Fashion-MNIST and under --quick")
    parser.set_defaults(seeds=None)  # the dataset's: 3 on digits, 1 on Fashion-MNIST
    args = parser.parse_args(argv)
    # --quick: digits (1437 train / 360 test, 8x8), 2 epochs of 23 steps, small grid.
    args = cli.apply_quick(parser, args, argv, epochs=2, batch_size=64, max_train=1024,
                           max_test=512)
    from experiments import datasets

    if args.dataset == "auto":  # local Fashion-MNIST, else a Keras download, else digits
        args.dataset = datasets.resolve_auto(download=not args.no_download)
    digits = args.dataset == "digits"
    # --epochs / --batch-size / --seeds / --lr-grid not given: the dataset's.
    args.epochs = args.epochs or (DIGITS_EPOCHS if digits else 3)
    args.batch_size = args.batch_size or (DIGITS_BATCH if digits else 128)
    if args.seeds is None:
        args.seeds = list(DIGITS_SEEDS) if digits and not args.quick else [0]
    return cli.finish_args(args, DIGITS_LR_GRID if digits else LR_GRID)


def main(argv=None):
    args = parse_args(argv)
    from experiments import datasets as data, models as zoo

    ds = data.load_dataset(args.dataset, max_train=args.max_train, max_test=args.max_test,
                           verbose=True, seed=0, download=not args.no_download)

    def build_model():
        return zoo.build(args.model, ds.input_shape, ds.num_classes)

    if args.thor_lr == [None]:  # --thor-lr not given: what wrap gives a run of this length
        total_steps = args.epochs * math.ceil(ds.num_train / args.batch_size)
        args.thor_lr = [cli.default_thor_peak(total_steps)]
    title = f"{args.model} on {ds.name} ({ds.num_train} train / {ds.num_test} test)"
    runner.run_experiment(args, ds, build_model, args.model, title)


if __name__ == "__main__":
    main()
