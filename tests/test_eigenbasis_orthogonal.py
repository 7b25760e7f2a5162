"""The eigenbasis rule's orthogonalized step (``Eigenbasis(step="orthogonal")``, SOAP-Muon) and
its Newton–Schulz iteration (thor_tf/rules/eigenbasis_ops.py) against float64 NumPy references.

* Newton–Schulz: five quintic iterations written out in NumPy float64 (wide orientation, the
  Frobenius normalization first), on a batch of tall and wide matrices; and what the iteration is
  for: singular values pulled into [0.6, 1.3] from a spread of 1e-2…1, the singular vectors kept.
* A Dense layer from first principles over 5 steps with refreshes at steps 0, 2 and 4: Adam in
  the eigenbasis (test_eigenbasis.NumpyEigenbasis), then the step's orthogonal factor scaled to
  its Frobenius norm (``scale="graft"``) or to Muon's RMS (``"rms"``); references without the
  iteration or with the other scale are far off (the test sees both).
* ``neuron_norm`` (NorMuon): the same steps, then each neuron's running second moment of the
  step at unit RMS divides it, back at its norm; on output units and on the longer side.
* ``newton_schulz_steps``: the same steps with 3 or 2 iterations, on a short side in the
  float64 ``eigh`` form's range and on one in the products'.
"""

import numpy as np
import keras
import pytest

import thor_tf
from thor_tf.rules.eigenbasis_ops import newton_schulz
from thor_tf.rules import Eigenbasis
from thor_tf.split.plan import SplitPlan

from reference import homogeneous, mean_outer
from test_newton_schulz import np_newton_schulz
from test_eigenbasis import (EVERY_2, LR, NumpyEigenbasis, _linear_targets, _plain_mlp,
                             _regression, _rotation_run, _softmax_data)


def test_newton_schulz_orthogonalizes():
    """Singular values from 1e-2 to 1 come out in [0.6, 1.3]; the singular vectors stay (the
    result is U·diag(s')·Vᵀ for the input's U, V): five iterations, not one, are needed."""
    rng = np.random.default_rng(1)
    u, _ = np.linalg.qr(rng.normal(size=(24, 12)))
    v, _ = np.linalg.qr(rng.normal(size=(12, 12)))
    s = np.logspace(-2, 0, 12)
    x = (u * s) @ v.T
    y = newton_schulz(x.astype(np.float32)).numpy().astype(np.float64)
    s_out = np.linalg.svd(y, compute_uv=False)
    assert s_out.min() > 0.6 and s_out.max() < 1.3
    core = u.T @ y @ v  # diagonal when the singular vectors are kept
    off = core - np.diag(np.diag(core))
    assert np.abs(off).max() < 1e-4 * np.abs(np.diag(core)).max()
    one = newton_schulz(x.astype(np.float32), steps=1).numpy()
    assert np.linalg.svd(one, compute_uv=False).min() < 0.1  # one iteration leaves them small
    assert not np.any(newton_schulz(np.zeros((2, 3, 4), np.float32)).numpy())


def _scaled(update, ortho, scale, rms=0.2):
    if scale == "graft":
        return ortho * np.linalg.norm(update) / np.linalg.norm(ortho)
    return ortho * rms * np.sqrt(max(update.shape))


@pytest.mark.parametrize("scale", ["graft", "rms"])
@pytest.mark.parametrize("split_dim,split_a,split_g",
                         [(3, 3, 3), (128, 128, 128), (SplitPlan(2, ((7, 1),)), 1, 2)])
def test_dense_orthogonal_steps_match_float64_first_principles(scale, split_dim, split_a,
                                                               split_g):
    """Weights after every step within 2e-5 of the float64 rule (Adam in the eigenbasis, the
    update's Newton–Schulz factor, the scale); the reference without the iteration, the one
    with the other scale end more than 100x that tolerance away, the one with the previous
    default's relative ε (1e-2, against 0.1) more than 20x."""
    x, _ = _softmax_data(n=96)
    y = _linear_targets(x)
    rule = Eigenbasis(step="orthogonal", scale=scale)
    model, wrapped, weights = _wrapped_dense(x, 5, rule, split_dim)
    plain, other = weights.copy(), weights.copy()
    ref = NumpyEigenbasis(7, 5, rel_eps=rule.relative_epsilon)
    before = NumpyEigenbasis(7, 5, rel_eps=1e-2)  # the default relative ε before 2026-11-30
    previous = weights.copy()
    other_scale = "rms" if scale == "graft" else "graft"
    for step in range(5):
        rows = slice(16 * step, 16 * (step + 1))
        xb, yb = x[rows].astype(np.float64), y[rows]
        a_rows = homogeneous(xb, True)
        g_rows = 2.0 * (a_rows @ weights - yb) / 5  # dℓ/dz per example, ℓ = mean_k (z - y)²
        grad = a_rows.T @ g_rows / len(xb)
        if step % 2 == 0:
            ref.refresh(mean_outer(a_rows), mean_outer(g_rows), split_a, split_g)
            before.refresh(mean_outer(a_rows), mean_outer(g_rows), split_a, split_g)
        update = ref.step(grad)
        ortho = np_newton_schulz(update)
        update_before = before.step(grad)
        previous = previous - LR * _scaled(update_before, np_newton_schulz(update_before), scale)
        wrapped.train_on_batch(x[rows], y[rows])
        got = _dense_weights(model)
        plain = plain - LR * _scaled(update, update, scale)  # no iteration
        other = other - LR * _scaled(update, ortho, other_scale)
        weights = weights - LR * _scaled(update, ortho, scale)
        np.testing.assert_allclose(got, weights, atol=2e-5, rtol=0)
    assert np.abs(plain - weights).max() > 100 * 2e-5
    assert np.abs(other - weights).max() > 100 * 2e-5
    # The default's ε is what ran: 1e-2 ends >= 1.3e-3 away on these 5 steps (measured).
    assert np.abs(previous - weights).max() > 20 * 2e-5
    assert [s["refreshes"] for s in wrapped.thor.layer_stats()] == [3]


def _wrapped_dense(x, units, rule, split_dim, learning_rate=LR):
    """A ``Dense(units)`` on ``x``'s features wrapped with ``rule`` (refreshes every 2 steps,
    MSE), and its initial ``[a_dim, g_dim]`` weights (kernel and bias row) in float64."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(units)])
    weights = _dense_weights(model).astype(np.float64)
    wrapped = thor_tf.wrap(model, learning_rate=learning_rate, split_dim=split_dim,
                           update_rule=rule, verbose=False, **EVERY_2)
    wrapped.compile(loss="mse")
    return model, wrapped, weights


def _correlated_regression(d_in, units):
    """96 examples of ``d_in`` features (the second correlated with the first) and ``units``
    linear targets."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(96, d_in)).astype("float32")
    x[:, 1] += 0.8 * x[:, 0]
    return x, _linear_targets(x, k=units)


def _reference_update(ref, x, y, weights, step):
    """The float64 rule's eigenbasis Adam step (before Newton–Schulz) of the Dense at
    ``weights`` (``[a_dim, g_dim]``, bias row last) on batch ``step`` (16 rows of ``x``, MSE),
    its factors refreshed at even steps, as ``_wrapped_dense``'s model does."""
    rows = slice(16 * step, 16 * (step + 1))
    a_rows = homogeneous(x[rows].astype(np.float64), True)
    g_rows = 2.0 * (a_rows @ weights - y[rows]) / weights.shape[1]  # dℓ/dz, ℓ = mean_k (z - y)²
    if step % 2 == 0:
        ref.refresh(mean_outer(a_rows), mean_outer(g_rows), *weights.shape)
    return ref.step(a_rows.T @ g_rows / len(a_rows))


def _dense_weights(model):
    """The first layer's kernel with its bias as the last row."""
    return np.concatenate([model.layers[0].kernel.numpy(), model.layers[0].bias.numpy()[None]],
                          axis=0)


@pytest.mark.parametrize("steps", [3, 2])
@pytest.mark.parametrize("d_in,units", [(6, 5), (24, 20)])
def test_fewer_newton_schulz_steps_match_float64_first_principles(steps, d_in, units):
    """``newton_schulz_steps=k``: the weights after every step within 2e-5 of the float64 rule
    with k iterations (Adam in the eigenbasis, k quintic steps, the graft), on a ``[7, 5]`` step
    (short side 5: the float64 ``eigh`` form) and a ``[25, 20]`` one (the float32 products); the
    reference with Muon's 5 iterations ends more than 20x the tolerance away."""
    x, y = _correlated_regression(d_in, units)
    rule = Eigenbasis(newton_schulz_steps=steps)
    model, wrapped, weights = _wrapped_dense(x, units, rule, 128)
    five = weights.copy()
    ref = NumpyEigenbasis(d_in + 1, units, rel_eps=rule.relative_epsilon)
    for step in range(5):
        update = _reference_update(ref, x, y, weights, step)
        wrapped.train_on_batch(x[16 * step:16 * (step + 1)], y[16 * step:16 * (step + 1)])
        got = _dense_weights(model)
        weights = weights - LR * _scaled(update, np_newton_schulz(update, steps=steps), "graft")
        five = five - LR * _scaled(update, np_newton_schulz(update), "graft")
        np.testing.assert_allclose(got, weights, atol=2e-5, rtol=0)
    assert np.abs(five - weights).max() > 20 * 2e-5


@pytest.mark.parametrize("steps,end", [(5, 2), (3, 5)])
@pytest.mark.parametrize("d_in,units", [(6, 5), (24, 20)])
def test_newton_schulz_steps_following_the_rate_match_float64_first_principles(steps, end, d_in,
                                                                               units):
    """``newton_schulz_steps_end=k`` under the rates 0.3, 1, 0.8, 0.4, 0.1 (× LR): the orthogonal
    factor ``w·O_K + (1 − w)·O_k`` with ``w = η_t/η_max`` (the largest rate so far; the first
    rate is its own), then grafted; fewer iterations late (5 → 2) or more (3 → 5), on a
    ``[7, 5]`` step (the float64 ``eigh`` form) and a ``[25, 20]`` one (the float32 products).
    Weights after every step within 2e-5 of the float64 rule; the rule at either count alone
    ends more than 10x the tolerance away (measured 18x to 500x): the test sees the blend."""
    x, y = _correlated_regression(d_in, units)
    rates = [r * LR for r in (0.3, 1.0, 0.8, 0.4, 0.1)]
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([0, 1, 2, 3], rates)
    rule = Eigenbasis(newton_schulz_steps=steps, newton_schulz_steps_end=end)
    model, wrapped, weights = _wrapped_dense(x, units, rule, 128, learning_rate=schedule)
    alone = {steps: weights.copy(), end: weights.copy()}
    ref = NumpyEigenbasis(d_in + 1, units, rel_eps=rule.relative_epsilon)
    for step, rate in enumerate(rates):
        update = _reference_update(ref, x, y, weights, step)
        w = rate / max(rates[:step + 1])
        blended = (w * np_newton_schulz(update, steps=steps)
                   + (1 - w) * np_newton_schulz(update, steps=end))
        wrapped.train_on_batch(x[16 * step:16 * (step + 1)], y[16 * step:16 * (step + 1)])
        got = _dense_weights(model)
        weights = weights - rate * _scaled(update, blended, "graft")
        for count in alone:
            alone[count] = alone[count] - rate * _scaled(
                update, np_newton_schulz(update, steps=count), "graft")
        np.testing.assert_allclose(got, weights, atol=2e-5, rtol=0)
    for count in alone:
        assert np.abs(alone[count] - weights).max() > 10 * 2e-5, count


def np_neuron_normalized(step, moment, axis, b2=0.95, eps=1e-8):
    """NorMuon on one ``[a, g]`` step in float64: ``(step', moment')`` with ``moment`` the running
    mean over ``axis`` of the step's squares at unit RMS."""
    unit = step * np.sqrt(step.size) / np.linalg.norm(step)
    moment = b2 * moment + (1 - b2) * (unit ** 2).mean(axis=axis)
    normalized = unit / (np.sqrt(np.expand_dims(moment, axis)) + eps)
    return normalized * np.linalg.norm(step) / np.linalg.norm(normalized), moment


@pytest.mark.parametrize("units,side,axis", [(5, "output", 0), (5, "long", 1), (9, "long", 0)])
def test_neuron_normalized_steps_match_float64_first_principles(units, side, axis):
    """``neuron_norm``: a Dense of 6 inputs (a_dim 7) and 5 outputs (a tall step: ``"output"``
    averages over its 7 rows per output unit, ``"long"`` over its 5 columns per input row) or 9
    (a wide one, where the longer side is the output's), split 3, refreshes at steps 0, 2, 4.
    Weights after every step within 2e-5 of the float64 rule (Adam in the eigenbasis, Newton–
    Schulz, the graft, the normalization), the moment within 1e-5 of its reference; the
    reference without the normalization ends more than 100x the tolerance away."""
    x, _ = _softmax_data(n=96)
    y = _linear_targets(x, k=units)
    rule = Eigenbasis(neuron_norm=side)
    model, wrapped, weights = _wrapped_dense(x, units, rule, 3)
    plain = weights.copy()
    ref = NumpyEigenbasis(7, units, rel_eps=rule.relative_epsilon)
    moment = np.zeros(weights.shape[1 - axis])
    for step in range(5):
        rows = slice(16 * step, 16 * (step + 1))
        a_rows = homogeneous(x[rows].astype(np.float64), True)
        g_rows = 2.0 * (a_rows @ weights - y[rows]) / units  # dℓ/dz, ℓ = mean_k (z - y)²
        grad = a_rows.T @ g_rows / len(a_rows)
        if step % 2 == 0:
            ref.refresh(mean_outer(a_rows), mean_outer(g_rows), 3, 3)
        update = ref.step(grad)
        grafted = _scaled(update, np_newton_schulz(update), "graft")
        normalized, moment = np_neuron_normalized(grafted, moment, axis)
        wrapped.train_on_batch(x[rows], y[rows])
        got = _dense_weights(model)
        plain = plain - LR * grafted
        weights = weights - LR * normalized
        np.testing.assert_allclose(got, weights, atol=2e-5, rtol=0)
    held = wrapped.thor.bases(wrapped.thor.blocks[0].name)["neuron_v"]
    assert held.shape == moment.shape
    np.testing.assert_allclose(held, moment, rtol=1e-5)
    # Measured 4.1e-3 to 7.6e-3; the float32 rule is within 7.1e-8 on either kernel path.
    assert np.abs(plain - weights).max() > 100 * 2e-5


def test_options_are_checked():
    for bad in (dict(step="muon"), dict(scale="spectral"), dict(rms=0.0), dict(rms=True),
                dict(neuron_norm="rows"), dict(neuron_norm=True), dict(newton_schulz_steps=0),
                dict(newton_schulz_steps_end=0), dict(newton_schulz_steps_end=2.5),
                dict(newton_schulz_steps_end=3, step="adam"),
                dict(newton_schulz_steps=2.5), dict(newton_schulz_steps=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Eigenbasis(**bad)
    with pytest.raises(ValueError, match=r"neuron_norm.*step='orthogonal'"):
        Eigenbasis(step="adam", neuron_norm="output")
    with pytest.raises(ValueError, match=r"newton_schulz_steps.*step='orthogonal'"):
        Eigenbasis(step="adam", newton_schulz_steps=3)
    rule = Eigenbasis(step="orthogonal", scale="rms", rms=0.3, neuron_norm="long",
                      newton_schulz_steps=3, newton_schulz_steps_end=2)
    assert Eigenbasis.from_config(rule.get_config()) == rule


def test_the_default_rule_is_the_orthogonalized_step():
    """``wrap(model)``: the eigenbasis rule with the orthogonalized step at the Adam step's norm,
    peak 3e-2; ``"eigenbasis_adam"`` is the previous default (Adam's step, 1e-2)."""
    default = thor_tf.rules.resolve(thor_tf.rules.DEFAULT_RULE)
    assert default == Eigenbasis(step="orthogonal", beta_1=0.9, scale="graft",
                                 relative_epsilon=0.1)
    assert default.default_learning_rate == pytest.approx(0.03)
    previous = thor_tf.rules.resolve("eigenbasis_adam")
    assert (previous.step, previous.beta_1, previous.relative_epsilon,
            previous.default_learning_rate) == ("adam", 0.9, 1e-4, 0.01)
    # A config saved when "eigenbasis" meant the Adam step (and refreshes by eigh, before
    # refresh="power_qr" was the default) loads as it was saved.
    saved = Eigenbasis(step="adam", refresh="eigh")
    assert thor_tf.rules.resolve(thor_tf.rules.from_saved("eigenbasis")) == saved
    assert thor_tf.rules.resolve(thor_tf.rules.from_saved("eigenbasis_adam")) == saved
    assert thor_tf.rules.resolve(thor_tf.rules.serialize(default)) == default


def test_rotated_input_features_leave_the_orthogonal_run_unchanged():
    """The orthogonal factor is equivariant (``orth(OΔ) = O·orth(Δ)``) and the graft keeps the
    norm: rotated inputs give the same 6 losses to 2e-4 (no tie-breaking ramp; measured 6e-5, the
    float32 iteration's round-off), AdamW's differ by more than 1e-3."""
    exact = Eigenbasis(tie_break=0.0)
    plain, rotated = _rotation_run(exact, False), _rotation_run(exact, True)
    np.testing.assert_allclose(rotated, plain, atol=2e-4)
    adam_plain, adam_rotated = _rotation_run("adamw", False), _rotation_run("adamw", True)
    assert np.abs(np.array(adam_plain) - np.array(adam_rotated)).max() > 1e-3


def test_loss_times_1000_gives_the_same_orthogonal_steps():
    """The loss ×1000: the same weights after 6 steps to 1e-5 of the step (Adam's division and
    the graft to its norm do not see the loss's units; Newton–Schulz starts from ‖Δ‖_F = 1)."""
    x, y = _regression()

    def run(scale):
        model = thor_tf.wrap(_plain_mlp(), learning_rate=LR, verbose=False, **EVERY_2)
        model.compile(loss=lambda t, p: scale * keras.losses.mean_squared_error(t, p))
        for s in range(6):
            model.train_on_batch(x[16 * s:16 * (s + 1)], y[16 * s:16 * (s + 1)])
        return [v.numpy() for v in model.trainable_variables]

    start = [v.numpy() for v in _plain_mlp().trainable_variables]
    one, many = run(1.0), run(1000.0)
    moved = max(np.abs(a - s).max() for a, s in zip(one, start))
    assert moved > 10 * LR * 1e-2
    assert max(np.abs(a - b).max() for a, b in zip(one, many)) < 1e-5 * moved / LR


def test_adam_kinds_keep_the_adam_step():
    """``adam_kinds=("dense",)`` on a Dense-only model: the same 6 steps as ``step="adam"`` (with
    the same ε_r) to float32 round-off; orthogonalized, the weights end elsewhere."""
    x, y = _regression()

    def run(rule):
        model = thor_tf.wrap(_plain_mlp(), learning_rate=LR, update_rule=rule, verbose=False,
                             **EVERY_2)
        model.compile(loss="mse")
        for s in range(6):
            model.train_on_batch(x[16 * s:16 * (s + 1)], y[16 * s:16 * (s + 1)])
        return [v.numpy() for v in model.trainable_variables]

    adam = run(Eigenbasis(step="adam", relative_epsilon=Eigenbasis().relative_epsilon))
    kept = run(Eigenbasis(adam_kinds=("dense",)))
    ortho = run(Eigenbasis())
    assert max(np.abs(a - b).max() for a, b in zip(adam, kept)) < 1e-6
    assert max(np.abs(a - b).max() for a, b in zip(adam, ortho)) > 1e-3
