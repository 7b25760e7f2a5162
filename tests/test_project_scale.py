"""The scaling cost model (scripts/project_scale.py): its bytes are what a live 2-replica run
hands to collectives, its FLOP and collective formulas are the textbook ones, and the per-block
inversion assignment balances.

No timing here: the measurements live in the script. Everything is recomputed independently from
the layer shapes (written out by hand), counted in a live run (the bytes), or checked against
recorded figures (docs/results/bench_distributed.json) and published ones (ResNet-50's parameter count
and multiply-adds).
"""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ps():
    from scripts import project_scale

    return project_scale


@pytest.fixture(scope="module")
def shapes(ps):
    """The CNN and ResNet-20 at bench_distributed's inputs, ResNet-50 at 224x224."""
    from experiments import models

    return {"cnn": ps.model_shape(models.build("cnn", (28, 28, 1), 10), "cnn"),
            "resnet20": ps.model_shape(models.build("resnet20", (32, 32, 1), 10), "resnet20"),
            "resnet50": ps.model_shape(models.build("resnet50", (224, 224, 3), 1000), "resnet50")}


LIVE_RUN = r"""
import collections, json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np, thor_tf
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
from test_project_scale import live_model

# Every collective a replica issues, by the thor_tf.distributed function that issued it and the
# engine function that called that (anything else: "other@<file>:<function>"), in float32 bytes.
issued = collections.defaultdict(set)
own = tf.distribute.ReplicaContext.all_reduce

def all_reduce(self, reduce_op, value, options=None):
    frame = sys._getframe(1)
    key = "other@" + os.path.basename(frame.f_code.co_filename) + ":" + frame.f_code.co_name
    while frame is not None and frame.f_back is not None:
        if frame.f_code.co_filename.endswith(os.path.join("thor_tf", "distributed.py")):
            key = frame.f_code.co_name + "@" + frame.f_back.f_code.co_name
            break
        frame = frame.f_back
    size = sum(int(t.shape.num_elements()) for t in tf.nest.flatten(value))
    issued[key].add(4 * size)
    return own(self, reduce_op, value, options)

tf.distribute.ReplicaContext.all_reduce = all_reduce
rng = np.random.default_rng(0)
x = rng.normal(size=(16, 8, 8, 1)).astype("float32")
y = rng.integers(0, 4, 16)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
out = {}
for assignment in ("all", "balanced"):
    issued.clear()
    with strategy.scope():
        model = thor_tf.wrap(live_model(), update_rule="inverse", split_dim=8, preset="thor_nt",
                             trace_filter="none", frequency=1, inverse_assignment=assignment,
                             verbose=False)
        model.compile(loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # one step: every block refreshes
    refreshes = [s["refreshes"] for s in model.thor.layer_stats()]
    out[assignment] = {"bytes": {k: sorted(v) for k, v in issued.items()},
                       "refreshes": refreshes}
print("RESULT" + json.dumps(out))
"""

# thor_tf.distributed's collectives ("<function>@<engine caller>") -> the cost model's stages.
STAGE_OF = {"sum_gradients": "gradients", "weighted_mean@cadence": "traces",
            "weighted_mean@exchange": "factors", "sum_packed": "inverses"}


def _stage(key):
    return next((stage for prefix, stage in STAGE_OF.items() if key.startswith(prefix)), key)


def live_model():
    """Conv2D (stride 2, same) + BatchNorm + two Dense: with split 8 the factors (10, 3, 49, 10,
    11, 4) are cut into padded blocks; BatchNorm's γ, β count in the gradients only."""
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(3, 3, strides=2, padding="same", name="conv"),
        keras.layers.BatchNormalization(name="bn"),
        keras.layers.Activation("relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(10, activation="tanh", name="fc"),
        keras.layers.Dense(4, activation="softmax", name="out"),
    ])


def test_bytes_equal_bench_distributed_recorded(ps):
    """A live 2-replica run (MirroredStrategy over 2 logical CPUs, one step at which every block
    refreshes, each inverse assignment; the inverse rule, whose state bench_distributed recorded):
    every collective the replicas issue, counted at
    ``ReplicaContext.all_reduce``, is one of the model's stages with exactly its bytes (nothing
    else is exchanged; inverses only with "balanced")."""
    import subprocess

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", LIVE_RUN, ROOT], capture_output=True, text=True,
                          env=env, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(lines[0][len("RESULT"):])
    predicted = ps.collective_bytes(ps.model_shape(live_model()), 2, split_dim=8)
    # By hand: 3·3·1·3 + 3 (conv) + 2·3 (bn) + 48·10 + 10 + 10·4 + 4 parameters, + the loss;
    # 2 traces per block + the batch weight; split 8: 10 -> 2 blocks of 8, 49 -> 7, 11 -> 2.
    floats = 2 * 64 + 9 + 7 * 64 + 2 * 64 + 2 * 64 + 16
    assert predicted == {"gradients": 4 * (30 + 6 + 490 + 44 + 1), "traces": 4 * (2 * 3 + 1),
                         "factors": 4 * (floats + 1), "inverses": 4 * floats}
    for assignment in ("all", "balanced"):
        run = result[assignment]
        assert run["refreshes"] == [1, 1, 1], run
        got = {_stage(k): v for k, v in run["bytes"].items()}
        want = {k: [v] for k, v in predicted.items() if k != "inverses" or assignment == "balanced"}
        assert got == want, (assignment, run["bytes"])


@pytest.mark.parametrize("model", ["cnn", "resnet20"])
def test_bench_distributed_json_agrees_with_the_model(ps, shapes, model):
    """The figures in docs/results/bench_distributed.json (recorded by an earlier engine, before the
    per-block "balanced" assignment: a check of the document, not of today's engine, which the
    live run above checks) are the model's bytes at R = 1, 2, 4."""
    with open(os.path.join(ROOT, "docs", "results", "bench_distributed.json")) as fh:
        results = [r for r in json.load(fh)["results"] if r["model"] == model]
    assert sorted(r["replicas"] for r in results) == [1, 2, 4]
    for rec in results:
        predicted = ps.collective_bytes(shapes[model], rec["replicas"], split_dim=128)
        for assignment in ("all", "balanced"):
            recorded = rec.get(f"all_reduced_bytes[{assignment}]")
            if recorded is None:
                continue
            if rec["replicas"] == 1:
                assert recorded == {} and set(predicted.values()) == {0}
                continue
            got = {_stage(k): v for k, v in recorded.items()}
            want = {k: [v] for k, v in predicted.items()
                    if k != "inverses" or assignment == "balanced"}
            assert got == want, (model, rec["replicas"], assignment)


def test_cnn_bytes_from_first_principles(ps, shapes):
    """The CNN's byte formula written out layer by layer (split 128, bias folded into A)."""
    blocks = lambda n: (-(-n // 128), 128) if n > 128 else (1, n)
    # (a_dim, g_dim): conv1 3*3*1+1, conv2 3*3*32+1, dense1 7*7*64+1, predictions 128+1
    dims = [(10, 32), (289, 64), (3137, 128), (129, 10)]
    floats = sum(nb * d * d for a, g in dims for nb, d in (blocks(a), blocks(g)))
    assert floats == 100 + 1024 + 3 * 128 ** 2 + 64 ** 2 + 25 * 128 ** 2 + 128 ** 2 + 2 * 128 ** 2 + 100
    params = (9 * 32 + 32) + (9 * 32 * 64 + 64) + (3136 * 128 + 128) + (128 * 10 + 10)
    assert [(l.a_dim, l.g_dim) for l in shapes["cnn"].layers] == dims
    assert shapes["cnn"].parameters == params
    assert ps.collective_bytes(shapes["cnn"], 8, 128) == {
        "gradients": 4 * (params + 1), "traces": 4 * (2 * 4 + 1), "factors": 4 * (floats + 1),
        "inverses": 4 * floats}
    assert [l.positions for l in shapes["cnn"].layers] == [28 * 28, 14 * 14, 1, 1]
    assert [l.input_size for l in shapes["cnn"].layers] == [28 * 28, 14 * 14 * 32, 3136, 128]
    assert [l.first for l in shapes["cnn"].layers] == [True, False, False, False]


def test_resnet50_shape_and_flops_match_published(ps, shapes):
    """ResNet-50 v1.5 at 224x224: 53 convolutions + the classifier; 25,557,032 trainable
    parameters (torchvision's count, BatchNorm's γ and β included); ~4.1 G multiply-adds forward
    (He et al. 2016 quote 3.8 G for v1, whose stride sits on the first 1x1; v1.5 ~4.1 G)."""
    shape = shapes["resnet50"]
    assert len(shape.layers) == 54
    assert shape.parameters == 25_557_032
    flops = ps.model_flops(shape, 1, 128)
    forward_macs = sum(l.positions * l.in_dim * l.g_dim for l in shape.layers)
    assert 4.05e9 < forward_macs < 4.15e9
    first = shape.layers[0]
    assert first.first and (first.in_dim, first.g_dim, first.positions) == (147, 64, 112 * 112)
    # forward + both backward products, except the stem's input gradient
    assert sum(flops["forward_backward"]) == 6 * forward_macs - 2 * first.positions * 147 * 64
    # inversion: 7/3 d^3 per block, batch-independent; factors scale with the batch
    assert ps.model_flops(shape, 32, 128)["inversion"] == flops["inversion"]
    assert sum(ps.model_flops(shape, 32, 128)["factors"]) == 32 * sum(flops["factors"])


def test_layer_flops_by_hand(ps):
    """One Conv2D block, every stage written out: 3x3x64 -> 64 on 56x56, batch 2, split 128."""
    layer = ps.LayerShape("c", "conv2d", 576, False, 64, 56 * 56, 56 * 56 * 64)
    f = ps.layer_flops(layer, 2, 128)
    rows = 2 * 56 * 56
    assert f["forward_backward"] == 3 * 2 * rows * 576 * 64
    assert f["traces"] == 4 * (2 * 56 * 56 * 64 + rows * 64)  # bytes of x and g (memory-bound)
    assert f["factors"] == 2 * rows * (5 * 128 ** 2 + 64 ** 2)       # 576 = 4.5 blocks -> 5
    assert f["inversion"] == pytest.approx(7 / 3 * (5 * 128 ** 3 + 64 ** 3))
    assert f["precondition"] == 2 * (5 * 128 ** 2 * 64 + 64 ** 2 * 576)


def test_allreduce_alpha_beta_formulas(ps):
    """Ring in a node; hierarchical ring or tree across nodes; NCCL's LL protocol below 64 KiB."""
    link = lambda bw, hop: ps.Link("l", bw, {"ll": hop / 10, "simple": hop}, "test")
    device = ps.DEVICES["h100"]
    cluster = ps.Cluster("t", device, 8, link(100e9, 2e-6), link(10e9, 5e-6))
    base = ps.NCCL_BASE_S["simple"]
    n = 64e6
    assert ps.allreduce_seconds(n, 1, cluster) == 0.0
    # one node, R = 4: 2(R-1) hops, 2(R-1)/R n bytes
    assert ps.allreduce_seconds(n, 4, cluster) == pytest.approx(base + 6 * 2e-6 + 1.5 * n / 100e9)
    # 64 replicas = 8 nodes: intra reduce-scatter + all-gather, inter on n/8 shards
    intra = 2 * (7 * 2e-6 + 7 / 8 * n / 100e9)
    ring = 2 * 7 * 5e-6 + 2 * 7 / 8 * (n / 8) / 10e9
    tree = 2 * 3 * 5e-6 + 2 * (n / 8) / 10e9
    assert ps.allreduce_seconds(n, 64, cluster, "ring") == pytest.approx(base + intra + ring)
    assert ps.allreduce_seconds(n, 64, cluster, "tree") == pytest.approx(base + intra + tree)
    assert ps.allreduce_seconds(n, 64, cluster) == pytest.approx(base + intra + min(ring, tree))
    # small messages: the low-latency protocol's hops; at 1024 replicas the tree's log wins
    small = ps.allreduce_seconds(36, 1024, cluster)
    assert small == pytest.approx(ps.NCCL_BASE_S["ll"] + 2 * (7 * 2e-7 + 7 / 8 * 36 / 100e9)
                                  + 2 * 7 * 5e-7 + 2 * (36 / 8) / 10e9)


def test_balanced_block_owners_spreads_a_dominant_layer(ps, shapes):
    """The CNN's dense1 holds 83 % of the inversion work: per layer the slowest replica keeps it
    whatever R; per block the load falls to within one block of total / R (LPT's bound)."""
    from thor_tf.distributed import balanced_block_owners, balanced_owners

    costs = ps.block_costs(shapes["cnn"], 128)
    total = sum(map(sum, costs))
    assert total == 65308624  # bench_distributed's inversion_cost_per_replica["all"]
    dense1 = sum(costs[2])
    assert dense1 == 54525952 and dense1 / total == pytest.approx(0.835, abs=1e-3)
    for replicas in (1, 2, 4, 8, 64):
        by_layer = balanced_owners([sum(c) for c in costs], replicas)
        layer_loads = [sum(sum(c) for c, o in zip(costs, by_layer) if o == r)
                       for r in range(replicas)]
        assert max(layer_loads) == (total if replicas == 1 else dense1)
        owners = balanced_block_owners(costs, replicas)
        assert [len(o) for o in owners] == [len(c) for c in costs]
        loads = [0.0] * replicas
        for cs, os_ in zip(costs, owners):
            for c, o in zip(cs, os_):
                assert 0 <= o < replicas
                loads[o] += c
        assert sum(loads) == total
        biggest = max(max(c) for c in costs)
        assert max(loads) <= total / replicas + biggest
        assert balanced_block_owners(costs, replicas) == owners  # deterministic
    # R = 4: 31 blocks of 128^3 and a few small ones -> 8 big blocks on the slowest replica
    loads4 = [0.0] * 4
    for cs, os_ in zip(costs, balanced_block_owners(costs, 4)):
        for c, o in zip(cs, os_):
            loads4[o] += c
    assert max(loads4) == 8 * 128 ** 3


def test_step_model_orders_and_shared_cores(ps, shapes):
    """Plain >= SGD, refresh >= cadence >= plain, amortized between plain and refresh; on one
    replica nothing is exchanged; on shared cores every-replica inversion costs R times."""
    eff = {k: 0.2 for k in ps.STAGE_PRECISION}
    c = ps.Costs(shapes["cnn"], 32, 128, ps.model_flops(shapes["cnn"], 32, 128), eff,
                 [0.1] * 4)
    cluster = ps.CLUSTERS["dgx-h100"]
    one = ps.step_times(c, cluster, 1)
    assert one["parts"]["gradient_allreduce"] == 0 and one["bytes"]["gradients"] == 0
    for r in (2, 64):
        for assignment in ps.ASSIGNMENTS:
            t = ps.step_times(c, cluster, r, assignment)
            assert t["sgd"] <= t["plain"] <= t["cadence"] <= t["refresh"]
            assert t["plain"] <= t["amortized"] <= t["refresh"]
    shared = ps.Cluster("cpu", ps.DEVICES["cpu_here"], 64, None, None, shared_compute=True,
                        measured_allreduce={4: (1e-4, 1e9)})
    everyone = ps.inversion_seconds(c, shared.device, 4, "all", [True] * 4, shared=True)
    single = ps.inversion_seconds(c, shared.device, 1, "all", [True] * 4, shared=True)
    assert everyone == pytest.approx(4 * single)
    spread = ps.inversion_seconds(c, shared.device, 4, "blocks", [True] * 4, shared=True)
    assert spread == pytest.approx(single)  # the same work, once, on the shared cores
