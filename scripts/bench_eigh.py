#!/usr/bin/env python
"""Time the eigenbasis rule's refresh work against the inverse rule's, per block size.

For each block size d (default 16, 32, 64, 128, 256) a batch of ``--blocks`` random SPD blocks
``F = X Xᵀ/m`` (X: [d, 2d] Gaussian) is decomposed with ``thor_tf.rules.eigenbasis_ops.eigh_blocks`` (what the
eigenbasis rule calls at a refresh: float32 ``eigh`` with the float64 retry) and inverted with
``thor_tf.rules.inverse_ops.invert_blocks`` (the inverse rule's damped Cholesky inverse), each in its own
``tf.function``; the two alternate so that the load of a shared machine hits both alike. Reports
the median of ``--repeats`` timed runs after 2 untimed ones, per block (µs) and the ratio
eigh / Cholesky.

    python scripts/bench_eigh.py --out docs/bench_eigh.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="16,32,64,128,256")
    p.add_argument("--blocks", type=int, default=16, help="blocks per batch (default 16)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", default="runs/bench_eigh.json")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import numpy as np
    import tensorflow as tf

    from thor_tf.rules.eigenbasis_ops import eigh_blocks
    from thor_tf.rules.inverse_ops import invert_blocks

    rows = []
    for d in [int(s) for s in args.sizes.split(",")]:
        rng = np.random.default_rng(d)
        x = rng.normal(size=(args.blocks, d, 2 * d)).astype("float32")
        blocks = tf.constant(x @ x.transpose(0, 2, 1) / (2 * d))
        mask = tf.ones([args.blocks, d])
        eig = tf.function(lambda: eigh_blocks(blocks, mask))
        chol = tf.function(lambda: invert_blocks(blocks, 0.03, args.blocks * d))
        times = {"eigh": [], "cholesky": []}
        for r in range(args.repeats + 2):
            for name, fn in (("eigh", eig), ("cholesky", chol)):
                start = time.perf_counter()
                out = fn()
                tf.nest.map_structure(lambda t: t.numpy(), out)
                if r >= 2:
                    times[name].append(time.perf_counter() - start)
        row = {"size": d, "blocks": args.blocks,
               "eigh_us_per_block": 1e6 * statistics.median(times["eigh"]) / args.blocks,
               "cholesky_us_per_block": 1e6 * statistics.median(times["cholesky"]) / args.blocks}
        row["ratio"] = row["eigh_us_per_block"] / row["cholesky_us_per_block"]
        rows.append(row)
        print(f"d={d:4d}  eigh {row['eigh_us_per_block']:9.1f} us/block  cholesky "
              f"{row['cholesky_us_per_block']:8.1f} us/block  ratio {row['ratio']:.1f}x", flush=True)
    out = {"rows": rows, "loadavg": os.getloadavg(), "device": "cpu",
           "tensorflow": tf.__version__}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main()
