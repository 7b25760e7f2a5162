"""The user's own code after ``wrap``: layer subclasses compute what they computed, a model's own
``train_step`` runs (and THOR preconditions what it applies), custom loops and GANs train with
THOR through the layer hooks, and the fit path takes the same steps as the hook path."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import thor_tf
from reference import (DenseKfac, dense_backward, dense_forward, folded, homogeneous, mean_outer,
                       softmax)

# THOR's inverse rule (K-FAC step, KL clip, damping, momentum) is what these tests check.
pytestmark = pytest.mark.update_rule("inverse")


def _data(n=64, shape=(8, 8, 1), classes=4, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, *shape)).astype("float32"), rng.integers(0, classes, n))


# -- layer subclasses: observe, never replace ------------------------------------------------------
class ScaledDense(keras.layers.Dense):
    """Goes through Dense's own computation, then scales: Dense's block sees z exactly."""

    def call(self, inputs):
        return super().call(inputs) * 3.0


class NoisyDense(keras.layers.Dense):
    """Adds training noise to its input before Dense's computation: z is not a @ W + b of the
    input it was called with, so it stays first order."""

    def __init__(self, units, **kwargs):
        super().__init__(units, **kwargs)
        self.noise = keras.random.SeedGenerator(7)

    def call(self, inputs, training=None):
        if training:
            inputs = inputs + keras.random.normal(tf.shape(inputs), seed=self.noise)
        return super().call(inputs)


class MaskedConv2D(keras.layers.Conv2D):
    """PixelCNN's masked convolution written as a subclass with its own kernel arithmetic."""

    def build(self, input_shape):
        super().build(input_shape)
        mask = np.ones(self.kernel.shape, "float32")
        mask[self.kernel.shape[0] // 2, self.kernel.shape[1] // 2:] = 0
        mask[self.kernel.shape[0] // 2 + 1:] = 0
        self.mask = tf.constant(mask)

    def call(self, inputs):
        return self.activation(self.convolution_op(inputs, self.kernel * self.mask) + self.bias)


class TiedEmbedding(keras.layers.Embedding):
    """keras-hub's ReversibleEmbedding: the same matrix embeds tokens and makes the logits."""

    def call(self, inputs, reverse=False):
        if reverse:
            return tf.matmul(inputs, self.embeddings, transpose_b=True)
        return super().call(inputs)

    def compute_output_spec(self, inputs, reverse=False):
        if reverse:
            return keras.KerasTensor((*inputs.shape[:-1], self.input_dim), inputs.dtype)
        return super().compute_output_spec(inputs)


def _subclass_model(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 1))
    h = MaskedConv2D(3, 3, padding="same", activation="relu", name="masked")(inp)
    h = keras.layers.Flatten()(h)
    h = NoisyDense(8, activation="tanh", name="noisy")(h)
    h = ScaledDense(6, activation="tanh", name="scaled")(h)
    out = keras.layers.Dense(4, activation="softmax", name="out")(h)
    return keras.Model(inp, out)


def test_subclasses_compute_exactly_what_they_computed_and_get_blocks_only_where_exact(capsys):
    x, y = _data()
    model = _subclass_model()
    before = model.predict(x, verbose=0)
    noisy = model.get_layer("noisy")
    state = noisy.noise.state.numpy()
    train_before = model(x, training=True).numpy()
    noisy.noise.state.assign(state)
    wrapped = thor_tf.wrap(model, frequency=1)
    table = capsys.readouterr().out
    # Inference and training (the same noise draws) bit-identical, on the original model and
    # through the wrapper.
    np.testing.assert_array_equal(model.predict(x, verbose=0), before)
    np.testing.assert_array_equal(wrapped.predict(x, verbose=0), before)
    with tf.GradientTape():  # observing
        np.testing.assert_array_equal(model(x, training=True).numpy(), train_before)
    assert [b.name for b in wrapped.thor.blocks] == ["scaled", "out"]
    assert "masked (MaskedConv2D: call overridden; its z differs from Conv2DBlock's" in table
    assert "noisy (NoisyDense: call overridden; its z differs from DenseBlock's in training" in table
    wrapped.compile(loss="sparse_categorical_crossentropy")
    wrapped.fit(x, y, batch_size=16, epochs=1, verbose=0)
    stats = {s["name"]: s for s in wrapped.thor.layer_stats()}
    assert stats["scaled"]["refreshes"] > 0
    # ScaledDense's block is built from its own z = a·W + b, before the subclass's ×3 (and its
    # G from dℓ/dz of that z), through fit's step and through the hooks of a user's loop: A and G
    # against float64 first principles (a deterministic model: NoisyDense's draws are unknown).
    for path in ("fit", "loop"):
        _check_scaled_dense_factors(path)


def _check_scaled_dense_factors(path):
    x, y = _data(32, shape=(5,))
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="tanh", name="h"),
                              ScaledDense(4, activation="tanh", name="scaled"),
                              keras.layers.Dense(4, activation="softmax", name="out")])
    layers = [(l.kernel.numpy(), l.bias.numpy()) for l in model.layers]
    wrapped = thor_tf.wrap(model, verbose=False)
    assert [b.name for b in wrapped.thor.blocks] == ["h", "scaled", "out"]
    if path == "fit":
        wrapped.compile(loss="sparse_categorical_crossentropy")
        wrapped.train_on_batch(x, y)  # step 0: every block refreshes from this batch
    else:
        wrapped.compile()
        with tf.GradientTape() as tape:
            loss = keras.losses.SparseCategoricalCrossentropy()(y, wrapped(x, training=True))
        grads = tape.gradient(loss, wrapped.trainable_variables)
        wrapped.optimizer.apply(grads, wrapped.trainable_variables)
    # Float64 forward and per-example backward: z of `scaled` is a·W + b, its output 3·tanh(z).
    (w0, b0), (w1, b1), (w2, b2) = ((k.astype(np.float64), b.astype(np.float64)) for k, b in layers)
    h = np.tanh(x @ w0 + b0)
    z = h @ w1 + b1
    p = softmax(3.0 * np.tanh(z) @ w2 + b2)
    g = ((p - np.eye(4)[y]) @ w2.T) * 3.0 * (1.0 - np.tanh(z) ** 2)  # dℓ_n/dz
    factors = wrapped.thor.factors("scaled")
    np.testing.assert_allclose(factors["A"], mean_outer(homogeneous(h, True)), rtol=1e-5,
                               atol=1e-6, err_msg=path)
    np.testing.assert_allclose(factors["G"], mean_outer(g), rtol=1e-4,
                               atol=1e-5 * np.abs(mean_outer(g)).max(), err_msg=path)


def test_tied_embedding_head_keeps_its_shape_and_trains_with_the_lookup_first_order():
    keras.utils.set_random_seed(0)
    tokens = np.random.default_rng(0).integers(0, 20, size=(32, 6))
    labels = np.random.default_rng(1).integers(0, 20, size=(32, 6))
    emb = TiedEmbedding(20, 8, name="tied")
    inp = keras.Input((6,), dtype="int32")
    h = emb(inp)
    h = keras.layers.Dense(8, activation="tanh", name="mix")(h)
    out = keras.layers.Activation("softmax")(emb(h, reverse=True))
    model = keras.Model(inp, out)
    before = model.predict(tokens, verbose=0)
    table = model.get_layer("tied").embeddings.numpy().astype(np.float64)
    mix = model.get_layer("mix")
    w_mix, b_mix = mix.kernel.numpy().astype(np.float64), mix.bias.numpy().astype(np.float64)
    wrapped = thor_tf.wrap(model, learning_rate=0.5, verbose=False)
    np.testing.assert_array_equal(wrapped.predict(tokens, verbose=0), before)
    assert wrapped.predict(tokens, verbose=0).shape == (32, 6, 20)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    with pytest.warns(UserWarning, match="a call of layer 'tied' did not compute its output"):
        wrapped.train_on_batch(tokens, labels)
    # First order: the table moves by lr · its float64 gradient (momentum starts at 0; no KL
    # clip for first-order variables), the sum of its two uses: the head's (logits = u Eᵀ)
    # and the lookup's (scattered back to the looked-up rows). Loss: the mean over 32·6 tokens.
    u = np.tanh(table[tokens] @ w_mix + b_mix)
    d_logits = (softmax(u @ table.T) - np.eye(20)[labels]) / tokens.size
    grad = np.einsum("ntv,ntd->vd", d_logits, u)
    d_lookup = ((d_logits @ table) * (1 - u ** 2)) @ w_mix.T
    np.add.at(grad, tokens, d_lookup)
    moved = table - model.get_layer("tied").embeddings.numpy()
    np.testing.assert_allclose(moved, 0.5 * grad, rtol=1e-4, atol=1e-5 * np.abs(grad).max())


# -- a model's own train_step ----------------------------------------------------------------------
class CustomModel(keras.Model):
    """keras-io "Customizing what happens in fit()": its own train_step, counting its calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = tf.Variable(0, trainable=False, dtype=tf.int64)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        self.calls.assign_add(1)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def _cnn_layers():
    return [keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
            keras.layers.Flatten(),
            keras.layers.Dense(4, activation="softmax", name="out")]


def _cnn(cls=keras.Sequential, seed=0):
    keras.utils.set_random_seed(seed)
    if cls is keras.Sequential:
        return keras.Sequential([keras.Input((8, 8, 1)), *_cnn_layers()])
    inp = keras.Input((8, 8, 1))
    h = inp
    for layer in _cnn_layers():
        h = layer(h)
    return cls(inp, h)


def test_custom_train_step_runs_once_per_step_and_takes_the_fit_path_steps():
    x, y = _data()
    custom = thor_tf.wrap(_cnn(CustomModel), frequency=2, verbose=False)
    custom.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    history = custom.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert int(custom.model.calls.numpy()) == 8  # 4 steps per epoch, its own train_step each
    assert set(history.history) == {"loss", "accuracy"}
    stats = {s["name"]: s for s in custom.thor.layer_stats()}
    assert stats["conv"]["refreshes"] > 0 and stats["out"]["refreshes"] > 0

    plain = thor_tf.wrap(_cnn(keras.Model), frequency=2, verbose=False)
    plain.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(custom.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(custom.thor.factors("conv")["G"], plain.thor.factors("conv")["G"],
                               rtol=1e-5, atol=1e-7)


class VAE(keras.Model):
    """keras-io's VAE: its own train_step with a KL term on the encoder's outputs."""

    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder, self.decoder = encoder, decoder
        self.total = keras.metrics.Mean(name="total_loss")
        self.kl = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total, self.kl]

    def call(self, x):
        return self.decoder(self.encoder(x)[0])

    def noise(self, shape):
        return tf.random.normal(shape, seed=1)

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var = self.encoder(data)
            eps = self.noise(tf.shape(z_mean))
            recon = self.decoder(z_mean + tf.exp(0.5 * z_log_var) * eps)
            rec_loss = tf.reduce_mean(tf.reduce_sum(tf.square(data - recon), axis=1))
            kl = -0.5 * tf.reduce_mean(tf.reduce_sum(
                1 + z_log_var - tf.square(z_mean) - tf.exp(z_log_var), axis=1))
            loss = rec_loss + kl
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total.update_state(loss)
        self.kl.update_state(kl)
        return {"loss": self.total.result(), "kl_loss": self.kl.result()}


class FixedNoiseVAE(VAE):
    """The VAE with its draws ε given (known to the float64 reference)."""

    def __init__(self, encoder, decoder, eps, **kwargs):
        super().__init__(encoder, decoder, **kwargs)
        self.eps = tf.constant(eps, tf.float32)

    def noise(self, shape):
        return self.eps


def test_vae_trains_with_its_kl_term():
    """One step of the VAE's own train_step (lr 1, momentum 0): its logged loss and KL, and every
    block's step, against float64 first principles (the reparameterized sample and the KL term
    differentiated by hand, one example at a time)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    data = rng.normal(size=(32, 12)).astype("float32")
    data[:, 6:] = data[:, :6] * 0.5  # structure to learn
    eps = rng.normal(size=(32, 2))
    inp = keras.Input((12,))
    h = keras.layers.Dense(8, activation="tanh", name="enc")(inp)
    encoder = keras.Model(inp, [keras.layers.Dense(2, name="mean")(h),
                                keras.layers.Dense(2, name="log_var")(h)])
    dec_in = keras.Input((2,))
    decoder = keras.Model(dec_in, keras.layers.Dense(12, name="dec")(
        keras.layers.Dense(8, activation="tanh", name="dec_h")(dec_in)))
    vae = FixedNoiseVAE(encoder, decoder, eps)
    vae(data[:2])
    names = ("enc", "mean", "log_var", "dec_h", "dec")
    layer = {n: (encoder if n in names[:3] else decoder).get_layer(n) for n in names}
    w = {n: folded(layer[n].kernel.numpy(), layer[n].bias.numpy()) for n in names}
    wrapped = thor_tf.wrap(vae, learning_rate=1.0, momentum=0.0, kl_clip=None, verbose=False)
    wrapped.compile()
    history = wrapped.fit(data, batch_size=32, epochs=1, verbose=0, shuffle=False)  # step 0
    assert set(history.history) == {"loss", "kl_loss"}

    x = data.astype(np.float64)
    dense = lambda n, a: a @ w[n][:-1] + w[n][-1]
    hid = np.tanh(dense("enc", x))
    mean, log_var = dense("mean", hid), dense("log_var", hid)
    sample = mean + np.exp(0.5 * log_var) * eps
    u = np.tanh(dense("dec_h", sample))
    recon = dense("dec", u)
    kl = -0.5 * np.sum(1 + log_var - mean ** 2 - np.exp(log_var), axis=1)
    rec = np.sum((x - recon) ** 2, axis=1)
    assert history.history["kl_loss"][0] == pytest.approx(kl.mean(), rel=1e-5)
    assert history.history["loss"][0] == pytest.approx((rec + kl).mean(), rel=1e-5)
    # dℓ_n/dz of each layer, ℓ_n = Σ (x − recon)² + KL_n:
    g = {"dec": -2.0 * (x - recon)}
    g["dec_h"] = (g["dec"] @ w["dec"][:-1].T) * (1 - u ** 2)
    d_sample = g["dec_h"] @ w["dec_h"][:-1].T
    g["mean"] = d_sample + mean
    g["log_var"] = d_sample * eps * 0.5 * np.exp(0.5 * log_var) - 0.5 * (1 - np.exp(log_var))
    g["enc"] = (g["mean"] @ w["mean"][:-1].T + g["log_var"] @ w["log_var"][:-1].T) * (1 - hid ** 2)
    inputs = {"enc": x, "mean": hid, "log_var": hid, "dec_h": sample, "dec": u}
    expected = DenseKfac(1.0).step([w[n] for n in names], [inputs[n] for n in names],
                                   [g[n] for n in names], refresh=True)
    for n, new in zip(names, expected):
        got = folded(layer[n].kernel.numpy(), layer[n].bias.numpy())
        step = w[n] - new
        np.testing.assert_allclose(w[n] - got, step, rtol=2e-4, atol=2e-5 * np.abs(step).max(),
                                   err_msg=n)


# -- custom loops ----------------------------------------------------------------------------------
def _resnet_block(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, padding="same", name="c0")(inp)
    r = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="c1")(h)
    r = keras.layers.Conv2D(4, 3, padding="same", name="c2")(r)
    h = keras.layers.Activation("relu")(keras.layers.Add()([h, r]))
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inp, keras.layers.Dense(4, activation="softmax", name="out")(h))


@pytest.mark.parametrize("build", [_cnn, _resnet_block], ids=["cnn", "resnet_block"])
@pytest.mark.parametrize("traced", [True, False], ids=["tf_function", "eager"])
def test_custom_loop_recipe_takes_the_fit_steps(build, traced):
    x, y = _data()
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    # The recipe of docs/usage.md: wrap, compile (THOR is attached), then the user's own loop.
    model = thor_tf.wrap(build(), frequency=2, verbose=False)
    model.compile()
    optimizer = model.optimizer

    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    step = tf.function(train_step) if traced else train_step
    for epoch in range(2):
        for i in range(0, 64, 16):
            step(tf.constant(x[i:i + 16]), tf.constant(y[i:i + 16]))

    # Outside fit the default rate has no run length: constant at the rule's peak (0.05), the
    # rate fit is given explicitly here (its own default would be warmup + cosine).
    reference = thor_tf.wrap(build(), frequency=2, learning_rate=0.05, verbose=False)
    reference.compile(loss="sparse_categorical_crossentropy")
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    # Traced, the loop is the fit step's graph; eager, float32 rounding of eager and graph
    # kernels differs (~1e-7 per op), grown by 8 second-order steps.
    tolerance = dict(rtol=1e-5, atol=1e-6) if traced else dict(rtol=1e-4, atol=1e-5)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, **tolerance)
    assert model.thor.counters()["cadence_points"] == reference.thor.counters()["cadence_points"]


# -- GANs ------------------------------------------------------------------------------------------
class GAN(keras.Model):
    """keras-io's GAN: its own compile(d_optimizer, g_optimizer, loss_fn) and train_step."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator, self.generator, self.latent_dim = discriminator, generator, latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def call(self, z):
        return self.generator(z)

    def noise(self, batch, seed):
        return tf.random.normal((batch, self.latent_dim), seed=seed)

    def train_step(self, real):
        batch = tf.shape(real)[0]
        noise = self.noise(batch, 3)
        fake = self.generator(noise)
        images = tf.concat([fake, real], axis=0)
        labels = tf.concat([tf.ones((batch, 1)), tf.zeros((batch, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(images))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        noise = self.noise(batch, 4)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((batch, 1)), self.discriminator(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def _gan_parts(seed=0):
    keras.utils.set_random_seed(seed)
    disc = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu", name="d1"),
                             keras.layers.Dense(1, activation="sigmoid", name="d2")], name="disc")
    gen = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="relu", name="g1"),
                            keras.layers.Dense(6, name="g2")], name="gen")
    return disc, gen


def _real(n=64):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 6)) * 0.5 + 1.0).astype("float32")


def _fixed_noise_gan(batch):
    """The GAN with its two draws per step given: ``(class, {seed: noise})``."""
    rng = np.random.default_rng(5)
    noises = {seed: rng.normal(size=(batch, 3)) for seed in (3, 4)}

    class FixedNoiseGAN(GAN):
        def noise(self, batch, seed):
            return tf.constant(noises[seed], tf.float32)[:batch]

    return FixedNoiseGAN, noises


def _params(model):
    """The Dense layers of a sub-model as float64 ``[kernel; bias]`` matrices."""
    return [folded(l.kernel.numpy(), l.bias.numpy()) for l in model.layers]


def _gan_reference_step(d, g, real, noises, d_step):
    """keras-io's GAN step in float64 from first principles. ``d``, ``g``: the discriminator's
    (relu, sigmoid) and generator's (relu, linear) ``[kernel; bias]`` matrices; ``d_step``:
    ``DenseKfac`` of the discriminator. Returns ``(new d, the generator's per-layer inputs and
    dℓ_n/dz)``: the generator loss goes through the discriminator *after* its step."""
    chain = lambda params, acts: [(p[:-1], p[-1], a) for p, a in zip(params, acts)]
    gen, dis = ("relu", "linear"), ("relu", "sigmoid")
    _, _, fake = dense_forward(noises[3], chain(g, gen))
    images = np.concatenate([fake, real])
    labels = np.concatenate([np.ones((len(fake), 1)), np.zeros((len(real), 1))])
    inputs, zs, p = dense_forward(images, chain(d, dis))
    gs, _ = dense_backward(p - labels, chain(d, dis), zs)  # BCE on a sigmoid: dℓ/dz = p − y
    d_new = d_step.step(d, inputs, gs, refresh=True)
    g_inputs, g_zs, fake = dense_forward(noises[4], chain(g, gen))
    _, d_zs, p = dense_forward(fake, chain(d_new, dis))
    _, d_fake = dense_backward(p - 0.0, chain(d_new, dis), d_zs)  # labels 0 ("real")
    g_gs, _ = dense_backward(d_fake, chain(g, gen), g_zs)
    return d_new, g_inputs, g_gs


def _assert_params(model, expected, what):
    for layer, before, after in zip(model.layers, *expected):
        got = folded(layer.kernel.numpy(), layer.bias.numpy())
        step = before - after
        np.testing.assert_allclose(before - got, step, rtol=2e-4, atol=2e-5 * np.abs(step).max(),
                                   err_msg=f"{what} {layer.name}")


def test_wrapped_gan_with_its_own_compile_trains_its_discriminator_with_thor():
    """One step (lr 1, momentum 0): the discriminator's is the float64 K-FAC step of its loss on
    [fake; real]; the generator's is its own optimizer's (SGD) step on the float64 gradient of its
    loss through the updated discriminator, untouched by THOR."""
    disc, gen = _gan_parts()
    d0, g0 = _params(disc), _params(gen)
    cls, noises = _fixed_noise_gan(16)
    gan = thor_tf.wrap(cls(disc, gen, latent_dim=3), verbose=False)
    gan.compile(d_optimizer=thor_tf.ThorOptimizer(learning_rate=1.0, momentum=0.0, kl_clip=None),
                g_optimizer=keras.optimizers.SGD(0.1),
                loss_fn=keras.losses.BinaryCrossentropy())
    history = gan.fit(_real(16), batch_size=16, epochs=1, verbose=0)  # one step: a refresh
    assert set(history.history) == {"d_loss", "g_loss"}
    assert [b.name for b in gan.thor.blocks] == ["d1", "d2"]  # THOR trains the discriminator
    d1, g_inputs, g_gs = _gan_reference_step(d0, g0, _real(16), noises, DenseKfac(1.0))
    _assert_params(disc, (d0, d1), "discriminator")
    g1 = [p - 0.1 * homogeneous(a, True).T @ g / len(a) for p, a, g in zip(g0, g_inputs, g_gs)]
    _assert_params(gen, (g0, g1), "generator")


def test_gan_recipe_with_thor_for_both_sub_models():
    """One step (lr 1, momentum 0) with THOR on each sub-model: both are float64 K-FAC steps,
    the generator's G from its gradients through the updated discriminator."""
    disc, gen = _gan_parts()
    d0, g0 = _params(disc), _params(gen)
    cls, noises = _fixed_noise_gan(16)
    options = dict(learning_rate=1.0, momentum=0.0, kl_clip=None, verbose=False)
    d_thor, g_thor = thor_tf.wrap(disc, **options), thor_tf.wrap(gen, **options)
    d_thor.compile()
    g_thor.compile()
    gan = cls(d_thor, g_thor, latent_dim=3)
    gan.compile(d_optimizer=d_thor.optimizer, g_optimizer=g_thor.optimizer,
                loss_fn=keras.losses.BinaryCrossentropy())
    gan.fit(_real(16), batch_size=16, epochs=1, verbose=0)
    d1, g_inputs, g_gs = _gan_reference_step(d0, g0, _real(16), noises, DenseKfac(1.0))
    _assert_params(disc, (d0, d1), "discriminator")
    _assert_params(gen, (g0, DenseKfac(1.0).step(g0, g_inputs, g_gs, refresh=True)), "generator")


def test_hook_path_refuses_the_sampled_fisher():
    model = thor_tf.wrap(_cnn(CustomModel), fisher="sampled", verbose=False)
    model.compile(loss="sparse_categorical_crossentropy")
    x, y = _data(16)
    with pytest.raises(ValueError, match="fisher='sampled'.*fisher='empirical'"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


MIRRORED_LOOP = r"""
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np, thor_tf

rng = np.random.default_rng(0)
x = rng.normal(size=(64, 8, 8, 1)).astype("float32")
y = rng.integers(0, 4, 64)

def build(**options):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, 1)),
                              keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
                              keras.layers.Flatten(),
                              keras.layers.Dense(4, activation="softmax", name="out")])
    wrapped = thor_tf.wrap(model, frequency=2, update_rule="inverse", verbose=False, **options)
    wrapped.compile()
    return wrapped

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    model = build()
optimizer = model.optimizer
loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction="none")

@tf.function
def step(xb, yb):
    def replica_step(xr, yr):
        with tf.GradientTape() as tape:
            per_example = loss_fn(yr, model(xr, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=16)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
    strategy.run(replica_step, args=(xb, yb))

dataset = strategy.experimental_distribute_dataset(
    tf.data.Dataset.from_tensor_slices((x, y)).batch(16))
for epoch in range(2):
    for xb, yb in dataset:
        step(xb, yb)

single = build(learning_rate=0.05)  # the loop's default rate: constant at the peak outside fit
single.compile(loss="sparse_categorical_crossentropy")
single.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
diff = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), single.get_weights()))
print("RESULT" + json.dumps({"diff": diff, "points": model.thor.counters()["cadence_points"],
                             "refreshes": [s["refreshes"] for s in model.thor.layer_stats()]}))
"""


def test_custom_loop_recipe_on_two_replicas_takes_the_one_device_step():
    import json
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", MIRRORED_LOOP], capture_output=True, text=True,
                          timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, proc.stderr[-3000:]
    result = json.loads(line[-1][len("RESULT"):])
    assert result["diff"] < 1e-5, result
    assert result["points"] == 4 and min(result["refreshes"]) > 0, result


# -- the recipes of docs/usage.md, run as written ----------------------------------------------------------
def _usage_recipe(name):
    import os
    import re
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "usage.md")
    text = open(path).read()
    match = re.search(rf"<!-- recipe: {name} -->\s*```python\n(.*?)```", text, re.S)
    assert match, f"docs/usage.md has no recipe {name!r}"
    return match.group(1)


class _RecordingThor:
    """thor_tf as the recipes see it: ``wrap`` keeps the weights it was handed (the float64
    reference starts from them), everything else is thor_tf's."""

    def __init__(self):
        self.initial = []

    def __getattr__(self, name):
        return getattr(thor_tf, name)

    def wrap(self, model, *args, **kwargs):
        self.initial.append([w.astype(np.float64) for w in model.get_weights()])
        return thor_tf.wrap(model, *args, **kwargs)


@pytest.mark.parametrize("name", ["train_step", "loop", "gan"])
def test_usage_recipes_run_as_written(name):
    """Each recipe, as written (THOR's defaults: lr 0.05, momentum 0.9, KL clip 0.001, split 128,
    a refresh at step 0), against float64 THOR steps: the train_step recipe's one step, the
    loop's two (the second reusing the first's inverses, with momentum), the GAN's one step of
    each sub-model (its draws fixed)."""
    rng = np.random.default_rng(0)
    disc, gen = _gan_parts()
    d0, g0 = _params(disc), _params(gen)
    gan_class, noises = _fixed_noise_gan(32)
    recording = _RecordingThor()
    n = 64 if name == "loop" else 32  # fit shuffles: one batch keeps the batch known
    x, y = rng.normal(size=(n, 28, 28, 1)).astype("float32"), rng.integers(0, 10, n)
    namespace = {"keras": keras, "tf": tf, "thor_tf": recording, "np": np, "x": x, "y": y,
                 "GAN": gan_class, "discriminator": disc, "generator": gen, "latent_dim": 3,
                 "images": _real(32)}
    exec(compile(_usage_recipe(name), f"docs/usage.md recipe {name}", "exec"), namespace)
    model = namespace["gan"].discriminator if name == "gan" else namespace["model"]
    stats = model.thor.layer_stats()
    assert stats and all(s["refreshes"] == 1 for s in stats)  # THOR's curvature was used
    thor = lambda: DenseKfac(0.05, momentum=0.9, kl_clip=0.001, split_dim=128)
    if name == "gan":
        d1, g_inputs, g_gs = _gan_reference_step(d0, g0, _real(32), noises, thor())
        _assert_params(disc, (d0, d1), "discriminator")
        _assert_params(gen, (g0, thor().step(g0, g_inputs, g_gs, refresh=True)), "generator")
        return
    kernel, bias = recording.initial[0]  # the recipe's Dense, as wrap received it
    params = [folded(kernel, bias)]
    reference = thor()
    flat = x.reshape(n, -1).astype(np.float64)
    for step, start in enumerate(range(0, n, 32)):
        rows, labels = flat[start:start + 32], y[start:start + 32]
        p = softmax(rows @ params[0][:-1] + params[0][-1])
        params = reference.step(params, [rows], [p - np.eye(10)[labels]], refresh=step == 0)
    dense = model.model.layers[-1]
    got = folded(dense.kernel.numpy(), dense.bias.numpy())
    moved = folded(kernel, bias) - params[0]
    np.testing.assert_allclose(folded(kernel, bias) - got, moved, rtol=2e-4,
                               atol=2e-5 * np.abs(moved).max())
