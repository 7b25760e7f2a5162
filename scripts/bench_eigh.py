#!/usr/bin/env python
"""Time the eigenbasis rule's refresh work against the inverse rule's, per block size.

For each block size d (default 16, 32, 64, 128, 256) a batch of ``--blocks`` random SPD blocks
``F = X Xᵀ/m`` (X: [d, 2d] Gaussian) is, each way in its own ``tf.function``:

* ``eigh64``: decomposed with ``thor_tf.rules.eigenbasis_ops.eigh_blocks`` (the rule's
  ``refresh="eigh"``: the ramped block's float64 ``eigh``);
* ``eigh32``: the same ramped block's ``eigh`` in float32 (what float64 replaced);
* ``power_qr``: renewed from a previous basis by ``power_qr_step`` (``refresh="power_qr"``: the
  drift ``Q_oldᵀ F Q_old``, ``qr(F·Q_old)``, the residual ``Q_newᵀ F Q_new``, sorting; float32).
  The previous basis is float64 eigh's of ``F_prev``, with ``F = F_prev + 0.3·F'`` (another
  such block): a factor that moved between refreshes; the time does not depend on how far;
* ``cholesky``: inverted with ``thor_tf.rules.inverse_ops.invert_blocks`` (the inverse rule's
  damped Cholesky inverse).

The ways alternate within each repeat so that the load of a shared machine hits all alike.
Reports the median of ``--repeats`` timed runs after 2 untimed ones, per block (µs), and each
way's ratio to Cholesky and power_qr's to eigh64.

    python scripts/bench_eigh.py --out docs/results/bench_eigh.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

WAYS = ("eigh64", "eigh32", "power_qr", "cholesky")


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

    from thor_tf.rules.eigenbasis_ops import _padded_for_eigh, eigh_blocks, power_qr_step
    from thor_tf.rules.inverse_ops import invert_blocks

    def spd(rng, d):
        x = rng.normal(size=(args.blocks, d, 2 * d)).astype("float32")
        return x @ x.transpose(0, 2, 1) / (2 * d)

    rows = []
    for d in [int(s) for s in args.sizes.split(",")]:
        rng = np.random.default_rng(d)
        previous = spd(rng, d)
        blocks = tf.constant(previous + 0.3 * spd(rng, d))
        mask = tf.ones([args.blocks, d])
        q_old, _ = eigh_blocks(tf.constant(previous), mask)
        fns = {
            "eigh64": tf.function(lambda: eigh_blocks(blocks, mask)),
            "eigh32": tf.function(lambda: tf.linalg.eigh(_padded_for_eigh(blocks, mask))),
            "power_qr": tf.function(lambda: power_qr_step(blocks, mask, q_old)),
            "cholesky": tf.function(lambda: invert_blocks(blocks, 0.03, args.blocks * d)),
        }
        times = {name: [] for name in WAYS}
        for r in range(args.repeats + 2):
            for name in WAYS:
                start = time.perf_counter()
                out = fns[name]()
                tf.nest.map_structure(lambda t: t.numpy(), out)
                if r >= 2:
                    times[name].append(time.perf_counter() - start)
        row = {"size": d, "blocks": args.blocks}
        for name in WAYS:
            row[f"{name}_us_per_block"] = 1e6 * statistics.median(times[name]) / args.blocks
        for name in WAYS[:-1]:
            row[f"{name}_vs_cholesky"] = (row[f"{name}_us_per_block"]
                                          / row["cholesky_us_per_block"])
        row["power_qr_vs_eigh64"] = row["power_qr_us_per_block"] / row["eigh64_us_per_block"]
        # The name earlier versions of this file wrote (float64 eigh / Cholesky).
        row["ratio"] = row["eigh64_vs_cholesky"]
        rows.append(row)
        print(f"d={d:4d}  " + "  ".join(f"{n} {row[n + '_us_per_block']:9.1f}" for n in WAYS)
              + f" us/block;  eigh64/chol {row['eigh64_vs_cholesky']:.1f}x  power_qr/chol "
              f"{row['power_qr_vs_cholesky']:.2f}x  power_qr/eigh64 "
              f"{row['power_qr_vs_eigh64']:.3f}x", flush=True)
    out = {"rows": rows, "loadavg": os.getloadavg(), "device": "cpu",
           "tensorflow": tf.__version__}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main()
