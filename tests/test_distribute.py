"""Data-parallel THOR: R replicas take the single-device step on the same global batch.

MirroredStrategy over 2 and 4 logical CPU devices against one device (weights, KL-clip ν,
decisions, factors and inverses; every optimizer variable identical on all replicas), checkpoints
of a 2-replica run resumed on 1 and 2 replicas, two MultiWorkerMirroredStrategy worker processes on
127.0.0.1 against one process (custom loop and ``fit``), a dead worker failing the other, the
skip path (NaN batches, loss scaling) on 2 replicas, and the default rule with a refresh at every
step against one device's own reordering of the batch's rows (with oneDNN and without). Each case runs in a subprocess (logical devices
and TF_CONFIG must be set before TensorFlow starts); the scripts are in tests/scripts/.
"""

import json
import numpy as np
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")

# Two logical CPU devices, then the digits; each script takes its own slice of them.
PREAMBLE = r"""
import json, os, sys, warnings
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np, thor_tf
from sklearn.datasets import load_digits

d = load_digits()
"""

SCRIPT = PREAMBLE + r"""
x = (d.images[:64] / 16.0).astype("float32")[..., None]
y = d.target[:64]

def build():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((8, 8, 1)),
                          keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
                          keras.layers.Flatten(),
                          keras.layers.Dense(10, activation="softmax", name="out")])
    w = thor_tf.wrap(m, learning_rate=0.1, verbose=False)
    w.compile(loss="sparse_categorical_crossentropy")
    return w

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    mirrored = build()
first = mirrored.evaluate(x, y, verbose=0)
mirrored.fit(x, y, batch_size=16, epochs=3, verbose=0)
bad = x.copy(); bad[0, 0, 0, 0] = np.nan
before = [v.numpy().copy() for v in mirrored.trainable_variables]
mirrored.fit(bad[:16], y[:16], batch_size=16, epochs=1, shuffle=False, verbose=0)
after = [v.numpy() for v in mirrored.trainable_variables]
out = {
    "loss_before": float(first), "loss_after": float(mirrored.evaluate(x, y, verbose=0)),
    "unchanged_on_nan": bool(all(np.array_equal(a, b) for a, b in zip(before, after))),
    "nonfinite_steps": mirrored.thor.counters()["nonfinite_steps"],
    "replicas_equal": bool(all(np.array_equal(v.value.values[0].numpy(), v.value.values[1].numpy())
                               for v in mirrored.trainable_variables)),
    "factors_finite": bool(all(np.isfinite(mirrored.thor.factors(n)[k]).all()
                               for n in ("conv", "out") for k in ("A", "G"))),
}
print("RESULT" + json.dumps(out))
"""


def test_mirrored_strategy_trains_and_keeps_replicas_in_step():
    result = _run(SCRIPT)
    assert result["loss_after"] < 0.7 * result["loss_before"], result
    assert result["unchanged_on_nan"] and result["nonfinite_steps"] == 1, result
    assert result["replicas_equal"] and result["factors_finite"], result


SKIP_SCRIPT = PREAMBLE + r"""
x = (d.images[:128] / 16.0).astype("float32")[..., None]
y = d.target[:128]
x[40] = np.nan  # batch 1 of 4 (batch 32) in every epoch
keras.mixed_precision.set_global_policy(sys.argv[1])
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, name="conv")(inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Flatten()(keras.layers.Activation("relu")(h))
    out = keras.layers.Dense(10, activation="softmax", dtype="float32", name="out")(h)
    model = thor_tf.wrap(keras.Model(inp, out), verbose=False)
    model.compile(loss="sparse_categorical_crossentropy")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
bn = model.model.get_layer("bn")
scale = getattr(model.optimizer, "dynamic_scale", None)
print("RESULT" + json.dumps({
    "losses": history.history["loss"],
    "moving_finite": bool(np.isfinite(bn.moving_mean.numpy()).all()
                          and np.isfinite(bn.moving_variance.numpy()).all()),
    "iterations": int(model.optimizer.iterations.numpy()),
    "skipped": model.thor.counters()["nonfinite_steps"],
    "scale": None if scale is None else float(scale.numpy()),
}))
"""


def _env(**extra):
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                TF_CPP_MIN_LOG_LEVEL="3", **extra)


def _result(stdout, stderr):
    lines = [l for l in stdout.splitlines() if l.startswith("RESULT")]
    assert lines, stdout[-2000:] + stderr[-4000:]
    return json.loads(lines[0][len("RESULT"):])


def _run(script, *args):
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          env=_env(), timeout=300)
    return _result(proc.stdout, proc.stderr)


def _run_file(name, *args, timeout=300, env=None):
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, name), *map(str, args)],
                          capture_output=True, text=True, env=_env(**(env or {})),
                          timeout=timeout)
    return _result(proc.stdout, proc.stderr)


def test_mirrored_skipped_batches_keep_moving_statistics_and_loss_scale_rule():
    """On 2 replicas a NaN batch leaves BatchNormalization's moving statistics finite, does not
    count in iterations or the loss, and under mixed_float16 halves the dynamic loss scale as
    Keras' LossScaleOptimizer does (once per skipped step, from 2**15)."""
    plain = _run(SKIP_SCRIPT, "float32")
    assert plain["moving_finite"] and all(np.isfinite(plain["losses"])), plain
    assert plain["skipped"] == 2 and plain["iterations"] == 6, plain
    mixed = _run(SKIP_SCRIPT, "mixed_float16")
    assert mixed["moving_finite"] and all(np.isfinite(mixed["losses"])), mixed
    assert mixed["skipped"] >= 2 and mixed["iterations"] + mixed["skipped"] == 8, mixed
    assert mixed["scale"] == 2.0 ** 15 / 2 ** mixed["skipped"], mixed


#: How far (relative to how far the weights moved) R replicas may land from one device on the same
#: global batches. The inverse rule: float32 round-off of all-reduced sums (measured ≤ 4e-7).
#: The eigenbasis rule (the default, which the checkpoint and multi-worker scripts run): the
#: same round-off moves eigenvectors of close eigenvalues and Adam's per-coordinate division
#: keeps the difference (measured < 1e-4 on TF 2.21, 1.7e-3 on TF 2.16's LAPACK; state that is
#: not shared or not restored shows as O(1)).
#: ``power_qr``: the eigenbasis rule with every later refresh a float32 power step + QR (no size
#: floor, no residual check: the float32 path alone), held to the eigenbasis rule's tolerance
#: (measured 6e-5; a float32 eigh instead of float64 there: 2.5e-3 of the step, its eigenvalues
#: 6e-3 apart).
SAME_STEP = {"inverse": 1e-4, "eigenbasis": 5e-3, "power_qr": 5e-3}
#: The rules' argument to the scripts (a name, or Keras' serialized dict as JSON).
RULE_ARG = {"inverse": "inverse", "eigenbasis": "eigenbasis",
            "power_qr": json.dumps({"class_name": "Eigenbasis",
                                    "registered_name": "thor_tf>Eigenbasis",
                                    "config": {"refresh": "power_qr", "refresh_min_size": 0,
                                               "refresh_tolerance": 1e30}})}


# The default rule on 2 replicas (the conv and the token model) and the inverse rule on 4 with
# balanced inverse assignment. Left out for CI's time (~30 s each): 2 replicas under the inverse
# rule (the 4-replica case runs its all-reduces and more) and under ``power_qr`` refreshes (a
# deterministic function of the all-reduced factors; test_checkpoint_of_a_two_replica_run_...
# runs that rule on 2 replicas against one device, here and in .ci/run's numerics pass).
@pytest.mark.parametrize("replicas,assignment,rule", [(2, "all", "eigenbasis"),
                                                      (4, "balanced", "inverse")])
def test_replicas_take_the_single_device_step(replicas, assignment, rule):
    """3 epochs of 4 steps, cadence every 2 steps (refreshes and reuses both happen): weights
    within SAME_STEP of the step size of the one-device run, the same decisions, ν, factors and
    inverses, and every optimizer variable bit-identical on all replicas. Before this was built
    (each replica preconditioned its local gradient with its local factors) the conv model's
    weights differed by 84 % of the step size, ν was 0.352 instead of 0.137 and the replicas'
    factors differed. The token model has an Embedding (sparse gradients) and a Conv1D. Under the
    eigenbasis rule the eigenvalues and moments are compared where the inverses are."""
    models = "conv,tokens" if replicas == 2 else "conv"
    result = _run_file("replicas_vs_one.py", replicas, assignment, models, RULE_ARG[rule])
    for name, r in result.items():
        assert r["replicas"] == replicas and r["copies"] == replicas, (name, r)
        assert r["relative_weight_diff"] < SAME_STEP[rule], (name, r)
        assert r["decisions_many"] == r["decisions_one"], (name, r)
        refreshes, reuses = zip(*[(d[0], d[1]) for d in r["decisions_one"]])
        assert max(refreshes) >= 2 and max(reuses) >= 1, (name, r)  # both paths exercised
        assert abs(r["nu_many"] - r["nu_one"]) <= 1e-5 * abs(r["nu_one"]), (name, r)
        # Factors, and the rule's products: inverses, or eigenvalues and second moments (those
        # carry the same sensitivity as the weights: 3e-4 measured on TF 2.16).
        assert r["factor_inverse_diff"] < SAME_STEP[rule], (name, r)
        assert r["replicas_identical"], (name, r)


#: Two replicas against one device under the default rule with a refresh at every step
#: (docs/distributed.md, "What bounds the difference"). The replicas change only the order of the
#: sums over the batch's rows (factors, gradients), so they land where one device lands with each
#: batch's rows reordered: within REORDERED times the larger of two such reorderings (measured
#: 0.7–1.0×, both kernel paths). That difference is the rule's own first-order response to
#: float32 round-off: δF ≈ u·‖F‖ in a factor turns an eigenvector pair whose eigenvalues are g
#: apart by θ ≈ δF/g, and Adam's division in the eigenbasis passes a rotated entry near its floor
#: f = ε_r·RMS with slope up to 1/f: a step moves by ≈ θ·|M'|/f (1.0–1.7e-4 of the first step
#: measured, 1.1e-4 of the run's movement after 3 steps). EVERY_REFRESH_CAP is 9× that; one
#: example of the first batch's 64 replaced moves the weights by 0.28 of it (2500×).
REORDERED = 4.0
EVERY_REFRESH_CAP = 1e-3
#: The factors after the first step, relative to their largest entry: float32 sums of n products
#: differ by ~√n·u between orders (n = 64 rows for the Dense layers, 64·36 patches for the
#: convolution: ≤ 3e-6; measured ≤ 3e-7); a wrong all-reduce weight or scale is O(1).
FACTOR_ROUND_OFF = 1e-5


def test_replicas_with_a_refresh_at_every_step_differ_as_one_device_reordered():
    """The default rule (eigenbasis, orthogonalized step) with every layer's basis renewed at every
    step, 3 steps of a Conv2D + Dense model on 2 replicas against one device on the same global
    batches (64 rows: the Dense layers' A is full rank), on the kernel path the tests run on
    (.ci/run runs it again with oneDNN off and capped at AVX2): the replicas are
    within REORDERED of one device's own reordering and under EVERY_REFRESH_CAP, their factors
    within round-off; a real difference (one example of the batch replaced) is ≥ 100× the cap."""
    r = _run_file("replicas_every_refresh.py", "pool", 3, 64)
    assert r["refreshes"] == [3, 3, 3], r
    reordered = max(r["swapped"], r["reversed"])
    assert r["many"] <= REORDERED * reordered, r
    assert r["many"] < EVERY_REFRESH_CAP and reordered < EVERY_REFRESH_CAP, r
    assert r["many_factors"] < FACTOR_ROUND_OFF, r
    assert r["other"] > 100 * EVERY_REFRESH_CAP and r["other_factors"] > 100 * FACTOR_ROUND_OFF, r


def test_checkpoint_of_a_two_replica_run_resumes_exactly_on_one_and_two_replicas():
    """model.save/load_model onto 1 and 2 replicas, tf.train.Checkpoint and BackupAndRestore
    (preempted in epoch 2) onto 1 device: epoch 2 ends where the uninterrupted one-device run
    ends (weights within SAME_STEP of the step size, the same counters and decisions). Under the
    eigenbasis rule with every later refresh a power step: the first refreshes are `eigh`'s, and
    the bases restored are what the power steps after the resume start from, so a basis, moment
    or eigenvalue not restored shows. (The rule's default on these small blocks, `eigh` at every
    refresh, restores the same variables; that variant, 32 s, was left out for CI's time.)"""
    result = _run_file("checkpoint_replicas.py", RULE_ARG["power_qr"])
    two = result.pop("uninterrupted_on_2")
    assert set(result) == {"keras_save_onto_1", "keras_save_onto_2", "checkpoint_onto_1",
                           "backup_onto_1"}, result
    # Resumed on 2 replicas, the run is the uninterrupted 2-replica run (same summation order):
    # within float32 round-off of the step, far below any variable not restored (a step's size).
    assert two["resumed_on_2_diff"] < 1e-4, two
    # Across replica counts the default rule amplifies round-off (docs/distributed.md: 1e-4…8e-3
    # of the run's movement by kernel path); a resume is held to what 2 replicas uninterrupted
    # reach, or SAME_STEP where that is smaller.
    bound = max(SAME_STEP["power_qr"], 2 * two["relative_weight_diff"])
    for how, r in result.items():
        assert r["iterations"] == 8, (how, r)
        assert r["relative_weight_diff"] < bound, (how, r, two)
        assert r["counters_equal"] and r["decisions_equal"], (how, r)


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _start_workers(out_dir, count=2):
    ports = _free_ports(count)
    workers = []
    for index in range(count):
        tf_config = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                "task": {"type": "worker", "index": index}})
        workers.append(subprocess.Popen(
            [sys.executable, os.path.join(SCRIPTS, "multi_worker.py"), out_dir],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=_env(TF_CONFIG=tf_config)))
    return workers


def _stop(workers):
    for w in workers:
        if w.poll() is None:
            w.kill()
        w.wait(timeout=30)


def test_two_worker_processes_match_one_process_and_a_dead_worker_fails_the_other():
    """MultiWorkerMirroredStrategy, 2 processes on 127.0.0.1: the custom-loop recipe and
    ``ThorModel.fit`` (which Keras' own fit cannot do there: keras-team/keras#20585) both end,
    on both workers, with identical weights equal to one process on the same global batches.
    Then worker 1 exits abruptly before its third step of the custom loop: worker 0 stops with an
    error naming the failed collective within a bounded time (seconds here), instead of waiting
    forever. (One cluster for both: each start costs every worker its imports and traces.)"""
    out_dir = tempfile.mkdtemp()
    workers = _start_workers(out_dir)
    try:
        outputs = [w.communicate(timeout=300) for w in workers]
        ended = time.time()
    finally:
        _stop(workers)
    results = [_result(*o) for o in outputs]
    for r in results:
        assert r["workers"] == 2 and r["loop_iterations"] == 8 and r["fit_iterations"] == 8, r
        assert r["loop_refreshes"] == results[0]["alone_refreshes"], results
    w0, w1 = (np.load(os.path.join(out_dir, f"worker{i}.npz")) for i in range(2))
    count = len([k for k in w0.files if k.startswith("alone_")])
    moved = max(np.abs(w0[f"alone_{k}"] - w0[f"start_{k}"]).max() for k in range(count))
    for run in ("loop", "fit"):
        for k in range(count):
            assert np.array_equal(w0[f"{run}_{k}"], w1[f"{run}_{k}"]), (run, k)
            diff = np.abs(w0[f"{run}_{k}"] - w0[f"alone_{k}"]).max()
            assert diff < SAME_STEP["eigenbasis"] * moved, (run, k, diff, moved)
    if tuple(int(v) for v in results[0]["keras"].split(".")[:2]) >= (3, 15):
        # The logged loss too (Keras 3.8 aggregates the loss metric across workers otherwise:
        # weights exact, History's loss within 3 %; docs/usage.md "Distributed training").
        np.testing.assert_allclose(results[0]["fit_loss"], results[0]["alone_loss"], rtol=1e-4)

    # The dead worker.
    (stdout, stderr), survivor = outputs[0], workers[0]
    assert workers[1].returncode == 3, outputs[1][1][-3000:]
    assert survivor.returncode not in (0, None), stdout[-2000:] + stderr[-3000:]
    assert "Collective" in stderr or "Unavailable" in stderr or "aborted" in stderr, stderr[-3000:]
    (started,) = [float(line.split()[1]) for line in stdout.splitlines()
                  if line.startswith("DEAD_PHASE")]
    assert ended - started < 200, ended - started


LOOP_METRICS_SCRIPT = r"""
import _dist_common as common
tf = common.setup(2)
x, y = common.digits(64)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    model = common.conv_model()  # compiled with metrics=["accuracy"], not built yet

@tf.function
def step(batch):
    strategy.run(model.train_step, args=(batch,))

message = None
try:
    for batch in strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(32)):
        step(batch)
except ValueError as err:
    message = str(err)
common.report({"message": message})
"""


def test_custom_loop_with_unbuilt_compiled_metrics_says_what_to_do():
    """MirroredStrategy cannot create the compiled metrics' variables inside a replica: the train
    step names the cause and the two ways out instead of TF's placeholder error."""
    proc = subprocess.run([sys.executable, "-c", LOOP_METRICS_SCRIPT], capture_output=True,
                          text=True, env=_env(), timeout=300, cwd=SCRIPTS)
    message = _result(proc.stdout, proc.stderr)["message"]
    assert message and "Compile without `metrics`" in message and "evaluate()" in message, message
