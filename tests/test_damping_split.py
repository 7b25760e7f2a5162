"""``damping_split``: how a block's damping λ_b = λ/P is shared between its factors A and G.

``"sqrt"`` (THOR, default): ``A + √λ_b·I`` and ``G + √λ_b·I``. ``"pi"`` (Martens & Grosse 2015,
§6.3; kfac-jax): ``A + π√λ_b·I`` and ``G + (√λ_b/π)·I`` with
``π = √((tr A / dim A) / (tr G / dim G))``. The references below are float64 NumPy inverses built
from the stored factors (``model.thor.factors``), P from the layer's output shape and π from its
definition; nothing is taken from thor_tf's own damping code.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import thor_tf
from digits_models import digits
from thor_tf.rules.inverse_ops import factor_dampings, pi_adjustment

# THOR's inverse rule (K-FAC step, KL clip, damping, momentum) is what these tests check.
pytestmark = pytest.mark.update_rule("inverse")

LAMBDA = 0.03
SPLIT = 64  # larger than every factor below: one exact block per factor


def _model(seed=0):
    """Conv2D(4, 3, strides 2) on 8x8 (P = 3·3 = 9; A 10, G 4) -> Dense(12) (A 37, G 12) ->
    Dense(10) (A 13, G 10). Sizes 13, 12, 10, 10 share one padded inversion batch, so blocks
    of different layers and factors with different dampings are inverted together."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3, strides=2, activation="relu", name="conv"),
        keras.layers.Flatten(),
        keras.layers.Dense(12, activation="tanh", name="fc"),
        keras.layers.Dense(10, activation="softmax", name="out"),
    ])


def _one_refresh(split, jit_compile=False, **options):
    x, y = digits(64)
    wrapped = thor_tf.wrap(_model(), learning_rate=0.05, damping=LAMBDA, split_dim=SPLIT,
                           damping_split=split, verbose=False, **options)
    wrapped.compile(loss="sparse_categorical_crossentropy", jit_compile=jit_compile)
    wrapped.train_on_batch(x, y)  # step 0 is a cadence point: every layer refreshes
    for name in ("conv", "fc", "out"):
        assert wrapped.thor.layer_stats()[[s["name"] for s in wrapped.thor.layer_stats()]
                                         .index(name)]["refreshes"] == 1
    return wrapped


def _positions(wrapped, name):
    """P: output positions per example (Ho·Wo for the conv, 1 for Dense)."""
    shape = wrapped.model.get_layer(name).output.shape
    return int(np.prod(shape[1:-1])) if len(shape) > 2 else 1


def _reference(factors, lam_b, split):
    a = factors["A"].astype(np.float64)
    g = factors["G"].astype(np.float64)
    if split == "pi":
        pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
    else:
        pi = 1.0
    d_a, d_g = pi * np.sqrt(lam_b), np.sqrt(lam_b) / pi
    return (np.linalg.inv(a + d_a * np.eye(a.shape[0])),
            np.linalg.inv(g + d_g * np.eye(g.shape[0])), pi)


def _check_inverses(wrapped, split):
    """The stored inverses are the float64 inverses of the factors damped as ``split`` says;
    returns π per layer."""
    pis = {}
    for name in ("conv", "fc", "out"):
        factors = wrapped.thor.factors(name)
        inverses = wrapped.thor.inverses(name)
        lam_b = LAMBDA / _positions(wrapped, name)
        a_inv, g_inv, pis[name] = _reference(factors, lam_b, split)
        for key, expected in (("A_inv", a_inv), ("G_inv", g_inv)):
            stored = inverses[key]
            dim = expected.shape[0]
            assert stored.shape == (1, dim, dim), (name, key, stored.shape)
            scale = np.abs(expected).max()
            np.testing.assert_allclose(stored[0], expected, rtol=2e-4, atol=2e-4 * scale,
                                       err_msg=f"{name} {key} ({split})")
    return pis


@pytest.mark.parametrize("jit_compile", [False, True])
def test_pi_split_inverts_a_and_g_with_pi_adjusted_dampings(jit_compile):
    """One refresh (step 0), eager graph and XLA (where every block of a bucket is inverted)."""
    wrapped = _one_refresh("pi", jit_compile=jit_compile)
    assert wrapped.optimizer.damping_split == "pi"
    assert _positions(wrapped, "conv") == 9
    pis = _check_inverses(wrapped, "pi")
    # The test means something only if π is far from 1 (else "pi" would equal "sqrt").
    assert any(abs(np.log(p)) > 0.5 for p in pis.values()), pis
    # The "sqrt" damping does NOT match these inverses where π is far from 1.
    for name, p in pis.items():
        if abs(np.log(p)) > 0.5:
            a_sqrt, _, _ = _reference(wrapped.thor.factors(name),
                                      LAMBDA / _positions(wrapped, name), "sqrt")
            assert not np.allclose(wrapped.thor.inverses(name)["A_inv"][0], a_sqrt, rtol=1e-2)


def test_sqrt_split_is_the_default_and_unchanged():
    wrapped = _one_refresh("sqrt")
    assert thor_tf.ThorOptimizer().damping_split == "sqrt"
    pis = _check_inverses(wrapped, "sqrt")
    assert set(pis.values()) == {1.0}


def test_pi_split_with_split_blocks_and_a_trace_rule_run():
    """split_dim 8 (< the factor sizes): each diagonal block is damped with π of the whole
    factor (the trace of the block-diagonal part is the factor's trace); later refreshes by the
    trace rule keep using the factors in use."""
    x, y = digits(128)
    wrapped = thor_tf.wrap(_model(), learning_rate=0.05, damping=LAMBDA, split_dim=8,
                           damping_split="pi", frequency=1, preset="thor_nt", verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    for start in (0, 64):
        wrapped.train_on_batch(x[start:start + 64], y[start:start + 64])
    for name, positions in (("conv", 9), ("fc", 1), ("out", 1)):
        factors = {k: v.astype(np.float64) for k, v in wrapped.thor.factors(name).items()}
        inverses = wrapped.thor.inverses(name)
        a, g = factors["A"], factors["G"]
        pi = np.sqrt((np.trace(a) / a.shape[0]) / (np.trace(g) / g.shape[0]))
        base = np.sqrt(LAMBDA / positions)
        for key, mat, damp in (("A_inv", a, pi * base), ("G_inv", g, base / pi)):
            dim = mat.shape[0]
            assert inverses[key].shape[0] == -(-dim // 8)
            for b in range(inverses[key].shape[0]):
                lo, hi = 8 * b, min(8 * b + 8, dim)
                expected = np.linalg.inv(mat[lo:hi, lo:hi] + damp * np.eye(hi - lo))
                np.testing.assert_allclose(inverses[key][b][:hi - lo, :hi - lo], expected,
                                           rtol=2e-4, atol=2e-4 * np.abs(expected).max(),
                                           err_msg=f"{name} {key} block {b}")


def test_pi_adjustment_formula_and_fallback():
    a = np.diag([4.0, 2.0, 0.0]).astype(np.float32)[None]           # tr/dim = 2
    g = np.diag([0.5, 0.5]).astype(np.float32)[None]                # tr/dim = 0.5
    assert float(pi_adjustment(a, g, 3, 2)) == pytest.approx(2.0)
    d_a, d_g = factor_dampings(0.09, a, g, 3, 2, "pi")
    assert float(d_a) == pytest.approx(0.6) and float(d_g) == pytest.approx(0.15)
    assert float(d_a) * float(d_g) == pytest.approx(0.09)
    d_a, d_g = factor_dampings(0.09, a, g, 3, 2, "sqrt")
    assert float(d_a) == pytest.approx(0.3) and float(d_g) == pytest.approx(0.3)
    zero = np.zeros_like(g)
    assert float(pi_adjustment(a, zero, 3, 2)) == 1.0                 # inf -> 1
    assert float(pi_adjustment(np.zeros_like(a), g, 3, 2)) == 1.0     # 0 -> 1
    assert float(pi_adjustment(np.zeros_like(a), zero, 3, 2)) == 1.0  # nan -> 1
    nan = np.full_like(g, np.nan)
    assert float(pi_adjustment(a, nan, 3, 2)) == 1.0


@pytest.mark.parametrize("bad", ["Pi", "none", None, 1])
def test_bad_damping_split_raises(bad):
    with pytest.raises(ValueError, match=r"damping_split.*\['sqrt', 'pi'\]"):
        thor_tf.ThorOptimizer(damping_split=bad)
    with pytest.raises(ValueError, match="damping_split"):
        thor_tf.wrap(_model(), damping_split=bad, verbose=False)


def test_damping_split_round_trips_through_config_and_save(tmp_path):
    x, y = digits(64)
    # thor_nt at frequency 1: every step refreshes every block (ω1 = 0 refreshes even at Δ = 0),
    # so the step after loading inverts anew, with whatever split the loaded optimizer has.
    wrapped = thor_tf.wrap(_model(), learning_rate=0.05, damping=LAMBDA, damping_split="pi",
                           split_dim=SPLIT, preset="thor_nt", frequency=1, verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    wrapped.fit(x, y, batch_size=32, epochs=1, verbose=0)
    config = wrapped.optimizer.get_config()
    # The option is the inverse rule's: saved on the rule.
    assert "damping_split" not in config
    assert config["update_rule"]["config"]["damping_split"] == "pi"
    assert thor_tf.ThorOptimizer.from_config(config).damping_split == "pi"
    assert thor_tf.ThorOptimizer.from_config(
        thor_tf.ThorOptimizer().get_config()).damping_split == "sqrt"
    path = os.path.join(tmp_path, "pi.keras")
    wrapped.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, thor_tf.ThorModel)
    assert loaded.optimizer.damping_split == "pi"
    assert loaded.optimizer.config.rule.damping_split == "pi"
    refreshes = {s["name"]: s["refreshes"] for s in loaded.thor.layer_stats()}
    # Both continue identically. The step after loading refreshes every block (checked), and the
    # loaded model's new inverses are the float64 inverses of its new factors damped with π (far
    # from 1 in some layer, checked), not √λ_b.
    wrapped.train_on_batch(x[32:], y[32:])
    loaded.train_on_batch(x[32:], y[32:])
    for s in loaded.thor.layer_stats():
        assert s["refreshes"] == refreshes[s["name"]] + 1, s
    pis = _check_inverses(loaded, "pi")
    assert any(abs(np.log(p)) > 0.5 for p in pis.values()), pis
    for name in ("conv", "fc", "out"):
        np.testing.assert_allclose(loaded.thor.factors(name)["A"], wrapped.thor.factors(name)["A"],
                                   rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(loaded.thor.inverses(name)["A_inv"],
                                   wrapped.thor.inverses(name)["A_inv"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(loaded.get_layer(index=0).get_layer(name).kernel.numpy(),
                                   wrapped.model.get_layer(name).kernel.numpy(), rtol=1e-5,
                                   atol=1e-6)


BALANCED = r"""
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
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((8, 8, 1)),
                          keras.layers.Conv2D(4, 3, strides=2, activation="relu", name="conv"),
                          keras.layers.Flatten(),
                          keras.layers.Dense(12, activation="tanh", name="fc"),
                          keras.layers.Dense(10, activation="softmax", name="out")])
    w = thor_tf.wrap(m, learning_rate=0.05, damping=0.03, split_dim=64, damping_split="pi",
                     inverse_assignment="balanced", update_rule="inverse", verbose=False)
    w.compile(loss="sparse_categorical_crossentropy")
w.fit(x, y, batch_size=64, epochs=1, verbose=0)
out = {}
for name in ("conv", "fc", "out"):
    f, i = w.thor.factors(name), w.thor.inverses(name)
    out[name] = {"A": f["A"].tolist(), "G": f["G"].tolist(), "A_inv": i["A_inv"].tolist(),
                 "G_inv": i["G_inv"].tolist()}
print("RESULT" + json.dumps(out))
"""


def test_pi_split_under_balanced_inverse_assignment_on_two_replicas():
    """``_shared_inverses`` (each block inverted by one replica) damps A and G with π too."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", BALANCED], capture_output=True, text=True,
                          env=env, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(lines[0][len("RESULT"):])
    far = 0
    for name, positions in (("conv", 9), ("fc", 1), ("out", 1)):
        r = {k: np.asarray(v) for k, v in result[name].items()}
        a_inv, g_inv, pi = _reference(r, LAMBDA / positions, "pi")
        far += abs(np.log(pi)) > 0.5
        for key, expected in (("A_inv", a_inv), ("G_inv", g_inv)):
            np.testing.assert_allclose(r[key][0], expected, rtol=2e-4,
                                       atol=2e-4 * np.abs(expected).max(), err_msg=f"{name} {key}")
    assert far >= 1
