"""Issue 8 item 4: a batch whose trace overflows float32 must not stop the trace rule for good."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import thor_tf
from thor_tf.callbacks import TraceRuleLogger

# THOR's inverse rule (K-FAC step, KL clip, damping, momentum) is what these tests check.
pytestmark = pytest.mark.update_rule("inverse")


def _linear_loss(y_true, y_pred):
    # dℓ_n/dz = y_n / K whatever the weights: loss and gradients stay finite for huge inputs.
    return tf.reduce_mean(y_true * y_pred, axis=-1)


@pytest.mark.parametrize("trace_filter", ["none", "mean"])
def test_overflowing_trace_is_skipped_counted_and_the_layer_keeps_deciding(trace_filter):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 6)).astype("float32")
    y = rng.normal(size=(8, 3)).astype("float32")
    huge = np.float32(1e19)
    # float64 check of the premise: ‖a‖² of the scaled rows overflows float32, while the loss and
    # the kernel gradient (what the finiteness check sees) stay far below float32's maximum.
    x64, y64 = x.astype(np.float64) * 1e19, y.astype(np.float64)
    assert np.max(np.sum(x64 ** 2, axis=1)) > np.finfo(np.float32).max
    assert np.max(np.abs(x64.T @ (y64 / 3) / 8)) < 1e25
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, use_bias=False, name="fc")])
    wrapped = thor_tf.wrap(model, omega1=0.05, omega2=0.0, frequency=1, damping=0.04,
                           learning_rate=1e-30, kl_clip=None, trace_filter=trace_filter,
                           verbose=False)
    wrapped.compile(loss=_linear_loss)
    logger = TraceRuleLogger(summary=False)
    # refresh (first block), same batch (reuse), overflow (nothing changes), same batch (reuse),
    # then traces 9x and 81x the block's: every later finite batch is still judged.
    scales = [1.0, 1.0, huge, 1.0, 3.0, 3.0, 9.0]
    for s in scales:
        wrapped.fit(x * s, y, batch_size=8, epochs=1, verbose=0, callbacks=[logger], shuffle=False)
    counters = wrapped.thor.counters()
    assert counters["nonfinite_steps"] == 0  # the loss and gradients were finite
    assert counters["nonfinite_traces"] == 1
    decisions = [r["decision"] for r in logger.rows]
    deltas = np.array([r["delta"] for r in logger.rows])
    # Published: 9x the block → refresh, same → reuse, 9x → refresh. Filtered: the window's mean at
    # the first refresh mixed 1x and 9x batches, so the next 9x batch reads a change again.
    later = ["refresh", "reuse", "refresh"] if trace_filter == "none" else ["refresh"] * 3
    assert decisions == ["refresh", "reuse", "reuse", "reuse"] + later
    assert np.isnan(deltas[2]) and np.all(np.isfinite(deltas[3:]))
    state = wrapped.thor.state
    for key, variable in [("trace_a", state.trace_a), ("trace_g", state.trace_g),
                          ("filter.window", state.filter.window),
                          ("filter.ref_mean", state.filter.ref_mean),
                          ("filter.last", state.filter.last), ("filter.noise", state.filter.noise)]:
        assert np.all(np.isfinite(variable.numpy())), key
    # The block in use is the last batch's A (scale 9), float64 reference.
    a = 9.0 * x.astype(np.float64)
    np.testing.assert_allclose(wrapped.thor.factors("fc")["A"], a.T @ a / 8, rtol=1e-5)
