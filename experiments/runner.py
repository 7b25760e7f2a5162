"""Training runs of the main job (``mnist.py``).

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
``adamw``       ``keras.optimizers.AdamW(lr, weight_decay=0.004)`` (Keras' default decay, or
                ``--weight-decay``; not on biases and normalization scales/offsets)
``muon``        ``keras.optimizers.Muon(lr)`` (Keras >= 3.10; the scripts exit saying so on an
                older Keras): Newton-Schulz orthogonalized momentum on 2-D kernels (Dense), its
                AdamW step on everything else (conv kernels are 4-D, Conv1D and attention
                kernels 3-D, biases and norms 1-D) and on the output layer ``predictions``
                (``exclude_layers``, as Keras' documentation advises); weight decay as AdamW's
==============  ===============================================================================

Fairness rules: for a given seed every optimizer starts from the same initial weights
(``keras.utils.set_random_seed(seed)`` right before the model is built) and sees the training
examples in the same order (one NumPy permutation per epoch drawn from ``seed``). The first-order
baselines (SGD, Adam, AdamW, Muon) run with their standard schedule by default (linear warmup
over 5 % of the steps, then cosine to 0: ``--baseline-lr-schedule cosine``) over a learning-rate
grid (``--lr-grid``; ``experiments/suite.py`` says when a best rate sits at an end of its grid);
the THOR
variants get the learning rates of ``--thor-lr`` (one value by default). Every run of the grid is kept in ``metrics.csv``; the summary
reports, per optimizer, the learning rate with the best median (over seeds) final test accuracy.

``metrics.csv`` columns: optimizer, lr (initial lr under a schedule), seed, epoch (from 1),
train_loss (Keras' mean over the epoch's batches), test_loss, test_acc, epoch_seconds (training
only), cumulative_seconds, refreshes (Kronecker-block refreshes so far, summed over layers; 0 for
SGD/Adam), first_seconds, steady_seconds_per_step, load (below). The ``--max-train``/``--max-test``
subsets do not depend on the seed.

Seconds (``experiments/timing.py``, docs/timing.md): the runs of a seed train back to back in
this process, in ``--optimizers`` order (THOR first) on the 1st, 3rd, ... seed and reversed on
the others; ``metrics.csv`` also holds each run's ``first_seconds`` (its first epoch: tracing),
``steady_seconds_per_step`` and ``load`` (the share of the CPU other processes used) so far, and
the summary THOR's seconds against the best baseline's only when those loads left both about the
same CPU (``thor_vs_best``; else "not comparable" and why).

Time-to-target (:func:`time_to_target`): the first epoch whose test accuracy is ``>= target`` and
the cumulative *training* wall time at the end of that epoch (evaluation excluded, graph tracing
of the first epoch included, as a user would pay it). Accuracy is only measured at epoch ends, so
the answer is an upper bound with epoch granularity; no interpolation between epochs is done.
The default target is the final test accuracy of the best first-order baseline (SGD, Adam, AdamW
or Muon) of the same run, so no guessed number enters the comparison; ``--target-acc`` overrides it.
"""


from __future__ import annotations

import math
from pathlib import Path

from experiments import timing
from experiments.cli import (ADAMW_WEIGHT_DECAY, FIRST_ORDER, MUON_EXCLUDE_LAYERS,
                                     MUON_WEIGHT_DECAY, THOR_FAMILY, require_muon)
from experiments.reports import (PLOT_FILES, CsvLog, RunResult, plot_curves, summarize,
                                         summary_table, write_summary)

LOSS = "sparse_categorical_crossentropy"
WEIGHT_DECAY_EXCLUDE = ["bias", "gamma", "beta"]

# MindSpore's THOR ResNet-50 (GPU config) schedule shape, rescaled to the run (see lr_schedule()).
THOR_LR_POWER = 4.9687            # lr = lr0 · (1 − epoch/end_epoch)^power
THOR_LR_END_FACTOR = 50 / 40      # end_epoch = 1.25 × the run's epochs (50 for 40 epochs)
THOR_DAMPING_TOTAL_DECAY = 0.5467 ** 4  # damping at the last epoch / λ0 (0.5467 per 10 of 40 epochs)



def lr_schedule(kind, lr0, epochs, steps_per_epoch):
    """The learning rate (float or schedule) for ``--lr-schedule`` / ``--baseline-lr-schedule``:
    ``constant``; ``cosine``, the standard recipe (linear warmup over 5 % of the run, then cosine
    to 0, :class:`thor_tf.schedules.WarmupCosine`, for THOR and the baselines alike); ``poly``,
    THOR's polynomial decay sized to the run."""
    if kind == "constant":
        return float(lr0)
    if kind == "cosine":
        from thor_tf.schedules import WarmupCosine
        return WarmupCosine(int(epochs * steps_per_epoch), peak=float(lr0))
    from thor_tf.schedules import ThorPolynomialDecay
    # MindSpore's ResNet-50 THOR: 40 epochs, end_epoch 50, power 4.9687. The late double halving
    # (decay_epochs 39) is left out: at 39/40 of the run the polynomial has already decayed lr
    # to ~1e-4·lr0.
    return ThorPolynomialDecay(float(lr0), THOR_LR_END_FACTOR * epochs, THOR_LR_POWER,
                               steps_per_epoch)


def damping_schedule(kind, damping0, epochs, steps_per_epoch):
    """THOR's damping: constant, except under ``poly`` (``ThorDampingDecay``, rescaled so the decay
    over the run equals MindSpore's over 40 epochs, ×0.5467⁴ ≈ 0.089: rate per 10 epochs =
    0.5467^(40/epochs))."""
    if kind != "poly":
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
        options = dict(preset=optimizer, frequency=args.frequency,
                       update_rule=getattr(args, "update_rule", "inverse"))
        if optimizer == "kfac":
            damping = args.kfac_damping if args.kfac_damping is not None else args.thor_damping
            options = dict(preset="thor_nt", fisher="sampled", factor_decay=0.95,
                           frequency=args.kfac_frequency, update_rule="inverse")
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
        if getattr(args, "damping_split", None) is not None:
            options.update(damping_split=args.damping_split)
        age = getattr(args, "max_block_age", None)
        if age is not None:  # "none": the trace rule alone; not given: thor_tf's default
            options.update(max_block_age=None if age == "none" else age)
        wrapped = thor_tf.wrap(
            model, learning_rate=lr_value,
            damping=damping_schedule(args.lr_schedule, damping, args.epochs, steps_per_epoch),
            verbose=show_table, **options)
        wrapped.compile(loss=LOSS, metrics=metrics)
        return wrapped
    if optimizer == "sgd":
        opt = keras.optimizers.SGD(lr_value, momentum=0.9,
                                   weight_decay=args.weight_decay or None)
    elif optimizer == "adamw":
        opt = keras.optimizers.AdamW(lr_value, weight_decay=args.weight_decay or ADAMW_WEIGHT_DECAY)
        opt.exclude_from_weight_decay(var_names=WEIGHT_DECAY_EXCLUDE)
    elif optimizer == "muon":
        require_muon()
        decay = args.weight_decay or MUON_WEIGHT_DECAY
        opt = keras.optimizers.Muon(lr_value, weight_decay=decay, adam_weight_decay=decay,
                                    exclude_layers=list(MUON_EXCLUDE_LAYERS))
        opt.exclude_from_weight_decay(var_names=WEIGHT_DECAY_EXCLUDE)
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


def train_run(optimizer, lr, seed, build_model, ds, args, csv_log, show_table=False):
    """Train one configuration; one CSV row and one printed line per epoch."""
    import numpy as np

    from experiments import train

    train.fresh_session(seed)  # same initial weights for every optimizer
    n = ds.x_train.shape[0]
    steps_per_epoch = math.ceil(n / args.batch_size)
    model = make_model(optimizer, lr, build_model, args, steps_per_epoch, show_table)
    order = np.random.default_rng([seed, 2024])  # same data order for every optimizer
    result = RunResult(optimizer, float(lr), int(seed), steps_per_epoch=steps_per_epoch)
    tag = f"[{optimizer} lr={lr:g} seed={seed}]"
    clock = timing.RunClock()

    def epochs():  # a fresh permutation per epoch, drawn when the epoch comes
        for epoch in range(args.epochs):
            perm = order.permutation(n)
            yield epoch + 1, ds.x_train[perm], ds.y_train[perm]

    def evaluate(epoch, train_loss, seconds):
        cumulative = clock.seconds
        evaluation = model.evaluate(ds.x_test, ds.y_test, batch_size=1024, verbose=0,
                                    return_dict=True)
        refreshes, reuses, frozen = thor_totals(model)
        row = {
            "optimizer": optimizer, "lr": float(lr), "seed": int(seed), "epoch": epoch,
            "train_loss": train_loss,
            "test_loss": float(evaluation["loss"]),
            "test_acc": float(evaluation.get("accuracy", evaluation.get("compile_metrics", 0))),
            "epoch_seconds": round(seconds, 4),
            "cumulative_seconds": round(cumulative, 4),
            "refreshes": int(refreshes),
            **clock.fields(),
        }
        result.rows.append(row)
        csv_log.write(row)
        extra = ""
        if optimizer in THOR_FAMILY:
            extra = f"  refreshes {refreshes} reuses {reuses} frozen {frozen}"
            nonfinite = model.thor.counters()["nonfinite_steps"]
            if nonfinite:  # THOR skips such steps; many of them mean the run has diverged
                extra += f"  NON-FINITE STEPS SKIPPED {nonfinite}"
        print(f"{tag} epoch {epoch}/{args.epochs}  train_loss {row['train_loss']:.4f}  "
              f"test_loss {row['test_loss']:.4f}  test_acc {row['test_acc']:.4f}  "
              f"time {seconds:.1f}s (total {cumulative:.1f}s){extra}", flush=True)

    train.train_in_segments(model, clock, epochs(), args.batch_size, evaluate,
                            first_evaluation=False, verbose=args.verbose)
    result.timing = clock.summary()
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


def run_experiment(args, ds, build_model, model_name, title):
    """Train every (optimizer, lr, seed), then write summary.json, plots, and print the table."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grid = run_grid(args)
    steps = math.ceil(ds.x_train.shape[0] / args.batch_size)
    print(f"{title}: {len(grid)} configuration(s) x {len(args.seeds)} seed(s), {args.epochs} "
          f"epoch(s) of {steps} steps (batch {args.batch_size}), lr schedule {args.lr_schedule}"
          f"{'' if args.baseline_lr_schedule is None else f' (first-order: {args.baseline_lr_schedule})'}; "
          f"output in {out}", flush=True)
    if any(name in THOR_FAMILY for name, _ in grid):
        from thor_tf import ThorOptimizer

        defaults = ThorOptimizer()  # what thor_tf uses for the options not given here
        split = args.split_dim if args.split_dim is not None else defaults.split_dim
        trace_filter = (args.trace_filter if args.trace_filter is not None
                        else getattr(defaults, "trace_filter", "none"))
        kl_clip = args.kl_clip if args.kl_clip is not None else getattr(defaults, "kl_clip", None)
        damping_split = getattr(args, "damping_split", None) or defaults.damping_split
        print(f"THOR: lr {','.join(f'{v:g}' for v in args.thor_lr)}, damping {args.thor_damping:g}, "
              f"frequency {args.frequency}, momentum {defaults.momentum}, split_dim {split}, "
              f"trace_filter {trace_filter}, kl_clip {kl_clip}, damping_split {damping_split}, "
              f"factor_examples {args.factor_examples or 'all'}, "
              f"max_block_age {getattr(args, 'max_block_age', None) or defaults.max_block_age}",
              flush=True)
    csv_log = CsvLog(out / "metrics.csv")
    results = []
    shown = False
    try:
        for index, seed in enumerate(args.seeds):
            if len(args.seeds) > 1 and len(grid) > 1:
                print(f"seed {seed}: {timing.order_text(index)}", flush=True)
            for name, lr in timing.run_order(grid, index):
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
