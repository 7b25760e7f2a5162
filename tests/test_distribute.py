"""MirroredStrategy over two logical CPU devices: THOR trains, replicas agree on skipping
non-finite batches, and the mirrored weights stay finite and identical across replicas.

Factors are per replica (local batch) under a strategy: see README "Limits"."""

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np, thor_tf
from sklearn.datasets import load_digits

d = load_digits()
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
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                          timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(lines[0][len("RESULT"):])
    assert result["loss_after"] < 0.7 * result["loss_before"], result
    assert result["unchanged_on_nan"] and result["nonfinite_steps"] == 1, result
    assert result["replicas_equal"] and result["factors_finite"], result
