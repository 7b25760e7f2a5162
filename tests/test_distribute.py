"""MirroredStrategy over two logical CPU devices: THOR trains, replicas agree on skipping
non-finite batches, and the mirrored weights stay finite and identical across replicas.

Factors are per replica (local batch) under a strategy: see README "Limits"."""

import json
import numpy as np
import os
import subprocess
import sys

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


def _run(script, *args):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          env=env, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[0][len("RESULT"):])


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
