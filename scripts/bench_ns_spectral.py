"""Newton–Schulz evaluated through ``eigh`` of the Gram matrix (``method="spectral"``, the
default) against the iteration's products (``"iterate"``), on the size buckets that the
eigenbasis rule orthogonalizes in each suite workload's step: CPU and wall time per call per
bucket, their sum per step and model, and each result's largest difference from a float64
iteration.

    python scripts/bench_ns_spectral.py --out docs/results/bench_ns_spectral.json

The buckets are read from the rule itself: each workload's THOR step is traced once (one
``train_on_batch``) with ``newton_schulz_many`` recording the ``[blocks, rows, cols]`` of each
batch it is given.

``--paired W1,W2`` measures the whole step instead: two wrapped models of each workload in one
process, one traced with ``method="iterate"`` and one with ``"spectral"``, their steps alternating
(cadence points at the same steps), each step's wall and process CPU time recorded; the medians
and their ratios go to the JSON's ``paired`` list.

    python scripts/bench_ns_spectral.py --paired resnet20,char_gpt,autoencoder --steps 100 \
        --out docs/results/bench_ns_spectral_paired.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ns_xla import measure  # noqa: E402

WORKLOADS = ("digits_cnn", "fashion_cnn", "resnet20", "vit", "autoencoder", "tabular_mlp",
             "char_gpt")


def buckets_of(workload_name):
    """``[[blocks, rows, cols], ...]``: what the rule's orthogonalization gets in one step."""
    import keras
    from thor_tf.rules import eigenbasis as eigenbasis_module
    from thor_tf_experiments import suite, workloads

    workload = workloads.WORKLOADS[workload_name]
    data = workload.load(False)
    keras.utils.set_random_seed(0)
    model = suite.compiled_model("thor", 0.0, workload, data, False, 100, {})
    seen, real = [], eigenbasis_module.newton_schulz_many

    def recording(xs, *args, **kwargs):
        # A bucket of one matrix is passed as that matrix ([rows, cols]): a batch of one.
        seen.extend([1] * (3 - len(x.shape)) + [int(d) for d in x.shape] for x in xs)
        return real(xs, *args, **kwargs)

    eigenbasis_module.newton_schulz_many = recording
    try:
        rows = np.arange(workload.batch_size) % data.num_train
        model.train_on_batch(data.x_train[rows], data.y_train[rows])
    finally:
        eigenbasis_module.newton_schulz_many = real
    return seen


def float64_iteration(x, steps=5):
    """Muon's iteration in float64 per matrix (wide orientation), the reference."""
    from thor_tf.rules.eigenbasis_ops import NS_COEFFICIENTS

    a, b, c = NS_COEFFICIENTS
    out = []
    for m in np.asarray(x, np.float64):
        tall = m.shape[0] > m.shape[1]
        m = m.T if tall else m
        m = m / (np.linalg.norm(m) + 1e-7)
        for _ in range(steps):
            gram = m @ m.T
            m = a * m + (b * gram + c * gram @ gram) @ m
        out.append(m.T if tall else m)
    return np.stack(out)


def paired(workload_name, steps):
    """Steady-step medians of the two methods, trained side by side (module docstring)."""
    import functools
    import statistics
    import time

    import keras
    from thor_tf.rules import eigenbasis as eigenbasis_module
    from thor_tf.rules.eigenbasis_ops import newton_schulz_many
    from thor_tf_experiments import suite, workloads

    workload = workloads.WORKLOADS[workload_name]
    data = workload.load(False)
    order = suite.batch_order(data.num_train, workload.batch_size, workload.epochs, 0,
                              workload.single_pass)
    models, methods = [], ("iterate", "spectral")
    real = eigenbasis_module.newton_schulz_many
    try:
        for method in methods:
            keras.utils.set_random_seed(0)
            model = suite.compiled_model("thor", 0.0, workload, data, False, len(order), {})
            eigenbasis_module.newton_schulz_many = functools.partial(newton_schulz_many,
                                                                     method=method)
            model.train_on_batch(data.x_train[order[0]], data.y_train[order[0]])  # traced here
            models.append(model)
    finally:
        eigenbasis_module.newton_schulz_many = real
    wall, cpu = ([], []), ([], [])
    for i in range(1, steps):
        batch = order[i % len(order)]
        for k in ((0, 1) if i % 2 else (1, 0)):
            c0, w0 = time.process_time(), time.perf_counter()
            models[k].train_on_batch(data.x_train[batch], data.y_train[batch])
            cpu[k].append(time.process_time() - c0)
            wall[k].append(time.perf_counter() - w0)
    # The first steps after the second model's first call are slowed once (not by the method).
    entry = {"workload": workload_name, "steps": steps}
    for k, method in enumerate(methods):
        entry[method] = {"wall_ms": round(1e3 * statistics.median(wall[k][2:]), 3),
                         "cpu_ms": round(1e3 * statistics.median(cpu[k][2:]), 3)}
    for measure in ("wall_ms", "cpu_ms"):
        entry["spectral_over_iterate_" + measure[:-3]] = round(
            entry["spectral"][measure] / entry["iterate"][measure], 3)
    print(f"{workload_name} paired: wall {entry['iterate']['wall_ms']:.1f} -> "
          f"{entry['spectral']['wall_ms']:.1f} ms ({entry['spectral_over_iterate_wall']:.3f}x), "
          f"CPU {entry['iterate']['cpu_ms']:.1f} -> {entry['spectral']['cpu_ms']:.1f} ms "
          f"({entry['spectral_over_iterate_cpu']:.3f}x)", flush=True)
    return entry


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="docs/results/bench_ns_spectral.json")
    parser.add_argument("--paired", default="", help="workloads whose whole step to compare")
    parser.add_argument("--steps", type=int, default=100, help="--paired: steps per model")
    args = parser.parse_args(argv)
    import tensorflow as tf
    from thor_tf.rules.eigenbasis_ops import newton_schulz

    report = {"tensorflow": tf.__version__, "repeats": args.repeats, "workloads": []}
    if args.paired:
        report = {"tensorflow": tf.__version__, "paired": [
            paired(name, args.steps) for name in args.paired.split(",")]}
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)
        print(f"wrote {args.out}")
        return
    for name in args.workloads.split(","):
        entry = {"workload": name, "buckets": []}
        for shape in buckets_of(name):
            # Singular values spread from 1e-3 to 1, like an Adam step's (not a Gaussian's).
            rng = np.random.default_rng(sum(shape))
            u = np.linalg.qr(rng.normal(size=(shape[0], shape[1], shape[1])))[0]
            v = np.linalg.qr(rng.normal(size=(shape[0], shape[2], shape[2])))[0]
            k = min(shape[1:])
            x = (u[:, :, :k] * np.logspace(-3, 0, k)) @ np.swapaxes(v[:, :, :k], 1, 2)
            want = float64_iteration(x)
            x = tf.constant(x, tf.float32)
            calls = 20 if shape[1] * shape[2] < 500_000 else 5
            row = {"dims": shape}
            for method in ("iterate", "spectral"):
                function = tf.function(lambda t, method=method: newton_schulz(t, method=method))
                first, cpu, wall, result = measure(function, x, calls, args.repeats)
                row[method] = {"cpu_ms": round(cpu, 3), "wall_ms": round(wall, 3),
                               "first_call_s": round(first, 3),
                               "max_difference": float(np.abs(result.numpy() - want).max()
                                                       / np.abs(want).max())}
            entry["buckets"].append(row)
            print(f"{name} {shape}: iterate {row['iterate']['cpu_ms']:.2f} ms CPU, spectral "
                  f"{row['spectral']['cpu_ms']:.2f}; error {row['iterate']['max_difference']:.1e}"
                  f" / {row['spectral']['max_difference']:.1e}", flush=True)
        for method in ("iterate", "spectral"):
            entry[method + "_cpu_ms_per_step"] = round(
                sum(b[method]["cpu_ms"] for b in entry["buckets"]), 3)
        entry["spectral_over_iterate"] = round(
            entry["spectral_cpu_ms_per_step"] / entry["iterate_cpu_ms_per_step"], 3)
        print(f"{name}: per step {entry['iterate_cpu_ms_per_step']:.2f} -> "
              f"{entry['spectral_cpu_ms_per_step']:.2f} ms CPU "
              f"({entry['spectral_over_iterate']:.2f}x)", flush=True)
        report["workloads"].append(entry)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
