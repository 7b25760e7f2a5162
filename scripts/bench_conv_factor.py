"""Conv2D's A factor: the im2col path against shifted input views (thor_tf.blocks.conv_factor).

For each layer (the Fashion-MNIST CNN's two convolutions, a ResNet-20 stage-3 convolution, batch
128), each method is a ``tf.function`` computing A's diagonal blocks at the optimizer's default
``split_dim`` (128). Per seed of random input data: two warm-up calls, then the median of
``--repeats`` timed calls; the JSON reports mean ± sd of those medians over ``--seeds`` seeds, the
largest relative error against a float64 NumPy reference over the seeds (``max|A − A64| /
max|A64|``), and the speedup ``im2col / shifted``. Methods:

* ``im2col``: ``tf.image.extract_patches`` rows + ``block_gram`` (the previous default);
* ``shifted``: the default (strategy "auto");
* ``shifted_pairs`` / ``shifted_concat``: the two per-block strategies forced (how "auto" chooses).

``--memory`` adds, per layer and method, the peak memory one call allocates through TensorFlow's
allocator (fresh process with ``TF_CPU_ALLOCATOR_USE_BFC=true``, which makes the CPU allocator
keep statistics; the function traced beforehand; peak during the call minus the memory in use
before it, MB). oneDNN's own scratch buffers are not counted.

``--refresh`` adds what a refresh of all the CNN's blocks costs in a training step, per method,
from ``scripts/bench_overhead.py``'s own worker (one fresh process per method): ``steady_step_s``
(no curvature work), ``cadence_step_s`` (every block refreshes: factors, traces, inversion) and
``refresh_over_step = (cadence − steady) / steady``; and ``thor_tf.profiling.profile_step`` on one
batch (each part its own ``tf.function``, median of ``--refresh-steps``): per block ``factors`` and
``inverse``, ``refresh_total`` (their sum over blocks) against ``forward_backward``, whose ratio
``profile_refresh_over_forward_backward`` is less sensitive to step-to-step noise than the above.

    python scripts/bench_conv_factor.py --refresh                 # docs/results/bench_conv_factor.json
    python scripts/bench_conv_factor.py --seeds 1 --repeats 3     # a smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from bench_worker import report, run_self, write_results

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# name: (input shape, filters, kernel, use_bias) -- 'same' padding, stride 1, as in
# experiments/models.py (cnn: conv1, conv2 after a 2x2 pool; resnet20: stage 3 at 8x8, no bias).
LAYERS = {
    "cnn_conv1": ((128, 28, 28, 1), 32, (3, 3), True),
    "cnn_conv2": ((128, 14, 14, 32), 64, (3, 3), True),
    "resnet20_stage3": ((128, 8, 8, 64), 64, (3, 3), False),
}
METHODS = ("im2col", "shifted", "shifted_pairs", "shifted_concat")


def make_factor_fn(input_shape, filters, kernel, use_bias, method, split_dim):
    """A ``tf.function`` ``x -> A's diagonal blocks [nb, d, d]`` by ``method``."""
    import keras
    import tensorflow as tf

    from thor_tf.blocks import conv_factor
    from thor_tf.blocks.conv2d import Conv2DBlock
    from thor_tf.capture import Record

    layer = keras.layers.Conv2D(filters, kernel, padding="same", use_bias=use_bias)
    layer.build((None,) + tuple(input_shape[1:]))
    block = Conv2DBlock("conv", layer)
    if method == "im2col":
        block.a_factor_method = "im2col"  # instance attribute: this block only
        return tf.function(lambda x: block.factor_a([Record(x, None)], split_dim))
    strategy = {"shifted": "auto", "shifted_pairs": "pairs", "shifted_concat": "concat"}[method]
    return tf.function(lambda x: conv_factor.conv_factor_a(
        [x], block.geometry(), use_bias, split_dim, strategy))


def reference_a(x, kernel, use_bias, split_dim):
    """Float64 A's diagonal blocks from explicit patches ('same' padding, stride 1)."""
    import numpy as np

    n, h, w, c = x.shape
    kh, kw = kernel
    xp = np.zeros((n, h + kh - 1, w + kw - 1, c))
    xp[:, (kh - 1) // 2:(kh - 1) // 2 + h, (kw - 1) // 2:(kw - 1) // 2 + w] = x
    columns = [xp[:, i:i + h, j:j + w].reshape(-1, c) for i in range(kh) for j in range(kw)]
    if use_bias:
        columns.append(np.ones((n * h * w, 1)))
    rows = np.concatenate(columns, axis=1)
    full = rows.T @ rows / rows.shape[0]
    a_dim = full.shape[0]
    if split_dim >= a_dim:
        return full[None]
    nb = -(-a_dim // split_dim)
    out = np.zeros((nb, split_dim, split_dim))
    for b in range(nb):
        lo, hi = b * split_dim, min((b + 1) * split_dim, a_dim)
        out[b, :hi - lo, :hi - lo] = full[lo:hi, lo:hi]
    return out


def time_median(fn, x, repeats):
    """Median seconds of ``repeats`` calls after two warm-up calls (tracing included in those)."""
    fn(x).numpy()
    fn(x).numpy()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x).numpy()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_layer(name, args):
    """Times and errors of every method on one layer; a dict for the JSON."""
    import numpy as np
    import tensorflow as tf

    shape, filters, kernel, use_bias = LAYERS[name]
    fns = {m: make_factor_fn(shape, filters, kernel, use_bias, m, args.split_dim) for m in METHODS}
    medians = {m: [] for m in METHODS}
    errors = {m: 0.0 for m in METHODS}
    for seed in range(args.seeds):
        x = np.random.default_rng(seed).normal(size=shape).astype("float32")
        ref = reference_a(x.astype(np.float64), kernel, use_bias, args.split_dim)
        xt = tf.constant(x)
        for m in METHODS:
            medians[m].append(time_median(fns[m], xt, args.repeats))
            err = np.abs(fns[m](xt).numpy() - ref).max() / np.abs(ref).max()
            errors[m] = max(errors[m], float(err))
    methods = {m: {"time_ms_mean": 1e3 * statistics.fmean(medians[m]),
                   "time_ms_sd": 1e3 * (statistics.stdev(medians[m]) if len(medians[m]) > 1 else 0.0),
                   "time_ms_per_seed": [1e3 * t for t in medians[m]],
                   "max_rel_err": errors[m]} for m in METHODS}
    speedup = methods["im2col"]["time_ms_mean"] / methods["shifted"]["time_ms_mean"]
    a_dim = kernel[0] * kernel[1] * shape[-1] + int(use_bias)
    return {"input_shape": list(shape), "kernel": list(kernel), "filters": filters,
            "use_bias": use_bias, "a_dim": a_dim, "methods": methods,
            "speedup_im2col_over_shifted": speedup}


def memory_worker(name, method, split_dim):
    """MB of peak memory one call of ``method`` on layer ``name`` allocates (this process; needs
    ``TF_CPU_ALLOCATOR_USE_BFC=true`` set before TensorFlow starts)."""
    import numpy as np
    import tensorflow as tf

    shape, filters, kernel, use_bias = LAYERS[name]
    fn = make_factor_fn(shape, filters, kernel, use_bias, method, split_dim)
    x = tf.constant(np.random.default_rng(0).standard_normal(size=shape, dtype=np.float32))
    concrete = fn.get_concrete_function(x)  # traced, not run
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    result = concrete(x)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    del result
    return (peak - before) / 2.0 ** 20


def _run_self(args, **environ):
    """Run this script with ``args`` in a fresh process (this checkout first on the path, plus
    ``environ``); the value it reports."""
    return run_self(__file__, args, PYTHONPATH=os.pathsep.join(
        [ROOT, os.environ.get("PYTHONPATH", "")]), **environ)


def refresh_worker(method, steps):
    """bench_overhead's CNN/THOR worker with Conv2D's A by ``method`` (runs in this process)."""
    sys.path.insert(0, HERE)
    import bench_overhead

    from thor_tf.blocks.conv2d import Conv2DBlock

    import numpy as np

    from thor_tf.profiling import profile_step

    Conv2DBlock.a_factor_method = method
    result = bench_overhead.worker("cnn", "thor", steps, amortize_steps=steps)
    result["a_factor_method"] = method
    shape, classes, batch = bench_overhead.MODELS["cnn"]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, *shape)).astype("float32")
    y = rng.integers(0, classes, size=batch)
    model = bench_overhead._compiled("cnn", "thor")
    model.train_on_batch(x, y)
    profile = profile_step(model, x, y, repeats=steps)
    result["profile"] = profile
    result["profile_refresh_over_forward_backward"] = (
        profile["refresh_total"] / profile["forward_backward"])
    return result


def run_refresh(args, method):
    return _run_self(["--refresh-worker", method, "--refresh-steps", str(args.refresh_steps)])


def plot(layers, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(layers)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(METHODS)
    for k, m in enumerate(METHODS):
        means = [layers[n]["methods"][m]["time_ms_mean"] for n in names]
        sds = [layers[n]["methods"][m]["time_ms_sd"] for n in names]
        ax.bar([i + k * width for i in range(len(names))], means, width, yerr=sds, capsize=3, label=m)
    labels = [f"{n}\n{layers[n]['speedup_im2col_over_shifted']:.1f}x" for n in names]
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], labels)
    ax.set_ylabel("A factor, ms (mean ± sd over seeds of medians)")
    ax.set_title("Conv2D A factor: im2col vs shifted views (speedup under each layer)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default=",".join(LAYERS))
    p.add_argument("--split-dim", type=int, default=128, help="the optimizer's default")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15, help="timed calls per seed (median)")
    p.add_argument("--refresh", action="store_true",
                   help="also the whole-CNN refresh vs a step, per method (bench_overhead's worker)")
    p.add_argument("--refresh-steps", type=int, default=25,
                   help="timed steps (median) of each refresh measure")
    p.add_argument("--memory", action="store_true",
                   help="also the peak memory one call adds, per layer and method (fresh processes)")
    p.add_argument("--out", default="docs/results/bench_conv_factor.json")
    p.add_argument("--refresh-worker", choices=("im2col", "shifted"), help=argparse.SUPPRESS)
    p.add_argument("--memory-worker", nargs=2, metavar=("LAYER", "METHOD"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.refresh_worker:
        report(refresh_worker(args.refresh_worker, args.refresh_steps))
        return
    if args.memory_worker:
        report(memory_worker(*args.memory_worker, args.split_dim))
        return

    layers = {}
    for name in args.layers.split(","):
        layers[name] = row = bench_layer(name, args)
        print(f"{name:16s} " + "  ".join(
            f"{m} {r['time_ms_mean']:6.1f}±{r['time_ms_sd']:.1f}ms (err {r['max_rel_err']:.1e})"
            for m, r in row["methods"].items())
            + f"  speedup {row['speedup_im2col_over_shifted']:.1f}x", flush=True)
        if args.memory:
            for m in ("im2col", "shifted"):
                row["methods"][m]["peak_alloc_mb"] = mb = _run_self(
                    ["--memory-worker", name, m, "--split-dim", str(args.split_dim)],
                    TF_CPU_ALLOCATOR_USE_BFC="true")
                print(f"{name:16s} {m}: one call allocates {mb:.1f} MB at its peak", flush=True)
    summary = {"layers": layers}
    if args.refresh:
        refresh = {m: run_refresh(args, m) for m in ("im2col", "shifted")}
        for m, r in refresh.items():
            print(f"cnn refresh ({m}): steady {r['steady_step_s'] * 1e3:.1f}ms  cadence "
                  f"{r['cadence_step_s'] * 1e3:.1f}ms  refresh/step {r['refresh_over_step']:.2f};  "
                  f"profile: forward+backward {r['profile']['forward_backward'] * 1e3:.1f}ms  "
                  f"refresh {r['profile']['refresh_total'] * 1e3:.1f}ms  ratio "
                  f"{r['profile_refresh_over_forward_backward']:.2f}  conv2 factors "
                  f"{r['profile']['layers']['conv2']['factors'] * 1e3:.1f}ms", flush=True)
        summary["cnn_refresh"] = refresh
    summary["settings"] = {"split_dim": args.split_dim, "seeds": args.seeds,
                           "repeats": args.repeats,
                           "refresh_steps": args.refresh_steps if args.refresh else None}
    write_results(args.out, summary, __file__, argv, plot, layers)


if __name__ == "__main__":
    main()
