"""Keras execution modes with THOR: XLA (``jit_compile=True``, Keras' default on GPU) and
``steps_per_execution > 1`` take exactly the steps of the plain traced train step."""

import numpy as np
import pytest

import thor_tf
from digits_models import digits, small_cnn
from thor_tf.callbacks import TraceRuleLogger


def _train(callbacks=(), update_rule=None, **compile_options):
    x, y = digits(256)
    wrapped = thor_tf.wrap(small_cnn(0), frequency=2, verbose=False, update_rule=update_rule)
    wrapped.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"], **compile_options)
    history = wrapped.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
                          callbacks=list(callbacks))
    return wrapped, history.history


XLA = {"jit_compile": True}
GROUPED = {"steps_per_execution": 4}


# Every rule under steps_per_execution; under XLA the default rule (eigenbasis with the
# orthogonalized step: XLA's eigh and the Newton-Schulz products) and the inverse rule. The
# eigenbasis rule's Adam step under XLA (the default's ops without Newton-Schulz, ~25 s) was left
# out for CI's time.
@pytest.mark.parametrize("options,rule", [(XLA, "inverse"), (XLA, "eigenbasis"),
                                          (GROUPED, "inverse"), (GROUPED, "eigenbasis_adam"),
                                          (GROUPED, "eigenbasis")],
                         ids=["xla-inverse", "xla-eigenbasis", "steps_per_execution-inverse",
                              "steps_per_execution-eigenbasis_adam",
                              "steps_per_execution-eigenbasis"])
def test_execution_mode_takes_the_plain_steps(options, rule):
    """The same losses, weights and factors. Under XLA the eigenbasis rule's weights agree to
    5e-3 (of ~0.08 moved; measured 1.7e-3) and the factors to 3e-3: XLA's float64 ``eigh`` (a
    Jacobi solver) and LAPACK's differ by ~1e-4 in eigenvectors whose eigenvalues are close, and
    Adam's per-coordinate division does not forget which basis it was given; the epoch's
    losses agree to 2e-3 (measured 8.6e-4). The orthogonalized step (the default) carries those
    differences further (its Newton–Schulz iteration enlarges the step's small singular
    directions): weights measured 1.2e-3 apart, factors 6e-4 of their largest entry; compared to
    their largest entry (an elementwise tolerance is meaningless on entries near 0)."""
    plain, plain_history = _train(update_rule=rule)
    other, other_history = _train(update_rule=rule, **options)
    assert int(other.optimizer.iterations) == int(plain.optimizer.iterations) == 8
    assert other.thor.counters()["cadence_points"] == plain.thor.counters()["cadence_points"] == 4
    loose = rule.startswith("eigenbasis") and "jit_compile" in options
    np.testing.assert_allclose(other_history["loss"], plain_history["loss"],
                               rtol=2e-3 if loose else 1e-5)
    for a, b in zip(other.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-3 if loose else 1e-6)
    for name in ("conv", "fc", "out"):
        a, b = other.thor.factors(name)["A"], plain.thor.factors(name)["A"]
        if loose:
            assert np.abs(a - b).max() <= 3e-3 * np.abs(b).max(), name
        else:
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_trace_rule_logger_sees_every_cadence_point_under_steps_per_execution():
    """4 steps per execution and a cadence point every 2 steps: two cadence points pass between
    two batch ends, and the logger still writes a row per layer for each, equal to the rows of the
    plain run (the train step records them in the engine's decision log)."""
    plain_logger, grouped_logger = TraceRuleLogger(summary=False), TraceRuleLogger(summary=False)
    _train(callbacks=[plain_logger])
    _train(callbacks=[grouped_logger], steps_per_execution=4)
    assert [r["step"] for r in plain_logger.rows] == [s for s in (0, 2, 4, 6) for _ in range(3)]
    assert len(grouped_logger.rows) == len(plain_logger.rows) == 12
    for a, b in zip(grouped_logger.rows, plain_logger.rows):
        assert (a["step"], a["layer"], a["decision"], a["refreshes"], a["reuses"]) == (
            b["step"], b["layer"], b["decision"], b["refreshes"], b["reuses"])
        np.testing.assert_allclose(a["delta"], b["delta"], rtol=1e-4)
    assert {r["decision"] for r in plain_logger.rows} >= {"refresh"}


def test_a_custom_loops_tf_function_takes_fits_steps_without_converting_thors_code(monkeypatch):
    """``tf.function(model.train_step)`` in a user's loop: AutoGraph converts the user's code and
    the model's train step and its helpers around the loss, but not THOR's step below it (``ThorEngine.train_update`` is
    ``do_not_convert``, as Keras' own train function is under fit): converting it transpiled
    ~500 functions, 15 s of a small CNN's first call. The loop takes fit's steps."""
    import tensorflow as tf
    from tensorflow.python.autograph.impl import api

    converted = []
    convert = api._convert_actual

    def recording(entity, program_ctx):
        converted.append(getattr(entity, "__module__", "") or "")
        return convert(entity, program_ctx)

    monkeypatch.setattr(api, "_convert_actual", recording)
    x, y = digits(128)
    # A constant rate for both (fit would otherwise schedule over its epochs).
    looped = thor_tf.wrap(small_cnn(0), frequency=2, verbose=False, learning_rate=0.01)
    looped.compile(loss="sparse_categorical_crossentropy")
    step = tf.function(looped.train_step)
    for start in range(0, 128, 32):
        step((x[start:start + 32], y[start:start + 32]))
    assert converted, "the loop's train step was not converted at all"
    # The train step's own few helpers around the loss may be; the step itself (the engine,
    # blocks, rules, refresh) is not.
    thor_modules = {m for m in converted if m.startswith("thor_tf")}
    assert thor_modules <= {"thor_tf.model", "thor_tf.compiling", "thor_tf._keras_compat",
                            "thor_tf.loss_terms"}, sorted(thor_modules)
    fitted = thor_tf.wrap(small_cnn(0), frequency=2, verbose=False, learning_rate=0.01)
    fitted.compile(loss="sparse_categorical_crossentropy")
    fitted.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(looped.trainable_variables, fitted.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-6)
