"""Newton–Schulz (``thor_tf.rules.eigenbasis_ops.newton_schulz``) in a plain ``tf.function``
against the same function with ``jit_compile=True`` (XLA), on the step shapes of the suite's
models: CPU time of the process and wall time per call (medians of repeats), the first call's
seconds (trace + compile) and the largest difference between the two results. It measures the
iteration's products (``method="iterate"``); the default evaluation through ``eigh`` is compared
with them in ``scripts/bench_ns_spectral.py``.

    python scripts/bench_ns_xla.py --out docs/results/bench_ns_xla.json

Shapes ``[batch, rows, cols]`` (a size bucket's blocks): the Fashion CNN's dense step
``[1, 3137, 128]`` (Gram-space iteration) and conv2 ``[1, 289, 64]``, the autoencoder's
``[1, 785, 1000]``, the char GPT's buckets ``[12, 64, 256]`` and ``[6, 65, 64]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

SHAPES = {"fashion_cnn dense": (1, 3137, 128), "fashion_cnn conv2": (1, 289, 64),
          "autoencoder 785x1000": (1, 785, 1000), "char_gpt bucket 12x64x256": (12, 64, 256),
          "char_gpt bucket 6x65x64": (6, 65, 64)}


def _cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(function, x, calls, repeats):
    """``(first call s, median CPU ms per call, median wall ms per call, result)``."""
    start = time.perf_counter()
    result = function(x)
    result.numpy()
    first = time.perf_counter() - start
    for _ in range(3):
        function(x)
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = _cpu(), time.perf_counter()
        for _ in range(calls):
            y = function(x)
        y.numpy()
        cpu.append((_cpu() - c0) / calls * 1e3)
        wall.append((time.perf_counter() - w0) / calls * 1e3)
    return first, statistics.median(cpu), statistics.median(wall), result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="docs/results/bench_ns_xla.json")
    parser.add_argument("--quick", action="store_true", help="two small shapes, 1 repeat")
    args = parser.parse_args(argv)
    import tensorflow as tf
    from thor_tf.rules.eigenbasis_ops import newton_schulz

    shapes = SHAPES if not args.quick else {k: SHAPES[k] for k in list(SHAPES)[3:]}
    repeats = 1 if args.quick else args.repeats
    rows = []
    for name, shape in shapes.items():
        x = tf.random.stateless_normal(shape, seed=[0, 1])
        calls = 20 if shape[-1] * shape[-2] < 500_000 else 6
        row = {"shape": name, "dims": list(shape)}
        results = {}
        for label, jit in (("graph", False), ("xla", True)):
            function = tf.function(lambda t: newton_schulz(t, method="iterate"), jit_compile=jit)
            first, cpu, wall, results[label] = measure(function, x, calls, repeats)
            row[label] = {"first_call_s": round(first, 3), "cpu_ms": round(cpu, 3),
                          "wall_ms": round(wall, 3)}
        row["max_abs_difference"] = float(tf.reduce_max(tf.abs(results["xla"] - results["graph"])))
        row["xla_over_graph_cpu"] = round(row["xla"]["cpu_ms"] / row["graph"]["cpu_ms"], 3)
        rows.append(row)
        print(f"{name}: graph {row['graph']['cpu_ms']:.2f} ms CPU, XLA {row['xla']['cpu_ms']:.2f} "
              f"({row['xla_over_graph_cpu']:.2f}x); first call {row['graph']['first_call_s']:.2f} "
              f"vs {row['xla']['first_call_s']:.2f} s; max |diff| {row['max_abs_difference']:.1e}",
              flush=True)
    with open(args.out, "w") as handle:
        json.dump({"tensorflow": tf.__version__, "repeats": repeats, "rows": rows}, handle, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
