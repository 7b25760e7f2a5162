#!/usr/bin/env python
"""Time the full inverse against the split inverse for ResNet-50's factor sizes on this machine.

For each size n (default: ResNet-50's factor dimensions 147, 576, 1152, 2048, 2304, 4608) a random
SPD factor ``F = X Xᵀ/m`` (X: [n, m] Gaussian, m = 2n) is cut into its diagonal blocks (not timed:
training computes the blocks directly, ``thor_tf.blocks.block_gram``) and the damped blocks are
inverted with ``thor_tf.rules.inverse_ops.invert_blocks`` — what training calls — once with
``split_dim = n`` (one exact Cholesky of the whole matrix) and once with ``split_dim = --split``
(128: a batched Cholesky over ceil(n/128) blocks, the last one padded with the identity), each in
its own ``tf.function`` on the default device (the GPU when TensorFlow sees one). Reports the
median of --repeats timed runs after --warmup untimed ones (full and split alternate, so that the
load of a shared machine hits both alike), and the ratio full/split (how many times faster the
split inverse is). The JSON records the 1-minute load average before and after: on a shared CPU
the absolute times move with it.

Examples:
  python scripts/bench_split_inverse.py --out docs/results/bench_split_inverse.json
  python scripts/bench_split_inverse.py --quick        # seconds, for CI
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RESNET50_SIZES = (147, 576, 1152, 2048, 2304, 4608)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(map(str, RESNET50_SIZES)),
                        help="comma-separated factor sizes (default: ResNet-50's "
                             f"{','.join(map(str, RESNET50_SIZES))})")
    parser.add_argument("--split", type=int, default=128, help="split dimension (default 128)")
    parser.add_argument("--damping", type=float, default=0.03 ** 0.5,
                        help="value added to the diagonal (default sqrt(0.03))")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs, median (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs after tracing (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join("runs", "bench_split_inverse.json"),
                        help="JSON output (default runs/bench_split_inverse.json)")
    parser.add_argument("--quick", action="store_true",
                        help="sizes 147,576,1152, 2 repeats, 1 warm-up run")
    args = parser.parse_args(argv)
    try:
        args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes must be comma-separated ints; got {args.sizes!r}")
    if not args.sizes or min(args.sizes) < 1 or args.split < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("need sizes >= 1, --split >= 1, --repeats >= 1, --warmup >= 0")
    if args.damping <= 0:
        parser.error("--damping must be > 0")
    if args.quick:
        args.sizes = [s for s in args.sizes if s <= 1152] or args.sizes[:1]
        args.repeats = min(args.repeats, 2)
        args.warmup = min(args.warmup, 1)
    return args


def random_spd(n, seed):
    """``X Xᵀ / m`` for Gaussian ``X`` [n, 2n]: a factor-like SPD matrix (float32)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 2 * n)).astype(np.float32)
    return (x @ x.T) / np.float32(2 * n)


def traced_inverse(factor, split):
    """``(fn, blocks)``: ``fn(blocks, d)`` runs ``invert_blocks`` on the diagonal blocks (traced)."""
    import tensorflow as tf

    from thor_tf.block_diagonal import diagonal_blocks
    from thor_tf.rules.inverse_ops import invert_blocks

    blocks = tf.constant(diagonal_blocks(factor, split))  # thor_tf.block_diagonal's cutting
    n = factor.shape[0]
    fn = tf.function(lambda b, d: invert_blocks(b, d, n),
                     input_signature=[tf.TensorSpec(blocks.shape, tf.float32),
                                      tf.TensorSpec([], tf.float32)], autograph=False)
    return fn, blocks


def time_full_and_split(factor, damping, split, repeats, warmup):
    """Median seconds ``(full, split)``; the two alternate, so machine load hits both alike."""
    import tensorflow as tf

    d = tf.constant(damping, tf.float32)
    runs = [traced_inverse(factor, factor.shape[0]), traced_inverse(factor, split)]
    for fn, blocks in runs:
        for _ in range(1 + warmup):  # trace, warm up
            fn(blocks, d)
            tf.test.experimental.sync_devices()
    times = [[], []]
    for _ in range(repeats):
        for k, (fn, blocks) in enumerate(runs):
            start = time.perf_counter()
            fn(blocks, d)
            tf.test.experimental.sync_devices()
            times[k].append(time.perf_counter() - start)
    return tuple(float(statistics.median(t)) for t in times)


def main(argv=None):
    args = parse_args(argv)
    import tensorflow as tf

    from thor_tf.calibration import device_description
    from thor_tf.block_diagonal import split_layout

    load_before = os.getloadavg()
    rows = []
    header = f"{'n':>6}  {'blocks':>9}  {'full s':>10}  {'split s':>10}  {'full/split':>10}"
    print(f"device: {device_description()}; TensorFlow {tf.__version__}; split {args.split}; "
          f"median of {args.repeats}")
    print(header, flush=True)
    for i, n in enumerate(args.sizes):
        factor = random_spd(n, args.seed + i)
        full, split = time_full_and_split(factor, args.damping, args.split, args.repeats,
                                          args.warmup)
        nb, size = split_layout(n, args.split)
        row = {"dim": n, "num_blocks": nb, "block_size": size, "full_seconds": full,
               "split_seconds": split, "ratio_full_over_split": full / split}
        rows.append(row)
        print(f"{n:>6}  {f'{nb}x{size}':>9}  {full:>10.5f}  {split:>10.5f}  {full / split:>10.2f}",
              flush=True)
    result = {
        "device": device_description(),
        "tensorflow_version": tf.__version__,
        "split_dim": args.split,
        "damping": args.damping,
        "timed": "thor_tf.rules.inverse_ops.invert_blocks on pre-cut diagonal blocks, as training calls it",
        "repeats": args.repeats,
        "warmup": args.warmup,
        "quick": bool(args.quick),
        "load_average_1min": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "cpu_count": os.cpu_count(),
        "results": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
