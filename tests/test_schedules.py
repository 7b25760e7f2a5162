"""Tests for thor_tf.schedules against plain-Python float64 references."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from thor_tf.schedules import (
    MINDSPORE_RESNET50_PRESETS,
    ThorDampingDecay,
    ThorPolynomialDecay,
    mindspore_resnet50,
)


def ref_lr(step, lr0, end_epoch, decay, spe, decay_epochs=None):
    """MindSpore's get_thor_lr for one 0-based step (clamped past end_epoch)."""
    epoch = (step + 1) / spe
    lr = lr0 * max(0.0, 1.0 - epoch / end_epoch) ** decay
    if decay_epochs is not None:
        if epoch >= decay_epochs:
            lr *= 0.5
        if epoch >= decay_epochs + 1:
            lr *= 0.5
    return lr


def ref_damping(step, lam0, rate, spe):
    """MindSpore's get_thor_damping for one 0-based step."""
    return lam0 * rate ** (((step + 1) / spe) / 10.0)


SPE = 7  # small, odd steps_per_epoch so that epoch boundaries fall mid-range


def _steps(end_epoch, decay_epochs):
    s = set(range(0, 3 * SPE))  # first epochs, step by step
    for e in (decay_epochs, decay_epochs + 1, end_epoch):  # around boundaries
        s.update(range(max(0, e * SPE - 3), e * SPE + 3))
    s.update(range(0, (end_epoch + 5) * SPE, 5))  # sweep past end_epoch
    return np.array(sorted(s), dtype=np.int64)


@pytest.mark.parametrize("decay_epochs", [None, 6])
def test_poly_matches_reference(decay_epochs):
    lr0, end_epoch, decay = 0.05672, 10, 4.9687
    sched = ThorPolynomialDecay(lr0, end_epoch, decay, SPE, decay_epochs)
    steps = _steps(end_epoch, decay_epochs or 6)
    got = np.array([float(sched(tf.constant(s))) for s in steps])
    want = np.array([ref_lr(int(s), lr0, end_epoch, decay, SPE, decay_epochs) for s in steps])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)
    # sanity on the reference itself: zero from end_epoch on, positive before
    assert np.all(got[(steps + 1) / SPE >= end_epoch] == 0.0)
    assert np.all(got[(steps + 1) / SPE < end_epoch] > 0.0)


def test_poly_halvings_exact():
    # decay tiny so the polynomial factor is ~1 and the halvings are visible
    sched = ThorPolynomialDecay(1.0, 1000, 1e-9, 4, decay_epochs=3)
    # epoch = (step+1)/4: step 10 -> 2.75, 11 -> 3.0, 14 -> 3.75, 15 -> 4.0
    vals = [float(sched(s)) for s in (10, 11, 14, 15, 40)]
    np.testing.assert_allclose(vals, [1.0, 0.5, 0.5, 0.25, 0.25], rtol=1e-6)


def test_damping_matches_reference():
    lam0, rate = 0.02345, 0.5467
    sched = ThorDampingDecay(lam0, rate, SPE)
    steps = np.arange(0, 60 * SPE, 3, dtype=np.int64)
    got = np.array([float(sched(s)) for s in steps])
    want = np.array([ref_damping(int(s), lam0, rate, SPE) for s in steps])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # after exactly 10 epochs the damping has been multiplied by decay_rate once
    np.testing.assert_allclose(float(sched(10 * SPE - 1)), lam0 * rate, rtol=1e-6)


def test_large_int64_step():
    # ImageNet-scale step counts: float64 internally keeps the epoch exact
    sched = ThorPolynomialDecay(0.05803, 53, 4.04839, 5004, decay_epochs=39)
    step = 39 * 5004 - 1  # first step of epoch 39 -> first halving
    got = float(sched(tf.constant(step, tf.int64)))
    np.testing.assert_allclose(got, ref_lr(step, 0.05803, 53, 4.04839, 5004, 39), rtol=1e-6)
    assert float(sched(step - 1)) > 1.9 * got


def test_returns_float32_scalar():
    for sched in (ThorPolynomialDecay(0.1, 5, 2.0, 10), ThorDampingDecay(0.03, 0.5, 10)):
        out = sched(tf.constant(3, tf.int64))
        assert out.dtype == tf.float32 and out.shape == ()


def test_inside_tf_function_with_int64_variable():
    lr = ThorPolynomialDecay(0.05672, 10, 4.9687, SPE, decay_epochs=6)
    damp = ThorDampingDecay(0.02345, 0.5467, SPE)
    step = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def both():
        return lr(step), damp(step)

    for s in (0, 5, 41, 42, 48, 69, 70, 100):
        step.assign(s)
        a, b = both()
        np.testing.assert_allclose(float(a), ref_lr(s, 0.05672, 10, 4.9687, SPE, 6),
                                   rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(float(b), ref_damping(s, 0.02345, 0.5467, SPE), rtol=1e-6)


def test_works_as_keras_optimizer_learning_rate():
    sched = ThorPolynomialDecay(0.5, 3, 2.0, 2)
    opt = keras.optimizers.SGD(learning_rate=sched)
    np.testing.assert_allclose(float(opt.learning_rate), ref_lr(0, 0.5, 3, 2.0, 2), rtol=1e-6)


@pytest.mark.parametrize(
    "sched",
    [
        ThorPolynomialDecay(0.05672, 50, 4.9687, 5004, decay_epochs=39),
        ThorPolynomialDecay(0.1, 2.5, 1.0, 3),
        ThorDampingDecay(0.02345, 0.5467, 5004),
    ],
)
def test_config_roundtrip(sched):
    cfg = sched.get_config()
    clone = type(sched).from_config(cfg)
    assert clone.get_config() == cfg
    blob = keras.saving.serialize_keras_object(sched)
    assert "thor_tf" in str(blob)  # registered under package="thor_tf"
    back = keras.saving.deserialize_keras_object(blob)
    assert type(back) is type(sched) and back.get_config() == cfg
    for s in (0, 17, 4000, 200000):
        assert float(back(s)) == float(sched(s))


def test_config_roundtrip_without_custom_objects_scope():
    # A model saved with the optimizer must be able to find the class by name.
    opt = keras.optimizers.SGD(learning_rate=ThorPolynomialDecay(0.1, 5, 2.0, 10, 3))
    restored = keras.optimizers.SGD.from_config(opt.get_config())
    assert isinstance(restored.learning_rate, ThorPolynomialDecay) or isinstance(
        restored._learning_rate, ThorPolynomialDecay
    )


def test_presets():
    for preset, p in MINDSPORE_RESNET50_PRESETS.items():
        lr, damp = mindspore_resnet50(preset, 5004)
        assert isinstance(lr, ThorPolynomialDecay) and isinstance(damp, ThorDampingDecay)
        assert lr.initial_learning_rate == p["lr_init"] and lr.end_epoch == p["lr_end_epoch"]
        assert lr.decay == p["lr_decay"] and lr.decay_epochs == p["decay_epochs"]
        assert damp.initial_damping == p["damping_init"]
        assert damp.decay_rate == p["damping_decay"]
        assert lr.steps_per_epoch == damp.steps_per_epoch == 5004
    lr, damp = mindspore_resnet50("gpu", 5004)
    np.testing.assert_allclose(float(lr(0)), ref_lr(0, 0.05672, 50, 4.9687, 5004, 39), rtol=1e-6)
    np.testing.assert_allclose(float(damp(0)), ref_damping(0, 0.02345, 0.5467, 5004), rtol=1e-6)
    with pytest.raises(ValueError, match="preset.*'gpu'.*'ascend'"):
        mindspore_resnet50("tpu", 5004)


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(initial_learning_rate=0.0), "initial_learning_rate"),
        (dict(initial_learning_rate=float("nan")), "initial_learning_rate"),
        (dict(end_epoch=0), "end_epoch"),
        (dict(end_epoch=-1), "end_epoch"),
        (dict(decay=-2.0), "decay"),
        (dict(steps_per_epoch=0), "steps_per_epoch"),
        (dict(steps_per_epoch=2.5), "steps_per_epoch"),
        (dict(steps_per_epoch=None), "steps_per_epoch"),
        (dict(decay_epochs=-1), "decay_epochs"),
        (dict(initial_learning_rate="x"), "initial_learning_rate"),
    ],
)
def test_poly_validation(kwargs, arg):
    base = dict(initial_learning_rate=0.1, end_epoch=10, decay=2.0, steps_per_epoch=5)
    base.update(kwargs)
    with pytest.raises(ValueError, match=arg):
        ThorPolynomialDecay(**base)


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(initial_damping=0.0), "initial_damping"),
        (dict(decay_rate=0.0), "decay_rate"),
        (dict(decay_rate=-0.5), "decay_rate"),
        (dict(steps_per_epoch=-3), "steps_per_epoch"),
    ],
)
def test_damping_validation(kwargs, arg):
    base = dict(initial_damping=0.03, decay_rate=0.5, steps_per_epoch=5)
    base.update(kwargs)
    with pytest.raises(ValueError, match=arg):
        ThorDampingDecay(**base)


# --------------------------------------------------------------------------- WarmupCosine

def ref_warmup_cosine(step, total, peak, warmup_fraction=0.05, floor=0.0):
    """float64 reference: linear ramp (step + 1) / W, then half a cosine from peak to floor."""
    w = round(warmup_fraction * total)
    if step < w:
        return peak * (step + 1) / w
    progress = min(max((step - w) / max(total - w, 1), 0.0), 1.0)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize("total,peak,fraction,floor", [(100, 0.05, 0.05, 0.0),
                                                        (37, 0.3, 0.1, 0.03),
                                                        (1000, 1e-3, 0.0, 0.0)])
def test_warmup_cosine_matches_reference(total, peak, fraction, floor):
    from thor_tf.schedules import WarmupCosine

    sched = WarmupCosine(total, peak=peak, warmup_fraction=fraction, floor=floor)
    for step in sorted({0, 1, 2, 3, 4, 5, 6, total // 2, total - 1, total, total + 50}):
        np.testing.assert_allclose(float(sched(step)),
                                   ref_warmup_cosine(step, total, peak, fraction, floor),
                                   rtol=1e-6, atol=1e-9, err_msg=f"step {step}")
    assert float(sched(total)) == pytest.approx(floor, abs=1e-9)


def ref_warmup_stable_decay(step, total, peak, warmup_fraction, decay_fraction, floor=0.0):
    """float64 reference of the warmup, stable, decay shape written out piece by piece: the ramp
    (step + 1) / W over W = round(warmup_fraction T) steps, the peak until S = T - round(decay_
    fraction T) (never before W), then half a cosine from peak at S to floor at T and after."""
    w = round(warmup_fraction * total)
    s = max(w, total - round(decay_fraction * total))
    if step < w:
        return peak * (step + 1) / w
    if step < s:
        return peak
    if step >= total:
        return floor
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * (step - s) / (total - s)))


@pytest.mark.parametrize("total,peak,fraction,decay,floor", [(100, 0.05, 0.05, 0.2, 0.0),
                                                              (37, 0.3, 0.1, 0.5, 0.03),
                                                              (1000, 1e-3, 0.0, 0.25, 0.0)])
def test_warmup_stable_decay_matches_reference(total, peak, fraction, decay, floor):
    from thor_tf.schedules import WarmupCosine

    sched = WarmupCosine(total, peak=peak, warmup_fraction=fraction, floor=floor,
                         decay_fraction=decay)
    start = max(round(fraction * total), total - round(decay * total))
    assert sched.decay_start == start
    for step in sorted({0, 1, 2, 5, start - 1, start, start + 1, (start + total) // 2,
                        total - 1, total, total + 50}):
        np.testing.assert_allclose(
            float(sched(step)), ref_warmup_stable_decay(step, total, peak, fraction, decay, floor),
            rtol=1e-6, atol=1e-9, err_msg=f"step {step}")
    # Held at the peak through the stable phase; half the way from peak to floor half-way
    # through an even-length decay.
    assert float(sched(start - 1)) == pytest.approx(peak, rel=1e-6)
    if (total - start) % 2 == 0:
        assert float(sched((start + total) // 2)) == pytest.approx((peak + floor) / 2, rel=1e-6)


def test_warmup_stable_decay_spanning_the_run_is_the_cosine_and_scales_with_the_horizon():
    """A decay as long as the steps after warmup (or longer) is the plain warmup + cosine, bit
    for bit; reference_steps scales the whole shape by sqrt(R/T), as it does the cosine's."""
    from thor_tf.schedules import WarmupCosine

    plain = WarmupCosine(200, peak=0.02)
    for decay in (0.95, 1.0):
        same = WarmupCosine(200, peak=0.02, decay_fraction=decay)
        assert same.decay_start == plain.decay_start == 10
        for step in (0, 9, 10, 11, 100, 199, 200):
            assert float(same(step)) == float(plain(step))
    scaled = WarmupCosine(400, peak=0.02, decay_fraction=0.3, reference_steps=100)
    for step in (5, 100, 279, 280, 350, 399):
        np.testing.assert_allclose(float(scaled(step)),
                                   0.5 * ref_warmup_stable_decay(step, 400, 0.02, 0.05, 0.3),
                                   rtol=1e-6, atol=1e-9)
    back = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(scaled))
    assert back.get_config() == scaled.get_config() and back.decay_fraction == 0.3
    assert WarmupCosine(400, decay_fraction=0.3).with_peak(0.1, 100).decay_fraction == 0.3


def test_warmup_cosine_decay_is_keras_cosine_decay_after_warmup():
    """After the warmup the shape is Keras' own CosineDecay with the same warmup (an independent
    implementation of the standard recipe the first-order baselines use)."""
    from thor_tf.schedules import WarmupCosine

    total, peak = 200, 0.02
    ours = WarmupCosine(total, peak=peak)
    keras_sched = keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=total - 10, alpha=0.0, warmup_target=peak, warmup_steps=10)
    for step in (10, 11, 57, 150, 199):
        np.testing.assert_allclose(float(ours(step)), float(keras_sched(step)), rtol=1e-5,
                                   atol=1e-9)


def test_warmup_cosine_in_a_traced_optimizer_step_and_config_roundtrip():
    from thor_tf.schedules import WarmupCosine

    sched = WarmupCosine(40, peak=0.1)
    step = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def value():
        return sched(step)

    for s in (0, 1, 2, 30, 40):
        step.assign(s)
        np.testing.assert_allclose(float(value()), ref_warmup_cosine(s, 40, 0.1), rtol=1e-6,
                                   atol=1e-9)
    back = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(sched))
    assert type(back) is WarmupCosine and back.get_config() == sched.get_config()


@pytest.mark.parametrize("kwargs,match", [(dict(total_steps=0), "total_steps"),
                                          (dict(total_steps=2.5), "total_steps"),
                                          (dict(total_steps=10, peak=-1.0), "peak"),
                                          (dict(total_steps=10, warmup_fraction=1.0),
                                           "warmup_fraction"),
                                          (dict(total_steps=10, peak=0.1, floor=0.2), "floor"),
                                          (dict(total_steps=10, decay_fraction=0.0),
                                           "decay_fraction"),
                                          (dict(total_steps=10, decay_fraction=1.5),
                                           "decay_fraction"),
                                          (dict(total_steps=10, decay_fraction="half"),
                                           "decay_fraction")])
def test_warmup_cosine_bad_arguments_name_the_argument(kwargs, match):
    from thor_tf.schedules import WarmupCosine

    with pytest.raises(ValueError, match=match):
        WarmupCosine(**kwargs)
