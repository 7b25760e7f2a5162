"""What the first epoch costs: THOR against SGD, Adam and Muon, each in a fresh process.

Issue 33 item 4's target: THOR's first epoch (tracing + graph optimization + the epoch's steps)
at most 1.5x the baseline's. Two workloads:

* ``digits``: the main job's digits run (``experiments/mnist.py --dataset digits``: the CNN, batch
  64, 1437 training images, THOR at its defaults under warmup + cosine, the baselines at their
  digits rates), its first epoch of ``fit`` timed as the main job times it
  (``experiments/timing.py``: the epoch's training seconds, no evaluation);
* ``resnet50``: ``keras.applications.ResNet50(weights=None)`` at 32x32x3, 10 classes, batch 32,
  random data: the first ``train_on_batch`` (trace + compile + one step).

Every (workload, optimizer) runs in a fresh Python process (tracing is paid once per process);
the optimizers run in turn, in alternating order across repeats (forward, then reversed), so a
slow minute of this shared machine hits each of them alike. Per run it records the seconds, the
Python part of the trace (``trace_python_s``: the calls of ``train_step``, i.e. building the
graph; ``train_step_traces``: how many) and the traced train function's graph size (nodes of
the function's own graph and of its function library: ``tf.cond`` branches, ``map_fn`` bodies).
The summary gives medians over the repeats and each optimizer's median over SGD's and over the
best (fastest) baseline's.

    python scripts/bench_first_fit.py --out docs/results/bench_first_fit.json
    python scripts/bench_first_fit.py --models digits --repeats 1   # a quick look

``--thor-from before=/path/to/checkout`` adds THOR from another checkout of thor_tf as one more
optimizer ("thor@before", run with that checkout first on ``PYTHONPATH``), in the same
alternation: before/after figures from one run, under the same load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
from experiments.timing import functions_in, train_step_seconds  # noqa: E402
from experiments import record  # noqa: E402
from experiments.worker import report, run_self, thor_defaults  # noqa: E402

MODELS = ("digits", "resnet50")
OPTIMIZERS = ("sgd", "adam", "muon", "thor")  # muon: when this Keras has it (>= 3.10)
#: Also accepted by ``--optimizers``: THOR with TensorFlow's default graph optimization
#: (``graph_optimization="full"``; THOR's default on a CPU is ``"light"``, thor_tf/graph_options.py).
THOR_FULL = "thor_full"
BASELINES = ("sgd", "adam", "muon")
RESNET50 = {"input_shape": (32, 32, 3), "classes": 10, "batch": 32}


def graph_size(model):
    """``{"graph_nodes", "library_nodes", "library_functions"}`` of the largest concrete function
    Keras traced for ``model``'s train function (the step; the outer iterator function holds
    little), or None when it cannot be found."""
    best = None
    for function in functions_in(model.train_function):
        for concrete in function._list_all_concrete_functions():
            graph = concrete.graph.as_graph_def()
            size = {"graph_nodes": len(graph.node),
                    "library_nodes": sum(len(f.node_def) for f in graph.library.function),
                    "library_functions": len(graph.library.function)}
            if best is None or (size["graph_nodes"] + size["library_nodes"]
                                > best["graph_nodes"] + best["library_nodes"]):
                best = size
    if best is not None:
        best["total_nodes"] = best["graph_nodes"] + best["library_nodes"]
    return best


def worker_digits(optimizer):
    """The main job's digits run for ``optimizer`` (``experiments/mnist.py --dataset digits``:
    the suite's recipe, THOR at its defaults, a baseline at the first rate of its grid), first
    epoch only."""
    from experiments import datasets, mnist, suite, timing, train

    name = "thor" if optimizer.startswith("thor") else optimizer
    args = mnist.parse_args(["--dataset", "digits", "--no-download", "--optimizers", name])
    ds = datasets.load_dataset("digits", verbose=False, seed=0, download=False)
    workload, data = mnist.main_job_workload(args, ds)
    lr = 0.0 if name == "thor" else args.lr_grid[name][0]
    train.fresh_session(0)
    order, _ = suite.segment_plan(workload, data, 0, 1)
    model = suite.compiled_model(name, lr, workload, data, False, len(order), args.thor_option)
    calls = train_step_seconds(model)
    steps = data.num_train // workload.batch_size  # one epoch of the run's batch order
    rows = order[:steps].reshape(-1)
    clock = timing.RunClock()
    seconds, _ = timing.fit_segment(model, clock, 0, data.x_train[rows], data.y_train[rows],
                                    workload.batch_size)
    return {"first_epoch_s": seconds, "steps": steps, "batch": workload.batch_size,
            "train_step_traces": len(calls), "trace_python_s": sum(calls),
            **(graph_size(model) or {})}


def worker_resnet50(optimizer):
    """The first ``train_on_batch`` of ResNet-50 at 32x32 (as ``scripts/bench_overhead.py``)."""
    import keras
    import numpy as np
    import thor_tf

    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None, input_shape=RESNET50["input_shape"],
                                        classes=RESNET50["classes"])
    loss = "sparse_categorical_crossentropy"
    if optimizer == "thor":
        model = thor_tf.wrap(model, learning_rate=0.01, verbose=False)
        model.compile(loss=loss)
    else:
        opt = {"sgd": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
               "adam": lambda: keras.optimizers.Adam(1e-3),
               # As the experiments run it: the output layer on Muon's AdamW step.
               "muon": lambda: keras.optimizers.Muon(3e-3, exclude_layers=["predictions"])}
        model.compile(optimizer=opt[optimizer](), loss=loss)
    rng = np.random.default_rng(0)
    batch = RESNET50["batch"]
    x = rng.normal(size=(batch, *RESNET50["input_shape"])).astype("float32")
    y = rng.integers(0, RESNET50["classes"], size=batch)
    calls = train_step_seconds(model)
    start = time.perf_counter()
    model.train_on_batch(x, y)
    seconds = time.perf_counter() - start
    split = {}
    if optimizer == "thor":  # the split this model was built with (the default plan)
        from thor_tf.split.plan import split_config

        split = {"split_dim": split_config(model.thor_optimizer.config.split_dim)}
    return {"first_epoch_s": seconds, "steps": 1, "batch": batch,
            "train_step_traces": len(calls), "trace_python_s": sum(calls),
            **split, **(graph_size(model) or {})}


def worker(model_name, optimizer):
    out = {"model": model_name, "optimizer": optimizer}
    if optimizer == THOR_FULL:
        import functools

        import thor_tf

        thor_tf.wrap = functools.partial(thor_tf.wrap, graph_optimization="full")
        optimizer = "thor"
    out.update(worker_digits(optimizer) if model_name == "digits" else worker_resnet50(optimizer))
    import thor_tf

    out["thor_tf"] = os.path.dirname(os.path.abspath(thor_tf.__file__))
    return out


def _repo_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def summarize(runs, optimizers):
    """Medians per (model, optimizer) and ratios against SGD and the best baseline."""
    summary = {}
    for model_name in sorted({r["model"] for r in runs}):
        rows = {}
        for opt in optimizers:
            mine = [r for r in runs if r["model"] == model_name and r["optimizer"] == opt]
            if not mine:
                continue
            row = {"runs": len(mine)}
            for key in ("first_epoch_s", "trace_python_s"):
                values = [r[key] for r in mine]
                row[key] = statistics.median(values)
                row[key + "_runs"] = [round(v, 3) for v in values]
            for key in ("train_step_traces", "graph_nodes", "library_nodes", "library_functions",
                        "total_nodes"):
                if key in mine[0]:
                    row[key] = mine[0][key]
            rows[opt] = row
        baselines = [o for o in BASELINES if o in rows]
        best = min(baselines, key=lambda o: rows[o]["first_epoch_s"]) if baselines else None
        for opt, row in rows.items():
            if "sgd" in rows:
                row["vs_sgd"] = row["first_epoch_s"] / rows["sgd"]["first_epoch_s"]
                row["trace_python_vs_sgd"] = row["trace_python_s"] / rows["sgd"]["trace_python_s"]
                if "total_nodes" in row and "total_nodes" in rows["sgd"]:
                    row["nodes_vs_sgd"] = row["total_nodes"] / rows["sgd"]["total_nodes"]
            if best is not None:
                row["vs_best_baseline"] = row["first_epoch_s"] / rows[best]["first_epoch_s"]
        summary[model_name] = {"best_baseline": best, "optimizers": rows}
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/results/bench_first_fit.json")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--thor-from", action="append", default=[], metavar="NAME=PATH",
                        help="also THOR from the checkout at PATH, as optimizer thor@NAME")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "OPTIMIZER"))
    args = parser.parse_args(argv)
    if args.worker:
        report(worker(*args.worker))
        return
    import keras

    optimizers = [o for o in args.optimizers.split(",")
                  if o != "muon" or hasattr(keras.optimizers, "Muon")]
    models = args.models.split(",")
    checkouts = {}
    for item in args.thor_from:
        name, path = item.split("=", 1)
        path = os.path.abspath(path)
        checkouts[f"thor@{name}"] = os.pathsep.join(
            [os.path.join(path, ".pyshim"), path] + [p for p in os.environ.get(
                "PYTHONPATH", "").split(os.pathsep) if p and not p.startswith(_repo_root())])
        optimizers.append(f"thor@{name}")
    runs = []
    for repeat in range(args.repeats):
        order = optimizers if repeat % 2 == 0 else optimizers[::-1]
        for model_name in models:
            for opt in order:
                environ = {"PYTHONPATH": checkouts[opt]} if opt in checkouts else {}
                result = run_self(__file__, ["--worker", model_name, opt.split("@")[0]],
                                  timeout=args.timeout, **environ)
                result["optimizer"] = opt
                result["repeat"] = repeat
                runs.append(result)
                print(f"[{repeat}] {model_name:9s} {opt:5s} first epoch {result['first_epoch_s']:.2f} s"
                      f"  trace {result['trace_python_s']:.2f} s x{result['train_step_traces']}"
                      f"  nodes {result.get('total_nodes')}", flush=True)

    import tensorflow as tf

    out = {"summary": summarize(runs, optimizers), "runs": runs,
           # THOR ran at wrap's defaults (learning_rate aside): a changed default fails
           # tests/test_bench_records.py until the record is re-measured.
           "thor_defaults": thor_defaults(),
           "tensorflow": tf.__version__, "keras": keras.__version__}
    record.write(args.out, out, argv=argv, script=__file__)
    for model_name, entry in out["summary"].items():
        for opt, row in entry["optimizers"].items():
            ratio = lambda key: "–" if row.get(key) is None else f"{row[key]:.2f}"  # noqa: E731
            print(f"{model_name:9s} {opt:5s} median {row['first_epoch_s']:.2f} s  "
                  f"x{ratio('vs_sgd')} SGD  x{ratio('vs_best_baseline')} best "
                  f"({entry['best_baseline']})"
                  f"  trace {row['trace_python_s']:.2f} s  nodes {row.get('total_nodes')}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
