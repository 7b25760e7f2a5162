"""The steady step of the char GPT (experiments/lm.py) with THOR, AdamW and Muon, side by side.

One process, the model of ``experiments/lm.py`` (default: nanoGPT's baby GPT, batch 12, block 64;
any lm.py model or THOR flag can follow, e.g. ``--tie-embeddings``, ``--fisher sampled``), built
and compiled exactly as lm.py does, trained with ``train_on_batch`` (Keras' traced train step) on
the same sequence of Shakespeare batches (``--random-data``: random tokens, no corpus):

* ``adamw`` (lr 1e-3) and ``muon`` (lr 1e-2): lm.py's recipes;
* ``thor``: lm.py's THOR (thor_tf's defaults: a cadence point every ``frequency`` = 10 steps, the
  trace rule deciding which blocks refresh); its steps are split by whether they held a cadence
  point (the engine's ``cadence_points`` counter moved): ``plain`` (preconditioning only) and
  ``cadence`` (traces, and factors + inverses of the blocks that refresh);
* ``thor_refresh_all``: THOR with ``preset="thor_nt", frequency=1``: every block refreshes at
  every step (the most a cadence point can cost).

Each variant is built once and warmed up (``--warmup-steps``: tracing and the first refreshes),
then timed in ``--repeats`` rounds of ``--steps`` steps, the variants in turn within each round
(a slow spell of a shared machine hits all alike); per round the median step (THOR: of its plain
and of its cadence steps), then the median over rounds; ``paired``: the ratios THOR/baseline
round by round, then their median (steadier when the machine's speed drifts). The amortized THOR step at its frequency
f is ``plain + (cadence − plain)/f`` (:func:`amortized`), also with the refresh-all step as the
cadence step (an upper bound); ``mean_ms`` is the measured mean over every timed step.

Writes ``--out`` (JSON, default docs/results/bench_lm_step.json) with the ratios THOR/AdamW and THOR/Muon.

    python scripts/bench_lm_step.py                          # baby GPT, ~3 min on 2 cores
    python scripts/bench_lm_step.py --repeats 3              # a quick look
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

VARIANTS = ("adamw", "muon", "thor", "thor_refresh_all")
BASELINE_LR = {"adamw": 1e-3, "muon": 1e-2}


def amortized(plain, cadence, frequency):
    """Mean step over a cadence interval: ``frequency − 1`` plain steps and one cadence step."""
    return plain + (cadence - plain) / frequency


def summarize(rounds, frequency):
    """Medians over rounds, the amortized THOR steps and the ratios to each baseline.

    ``rounds``: ``{variant: [per-round dict]}``; a round has ``median_ms`` and ``mean_ms``, and for
    THOR ``plain_ms`` and ``cadence_ms`` (None when the round had no cadence point)."""
    def med(variant, key):
        values = [r[key] for r in rounds.get(variant, []) if r.get(key) is not None]
        return statistics.median(values) if values else None

    out = {v: {"median_ms": med(v, "median_ms"), "mean_ms": med(v, "mean_ms")} for v in rounds}
    if "thor" in rounds:
        thor = out["thor"]
        thor.update(plain_ms=med("thor", "plain_ms"), cadence_ms=med("thor", "cadence_ms"),
                    frequency=frequency)
        thor["amortized_ms"] = thor["refresh_all_amortized_ms"] = None
        if isinstance(frequency, int) and thor["plain_ms"] is not None:
            if thor["cadence_ms"] is not None:
                thor["amortized_ms"] = amortized(thor["plain_ms"], thor["cadence_ms"], frequency)
            if "thor_refresh_all" in out:
                thor["refresh_all_amortized_ms"] = amortized(
                    thor["plain_ms"], out["thor_refresh_all"]["median_ms"], frequency)
    ratios = {}
    for base in ("adamw", "muon"):
        if base not in out or "thor" not in out:
            continue
        ref = out[base]["median_ms"]
        thor = out["thor"]
        row = {key: (None if thor.get(key) is None else thor[key] / ref)
               for key in ("plain_ms", "cadence_ms", "amortized_ms", "refresh_all_amortized_ms",
                           "mean_ms")}
        if "thor_refresh_all" in out:
            row["refresh_all_ms"] = out["thor_refresh_all"]["median_ms"] / ref
        # Round by round (the variants of a round ran within seconds of each other), then the
        # median: steadier than the ratio of medians when the machine's speed drifts.
        pairs = [("plain_ms", "thor", "plain_ms", "median_ms"), ("mean_ms", "thor", "mean_ms", "mean_ms"),
                 ("refresh_all_ms", "thor_refresh_all", "median_ms", "median_ms")]
        row["paired"] = {}
        for name, variant, key, ref_key in pairs:
            values = [a[key] / b[ref_key] for a, b in zip(rounds.get(variant, []), rounds[base])
                      if a.get(key) is not None]
            row["paired"][name] = statistics.median(values) if values else None
        ratios[f"thor_vs_{base}"] = row
    return out, ratios


def _timed_round(model, batches, first, count, is_thor):
    """Time steps ``first .. first+count−1`` (batch k for step k); THOR: split by cadence."""
    times, cadence = [], []
    for k in range(first, first + count):
        x, y = batches[k % len(batches)]
        before = model.thor.counters()["cadence_points"] if is_thor else 0
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(1e3 * (time.perf_counter() - start))
        cadence.append(is_thor and model.thor.counters()["cadence_points"] > before)
    row = {"median_ms": statistics.median(times), "mean_ms": statistics.fmean(times),
           "steps": len(times)}
    if is_thor:
        plain = [t for t, c in zip(times, cadence) if not c]
        hits = [t for t, c in zip(times, cadence) if c]
        row.update(plain_ms=statistics.median(plain) if plain else None,
                   cadence_ms=statistics.median(hits) if hits else None, cadence_points=len(hits))
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--repeats", type=int, default=10, help="timed rounds (default 10)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per round (default 20)")
    p.add_argument("--warmup-steps", type=int, default=20,
                   help="untimed steps after the first (traced) one (default 20)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma list from {','.join(VARIANTS)} (default: all)")
    p.add_argument("--random-data", action="store_true", help="random tokens instead of the corpus")
    p.add_argument("--out", default="docs/results/bench_lm_step.json")
    args, lm_argv = p.parse_known_args(argv)

    import keras
    import numpy as np
    import tensorflow as tf

    from experiments import lm, text

    # lm.py's own flags (model shape, THOR settings, corpus); its --steps sizes the schedules.
    lm_args = lm.parse_args(lm_argv + ["--optimizers", "thor,adamw"])
    variants = [v for v in args.variants.split(",") if v]
    if "muon" in variants and not hasattr(keras.optimizers, "Muon"):
        variants.remove("muon")
        print(f"muon skipped: Keras {keras.__version__} has no keras.optimizers.Muon")
    total = 1 + args.warmup_steps + args.repeats * args.steps
    if args.random_data:
        vocab = 84
        ids = np.random.default_rng(0).integers(0, vocab, 100_000).astype("int32")
        data = "random tokens"
    else:
        try:
            corpus = text.load_text(lm_args.text, cache_dir=lm_args.cache_dir,
                                    download=not lm_args.no_download)
        except text.DataUnavailable as err:
            raise SystemExit(f"error: {err}\n(or run with --random-data)")
        vocab, ids, data = corpus.vocab_size, corpus.train, corpus.name
    x, y = lm.train_batches(ids, 0, total, lm_args.batch, lm_args.block)
    batches = [(x[k * lm_args.batch:(k + 1) * lm_args.batch],
                y[k * lm_args.batch:(k + 1) * lm_args.batch]) for k in range(total)]

    models, first_step = {}, {}
    for variant in variants:
        keras.utils.set_random_seed(0)
        if variant == "thor_refresh_all":
            model = lm.make_model("thor", lm_args.thor_lr[0], lm_args, vocab, preset="thor_nt",
                                  frequency=1)
        else:
            model = lm.make_model(variant, BASELINE_LR.get(variant, lm_args.thor_lr[0]), lm_args,
                                  vocab)
        start = time.perf_counter()
        model.train_on_batch(*batches[0])
        first_step[variant] = time.perf_counter() - start
        for k in range(1, 1 + args.warmup_steps):
            model.train_on_batch(*batches[k])
        models[variant] = model
        print(f"{variant:17s} first step (trace) {first_step[variant]:6.1f} s", flush=True)
    frequency = None
    if "thor" in models:
        frequency = models["thor"].thor_optimizer.config.trace_rule.frequency
        settings = lm.thor_settings(models["thor"])
    rounds = {v: [] for v in variants}
    load = [os.getloadavg()[0]]
    for r in range(args.repeats):
        first = 1 + args.warmup_steps + r * args.steps
        for variant in variants:
            row = _timed_round(models[variant], batches, first, args.steps,
                               variant.startswith("thor"))
            rounds[variant].append(row)
            extra = ""
            if variant == "thor":
                extra = (f"  plain {row['plain_ms'] or float('nan'):7.1f} ms  cadence "
                         f"{row['cadence_ms'] or float('nan'):7.1f} ms ({row['cadence_points']})")
            print(f"round {r} {variant:17s} median {row['median_ms']:7.1f} ms  mean "
                  f"{row['mean_ms']:7.1f} ms{extra}", flush=True)
        load.append(os.getloadavg()[0])
    summary, ratios = summarize(rounds, frequency)
    for variant, row in summary.items():
        print(f"{variant:17s} " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in row.items() if v is not None))
    for name, row in ratios.items():
        print(f"{name}: " + ", ".join(f"{k.replace('_ms', '')} {v:.2f}x" for k, v in row.items()
                                      if isinstance(v, float))
              + "; round by round: " + ", ".join(f"{k.replace('_ms', '')} {v:.2f}x"
                                                 for k, v in row["paired"].items() if v is not None))
    result = {
        "summary": summary, "ratios": ratios, "rounds": rounds,
        "first_step_s": first_step,
        "model": {"name": "char_gpt", **lm.model_kwargs(lm_args), "vocab_size": vocab},
        "data": data, "baseline_lr": BASELINE_LR,
        "thor_settings": settings if "thor" in models else None,
        "args": {**vars(args), "lm_argv": lm_argv},
        "load_average_1min": load,
        "tensorflow": tf.__version__, "keras": keras.__version__,
    }
    from experiments import record

    return record.write(args.out, result, argv=argv, script=__file__)


if __name__ == "__main__":
    main()
