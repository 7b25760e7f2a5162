"""Where the preconditioning time goes: THOR's step against the bare matmuls it must do.

Per model (the Fashion-MNIST CNN by default), after one THOR step (so every block has inverses):

* ``precondition``: THOR's preconditioning as the train step runs it (``profile_step``: gradient
  matrices from the kernels, ``A_inv·M·G_inv`` per block, KL clip, back to kernel shapes);
* ``core``: only the products ``A_inv·M`` (one batched matmul over A's diagonal blocks) and
  ``(·)·G_inv`` per block, on tensors already in block layout: the arithmetic the step cannot
  avoid with these inverses;
* ``flops``: the multiply-adds of ``core`` ×2, and ``gemm_gflops``: this machine's rate on the
  same batched shapes measured apart, and on one 1024³ matmul.

``precondition − core`` is what the layout work (pad, reshape, concat, casts) and the KL clip
cost; ``flops / gemm rate`` is the floor. Medians of ``--repeats``; one process.

    python scripts/bench_precondition.py --out docs/results/bench_precondition.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import thor_tf  # noqa: E402
from thor_tf.profiling import profile_step  # noqa: E402

MODELS = {"cnn": ((28, 28, 1), 10, 128), "resnet20": ((32, 32, 1), 10, 128)}


def median_seconds(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tf.nest.map_structure(lambda t: t.numpy(), fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def core_products(engine):
    """A tf.function computing every block's ``A_inv·M·G_inv`` in block layout, and its FLOPs."""
    operands, flops = [], 0
    rng = np.random.default_rng(0)
    for i, block in enumerate(engine.blocks):
        layer = engine.state.layers[i]
        a_inv, g_inv = tf.convert_to_tensor(layer.A_inv), tf.convert_to_tensor(layer.G_inv)
        nb_a, d_a, _ = a_inv.shape
        nb_g, d_g, _ = g_inv.shape
        m = tf.constant(rng.normal(size=(nb_a, d_a, nb_g * d_g)).astype("float32"))
        operands.append((a_inv, m, g_inv))
        flops += 2 * nb_a * d_a * d_a * nb_g * d_g + 2 * nb_a * d_a * nb_g * d_g * d_g

    @tf.function
    def core():
        out = []
        for a_inv, m, g_inv in operands:
            left = tf.linalg.matmul(a_inv, m)                       # [nb_a, d_a, nb_g·d_g]
            nb_g, d_g = g_inv.shape[0], g_inv.shape[1]
            rows = tf.reshape(left, [-1, nb_g, d_g])
            out.append(tf.einsum("mbi,bij->mbj", rows, g_inv))
        return out

    return core, flops, operands


def gemm_rate(operands, repeats):
    """GFLOP/s of this machine on the same batched shapes, and on one 1024³ matmul."""
    big = tf.random.normal([1024, 1024])
    one = tf.function(lambda: tf.linalg.matmul(big, big))
    rate_big = 2 * 1024 ** 3 / median_seconds(one, repeats) / 1e9
    largest = max(operands, key=lambda o: int(np.prod(o[0].shape)) * int(o[1].shape[-1]))
    a_inv, m, _ = largest
    batched = tf.function(lambda: tf.linalg.matmul(a_inv, m))
    flops = 2 * int(np.prod(a_inv.shape)) * int(m.shape[-1])
    return rate_big, flops / median_seconds(batched, repeats) / 1e9


def measure(model_name, repeats):
    from thor_tf_experiments import models

    shape, classes, batch = MODELS[model_name]
    keras.utils.set_random_seed(0)
    model = thor_tf.wrap(models.build(model_name, shape, classes), learning_rate=0.01,
                         verbose=False)
    model.compile(loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.random((batch,) + shape).astype("float32")
    y = rng.integers(0, classes, batch)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # step 0 refreshes every block
    parts = profile_step(model, x, y, repeats=repeats)
    core, flops, operands = core_products(model.thor)
    core_s = median_seconds(core, repeats)
    rate_big, rate_batched = gemm_rate(operands, repeats)
    return {
        "model": model_name, "batch": batch, "blocks": len(model.thor.blocks),
        "forward_backward_ms": 1e3 * parts["forward_backward"],
        "precondition_ms": 1e3 * parts["precondition"],
        "core_ms": 1e3 * core_s,
        "layout_and_clip_ms": 1e3 * (parts["precondition"] - core_s),
        "core_gflop": flops / 1e9,
        "core_gflops_per_s": flops / core_s / 1e9,
        "gemm_gflops_1024": rate_big,
        "gemm_gflops_largest_block_shape": rate_batched,
        "floor_ms_at_1024_rate": 1e3 * flops / (rate_big * 1e9),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="cnn")
    p.add_argument("--repeats", type=int, default=31)
    p.add_argument("--out", default="runs/bench_precondition.json")
    args = p.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        row = measure(name, args.repeats)
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"rows": rows, "repeats": args.repeats, "tensorflow": tf.__version__,
                   "machine": platform.platform(), "cpus": os.cpu_count(),
                   "date": time.strftime("%Y-%m-%d")}, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
