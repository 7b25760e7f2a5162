"""The eigenbasis update rule (thor_tf/rules/eigenbasis.py) against float64 NumPy references.

* Dense, from first principles: per-example activations and softmax gradients give A, G and the
  gradient matrix; the eigendecomposition of every split diagonal block, the rotation, Adam's
  moments, the moments carried into a new basis at a refresh and the rotation back, over several
  steps with refreshes between, in float64.
* Conv2D, EinsumDense and a Dense pair sharing inputs: the same NumPy rule replayed from the
  gradients of an unhooked clone and the factors the state holds (their own float64 tests are in
  test_hooks.py / test_blocks_layers.py).
* Bases held at identity are Keras' AdamW; an orthogonal rotation of the input features leaves
  the run unchanged while AdamW's changes; the loss ×1000 gives the same steps; a non-finite
  batch changes no moment and no basis; save/load resumes to the same continuation.
"""

import numpy as np
import keras
import pytest
import tensorflow as tf

import thor_tf
from thor_tf.rules import Eigenbasis, Inverse
from thor_tf.split.plan import SplitPlan

from reference import homogeneous, mean_outer

#: The Adam step in the eigenbasis (the previous default; the orthogonalized step on top of it:
#: test_eigenbasis_orthogonal.py): the models below take ``update_rule="eigenbasis_adam"``.
pytestmark = pytest.mark.update_rule("eigenbasis_adam")

LR, B1, B2, EPS, REL_EPS, TIE_BREAK = 0.01, 0.9, 0.95, 1e-8, 1e-4, 0.1
CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
#: Refresh at every cadence point (THOR_NT, the published rule) every 2 steps: steps 0, 2, 4.
EVERY_2 = dict(preset="thor_nt", trace_filter="none", frequency=2, max_block_age=None)


# -- the rule in float64 NumPy ------------------------------------------------------------------

def np_eigh_blocks(factor, split):
    """Per diagonal block of ``factor`` (dense [n, n]): its eigenvectors (columns), after the
    tie-breaking ramp ``0.1·(tr/d)·k/d`` on entry k of its diagonal."""
    n = factor.shape[0]
    out = []
    for start in range(0, n, split):
        block = factor[start:start + split, start:start + split]
        d = block.shape[0]
        ramp = TIE_BREAK * np.trace(block) / d * np.arange(d) / d
        out.append(np.linalg.eigh(block + np.diag(ramp))[1])
    return out


def block_diag(blocks):
    n = sum(b.shape[0] for b in blocks)
    out, k = np.zeros((n, n)), 0
    for b in blocks:
        d = b.shape[0]
        out[k:k + d, k:k + d] = b
        k += d
    return out


class NumpyEigenbasis:
    """Adam in the eigenbasis of ⊕A_i and ⊕G_j, float64 (DESIGN.md §9)."""

    def __init__(self, a_dim, g_dim, rel_eps=REL_EPS, b2=B2, growth=None):
        self.rel_eps, self.b2, self.growth = rel_eps, b2, growth
        self.qa, self.qg = np.eye(a_dim), np.eye(g_dim)
        self.m, self.v = np.zeros((a_dim, g_dim)), np.zeros((a_dim, g_dim))
        self.t = 0

    def refresh(self, factor_a, factor_g, split_a, split_g):
        qa = block_diag(np_eigh_blocks(factor_a, split_a))
        qg = block_diag(np_eigh_blocks(factor_g, split_g))
        ra, rg = self.qa.T @ qa, self.qg.T @ qg
        self.m = ra.T @ self.m @ rg
        self.v = (ra ** 2).T @ self.v @ rg ** 2
        self.qa, self.qg = qa, qg

    def step(self, grad):
        self.t += 1
        rotated = self.qa.T @ grad @ self.qg
        b2 = self.b2 if self.growth is None else min(self.b2, 1.0 - self.t ** -self.growth)
        self.m = B1 * self.m + (1 - B1) * rotated
        self.v = b2 * self.v + (1 - b2) * rotated ** 2
        # Under growth β2 at t = 1 is 0: v is already an average whose weights sum to one.
        correction_2 = 1 - self.b2 ** self.t if self.growth is None else 1.0
        m_hat, v_hat = self.m / (1 - B1 ** self.t), self.v / correction_2
        floor = EPS + self.rel_eps * np.sqrt(v_hat.mean())
        return self.qa @ (m_hat / (np.sqrt(v_hat) + floor)) @ self.qg.T


# -- Dense from first principles ----------------------------------------------------------------

def _softmax_data(n=64, d=6, k=5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    x[:, 1] += 0.8 * x[:, 0]  # correlated features: A is far from diagonal
    y = rng.integers(0, k, size=n)
    return x, y


def _linear_targets(x, k=5, seed=0):
    """Regression targets ``[n, k]``: a noisy linear map of ``x`` (G of an MSE loss is full
    rank, unlike a softmax's, whose logits' all-ones direction has no gradient: Adam in any
    rotated basis would turn float32 round-off there into steps that float64 does not take)."""
    rng = np.random.default_rng(seed + 7)
    return (x @ rng.normal(size=(x.shape[1], k)) + rng.normal(size=(len(x), k))).astype("float32")


def _softmax_model(d=6, k=5, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((d,)), keras.layers.Dense(k)])


#: ``(split_dim, A's split, G's split)``: one split for both factors, or a plan per factor
#: dimension (A is 7 wide, G 5) as split_dim="auto" makes them, a side of 1 not rotated.
SPLITS = [(3, 3, 3), (4, 4, 4), (128, 128, 128),
          (SplitPlan(128, ((7, 1),)), 1, 5), (SplitPlan(2, ((7, 4),)), 4, 2),
          (SplitPlan(3, ((5, 1),)), 3, 1)]


@pytest.mark.parametrize("split_dim,split_a,split_g", SPLITS)
def test_dense_steps_match_float64_first_principles(split_dim, split_a, split_g):
    """5 steps of batch 16, refreshes at steps 0, 2, 4 (the bases change twice with moments in
    them); A is split into blocks of 3 (7 = 3 + 3 + 1 padded) or 4 (4 + 3 padded) or one block,
    or by a plan per dimension (a side of 1×1 blocks keeps Adam's coordinates).
    Weights after every step within 2e-5 of the float64 rule. A reference that keeps v across a
    basis change (no rotation) is 100x farther: the test sees the carry."""
    x, _ = _softmax_data(n=96)
    y = _linear_targets(x)
    model = _softmax_model()
    kernel0, bias0 = (v.numpy().astype(np.float64) for v in model.layers[0].weights)
    wrapped = thor_tf.wrap(model, learning_rate=LR, split_dim=split_dim, verbose=False, **EVERY_2)
    wrapped.compile(loss="mse")
    weights = np.concatenate([kernel0, bias0[None]], axis=0)  # [a_dim, g_dim]
    ref = NumpyEigenbasis(7, 5)
    stale = NumpyEigenbasis(7, 5)
    for step in range(5):
        xb, yb = x[16 * step:16 * (step + 1)].astype(np.float64), y[16 * step:16 * (step + 1)]
        a_rows = homogeneous(xb, True)
        g_rows = 2.0 * (a_rows @ weights - yb) / 5  # dℓ/dz per example, ℓ = mean_k (z - y)²
        grad = a_rows.T @ g_rows / len(xb)  # mean loss
        if step % 2 == 0:
            factor_a, factor_g = mean_outer(a_rows), mean_outer(g_rows)
            ref.refresh(factor_a, factor_g, split_a, split_g)
            old_v = stale.v.copy()
            stale.refresh(factor_a, factor_g, split_a, split_g)
            stale.v = old_v
        update = ref.step(grad)
        stale_update = stale.step(grad)
        wrapped.train_on_batch(x[16 * step:16 * (step + 1)], y[16 * step:16 * (step + 1)])
        got = np.concatenate([model.layers[0].kernel.numpy(),
                              model.layers[0].bias.numpy()[None]], axis=0)
        stale_weights = weights - LR * stale_update
        weights = weights - LR * update
        np.testing.assert_allclose(got, weights, atol=2e-5, rtol=0)
    assert np.abs(stale_weights - weights).max() > 100 * 2e-5
    assert [s["refreshes"] for s in wrapped.thor.layer_stats()] == [3]


def test_growing_beta_2_matches_float64_first_principles():
    """``beta_2_growth=0.8`` with ``beta_2=0.6``: β2_t = min(0.6, 1 − t^−0.8) is 0, 0.426, 0.585,
    then 0.6 from step 4 (both the growth and the cap are met), v̂ = v. 6 steps of batch 16,
    refreshes at steps 0, 2, 4: weights within 2e-5 of the float64 rule after every step. The
    constant-β2 rule with its bias correction is 100x farther: the test sees the schedule."""
    x, _ = _softmax_data(n=96)
    y = _linear_targets(x)
    model = _softmax_model()
    kernel0, bias0 = (v.numpy().astype(np.float64) for v in model.layers[0].weights)
    rule = Eigenbasis(step="adam", beta_2=0.6, beta_2_growth=0.8)
    wrapped = thor_tf.wrap(model, learning_rate=LR, split_dim=3, update_rule=rule,
                           verbose=False, **EVERY_2)
    wrapped.compile(loss="mse")
    weights = np.concatenate([kernel0, bias0[None]], axis=0)  # [a_dim, g_dim]
    ref = NumpyEigenbasis(7, 5, b2=0.6, growth=0.8)
    constant = NumpyEigenbasis(7, 5, b2=0.6)
    constant_weights = weights.copy()
    for step in range(6):
        xb, yb = x[16 * step:16 * (step + 1)].astype(np.float64), y[16 * step:16 * (step + 1)]
        a_rows = homogeneous(xb, True)
        g_rows = 2.0 * (a_rows @ weights - yb) / 5
        grad = a_rows.T @ g_rows / len(xb)
        constant_grad = a_rows.T @ (2.0 * (a_rows @ constant_weights - yb) / 5) / len(xb)
        if step % 2 == 0:
            for r in (ref, constant):
                r.refresh(mean_outer(a_rows), mean_outer(g_rows), 3, 3)
        weights = weights - LR * ref.step(grad)
        constant_weights = constant_weights - LR * constant.step(constant_grad)
        wrapped.train_on_batch(x[16 * step:16 * (step + 1)], y[16 * step:16 * (step + 1)])
        got = np.concatenate([model.layers[0].kernel.numpy(),
                              model.layers[0].bias.numpy()[None]], axis=0)
        np.testing.assert_allclose(got, weights, atol=2e-5, rtol=0)
    assert np.abs(constant_weights - weights).max() > 100 * 2e-5


# -- other block kinds, replayed ----------------------------------------------------------------

def _conv_model():
    return keras.Sequential([keras.Input((6, 6, 2)),
                             keras.layers.Conv2D(4, 3, padding="same", activation="tanh"),
                             keras.layers.Flatten(), keras.layers.Dense(3)])


def _einsum_model():
    inputs = keras.Input((4, 5))
    h = keras.layers.EinsumDense("btd,de->bte", output_shape=(4, 6), bias_axes="e",
                                 activation="tanh")(inputs)
    h = keras.layers.Flatten()(h)
    return keras.Model(inputs, keras.layers.Dense(3)(h))


@pytest.mark.parametrize("build,shape", [(_conv_model, (6, 6, 2)), (_einsum_model, (4, 5))],
                         ids=["conv2d", "einsum_dense"])
def test_other_blocks_replay_the_float64_rule(build, shape):
    """Every block of a Conv2D and an EinsumDense model: from the gradient of an unhooked clone
    at the same weights and the factors the state holds after each refresh, the float64 rule gives
    the weights after each of 5 steps (refreshes at 0, 2, 4; split 8 cuts the conv's A of 19)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(80, *shape)).astype("float32")
    y = rng.normal(size=(80, 3)).astype("float32")
    mse = keras.losses.MeanSquaredError()
    keras.utils.set_random_seed(0)
    model = build()
    keras.utils.set_random_seed(0)
    clone = build()
    clone.set_weights(model.get_weights())
    wrapped = thor_tf.wrap(model, learning_rate=LR, split_dim=8, verbose=False, **EVERY_2)
    wrapped.compile(loss="mse")
    blocks = wrapped.thor.blocks
    refs = {b.name: NumpyEigenbasis(b.a_dim, b.g_dim) for b in blocks}
    for step in range(5):
        xb, yb = x[16 * step:16 * (step + 1)], y[16 * step:16 * (step + 1)]
        with tf.GradientTape() as tape:
            loss = mse(yb, clone(xb))
        grads = dict(zip([id(v) for v in clone.trainable_variables],
                         tape.gradient(loss, clone.trainable_variables)))
        wrapped.train_on_batch(xb, yb)
        expected = []
        for b, layer in zip(blocks, [l for l in clone.layers if l.weights]):
            kernel, bias = layer.kernel, layer.bias
            grad = np.concatenate([grads[id(kernel)].numpy().reshape(b.in_dim, b.g_dim),
                                   grads[id(bias)].numpy().reshape(1, b.g_dim)]).astype(np.float64)
            if step % 2 == 0:
                f = wrapped.thor.factors(b.name)
                split_a = wrapped.thor.state.layers[wrapped.thor.block_position(b.name)].A.shape[1]
                split_g = wrapped.thor.state.layers[wrapped.thor.block_position(b.name)].G.shape[1]
                refs[b.name].refresh(f["A"].astype(np.float64), f["G"].astype(np.float64),
                                     split_a, split_g)
            update = refs[b.name].step(grad)
            weights = np.concatenate([kernel.numpy().reshape(b.in_dim, b.g_dim),
                                      bias.numpy()[None]]).astype(np.float64) - LR * update
            expected.append(weights)
            new_kernel, new_bias = weights[:-1].reshape(kernel.shape), weights[-1]
            kernel.assign(new_kernel.astype("float32"))
            bias.assign(new_bias.astype("float32"))
        for b, layer, weights in zip(blocks, [l for l in model.layers if l.weights], expected):
            got = np.concatenate([layer.kernel.numpy().reshape(b.in_dim, b.g_dim),
                                  layer.bias.numpy()[None]])
            np.testing.assert_allclose(got, weights, atol=3e-5, rtol=0, err_msg=b.name)


# -- invariances and Keras equivalence ---------------------------------------------------------

class HeldBases(Eigenbasis):
    """The eigenbasis rule with its bases held at the identity (refresh does nothing) and Adam's
    absolute ε alone (``relative_epsilon=0`` unless given)."""

    def __init__(self, **options):
        options.setdefault("relative_epsilon", 0.0)
        super().__init__(step="adam", **options)

    def refresh(self, step, layers, refresh, factors, damping):
        pass


def _regression(seed=0, n=96, d=5):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    y = (np.tanh(x @ rng.normal(size=(d, 2))) + 0.1 * rng.normal(size=(n, 2))).astype("float32")
    return x, y


def _mlp(seed=0, d=5):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((d,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.LayerNormalization(), keras.layers.Dense(2)])


def test_bases_held_at_identity_are_keras_adamw(monkeypatch):
    """Bases at the identity: 6 steps equal Keras' AdamW (β2 0.95, weight decay 0.01, the same ε
    up to Keras' ε·√(1−β2ᵗ)) on every variable, blocks and LayerNormalization alike (its scale
    and offset, of one shape, take Adam as one stack), to float32 round-off."""
    stacked = []
    first_order_adam = Eigenbasis._first_order_adam

    def recording(*args):
        out = first_order_adam(*args)
        stacked.append(len(out))
        return out

    monkeypatch.setattr(Eigenbasis, "_first_order_adam", staticmethod(recording))
    x, y = _regression()
    plain = _mlp()
    plain.compile(optimizer=keras.optimizers.AdamW(LR, weight_decay=0.01, beta_2=B2, epsilon=EPS),
                  loss="mse")
    wrapped = thor_tf.wrap(_mlp(), learning_rate=LR, update_rule=HeldBases(), weight_decay=0.01,
                           verbose=False)
    wrapped.compile(loss="mse")
    for step in range(6):
        xb, yb = x[16 * step:16 * (step + 1)], y[16 * step:16 * (step + 1)]
        plain.train_on_batch(xb, yb)
        wrapped.train_on_batch(xb, yb)
    moved = max(np.abs(a.numpy() - b.numpy()).max()
                for a, b in zip(plain.trainable_variables, _mlp().trainable_variables))
    diff = max(np.abs(a.numpy() - b.numpy()).max()
               for a, b in zip(plain.trainable_variables, wrapped.trainable_variables))
    assert moved > 0.03 and diff < 1e-5 * max(moved, 1.0), (moved, diff)
    assert stacked == [2], stacked  # traced once: gamma and beta as one stack


def _clone_gradients(clone, weights, xb, yb):
    """The MSE gradients of ``clone`` (an unwrapped copy of the model) at ``weights`` (float64,
    set as float32) on one batch, as float64 arrays: what a float64 replay of a first-order
    rule steps with."""
    for var, w in zip(clone.trainable_variables, weights):
        var.assign(w.astype(np.float32))
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(yb, clone(xb))
    return [g.numpy().astype(np.float64) for g in tape.gradient(loss, clone.trainable_variables)]


def test_growing_beta_2_is_adafactors_decay_on_every_variable():
    """Bases at the identity under ``beta_2_growth=0.8`` (β2 capped at 0.95): 6 steps are Adam
    with β2_t = min(0.95, 1 − t^−0.8) and no bias correction of v, replayed in float64 from the
    gradients of an unwrapped clone at the reference's weights, on blocks and on the
    LayerNormalization's scale and offset (the first-order path) alike."""
    x, y = _regression()
    wrapped = thor_tf.wrap(_mlp(), learning_rate=LR, update_rule=HeldBases(beta_2_growth=0.8),
                           verbose=False)
    wrapped.compile(loss="mse")
    clone = _mlp()
    weights = [v.numpy().astype(np.float64) for v in clone.trainable_variables]
    m = [np.zeros_like(w) for w in weights]
    v = [np.zeros_like(w) for w in weights]
    for step in range(6):
        xb, yb = x[16 * step:16 * (step + 1)], y[16 * step:16 * (step + 1)]
        grads = _clone_gradients(clone, weights, xb, yb)
        t = step + 1
        b2 = min(B2, 1.0 - t ** -0.8)
        for k, g in enumerate(grads):
            m[k] = B1 * m[k] + (1 - B1) * g
            v[k] = b2 * v[k] + (1 - b2) * g ** 2
            weights[k] = weights[k] - LR * (m[k] / (1 - B1 ** t)) / (np.sqrt(v[k]) + EPS)
        wrapped.train_on_batch(xb, yb)
        for got, want in zip(wrapped.trainable_variables, weights):
            np.testing.assert_allclose(got.numpy(), want, atol=2e-5, rtol=0, err_msg=got.name)
    moved = max(np.abs(w - w0.numpy()).max() for w, w0 in zip(weights, _mlp().trainable_variables))
    assert moved > 0.03, moved


def _mlp_with_lone_variable(seed=0, d=5):
    """:func:`_mlp` and a PReLU on its output: the PReLU's ``[2]`` slope is the only variable of
    its shape without a block, so it takes the rule's per-variable AdamW path
    (``Eigenbasis.update_step``), the LayerNormalization's scale and offset the stacked one."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((d,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.LayerNormalization(), keras.layers.Dense(2),
                             keras.layers.PReLU()])


def _assert_follows_the_replay(wrapped, x, y, want, constant, start, peak):
    """Six steps of ``wrapped`` on 16-row batches within 2e-5 of the float64 replay ``want``
    (weights after each step) on every variable; the largest rate so far is ``peak``; the
    replay is > 100x that from ``constant`` (the schedule is seen) and moved from ``start``."""
    for step in range(6):
        wrapped.train_on_batch(x[16 * step:16 * (step + 1)], y[16 * step:16 * (step + 1)])
        for got, w in zip(wrapped.trainable_variables, want[step]):
            np.testing.assert_allclose(got.numpy(), w, atol=2e-5, rtol=0, err_msg=got.name)
    assert float(wrapped.thor.state.rule_state.numpy()) == pytest.approx(peak)
    assert max(np.abs(a - b).max() for a, b in zip(want[-1], constant[-1])) > 100 * 2e-5
    moved = max(np.abs(w - w0).max() for w, w0 in zip(want[-1], start))
    assert moved > 0.03, moved


@pytest.mark.parametrize("peak_beta,end_beta,want_decays", [
    (0.5, 0.8, [0.0, 0.5, 0.56, 0.62, 0.74, 0.785]),
    (0.8, 0.5, [0.0, 0.5, 2 / 3, 0.68, 0.56, 0.515])])
def test_beta_1_following_the_rate_matches_float64_first_principles(peak_beta, end_beta,
                                                                      want_decays):
    """``beta_1_end`` under the rates 0.3, 1, 0.8, 0.6, 0.2, 0.05 (× 0.05): ``β1_t = min(e +
    (β1 − e)·η_t/η_max, 1 − 1/t)`` with ``η_max`` the largest rate so far (t = 1: the first rate
    is its own largest) and ``m̂ = m``, a memory growing (0.5 → 0.8) or shrinking (0.8 → 0.5)
    as the rate falls; the cap ``1 − 1/t`` decides the first steps. Bases at the identity, 6
    steps replayed in float64 from the gradients of an unwrapped clone at the reference's
    weights, on the blocks, the stacked LayerNormalization and the lone PReLU slope: within
    2e-5 after every step. A constant β1 at the peak's value with Adam's bias correction is
    100x farther: the test sees the schedule."""
    x, y = _regression()
    peak = 0.05
    rates = [r * peak for r in (0.3, 1.0, 0.8, 0.6, 0.2, 0.05)]
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([0, 1, 2, 3, 4], rates)
    with pytest.warns(UserWarning, match="no Kronecker block for p_re_lu"):
        wrapped = thor_tf.wrap(_mlp_with_lone_variable(), learning_rate=schedule,
                               update_rule=HeldBases(beta_1=peak_beta, beta_1_end=end_beta),
                               verbose=False)
    wrapped.compile(loss="mse")
    clone = _mlp_with_lone_variable()
    start = [v.numpy().astype(np.float64) for v in clone.trainable_variables]

    def replay(first_moment_decay, bias_corrected, steps):
        weights = [w.copy() for w in start]
        m = [np.zeros_like(w) for w in weights]
        v = [np.zeros_like(w) for w in weights]
        out = []
        for step in range(steps):
            xb, yb = x[16 * step:16 * (step + 1)], y[16 * step:16 * (step + 1)]
            grads = _clone_gradients(clone, weights, xb, yb)
            t, rate = step + 1, rates[step]
            b1 = first_moment_decay(t, rate / max(rates[:step + 1]))
            correction_1 = 1 - b1 ** t if bias_corrected else 1.0
            for k, g in enumerate(grads):
                m[k] = b1 * m[k] + (1 - b1) * g
                v[k] = B2 * v[k] + (1 - B2) * g ** 2
                weights[k] = weights[k] - rate * (m[k] / correction_1) / (
                    np.sqrt(v[k] / (1 - B2 ** t)) + EPS)
            out.append([w.copy() for w in weights])
        return out

    decays = []

    def following(t, ratio):
        decays.append(min(end_beta + (peak_beta - end_beta) * ratio, 1 - 1 / t))
        return decays[-1]

    want = replay(following, False, 6)
    np.testing.assert_allclose(decays, want_decays, atol=1e-12)
    constant = replay(lambda t, ratio: peak_beta, True, 6)
    _assert_follows_the_replay(wrapped, x, y, want, constant, start, peak)


@pytest.mark.parametrize("start_eps,end_eps,norm_eps", [(0.1, 0.5, None), (0.5, 0.05, None),
                                                       (0.1, 0.5, 0.1)])
def test_relative_epsilon_following_the_rate_matches_float64_first_principles(start_eps,
                                                                             end_eps, norm_eps):
    """``relative_epsilon_end`` under the rates 0.3, 1, 0.8, 0.6, 0.2, 0.05 (× 0.05): each block's
    floor is ``ε + ε_r,t·√mean(v̂)`` (the mean over the block's ``[a_dim, g_dim]`` matrix, bias row
    included) with ``ε_r,t = e + (ε_r − e)·η_t/η_max`` and ``η_max`` the largest rate so far;
    the LayerNormalization's scale and offset (no block) take Adam's ``ε`` alone. Bases at the
    identity, 6 steps replayed in float64 from the gradients of an unwrapped clone at the
    reference's weights: within 2e-5 after every step. A constant ``ε_r`` at the peak's value is
    farther than 100x that: the test sees the schedule, growing (0.1 → 0.5) or falling. Under
    ``step_norm_epsilon=k`` each block's step is scaled to the Frobenius norm of the step with
    ``ε_r = k`` (the same floor with ``k``): the direction from the schedule, the size from
    ``k``."""
    x, y = _regression()
    peak = 0.05
    rates = [r * peak for r in (0.3, 1.0, 0.8, 0.6, 0.2, 0.05)]
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([0, 1, 2, 3, 4], rates)
    wrapped = thor_tf.wrap(_mlp(), learning_rate=schedule,
                           update_rule=HeldBases(relative_epsilon=start_eps,
                                                 relative_epsilon_end=end_eps,
                                                 step_norm_epsilon=norm_eps),
                           verbose=False)
    wrapped.compile(loss="mse")
    clone = _mlp()
    start = [v.numpy().astype(np.float64) for v in clone.trainable_variables]
    # (kernel, bias) index pairs of the two Dense layers: one block each, the bias a row of it.
    dense = [(0, 1), (4, 5)]
    assert [tuple(start[k].shape) for k, _ in dense] == [(5, 8), (8, 2)]

    def replay(relative_epsilon):
        weights = [w.copy() for w in start]
        m = [np.zeros_like(w) for w in weights]
        v = [np.zeros_like(w) for w in weights]
        out, used = [], []
        for step in range(6):
            xb, yb = x[16 * step:16 * (step + 1)], y[16 * step:16 * (step + 1)]
            grads = _clone_gradients(clone, weights, xb, yb)
            t, rate = step + 1, rates[step]
            eps_r = relative_epsilon(rate / max(rates[:step + 1]))
            used.append(eps_r)
            for k, g in enumerate(grads):
                m[k] = B1 * m[k] + (1 - B1) * g
                v[k] = B2 * v[k] + (1 - B2) * g ** 2
            m_hat = [mk / (1 - B1 ** t) for mk in m]
            v_hat = [vk / (1 - B2 ** t) for vk in v]
            steps = [m_hat[k] / (np.sqrt(v_hat[k]) + EPS) for k in range(len(weights))]
            for kernel, bias in dense:
                block = np.concatenate([v_hat[kernel], v_hat[bias][None]])  # [a_dim, g_dim]
                rms = np.sqrt(block.mean())
                own = [m_hat[k] / (np.sqrt(v_hat[k]) + EPS + eps_r * rms) for k in (kernel, bias)]
                if norm_eps is not None:
                    sized = [m_hat[k] / (np.sqrt(v_hat[k]) + EPS + norm_eps * rms)
                             for k in (kernel, bias)]
                    ratio = np.sqrt(sum((u ** 2).sum() for u in sized) / sum(
                        (u ** 2).sum() for u in own))
                    own = [u * ratio for u in own]
                steps[kernel], steps[bias] = own
            for k in range(len(weights)):
                weights[k] = weights[k] - rate * steps[k]
            out.append([w.copy() for w in weights])
        return out, used

    want, used = replay(lambda ratio: end_eps + (start_eps - end_eps) * ratio)
    np.testing.assert_allclose(
        used, [end_eps + (start_eps - end_eps) * r for r in (1, 1, 0.8, 0.6, 0.2, 0.05)],
        atol=1e-12)
    constant, _ = replay(lambda ratio: start_eps)
    _assert_follows_the_replay(wrapped, x, y, want, constant, start, peak)


def test_step_norm_epsilon_is_the_same_on_stacked_and_single_blocks(monkeypatch):
    """Two Dense blocks of one shape are preconditioned as one stack: under
    ``step_norm_epsilon`` each member is scaled by its own norms, as when every block is its
    own stack (``_stack_key`` per block); 4 steps within float32 round-off, and the scaling
    moves them (against no ``step_norm_epsilon``)."""
    x, y = _regression(d=6)

    def run(**options):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(6, activation="tanh"),
                                  keras.layers.Dense(6, activation="tanh"),
                                  keras.layers.Dense(2)])
        model = thor_tf.wrap(model, learning_rate=LR, verbose=False, update_rule=Eigenbasis(
            relative_epsilon=0.5, **options), **EVERY_2)
        model.compile(loss="mse")
        for step in range(4):
            model.train_on_batch(x[16 * step:16 * (step + 1)], y[16 * step:16 * (step + 1)])
        return [v.numpy() for v in model.trainable_variables]

    stacked = run(step_norm_epsilon=0.1)
    plain = run()
    monkeypatch.setattr(Eigenbasis, "_stack_key", staticmethod(lambda held: id(held)))
    single = run(step_norm_epsilon=0.1)
    for a, b in zip(stacked, single):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=0)
    assert max(np.abs(a - b).max() for a, b in zip(stacked, plain)) > 1e-4


def _rotation_run(rule, rotate, steps=6):
    """Losses of a softmax regression whose inputs are rotated by an orthogonal O (the kernel
    rotated to match, so the model computes the same function)."""
    x, y = _softmax_data(n=96, d=6)
    o = np.linalg.qr(np.random.default_rng(3).normal(size=(6, 6)))[0].astype("float32")
    model = _softmax_model()
    if rotate:
        kernel, bias = model.layers[0].get_weights()
        model.layers[0].set_weights([o @ kernel, bias])
        x = x @ o.T
    if rule == "adamw":
        model.compile(optimizer=keras.optimizers.AdamW(LR, beta_2=B2, epsilon=EPS), loss=CE)
    else:
        model = thor_tf.wrap(model, learning_rate=LR, update_rule=rule, verbose=False,
                             **EVERY_2)
        model.compile(loss=CE)
    return [float(model.train_on_batch(x[16 * s:16 * (s + 1)], y[16 * s:16 * (s + 1)]))
            for s in range(steps)]


def test_rotated_input_features_leave_the_eigenbasis_run_unchanged():
    """x → x·Oᵀ with the kernel O·W (same function): without the tie-breaking ramp the eigenbasis
    rule's 6 losses agree to 1e-5 (A is one block: its eigenbasis rotates with O); with the
    default ramp (10 % of the mean eigenvalue on the coordinate axes) within 5e-3 (measured
    1.7e-3); AdamW's differ by > 1e-3 (measured 2.9e-3 on TF 2.16, more on 2.21)."""
    exact = Eigenbasis(tie_break=0.0, step="adam")
    plain, rotated = _rotation_run(exact, False), _rotation_run(exact, True)
    np.testing.assert_allclose(rotated, plain, atol=1e-5)
    default = np.array(_rotation_run("eigenbasis_adam", True)) - np.array(
        _rotation_run("eigenbasis_adam", False))
    assert np.abs(default).max() < 5e-3
    adam_plain, adam_rotated = _rotation_run("adamw", False), _rotation_run("adamw", True)
    assert np.abs(np.array(adam_plain) - np.array(adam_rotated)).max() > 1e-3


def _plain_mlp(seed=0, d=5):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((d,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(2)])


def test_loss_times_1000_gives_the_same_steps():
    """The loss ×1000 (a loss in other units): the same weights after 6 steps to 1e-5 of the step
    (the inverse rule's KL clip and damping are in loss units: its steps differ by > 1 %). The
    model has no direction without gradient (no LayerNormalization before a Dense, no softmax):
    there float32 round-off of the rotation meets ε (docs/limits.md)."""
    x, y = _regression()

    def run(scale, rule):
        model = thor_tf.wrap(_plain_mlp(), learning_rate=LR, update_rule=rule, verbose=False,
                             **EVERY_2)
        model.compile(loss=lambda t, p: scale * keras.losses.mean_squared_error(t, p))
        for s in range(6):
            model.train_on_batch(x[16 * s:16 * (s + 1)], y[16 * s:16 * (s + 1)])
        return [v.numpy() for v in model.trainable_variables]

    start = [v.numpy() for v in _plain_mlp().trainable_variables]
    one, many = run(1.0, "eigenbasis_adam"), run(1000.0, "eigenbasis_adam")
    moved = max(np.abs(a - s).max() for a, s in zip(one, start))
    assert max(np.abs(a - b).max() for a, b in zip(one, many)) < 1e-5 * moved / LR
    inv_one, inv_many = run(1.0, "inverse"), run(1000.0, "inverse")
    assert max(np.abs(a - b).max() for a, b in zip(inv_one, inv_many)) > 0.01 * moved


@pytest.mark.parametrize("rule", ["eigenbasis_adam", Eigenbasis(neuron_norm="output")])
def test_non_finite_batch_changes_no_moment_and_no_basis(rule):
    """A batch with a NaN: weights, moments, bases and the Adam slots (and ``neuron_norm``'s
    moments) stay as they were (a NaN update times a zero rate is NaN: the step is selected
    away, not scaled)."""
    x, y = _regression()
    model = thor_tf.wrap(_mlp(), learning_rate=LR, update_rule=rule, verbose=False, **EVERY_2)
    model.compile(loss="mse")
    model.train_on_batch(x[:16], y[:16])
    state = model.thor_optimizer.variables + model.trainable_variables
    before = [v.numpy().copy() for v in state]
    bad = x[16:32].copy()
    bad[3, 1] = np.nan
    model.train_on_batch(bad, y[16:32])
    after = [v.numpy() for v in state]
    assert any("neuron_v" in v.name for v in state) == (rule != "eigenbasis_adam")
    for v, a, b in zip(state, before, after):
        if "nonfinite" in v.name:
            continue
        np.testing.assert_array_equal(a, b, err_msg=v.name)
    assert model.thor.counters()["nonfinite_steps"] == 1


@pytest.mark.parametrize("growth,beta_1_end,neuron_norm,releps_end,ns_end", [
    (None, None, None, None, None), (0.8, None, None, None, None), (None, 0.9, None, None, None),
    (None, None, "output", None, None), (None, None, None, 0.5, None),
    (None, None, None, None, 2)])
def test_save_and_load_resume_the_same_run(tmp_path, growth, beta_1_end, neuron_norm,
                                           releps_end, ns_end):
    """model.save after 4 steps, load, 4 more steps = 8 uninterrupted steps (bases, eigenvalues,
    moments and Adam slots are optimizer state; a growing β2 is a function of the step count;
    under ``beta_1_end``, ``relative_epsilon_end`` or ``newton_schulz_steps_end`` the largest
    rate so far is state too: the rate halves right after the save, and a restart from 0 would
    take the halved rate as the largest; under ``neuron_norm``
    the orthogonal step's moment per neuron); the loaded optimizer is the eigenbasis rule with
    its options."""
    x, y = _regression()
    step = "adam" if neuron_norm is None and ns_end is None else "orthogonal"
    rule = Eigenbasis(beta_2=0.99, step=step, beta_2_growth=growth, neuron_norm=neuron_norm,
                      relative_epsilon_end=releps_end, newton_schulz_steps_end=ns_end,
                      **({} if beta_1_end is None else dict(beta_1=0.5, beta_1_end=beta_1_end)))
    follows = beta_1_end is not None or releps_end is not None or ns_end is not None
    rate = LR if not follows else keras.optimizers.schedules.PiecewiseConstantDecay(
        [3, 4, 5, 6], [LR, 0.5 * LR, 0.3 * LR, 0.2 * LR, 0.1 * LR])

    def fresh():
        model = thor_tf.wrap(_mlp(), learning_rate=rate, update_rule=rule, verbose=False,
                             **EVERY_2)
        model.compile(loss="mse")
        return model

    whole = fresh()
    for s in range(8):
        whole.train_on_batch(x[8 * s:8 * (s + 1)], y[8 * s:8 * (s + 1)])
    half = fresh()
    for s in range(4):
        half.train_on_batch(x[8 * s:8 * (s + 1)], y[8 * s:8 * (s + 1)])
    half.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.thor_optimizer.update_rule == rule
    for s in range(4, 8):
        loaded.train_on_batch(x[8 * s:8 * (s + 1)], y[8 * s:8 * (s + 1)])
    for a, b in zip(whole.trainable_variables, loaded.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)
    bases = loaded.thor.bases(loaded.thor.blocks[0].name)
    q = bases["Q_A"][0]
    np.testing.assert_allclose(q.T @ q, np.eye(q.shape[0]), atol=1e-5)


def test_options_name_the_allowed_values():
    with pytest.raises(ValueError, match="update_rule.*eigenbasis.*inverse"):
        thor_tf.wrap(_mlp(), update_rule="adam")
    with pytest.raises(ValueError, match="beta_2"):
        Eigenbasis(beta_2=1.0)
    for bad in (0, 1.5, "0.8", True):
        with pytest.raises(ValueError, match=r"beta_2_growth.*None or a float in \(0, 1\]"):
            Eigenbasis(beta_2_growth=bad)
    for bad in (-0.1, 1.0, "0.95", True):
        with pytest.raises(ValueError, match=r"beta_1_end.*None or a float in \[0, 1\)"):
            Eigenbasis(beta_1_end=bad)
    for bad in (-0.1, "0.5", True):
        with pytest.raises(ValueError, match=r"relative_epsilon_end.*None or a float >= 0"):
            Eigenbasis(relative_epsilon_end=bad)
        with pytest.raises(ValueError, match=r"step_norm_epsilon.*None or a float >= 0"):
            Eigenbasis(step_norm_epsilon=bad)
    model = thor_tf.wrap(_mlp(), update_rule="inverse", verbose=False)
    model.compile(loss="mse")
    assert isinstance(model.thor_optimizer.update_rule, Inverse)
    assert float(model.thor_optimizer.learning_rate) == pytest.approx(0.05)
    default = thor_tf.wrap(_mlp(), verbose=False)
    default.compile(loss="mse")
    assert isinstance(default.thor_optimizer.update_rule, Eigenbasis)
    assert float(default.thor_optimizer.learning_rate) == pytest.approx(0.01)


def test_clip_norm_clips_each_gradient_before_the_moments():
    """``clip_norm`` under the eigenbasis rule is Keras' ``clipnorm``: after one step the first
    moment of a Dense block (kernel and bias clipped to norm c each, then rotated: the norm is
    kept) has norm (1 − β1)·c·√2, and an AdamW variable's (LayerNormalization) (1 − β1)·c."""
    x, y = _regression()
    c = 1e-4
    model = thor_tf.wrap(_mlp(), learning_rate=LR, clip_norm=c, verbose=False, **EVERY_2)
    model.compile(loss="mse")
    model.train_on_batch(x[:16], y[:16])
    for block in model.thor.blocks:
        m = model.thor.bases(block.name)["m"]
        np.testing.assert_allclose(np.linalg.norm(m), (1 - B1) * c * np.sqrt(2), rtol=1e-4)
    opt = model.thor_optimizer
    gamma = [v for v in model.trainable_variables if "gamma" in v.path][0]
    slot = opt.slot("adam_m", gamma)
    np.testing.assert_allclose(np.linalg.norm(slot.numpy()), (1 - B1) * c, rtol=1e-4)
