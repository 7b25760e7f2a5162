"""What plain Keras does, a wrapped model does: list outputs with losses and metrics by name,
float64, NaN logs for an epoch with no finite step, clear errors and reasons."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import thor_tf
from reference import dense_backward, dense_forward, dense_kfac_steps, softmax


def _two_outputs(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh", name="trunk")(inp)
    cls = keras.layers.Dense(3, activation="softmax", name="cls")(h)
    reg = keras.layers.Dense(1, name="reg")(h)
    return keras.Model(inp, [cls, reg])


@pytest.mark.update_rule("inverse")  # the float64 reference is THOR's inverse step
def test_list_outputs_with_losses_and_metrics_by_name_log_what_keras_logs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    ys = {"cls": rng.integers(0, 3, 64), "reg": rng.normal(size=(64, 1)).astype("float32")}
    weights = {"cls": 1.5, "reg": 0.5}
    compile_args = dict(loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
                        loss_weights=weights, metrics={"cls": ["accuracy"], "reg": ["mae"]})
    wrapped = thor_tf.wrap(_two_outputs(), learning_rate=1.0, momentum=0.0, kl_clip=None,
                           verbose=False)
    start = [w.astype(np.float64) for w in wrapped.get_weights()]
    wrapped.compile(**compile_args)
    # One step (step 0: every block refreshes from this batch) against the float64 K-FAC step of
    # the weighted loss ℓ_n = 1.5·CE_n + 0.5·(r_n − y_n)²: the loss weights reach the gradient
    # and, squared, G of each head and (summed through the trunk) of the trunk.
    wrapped.train_on_batch(x[:16], {k: v[:16] for k, v in ys.items()})
    (wt, bt), (wc, bc), (wr, br) = zip(start[0::2], start[1::2])
    h = np.tanh(x[:16] @ wt + bt)
    g_cls = weights["cls"] * (softmax(h @ wc + bc) - np.eye(3)[ys["cls"][:16]])
    g_reg = weights["reg"] * 2.0 * (h @ wr + br - ys["reg"][:16])
    g_trunk = (g_cls @ wc.T + g_reg @ wr.T) * (1.0 - h ** 2)
    expected = {"trunk": (x[:16], g_trunk), "cls": (h, g_cls), "reg": (h, g_reg)}
    for name, (a, g) in expected.items():
        (delta, _), = dense_kfac_steps([a], [g], 0.03)
        layer = wrapped.model.get_layer(name)
        k = 2 * ["trunk", "cls", "reg"].index(name)
        moved = np.concatenate([start[k] - layer.kernel.numpy(),
                                (start[k + 1] - layer.bias.numpy())[None]])
        np.testing.assert_allclose(moved, delta, rtol=2e-4, atol=2e-5 * np.abs(delta).max(),
                                   err_msg=name)
    # evaluate: plain Keras on the same weights gives the same losses (weighted total and per
    # output) and metrics.
    plain = _two_outputs()
    plain.compile(optimizer="sgd", **compile_args)
    plain.set_weights(wrapped.get_weights())
    got = wrapped.evaluate(x, ys, batch_size=64, verbose=0, return_dict=True)
    want = plain.evaluate(x, ys, batch_size=64, verbose=0, return_dict=True)
    assert sorted(got) == sorted(want) and {"loss", "cls_accuracy"} <= set(got)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=key)
    # ... and the weighted loss of the stepped weights, in float64.
    wt, bt, wc, bc, wr, br = (w.astype(np.float64) for w in wrapped.get_weights())
    h = np.tanh(x @ wt + bt)
    cross_entropy = -np.log(softmax(h @ wc + bc)[np.arange(64), ys["cls"]]).mean()
    squared = ((h @ wr + br - ys["reg"]) ** 2).mean()
    assert got["loss"] == pytest.approx(1.5 * cross_entropy + 0.5 * squared, rel=1e-5)
    # fit logs what Keras logs.
    expected = plain.fit(x, ys, batch_size=16, epochs=1, verbose=0, validation_data=(x, ys))
    history = wrapped.fit(x, ys, batch_size=16, epochs=1, verbose=0, validation_data=(x, ys))
    assert sorted(history.history) == sorted(expected.history)
    assert "cls_accuracy" in history.history and "val_reg_mae" in history.history
    assert wrapped.output_names == ["cls", "reg"]


@pytest.mark.update_rule("inverse")  # the float64 reference is THOR's inverse step
@pytest.mark.parametrize("how", ["floatx", "layer_dtype"])
def test_float64_trains_like_keras(how):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6))
    y = (x[:, 0] > 0).astype("int64")
    previous, policy = keras.config.floatx(), keras.config.dtype_policy()
    try:
        if how == "floatx":
            # As at the start of a program: Keras caches the global policy at its first use.
            keras.config.set_floatx("float64")
            keras.config.set_dtype_policy("float64")
        keras.utils.set_random_seed(0)
        dtype = "float64" if how == "layer_dtype" else None
        model = keras.Sequential([keras.Input((6,)),
                                  keras.layers.Dense(8, activation="tanh", dtype=dtype, name="h"),
                                  keras.layers.Dense(2, activation="softmax", dtype=dtype,
                                                     name="out")])
        start = [w.copy() for w in model.get_weights()]
        wrapped = thor_tf.wrap(model, learning_rate=1.0, momentum=0.0, kl_clip=None,
                               verbose=False)
        wrapped.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        wrapped.train_on_batch(x, y)  # step 0: both blocks refresh from this batch
    finally:
        keras.config.set_floatx(previous)
        keras.config.set_dtype_policy(policy)
    assert model.get_layer("h").kernel.dtype == "float64"
    assert all(w.dtype == np.float64 for w in start)
    assert wrapped.thor.counters()["nonfinite_steps"] == 0
    assert wrapped.thor.factors("h")["A"].dtype == np.float32  # statistics in float32
    # The step (lr 1, momentum 0) is the float64 K-FAC step of the mean cross-entropy, to the
    # float32 precision of the statistics.
    layers = [(start[0], start[1], "tanh"), (start[2], start[3], "softmax")]
    inputs, zs, p = dense_forward(x, layers)
    gs, _ = dense_backward(p - np.eye(2)[y], layers, zs)
    for (delta, _), name, k in zip(dense_kfac_steps(inputs, gs, 0.03), ("h", "out"), (0, 2)):
        layer = model.get_layer(name)
        moved = np.concatenate([start[k] - layer.kernel.numpy(),
                                (start[k + 1] - layer.bias.numpy())[None]])
        np.testing.assert_allclose(moved, delta, rtol=2e-4, atol=2e-5 * np.abs(delta).max(),
                                   err_msg=name)


def test_an_epoch_with_no_finite_step_logs_nan_and_checkpoints_keep_the_real_best(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.integers(0, 3, 32)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, activation="softmax")])
    wrapped = thor_tf.wrap(model, verbose=False)
    wrapped.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    path = str(tmp_path / "best.weights.h5")
    checkpoint = keras.callbacks.ModelCheckpoint(path, monitor="loss", save_best_only=True,
                                                 save_weights_only=True)
    wrapped.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[checkpoint])
    best = checkpoint.best
    bad = np.full_like(x, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        history = wrapped.fit(bad, y, batch_size=16, epochs=1, verbose=0, callbacks=[checkpoint])
    assert np.isnan(history.history["loss"][0]) and np.isnan(history.history["accuracy"][0])
    assert checkpoint.best == best  # the NaN epoch is not "best"


def test_exclude_names_that_match_no_layer_raise():
    model = _two_outputs()
    with pytest.raises(ValueError, match=r"`exclude` names layers the model does not have: \['trnk'\]"):
        thor_tf.wrap(model, exclude=["trnk"], verbose=False)
    wrapped = thor_tf.wrap(model, exclude=["trunk"], verbose=False)
    assert "trunk" not in [b.name for b in wrapped.thor.blocks]


def test_table_names_the_layers_the_user_named_and_gives_every_reason():
    keras.utils.set_random_seed(0)
    inp = keras.Input((5, 4, 4, 1))
    h = keras.layers.Conv3D(2, 2, name="c3")(inp)
    h = keras.layers.Reshape((4, 18))(h)
    h = keras.layers.LSTM(6, return_sequences=True, name="rnn")(h)
    h = keras.layers.Reshape((4, 6, 1))(h)
    h = keras.layers.Conv2DTranspose(2, 2, name="up")(h)
    h = keras.layers.DepthwiseConv2D(2, name="dw")(h)
    h = keras.layers.Flatten()(h)
    out = keras.layers.Dense(2, name="out")(h)
    model = keras.Model(inp, out)
    with pytest.warns(UserWarning) as caught:
        wrapped = thor_tf.wrap(model, verbose=False)
    table = wrapped.thor.registration_table(128)
    first_order = table.split("first order: ")[1]
    assert "rnn (LSTM: recurrent" in first_order and "cell" not in first_order
    assert "up (Conv2DTranspose: transposed convolution" in first_order
    assert "dw (DepthwiseConv2D: depthwise/separable convolution" in first_order
    assert "c3 (Conv3D: 3-D convolution" in first_order
    assert len(caught) == 1 and "rnn (LSTM" in str(caught[0].message)


def test_telemetry_with_another_optimizer_says_so():
    wrapped = thor_tf.wrap(_two_outputs(), verbose=False)
    wrapped.compile(optimizer="adam", loss=["sparse_categorical_crossentropy", "mse"])
    with pytest.raises(ValueError, match="trains with Adam, not THOR"):
        wrapped.thor.counters()
    wrapped.compile(loss=["sparse_categorical_crossentropy", "mse"])  # THOR again
    assert wrapped.thor.counters()["cadence_points"] == 0


def test_keras_use_ema_averages_under_thor_and_a_saved_model_resumes_it(tmp_path):
    """Keras' ``use_ema`` passes through ``wrap``: the average follows Keras' rule on THOR's
    weights (float64 reference: the first step's weights, then ``a = m·a + (1−m)·w``), ``fit``
    ends with the average in the model, and a saved model holds it and resumes bit for bit."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = rng.integers(0, 3, 64)
    keras.utils.set_random_seed(0)
    model = thor_tf.wrap(keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, "tanh"),
                                           keras.layers.Dense(3)]),
                         verbose=False, use_ema=True, ema_momentum=0.9, learning_rate=0.01)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    average = None
    for _ in range(3):
        model.train_on_batch(x, y)
        weights = [w.astype(np.float64) for w in model.get_weights()]
        average = weights if average is None else [0.9 * a + 0.1 * w
                                                    for a, w in zip(average, weights)]
    held = [v.numpy() for v in model.optimizer._model_variables_moving_average]
    for got, ref in zip(held, average):
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    path = str(tmp_path / "ema.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.optimizer.use_ema and loaded.optimizer.ema_momentum == 0.9
    for a, b in zip(held, loaded.optimizer._model_variables_moving_average):
        np.testing.assert_array_equal(a, b.numpy())
    for _ in range(2):
        model.train_on_batch(x, y)
        loaded.train_on_batch(x, y)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    for w, a in zip(model.get_weights(), model.optimizer._model_variables_moving_average):
        np.testing.assert_array_equal(w, a.numpy())   # fit ends with the average
