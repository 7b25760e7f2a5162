"""The seed's split calibration for the inverse rule (thor_tf/split/: crossing, information,
timing, inverse_calibration) and scripts/calibrate_split_dim.py (hardware-aware splitting)."""

import json
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import thor_tf
from thor_tf.split import crossing, information, inverse_calibration, timing
from thor_tf.rules.inverse_ops import split_inverse

# THOR's inverse rule (K-FAC step, KL clip, damping, momentum) is what these tests check.
pytestmark = pytest.mark.update_rule("inverse")


def _spd(n, seed, rank=None):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, rank or 2 * n))
    return x @ x.T / x.shape[1]


def _block_diagonal_part(a, size):
    """Â: A with everything outside the diagonal blocks of ``size`` set to 0 (last block partial)."""
    n = a.shape[0]
    ids = np.arange(n) // size
    return np.where(ids[:, None] == ids[None, :], a, 0.0)


def _reference_loss(a, size):
    """1 − sqrt(λmax(ÂÂᵀ)/λmax(AAᵀ)) from explicit float64 eigenvalues."""
    hat = _block_diagonal_part(a, size)
    return 1.0 - math.sqrt(np.linalg.eigvalsh(hat @ hat.T).max() / np.linalg.eigvalsh(a @ a.T).max())


# ---------------------------------------------------------------------------------- candidates

def test_candidates():
    assert crossing.candidates(577) == [1, 16, 32, 64, 128, 256, 512, 577]
    assert crossing.candidates(512) == [1, 16, 32, 64, 128, 256, 512]
    assert crossing.candidates(10) == [1, 10]
    assert crossing.candidates(16) == [1, 16]
    assert crossing.candidates(1) == [1]
    assert crossing.candidates(100, base=(1, 8)) == [1, 8, 16, 32, 64, 100]
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError):
            crossing.candidates(bad)


# ---------------------------------------------------------------------------- information loss

@pytest.mark.parametrize("n,seed,rank", [(40, 0, None), (50, 1, 7), (37, 2, None), (64, 3, 200)])
def test_information_loss_matches_eigenvalue_reference(n, seed, rank):
    a = _spd(n, seed, rank)
    for size in (1, 3, 8, 16, 25, n - 1, n, n + 5):
        expected = 0.0 if size >= n else _reference_loss(a, size)
        got = information.information_loss(a.astype(np.float32) if seed == 3 else a, size)
        assert got == pytest.approx(expected, abs=1e-6 if seed == 3 else 1e-10), (n, size)
        assert 0.0 <= got <= 1.0


def test_information_loss_non_symmetric_uses_singular_values():
    a = np.random.default_rng(4).standard_normal((30, 30))
    for size in (4, 7, 16):
        assert information.information_loss(a, size) == pytest.approx(_reference_loss(a, size), abs=1e-10)


def test_information_loss_zero_for_block_diagonal_at_size_and_multiples():
    rng = np.random.default_rng(5)
    n, b = 50, 10  # 5 blocks of 10, so 50 is not a multiple of 20 or 40: last block partial
    a = np.zeros((n, n))
    for k in range(n // b):
        a[k * b:(k + 1) * b, k * b:(k + 1) * b] = _spd(b, seed=10 + k)
    for size in (10, 20, 30, 40, 50, 64):
        assert information.information_loss(a, size) == pytest.approx(0.0, abs=1e-12), size
    # Smaller sizes cut every 10-block and lose information. (A size such as 15 that keeps one
    # whole 10-block can still give L = 0: only the largest block norm counts.)
    for size in (1, 5, 7):
        assert information.information_loss(a, size) > 1e-3, size
    assert information.information_loss(np.zeros((6, 6)), 2) == 0.0
    assert information.information_loss(np.eye(9), 1) == pytest.approx(0.0, abs=1e-15)


def test_loss_fractions():
    diag = np.diag(np.arange(1.0, 33.0))          # L = 0 at every size
    blocks = np.kron(np.eye(4), np.ones((8, 8)))   # block-diagonal at 8 (and 16, 32)
    dense = np.ones((32, 32))                      # L = 1 − size/32 for size < 32
    small = _spd(5, 6)                             # any size >= 5 keeps it exactly
    cands = [1, 8, 16, 32]
    fractions, losses = information.loss_fractions([diag, blocks, dense, small], cands,
                                                   return_losses=True)
    assert losses.shape == (4, 4)
    np.testing.assert_allclose(losses[2], [1 - 1 / 32, 1 - 8 / 32, 1 - 16 / 32, 0.0], atol=1e-12)
    np.testing.assert_allclose(losses[3, 1:], 0.0)
    assert fractions == pytest.approx([1 / 4, 3 / 4, 3 / 4, 1.0])
    # A looser threshold counts more matrices as kept.
    assert information.loss_fractions([dense], [16, 32], threshold=0.6) == [1.0, 1.0]
    with pytest.raises(ValueError):
        information.loss_fractions([np.ones((3, 4))], cands)
    with pytest.raises(ValueError):
        information.loss_fractions([diag], [16, 8])


# ---------------------------------------------------------------------------------- crossing

CANDS = [1, 16, 32, 64, 128, 256]


def test_crossing_exactly_at_a_candidate():
    info = [0.0, 0.2, 0.4, 0.6, 0.9, 1.0]
    speed = [1.0, 0.9, 0.8, 0.6, 0.5, 0.3]
    result = crossing.find_crossing(CANDS, info, speed)
    assert result.crossing == 64.0 and result.split_dim == 64


def test_crossing_between_candidates_is_interpolated_on_log2_axis():
    info = [0.0, 0.2, 0.4, 0.5, 0.9, 1.0]
    speed = [1.0, 0.9, 0.8, 0.7, 0.5, 0.3]
    # D(64) = −0.2, D(128) = +0.4: t = 1/3 of the way from log2 64 = 6 to log2 128 = 7.
    result = crossing.find_crossing(CANDS, info, speed)
    assert result.crossing == pytest.approx(2 ** (6 + 1 / 3))
    assert result.split_dim == 64
    # MindSpore's ResNet-50 case: a crossing at 106 rounds to 128.
    t = math.log2(106) - 6
    info = [0.0, 0.1, 0.2, 0.5 - 0.1 * t, 0.5 + 0.1 * (1 - t), 1.0]
    speed = [1.0, 0.9, 0.8, 0.5, 0.5, 0.2]
    result = crossing.find_crossing(CANDS, info, speed)
    assert result.crossing == pytest.approx(106.0)
    assert result.split_dim == 128
    assert "106" in result.reason


def test_crossing_fallbacks():
    # Information below speed everywhere: the largest candidate (the exact inverse).
    result = crossing.find_crossing(CANDS, [0.0] * 6, [1.0, 0.9, 0.8, 0.7, 0.6, 0.5])
    assert result.crossing is None and result.split_dim == 256
    # Information above speed from the start: the smallest candidate.
    result = crossing.find_crossing(CANDS, [1.0] * 6, [0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    assert result.crossing is None and result.split_dim == 1
    # Equal at the smallest candidate (every factor kept at split 1, speed is 1 there).
    result = crossing.find_crossing(CANDS, [1.0] * 6, [1.0, 0.8, 0.7, 0.6, 0.5, 0.4])
    assert result.crossing == 1.0 and result.split_dim == 1
    with pytest.raises(ValueError):
        crossing.find_crossing(CANDS, [0.0] * 5, [1.0] * 6)


def test_normalize_speed():
    assert crossing.normalize_speed([0.5, 1.0, 2.0]) == [1.0, 0.5, 0.25]
    with pytest.raises(ValueError):
        crossing.normalize_speed([1.0, 0.0])


# --------------------------------------------------------------------------- split inversion

@pytest.mark.parametrize("n,split", [(48, 16), (50, 16), (37, 10), (20, 32), (9, 1)])
def test_split_inverse_equals_inverse_of_block_diagonal_part(n, split):
    factor = _spd(n, seed=n, rank=max(2, n // 3))  # rank deficient: damping makes it invertible
    damping = 0.1
    got = split_inverse(tf.constant(factor, tf.float32), tf.constant(damping), split).numpy()
    damped = factor + damping * np.eye(n)
    size = min(split, n)
    assert got.shape == (-(-n // size), size, size)
    for k in range(got.shape[0]):
        lo, hi = k * size, min((k + 1) * size, n)
        expected = np.linalg.inv(damped[lo:hi, lo:hi])
        np.testing.assert_allclose(got[k, :hi - lo, :hi - lo], expected, rtol=2e-3, atol=2e-3)
        # Identity padding of a partial last block stays identity and decoupled.
        np.testing.assert_allclose(got[k, hi - lo:, hi - lo:], np.eye(size - (hi - lo)), atol=1e-6)
        np.testing.assert_allclose(got[k, :hi - lo, hi - lo:], 0.0, atol=1e-6)


def test_time_split_inversion_and_calibrate_on_factor_list():
    mats = [_spd(40, 0), _spd(33, 1, rank=5), np.eye(7)]
    seconds = timing.time_split_inversion(mats, [1, 16, 40], damping=0.1, repeats=1, warmup=0)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    result = inverse_calibration.calibrate({"a": {"A": mats[0], "G": mats[1]}, "b": mats[2]},
                                   repeats=1, warmup=0)
    for key in ("candidates", "loss_fraction", "inversion_seconds", "speed_normalized", "crossing",
                "split_dim", "reason", "device", "tensorflow_version", "num_factors",
                "factor_dims"):
        assert key in result
    assert result["candidates"] == [1, 16, 32, 40]
    assert result["num_factors"] == 3 and result["factor_dims"] == [7, 33, 40]
    assert result["loss_fraction"][-1] == 1.0 and result["speed_normalized"][0] == 1.0
    assert result["split_dim"] in result["candidates"]
    assert set(result["factors"]) == {"a/A", "a/G", "b"}
    json.dumps(result)  # JSON ready
    with pytest.raises(ValueError):
        timing.time_split_inversion(mats, [1, 16], damping=0.0)


# --------------------------------------------------------------------- wrap(split_dim=json)

def _tiny_model():
    inputs = keras.Input((6,))
    x = keras.layers.Dense(5, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(x))


def test_wrap_reads_split_dim_from_calibration_json(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"split_dim": 32, "candidates": [1, 16, 32]}))
    model = thor_tf.wrap(_tiny_model(), split_dim=str(path), verbose=False)
    assert model.thor.options.split_dim == 32
    model.compile(loss="sparse_categorical_crossentropy")
    assert model.optimizer.split_dim == 32
    model = thor_tf.wrap(_tiny_model(), split_dim=path, verbose=False)  # os.PathLike too
    assert model.thor.options.split_dim == 32

    for bad in (tmp_path / "missing.json", tmp_path / "nokey.json", tmp_path / "garbage.json"):
        if bad.name == "nokey.json":
            bad.write_text(json.dumps({"crossing": 100.0}))
        elif bad.name == "garbage.json":
            bad.write_text("{not json")
        with pytest.raises(ValueError):
            thor_tf.wrap(_tiny_model(), split_dim=str(bad), verbose=False)


# --------------------------------------------------------------------------- the script, e2e

def _calibrate(capsys, monkeypatch, tmp_path, *argv):
    """``scripts/calibrate_split_dim.py argv`` through its ``main`` in this process (a subprocess
    costs TensorFlow's import, ~6 s of CI's CPU a run); its stdout."""
    from scripts import calibrate_split_dim

    monkeypatch.chdir(tmp_path)
    calibrate_split_dim.main(list(argv))
    return capsys.readouterr().out


def test_calibration_script_quick_end_to_end(tmp_path, capsys, monkeypatch):
    """The inverse rule's calibration (the seed's): one split for the model."""
    out = tmp_path / "cal.json"
    stdout = _calibrate(capsys, monkeypatch, tmp_path, "--rule", "inverse", "--model", "cnn",
                        "--data", "digits", "--steps", "3", "--quick", "--out", str(out))
    result = json.loads(out.read_text())
    for key in ("candidates", "loss_fraction", "inversion_seconds", "speed_normalized", "crossing",
                "split_dim", "reason", "device", "tensorflow_version", "num_factors",
                "factor_dims"):
        assert key in result, key
    n = len(result["candidates"])
    assert len(result["loss_fraction"]) == len(result["inversion_seconds"]) == n
    assert result["candidates"][-1] == max(result["factor_dims"])
    assert result["num_factors"] == 8  # cnn: 4 registered layers, A and G each
    assert result["split_dim"] in result["candidates"]
    assert result["loss_fraction"][-1] == 1.0
    png = out.with_suffix(".png")
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "split_dim =" in stdout
    # The file it wrote is what wrap accepts.
    model = thor_tf.wrap(_tiny_model(), split_dim=str(out), verbose=False)
    assert model.thor.options.split_dim == result["split_dim"]


@pytest.mark.update_rule("eigenbasis")
def test_calibration_script_for_the_eigenbasis_rule_end_to_end(tmp_path, capsys, monkeypatch):
    """The default rule's calibration: a split per factor dimension of the zoo CNN on digits,
    JSON that wrap reads as that plan, one plot panel per dimension; --replot redraws it."""
    out = tmp_path / "cal.json"
    stdout = _calibrate(capsys, monkeypatch, tmp_path, "--model", "cnn", "--data", "digits",
                        "--steps", "3", "--quick", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["rule"] == "eigenbasis"
    plan = thor_tf.SplitPlan.from_config(result["split_plan"])
    assert {str(d) for d, _ in plan.by_dim} == set(result["dims"])
    for dim, entry in result["dims"].items():
        n = len(entry["candidates"])
        assert len(entry["information"]) == len(entry["speed"]) == len(entry["cost_seconds"]) == n
        assert entry["split"] in entry["candidates"] and entry["candidates"][0] == 1
        assert max(entry["speed"]) == pytest.approx(1.0)
    assert "split calibrated for the eigenbasis rule" in stdout
    png = out.with_suffix(".png")
    assert png.stat().st_size > 1000
    model = thor_tf.wrap(_tiny_model(), split_dim=str(out), verbose=False)
    assert model.thor.options.split_dim == plan
    png.unlink()
    _calibrate(capsys, monkeypatch, tmp_path, "--replot", str(out))
    assert png.stat().st_size > 1000


def test_calibrate_on_trained_model_needs_exact_factors():
    rng = np.random.default_rng(0)
    x, y = rng.random((64, 6), dtype=np.float32), rng.integers(0, 3, 64)
    exact = thor_tf.wrap(_tiny_model(), split_dim=1 << 30, verbose=False, frequency=1)
    exact.compile(loss="sparse_categorical_crossentropy")
    exact.fit(x, y, batch_size=32, epochs=1, verbose=0)
    result = inverse_calibration.calibrate(exact, repeats=1, warmup=0)
    assert result["num_factors"] == 4 and result["factor_dims"] == [3, 5, 6, 7]
    first = exact.thor.layer_stats()[0]["name"]
    collected = inverse_calibration.collect_factors(exact)[f"{first}/A"]
    assert collected.shape == (7, 7)
    np.testing.assert_allclose(collected, exact.thor.factors(first)["A"])
    assert np.count_nonzero(collected[:3, 3:])  # a full factor, not only diagonal blocks
    split = thor_tf.wrap(_tiny_model(), split_dim=2, verbose=False, frequency=1)
    split.compile(loss="sparse_categorical_crossentropy")
    split.fit(x, y, batch_size=32, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="split_dim"):
        inverse_calibration.calibrate(split, repeats=1, warmup=0)
