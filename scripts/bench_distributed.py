"""Data-parallel THOR: step times against SGD-momentum on the same replicas, what is all-reduced,
and the two inversion assignments, for 1, 2 and 4 replicas.

One worker process per (model, replica count): MirroredStrategy over R devices (GPUs when the
machine has R of them, else R logical CPU devices: on a CPU the replicas share its cores, so R > 1
cannot be faster; what these runs show is the communication volume and the per-replica work, and
the timings are labelled with the devices they ran on). Global batch fixed (``--batch``), so every
R trains on the same global batches. Per worker:

* ``sgd_step_s``: Keras SGD-momentum, median step;
* ``plain_step_s``: THOR with no cadence point after step 0 (preconditioning only);
* ``cadence_step_s[all|balanced]``: THOR with every block refreshing at every step
  (``preset="thor_nt"``, ``trace_filter="none"``, ``frequency=1``), with ``inverse_assignment``
  ``"all"`` (every replica inverts every layer) and ``"balanced"`` (each layer inverted once,
  the inverses shared);
* ``all_reduced_bytes``: what the engine hands to collectives, recorded while the step is traced
  (per step: the gradients; per cadence point: traces; when some layer refreshes: factors, and
  with ``"balanced"`` the inverses), next to the design's formula from the block shapes;
* ``inversion_cost_per_replica``: Σ nb·d³ of the blocks a replica inverts at a full refresh
  (``all``: every block; ``balanced``: the largest share of the greedy assignment).

Inputs are random (timing does not depend on the data). Writes JSON (``--out``) and a PNG next to it.

    python scripts/bench_distributed.py --out docs/results/bench_distributed.json
    python scripts/bench_distributed.py --models cnn --replicas 1,2 --quick   # a smoke test
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os

from experiments.timing import fit_step_seconds
from experiments.worker import report, run_self, write_results

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODELS = {"cnn": ((28, 28, 1), 10), "resnet20": ((32, 32, 1), 10)}


def _devices(tf, replicas):
    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= replicas:
        return [f"/gpu:{i}" for i in range(replicas)], "gpu"
    cpu = tf.config.list_physical_devices("CPU")[0]
    if replicas > 1:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    return [f"/cpu:{i}" for i in range(replicas)], "logical cpu"


class CollectiveLog:
    """Records the float32 size of everything thor_tf.distributed hands to a collective, by the
    engine stage that asked (traced once; each replica's call is counted once)."""

    def __init__(self, distributed):
        self.bytes = collections.defaultdict(set)
        for name in ("sum_gradients", "weighted_mean", "sum_packed"):
            setattr(distributed, name, self._wrap(distributed, name, getattr(distributed, name)))

    def _wrap(self, distributed, name, fn):
        import tensorflow as tf

        def recorded(tensors, *args, **kwargs):
            if distributed.replica_context() is None:  # one replica: nothing is exchanged
                return fn(tensors, *args, **kwargs)
            caller = inspect.stack()[1].function
            size = 0
            for t in tensors:
                if t is None:
                    continue
                if isinstance(t, tf.IndexedSlices):
                    size += int(t.values.shape.num_elements() or 0) + int(t.indices.shape[0] or 0)
                else:
                    size += int(t.shape.num_elements())
            size += 1 if name == "weighted_mean" else 0  # the packed batch weight
            self.bytes[f"{name}@{caller}"].add(4 * size)
            return fn(tensors, *args, **kwargs)

        return recorded

    def summary(self):
        return {k: sorted(v) for k, v in self.bytes.items()}


def _design_bytes(model):
    """The design's figures (DESIGN §3.7) from the block shapes and the trainable variables."""
    blocks = model.thor.blocks
    state = model.thor.state
    factor_floats = sum(_numel(shape) for layer in state.layers for shape in layer.shapes())
    gradient_floats = sum(_numel(v.shape) for v in model.trainable_variables)
    return {"gradients_per_step": 4 * (gradient_floats + 1),  # + the loss, riding along
            "traces_per_cadence_point": 4 * (2 * len(blocks) + 1),
            "factors_per_refresh": 4 * (factor_floats + 1),
            "inverses_per_refresh_balanced": 4 * factor_floats}


def _numel(shape):
    n = 1
    for s in shape:
        n *= int(s)
    return n


def worker(model_name, replicas, batch, steps):
    import numpy as np
    import tensorflow as tf

    devices, kind = _devices(tf, replicas)
    import keras
    import thor_tf
    from thor_tf import distributed
    from experiments import models

    log = CollectiveLog(distributed)
    shape, classes = MODELS[model_name]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, *shape)).astype("float32")
    y = rng.integers(0, classes, size=batch)
    strategy = tf.distribute.MirroredStrategy(devices)
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()  # one global batch, split by fit

    def compiled(optimizer, **options):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = models.build(model_name, shape, classes)
            if optimizer == "sgd":
                model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                              loss="sparse_categorical_crossentropy")
                return model
            wrapped = thor_tf.wrap(model, learning_rate=0.01, verbose=False, **options)
            wrapped.compile(loss="sparse_categorical_crossentropy")
            return wrapped

    out = {"model": model_name, "replicas": replicas, "devices": kind, "global_batch": batch}
    out["sgd_step_s"], out["sgd_first_step_s"] = fit_step_seconds(compiled("sgd"), dataset, steps)
    plain = compiled("thor", frequency=10 ** 9)
    out["plain_step_s"], out["thor_first_step_s"] = fit_step_seconds(plain, dataset, steps)
    for assignment in ("all", "balanced"):
        if replicas == 1 and assignment == "balanced":
            continue  # the same program on one replica
        log.bytes.clear()
        # The inverse rule: the one that inverts factors, where the assignment matters.
        model = compiled("thor", preset="thor_nt", trace_filter="none", frequency=1,
                         update_rule=thor_tf.rules.Inverse(inverse_assignment=assignment))
        out[f"cadence_step_s[{assignment}]"], _ = fit_step_seconds(model, dataset, steps)
        out[f"all_reduced_bytes[{assignment}]"] = log.summary()
    out["design_bytes"] = _design_bytes(plain)
    costs = [plain.thor.refresher.inversion_cost(i) for i in range(len(plain.thor.blocks))]
    owners = distributed.balanced_owners(costs, replicas)
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(replicas)]
    out["inversion_cost_per_replica"] = {"all": sum(costs), "balanced": max(loads),
                                         "balanced_loads": loads}
    out["blocks"] = len(plain.thor.blocks)
    return out


def run_worker(args, model_name, replicas):
    return run_self(__file__, ["--worker", model_name, replicas, "--batch", args.batch,
                               "--steps", args.steps], timeout=args.timeout)


def check_bytes(result):
    """Whether the recorded collectives are the design's, stage by stage."""
    design = result["design_bytes"]
    checks = {}
    for assignment in ("all", "balanced"):
        recorded = result.get(f"all_reduced_bytes[{assignment}]")
        if recorded is None:
            continue
        if result["replicas"] == 1:
            checks[assignment] = recorded == {}  # nothing is exchanged on one replica
            continue
        expected = {"sum_gradients@train_update": [design["gradients_per_step"]],
                    "weighted_mean@cadence": [design["traces_per_cadence_point"]],
                    "weighted_mean@exchange": [design["factors_per_refresh"]]}
        if assignment == "balanced":
            expected["sum_packed@_shared_inverses"] = [design["inverses_per_refresh_balanced"]]
        checks[assignment] = recorded == expected
    return checks


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["model"] for r in results})
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    keys = [("plain_step_s", "THOR plain step"), ("cadence_step_s[all]", "refresh all: every replica inverts"),
            ("cadence_step_s[balanced]", "refresh all: balanced inversion")]
    for ax, name in zip(axes[0], names):
        rows = sorted((r for r in results if r["model"] == name), key=lambda r: r["replicas"])
        width = 0.8 / len(keys)
        for k, (key, label) in enumerate(keys):
            ax.bar([i + k * width for i in range(len(rows))],
                   [r.get(key, float("nan")) / r["sgd_step_s"] for r in rows], width, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))],
                      [f"{r['replicas']} ({r['devices']})" for r in rows])
        ax.set_xlabel("replicas (devices)")
        ax.set_ylabel("step time / SGD-momentum's on the same replicas")
        ax.set_title(f"{name}, global batch {rows[0]['global_batch']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="cnn,resnet20")
    p.add_argument("--replicas", default="1,2,4")
    p.add_argument("--batch", type=int, default=128, help="global batch size")
    p.add_argument("--steps", type=int, default=10, help="timed steps per measure (median)")
    p.add_argument("--quick", action="store_true", help="few steps, for a smoke test")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per worker")
    p.add_argument("--out", default="runs/bench_distributed.json")
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "REPLICAS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 3
    if args.worker:
        result = worker(args.worker[0], int(args.worker[1]), args.batch, args.steps)
        report(result)
        return

    results = []
    for model_name in args.models.split(","):
        for replicas in (int(r) for r in args.replicas.split(",")):
            r = run_worker(args, model_name, replicas)
            r["bytes_match_design"] = check_bytes(r)
            results.append(r)
            cadence = "  ".join(f"cadence[{a}] {r[f'cadence_step_s[{a}]'] / r['sgd_step_s']:.2f}x"
                                for a in ("all", "balanced") if f"cadence_step_s[{a}]" in r)
            print(f"{model_name:9s} R={replicas} ({r['devices']})  sgd {r['sgd_step_s'] * 1e3:7.1f}ms  "
                  f"plain {r['plain_step_s'] / r['sgd_step_s']:.2f}x  {cadence}  "
                  f"factors {r['design_bytes']['factors_per_refresh'] / 1e6:.2f} MB/refresh  "
                  f"bytes as designed {r['bytes_match_design']}", flush=True)
    summary = {"results": results, "settings": {"steps": args.steps, "global_batch": args.batch}}
    write_results(args.out, summary, __file__, argv, plot, results)


if __name__ == "__main__":
    main()
