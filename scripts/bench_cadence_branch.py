"""What the cadence branch costs on the steps that do not take it: lowered (THOR today) against
kept as a functional ``If``.

THOR's cadence work (factor statistics, the trace rule, refreshes) sits in one ``tf.cond``
(``thor_tf.distributed.run_if``). TensorFlow lowers a ``tf.cond`` inside a ``tf.function`` to
``Switch``/``Merge`` ops, and the executor then visits every op of the branch on every step to
mark it dead. With the ``If`` op's ``_lower_using_switch_merge`` attribute set to False the
runtime calls the branch's function only on the steps where it is due. This benchmark measures
what that would save, per workload, with two wrapped copies of the same model in one process
(same initial weights and batches): the first fit of each traces its step, then ``--rounds``
fits of ``--steps`` steps alternate between them (the order reversed every other round), and
the record holds each variant's median milliseconds per step, the median of the per-round
ratios (functional ``If`` over lowered) and the largest difference between the two copies'
weights at the end (0 when the two graphs compute the same numbers on this kernel path; run it
again with ``TF_ENABLE_ONEDNN_OPTS=0`` for the other path).

    python scripts/bench_cadence_branch.py --out docs/results/bench_cadence_branch.json
    TF_ENABLE_ONEDNN_OPTS=0 python scripts/bench_cadence_branch.py --out /tmp/off.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402
from tensorflow.core.framework import attr_value_pb2  # noqa: E402

import thor_tf  # noqa: E402
from thor_tf import distributed  # noqa: E402
from experiments import record, workloads as wl  # noqa: E402

WORKLOADS = ("char_gpt", "lm", "tabular_mlp", "digits_cnn", "fashion_cnn", "vit")
VARIANTS = ("lowered", "functional_if")


def functional_if_run_if(flag, fn):
    """:func:`thor_tf.distributed.run_if` on one replica, its ``If`` op left unlowered."""
    def branch():
        fn()
        return tf.constant(0)

    out = tf.cond(flag, branch, lambda: tf.constant(0))
    op = out.op.inputs[0].op if out.op.type == "Identity" else out.op
    if op.type not in ("If", "StatelessIf"):
        raise RuntimeError(f"expected the cond's If op, found {op.type}")
    op._set_attr("_lower_using_switch_merge", attr_value_pb2.AttrValue(b=False))


def lm_workload(steps):
    """``experiments/lm.py``'s char GPT (4 blocks of width 128, context 64, batch 12) on random
    tokens: a stand-in with its shapes, for timing only."""
    from experiments import models

    vocab, batch, block = 65, 12, 64
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, (batch * steps, block)).astype("int32")
    y = rng.integers(0, vocab, (batch * steps, block)).astype("int32")
    return (lambda: models.build_gpt(vocab),
            lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True), x, y, batch)


def suite_workload(name, steps):
    """The suite's workload on its first ``steps`` batches (fewer where its training set is
    smaller: the tabular MLP's 353 rows are 11 batches)."""
    w = wl.WORKLOADS[name]
    data = w.load(False)
    b = w.batch_size
    steps = min(steps, len(data.y_train) // b)
    return (lambda: w.build(data, False), w.loss, wl.take(data.x_train, np.arange(b * steps)),
            data.y_train[:b * steps], b, steps)


def bench(name, steps, rounds):
    build, loss, x, y, batch, steps = (lm_workload(steps) + (steps,) if name == "lm"
                                       else suite_workload(name, steps))
    models = {}
    original = distributed.run_if
    for variant in VARIANTS:
        keras.utils.set_random_seed(0)
        model = thor_tf.wrap(build(), verbose=False)
        model.compile(loss=loss())
        distributed.run_if = functional_if_run_if if variant == "functional_if" else original
        try:
            model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)  # the trace
        finally:
            distributed.run_if = original
        models[variant] = model
    ms = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            start = time.perf_counter()
            models[variant].fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
            ms[variant].append((time.perf_counter() - start) / steps * 1e3)
    ratios = [b / a for a, b in zip(ms["lowered"], ms["functional_if"])]
    diff = max(float(np.max(np.abs(a.numpy() - b.numpy())))
               for a, b in zip(models["lowered"].trainable_variables,
                               models["functional_if"].trainable_variables))
    return {"ms_per_step": {v: round(statistics.median(t), 3) for v, t in ms.items()},
            "ratio_median": round(statistics.median(ratios), 4),
            "ratios": [round(q, 4) for q in ratios],
            "max_weight_difference": diff, "steps": steps, "rounds": rounds}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma list from {','.join(WORKLOADS)} (default all)")
    parser.add_argument("--steps", type=int, default=40, help="steps per timed fit (default 40)")
    parser.add_argument("--rounds", type=int, default=8, help="timed fits per variant (default 8)")
    parser.add_argument("--out", default="runs/bench_cadence_branch.json")
    args = parser.parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; allowed: {', '.join(WORKLOADS)}")
    results = {}
    for name in names:
        results[name] = bench(name, args.steps, args.rounds)
        r = results[name]
        print(f"{name}: lowered {r['ms_per_step']['lowered']:.2f} ms, functional If "
              f"{r['ms_per_step']['functional_if']:.2f} ms, ratio {r['ratio_median']:.3f}, "
              f"max weight difference {r['max_weight_difference']:.3g}", flush=True)
    out = {**record.stamp(argv, "scripts/bench_cadence_branch.py"),
           "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default"),
           "environment": record.environment(), "workloads": results}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
