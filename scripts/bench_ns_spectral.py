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

import numpy as np

from experiments import record  # noqa: E402
from experiments.timing import time_calls  # noqa: E402

from experiments.workloads import WORKLOADS  # noqa: E402  (the suite's, in its order)


def buckets_of(workload_name):
    """``[[blocks, rows, cols], ...]``: what the rule's orthogonalization gets in one step."""
    import keras
    from thor_tf.rules import orthogonal_step
    from experiments import suite, workloads

    workload = workloads.WORKLOADS[workload_name]
    data = workload.load(False)
    keras.utils.set_random_seed(0)
    model = suite.compiled_model("thor", 0.0, workload, data, False, 100, {})
    seen, real = [], orthogonal_step.newton_schulz_many

    def recording(xs, *args, **kwargs):
        # A bucket of one matrix is passed as that matrix ([rows, cols]): a batch of one.
        seen.extend([1] * (3 - len(x.shape)) + [int(d) for d in x.shape] for x in xs)
        return real(xs, *args, **kwargs)

    orthogonal_step.newton_schulz_many = recording
    try:
        rows = np.arange(workload.batch_size) % data.num_train
        model.train_on_batch(data.x_train[rows], data.y_train[rows])
    finally:
        orthogonal_step.newton_schulz_many = real
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


def float32_spectral(xs, steps=5, coefficients=None, epsilon=1e-7, method=None):
    """The evaluation ``"auto"`` made on a CPU before 2026-11 (the library at 14e272e): every
    short side up to 1024 through a float32 ``eigh`` of a float32 Gram matrix, ``P`` and ``X P``
    in float32; up to ~100x the float32 iteration's error on nearly singular matrices. Kept here
    only as the ``--paired`` baseline of what the accurate default costs."""
    import tensorflow as tf
    from thor_tf.rules.newton_schulz import NS_COEFFICIENTS

    a, b, c = (tf.constant(v, tf.float32) for v in (coefficients or NS_COEFFICIENTS))
    out = []
    for x in xs:
        tall = x.shape[-2] > x.shape[-1]
        x = x / (tf.sqrt(tf.reduce_sum(tf.square(x), axis=[-2, -1], keepdims=True)) + epsilon)
        x = tf.where(tf.reduce_all(tf.math.is_finite(x), axis=[-2, -1], keepdims=True), x,
                     tf.zeros_like(x))
        gram = tf.matmul(x, x, transpose_a=True) if tall else tf.matmul(x, x, transpose_b=True)
        w, u = tf.linalg.eigh(gram)
        s2, gain = tf.maximum(w, 0.0), None
        for k in range(steps):
            f = a + s2 * (b + c * s2)
            gain = f if gain is None else gain * f
            s2 = s2 * tf.square(f)
        p = tf.matmul(u * tf.expand_dims(gain, -2), u, transpose_b=True)
        out.append(tf.matmul(x, p) if tall else tf.matmul(p, x))
    return out


def paired(workload_name, steps, methods=("iterate", "spectral")):
    """Steady-step medians of two methods, trained side by side (module docstring); a method is
    one of ``newton_schulz``'s or ``"float32_spectral"`` (:func:`float32_spectral`)."""
    import functools
    import statistics
    import time

    import keras
    from thor_tf.rules import orthogonal_step
    from thor_tf.rules.eigenbasis_ops import newton_schulz_many
    from experiments import suite, workloads

    workload = workloads.WORKLOADS[workload_name]
    data = workload.load(False)
    order = suite.batch_order(data.num_train, workload.batch_size, workload.epochs, 0,
                              workload.single_pass)
    models = []
    real = orthogonal_step.newton_schulz_many
    try:
        for method in methods:
            keras.utils.set_random_seed(0)
            model = suite.compiled_model("thor", 0.0, workload, data, False, len(order), {})
            orthogonal_step.newton_schulz_many = (
                float32_spectral if method == "float32_spectral"
                else functools.partial(newton_schulz_many, method=method))
            model.train_on_batch(data.x_train[order[0]], data.y_train[order[0]])  # traced here
            models.append(model)
    finally:
        orthogonal_step.newton_schulz_many = real
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
    first, second = methods
    for measure in ("wall_ms", "cpu_ms"):
        entry[f"{second}_over_{first}_" + measure[:-3]] = round(
            entry[second][measure] / entry[first][measure], 3)
    print(f"{workload_name} paired: wall {entry[first]['wall_ms']:.1f} -> "
          f"{entry[second]['wall_ms']:.1f} ms ({entry[f'{second}_over_{first}_wall']:.3f}x), "
          f"CPU {entry[first]['cpu_ms']:.1f} -> {entry[second]['cpu_ms']:.1f} ms "
          f"({entry[f'{second}_over_{first}_cpu']:.3f}x)", flush=True)
    return entry


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="docs/results/bench_ns_spectral.json")
    parser.add_argument("--paired", default="", help="workloads whose whole step to compare")
    parser.add_argument("--steps", type=int, default=100, help="--paired: steps per model")
    parser.add_argument("--methods", default="iterate,spectral",
                        help="--paired: the two methods (newton_schulz's, or float32_spectral)")
    args = parser.parse_args(argv)
    import tensorflow as tf
    from thor_tf.rules.eigenbasis_ops import newton_schulz

    report = {"tensorflow": tf.__version__, "repeats": args.repeats, "workloads": []}
    if args.paired:
        report = {"tensorflow": tf.__version__, "paired": [
            paired(name, args.steps, tuple(args.methods.split(",")))
            for name in args.paired.split(",")]}
        record.write(args.out, report, argv=argv, script=__file__)
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
                first, cpu, wall, result = time_calls(function, x, calls, args.repeats)
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
    record.write(args.out, report, argv=argv, script=__file__)


if __name__ == "__main__":
    main()
