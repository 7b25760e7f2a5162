"""The split calibrated for the rule that runs (thor_tf/split/calibrate.py, plan.py,
information.py, the rules' split costs, split_dim="auto").

* ``SplitPlan`` and ``split_dim``'s forms, with errors naming the argument; a plan sets each
  factor dimension's split in the state, the registration table and the saved config.
* The eigenbasis rule's information measure against explicit float64 products: the split basis
  as a dense block-diagonal matrix, ``Qᵀ F' Q`` formed whole; exactly block-diagonal factors keep
  everything at their block size and lose at a size that cuts a coupled pair of blocks.
* The calibration picks the crossing a hand computation gives for a rule with a known cost.
* Each rule's timed work is its real work: the rotations and refresh of the eigenbasis rule, the
  product and Cholesky inverse of the inverse rule, against NumPy.
* ``split_dim="auto"``: ``fit`` gives the same weights as ``split_dim=<the plan it chose>``,
  leaves no trace of its probe (BatchNorm statistics), saves the plan; the data forms it can
  sample; a custom loop without it falls back to 128 with a warning.
"""

import json
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import thor_tf
from thor_tf.split import calibrate as sc
from thor_tf.split.information import held_out_kept, kept_curve
from thor_tf.model import _probe_batches
from thor_tf.rules import Eigenbasis, Inverse
from thor_tf.rules.inverse import InverseSplitCost
from thor_tf.rules.base import SideWork, SplitCost
from thor_tf.split.plan import AUTO, SplitPlan, resolve_split_dim, split_size


def _psd(n, seed, rank=None):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rank or 2 * n, n))
    return x.T @ x / len(x)


def _block_diag(blocks):
    n = sum(b.shape[0] for b in blocks)
    out, k = np.zeros((n, n)), 0
    for b in blocks:
        out[k:k + b.shape[0], k:k + b.shape[0]] = b
        k += b.shape[0]
    return out


# -- split_dim's forms ----------------------------------------------------------------------------

def test_split_dim_forms_resolve(tmp_path):
    plan = SplitPlan(64, ((785, 32), (10, 1)))
    assert plan.by_dim == ((10, 1), (785, 32)) and plan.size(785) == 32 and plan.size(9) == 64
    assert resolve_split_dim(128) == 128 and resolve_split_dim("auto") == AUTO
    assert resolve_split_dim(plan) is plan
    assert resolve_split_dim(plan.get_config()) == plan
    assert resolve_split_dim({"default": 64, "by_dim": {"785": 32, "10": 1}}) == plan
    assert split_size(plan, 10) == 1 and split_size(16, 10) == 16
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"split_dim": 128, "split_plan": plan.get_config()}))
    assert resolve_split_dim(str(path)) == plan
    path.write_text(json.dumps({"split_dim": 32}))
    assert resolve_split_dim(path) == 32
    assert str(plan) == "64 (10: none, 785: 32)"
    wide = SplitPlan(128, ((300, 32),), diagonal_above=256)
    assert [wide.size(d) for d in (64, 256, 257, 300, 3137)] == [128, 128, 1, 32, 1]
    assert wide.get_config() == {"default": 128, "by_dim": {"300": 32}, "diagonal_above": 256}
    assert resolve_split_dim(wide.get_config()) == wide
    assert str(wide) == "128 (300: 32, wider than 256: none)"


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "fast", {"default": 0}, {"by_dim": {}},
                                 {"default": 8, "splits": {}}, {"default": 8, "by_dim": {"4": 0}},
                                 {"default": 8, "diagonal_above": 0}])
def test_bad_split_dim_names_the_argument_and_its_forms(bad):
    with pytest.raises(ValueError, match=r"`split_dim` must be an int >= 1, 'auto', a "
                                         r"thor_tf.SplitPlan"):
        resolve_split_dim(bad)
    with pytest.raises(ValueError, match="split_dim"):
        thor_tf.wrap(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]),
                     split_dim=bad, verbose=False)


def test_a_plan_splits_each_factor_dimension_its_own_way():
    """A: 21 and 31 wide, G: 30 and 5. The plan: 21 unsplit-but-unrotated (1), 30 at 16, the
    rest at 8 (31 → 4 blocks of 8, 5 → one block)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(30, activation="tanh"),
                              keras.layers.Dense(5)])
    plan = SplitPlan(8, ((21, 1), (30, 16)))
    wrapped = thor_tf.wrap(model, split_dim=plan, verbose=False)
    wrapped.compile(loss="mse")
    state = wrapped.thor.state.layers
    assert tuple(state[0].Q_A.shape) == (21, 1, 1) and tuple(state[0].Q_G.shape) == (2, 16, 16)
    assert tuple(state[1].Q_A.shape) == (4, 8, 8) and tuple(state[1].Q_G.shape) == (1, 5, 5)
    table = wrapped.thor.registration_table(plan)
    assert "1x21" in table and "16x2" in table and "8x4" in table
    saved = wrapped.get_config()["thor_options"]["split_dim"]
    assert saved == {"default": 8, "by_dim": {"21": 1, "30": 16}}
    x = np.random.default_rng(0).normal(size=(64, 20)).astype("float32")
    wrapped.fit(x, x[:, :5], batch_size=16, epochs=1, verbose=0)
    assert np.all(np.isfinite(wrapped.predict(x, verbose=0)))


# -- the eigenbasis rule's information measure ----------------------------------------------------

@pytest.mark.parametrize("split", [1, 3, 4, 7, 10])
def test_held_out_kept_equals_the_explicit_rotation(split):
    """kept(b) = ‖diag(Qᵀ F' Q)‖² / ‖F'‖²_F with Q the dense block-diagonal matrix of F's block
    eigenvectors, formed whole in float64 (the module computes it per block)."""
    f1, f2 = _psd(10, 0), _psd(10, 1)
    blocks = [np.linalg.eigh(f1[s:s + split, s:s + split])[1] for s in range(0, 10, split)]
    q = _block_diag(blocks)
    rotated = q.T @ f2 @ q
    expected = np.sum(np.diag(rotated) ** 2) / np.sum(f2 ** 2)
    assert held_out_kept(f1, f2, split) == pytest.approx(expected, rel=1e-12)
    assert kept_curve([(f1, f2)], [split]) == [pytest.approx(expected, rel=1e-12)]


def test_block_diagonal_factors_keep_everything_at_their_block_size():
    """F block-diagonal at 4 (three 4-blocks): its own basis at 4, 8 or 12 keeps all of it; at 2
    (cutting every block) it does not. Coupling blocks 0 and 1: kept at 4 falls below 1, at 8
    (which holds the coupled pair in one block) it stays 1. A measure that kept only the diagonal
    blocks' own mass (``Σ‖F_kk‖² / ‖F‖²``, the rotation ignored) would say 1 at 2 for a
    diagonal-heavy block: the test asserts it does not."""
    blocks = [_psd(4, s) for s in range(3)]
    f = _block_diag(blocks)
    for split in (4, 8, 12):
        assert held_out_kept(f, f, split) == pytest.approx(1.0, abs=1e-12)
    assert held_out_kept(f, f, 2) < 0.99
    coupled = f.copy()
    coupled[:4, 4:8] = coupled[4:8, :4] = 0.3 * np.ones((4, 4))
    coupled += 2.0 * np.eye(12)  # still PSD
    assert held_out_kept(coupled, coupled, 4) < 0.99
    assert held_out_kept(coupled, coupled, 8) == pytest.approx(1.0, abs=1e-12)
    # A held-out factor with other eigenvectors loses even at the full size.
    assert held_out_kept(_psd(12, 5), _psd(12, 6), 12) < 0.99


def test_held_out_kept_checks_its_arguments():
    with pytest.raises(ValueError, match="block_size"):
        held_out_kept(np.eye(3), np.eye(3), 0)
    with pytest.raises(ValueError, match="one shape"):
        held_out_kept(np.eye(3), np.eye(4), 2)
    with pytest.raises(ValueError, match="finite"):
        held_out_kept(np.full((2, 2), np.nan), np.eye(2), 1)
    assert held_out_kept(np.eye(3), np.zeros((3, 3)), 2) == 1.0


# -- the crossing, with a known cost ----------------------------------------------------------------

class KnownCostRule(SplitCost):
    """A rule whose information curve is given; its works are tagged with their candidate (the
    rule is its own cost model)."""

    name = "known"

    def __init__(self, info):
        self.info = info

    def split_cost(self):
        return self

    def side_work(self, factor, previous, split, other_dim, side):
        tag = (lambda: tf.constant(float(split)), ())
        return SideWork(step=tag, refresh=tag)

    def information_curve(self, pairs, cands):
        return [self.info[c] for c in cands]


def test_calibration_takes_the_hand_computed_crossing():
    """One side of dimension 64: candidates 1, 16, 32, 64 with step seconds 0, 1, 2, 4 ms and
    refresh seconds 0, 10, 20, 40 ms at 0.1 refreshes per step, T = 10 ms, and a call overhead
    of 0.5 ms on every timing (taken off). Cost 0, 2, 4, 8 ms → speed 10/(10 + c) = 1, 0.833,
    0.714, 0.556; information 0.2, 0.5, 0.9, 1.0 → D = −0.8, −0.333, +0.186: the curves cross
    between 16 and 32 at t = 0.333/0.519 on the log2 axis, x = 2^(4 + t) ≈ 24.97 → 32."""
    step = {1: 0.0, 16: 1e-3, 32: 2e-3, 64: 4e-3}
    overhead = 5e-4

    def timer(works, repeats, warmup):
        assert len(works) == 2 * 4 + 1  # (step, refresh) per candidate, then the empty call
        out = []
        for n, (fn, args) in enumerate(works[:-1]):
            split = int(fn(*args)[0].numpy())
            out.append(overhead + (step[split] if n % 2 == 0 else 10 * step[split]))
        return out + [overhead]

    side = sc.Side("dense", "A", 64, 10, np.eye(64), np.eye(64))
    report = sc.calibrate_rule([side], KnownCostRule({1: 0.2, 16: 0.5, 32: 0.9, 64: 1.0}),
                               base_seconds=0.01, refresh_rate=0.1, timer=timer)
    dim = report["dims"][64]
    assert dim["candidates"] == [1, 16, 32, 64]
    np.testing.assert_allclose(dim["cost_seconds"], [0.0, 2e-3, 4e-3, 8e-3], atol=1e-12)
    np.testing.assert_allclose(dim["speed"], [1.0, 10 / 12, 10 / 14, 10 / 18], rtol=1e-12)
    d_lo, d_hi = 0.5 - 10 / 12, 0.9 - 10 / 14
    t = -d_lo / (d_hi - d_lo)
    assert dim["crossing"] == pytest.approx(2 ** (4 + t), rel=1e-9)
    assert dim["split"] == 32 and report["plan"] == SplitPlan(128, ((64, 32),))
    assert report["layers"] == {"dense/A": {"dim": 64, "other_dim": 10, "split": 32}}


@pytest.mark.parametrize("fallback,expected", [("largest", 64), ("cheapest", 1), ("default", 32)])
def test_without_a_crossing_each_rule_takes_its_fallback(fallback, expected):
    """Information below speed at every candidate: the inverse rule (the seed) takes the largest
    split, "cheapest" the least work (here: not rotated), the eigenbasis rule's "default" the
    largest candidate up to the default split (32 here)."""
    def timer(works, repeats, warmup):
        costs = {1: 0.0, 16: 1e-3, 32: 2e-3, 64: 4e-3}
        return [costs[int(fn(*args)[0].numpy())] for fn, args in works[:-1]] + [0.0]

    rule = KnownCostRule({1: 0.0, 16: 0.05, 32: 0.1, 64: 0.2})
    rule.fallback = fallback
    side = sc.Side("dense", "G", 64, 10, np.eye(64), np.eye(64))
    report = sc.calibrate_rule([side], rule, base_seconds=0.01, refresh_rate=0.0, timer=timer,
                               default=32)
    assert report["dims"][64]["crossing"] is None
    assert report["plan"].size(64) == expected
    assert Eigenbasis().split_cost().fallback == "default"
    assert Inverse().split_cost().fallback == "largest"


def test_eigenbasis_information_is_relative_to_the_unsplit_basis():
    """With the unsplit factor among the candidates the curve ends at exactly 1 (its own
    held-out value is the reference); for a factor wider than every candidate the reference is
    1 (the unsplit basis on its own batch) and the curve is the measure itself."""
    f1, f2 = _psd(12, 7), _psd(12, 8)
    curve = Eigenbasis().split_cost().information_curve([(f1, f2)], [1, 4, 12])
    raw = kept_curve([(f1, f2)], [1, 4, 12])
    assert curve[-1] == 1.0
    np.testing.assert_allclose(curve, [r / raw[-1] for r in raw], rtol=1e-12)
    wide = Eigenbasis().split_cost().information_curve([(f1, f2)], [1, 4, 8])
    np.testing.assert_allclose(wide, kept_curve([(f1, f2)], [1, 4, 8]), rtol=1e-12)


def test_work_within_the_timing_resolution_counts_as_equally_fast():
    """Costs 0, 0.02, 0.04 ms against a 10 ms step (below 0.5 % of it): every speed is 1, so a
    rising information curve keeps the unsplit side whatever the noise ordered."""
    costs = {1: 0.0, 16: 4e-5, 24: 2e-5}

    def timer(works, repeats, warmup):
        return [costs[int(fn(*args)[0].numpy())] for fn, args in works[:-1]] + [0.0]

    side = sc.Side("dense", "A", 24, 10, np.eye(24), np.eye(24))
    report = sc.calibrate_rule([side], KnownCostRule({1: 0.3, 16: 0.8, 24: 1.0}), 0.01, 0.0,
                               timer=timer)
    assert report["dims"][24]["speed"] == [1.0, 1.0, 1.0]
    assert report["plan"].size(24) == 24


def test_candidates_and_argument_errors():
    assert sc.candidates_for(300) == [1, 16, 32, 64, 128, 256]
    assert sc.candidates_for(200) == [1, 16, 32, 64, 128, 200]
    assert sc.candidates_for(10) == [1, 10]
    assert sc.candidates_for(3137, max_split=512)[-1] == 512
    with pytest.raises(ValueError, match="dim"):
        sc.candidates_for(1)
    side = sc.Side("d", "A", 8, 2, np.eye(8), np.eye(8))
    with pytest.raises(ValueError, match="base_seconds"):
        sc.calibrate_rule([side], Eigenbasis(), 0.0, 0.1)
    with pytest.raises(ValueError, match="refresh_rate"):
        sc.calibrate_rule([side], Eigenbasis(), 1.0, 2.0)
    with pytest.raises(ValueError, match="no factor sides"):
        sc.calibrate_rule([], Eigenbasis(), 1.0, 0.1)


# -- the timed work is the rule's work ------------------------------------------------------------

@pytest.mark.parametrize("side", ["A", "G"])
def test_eigenbasis_side_work_rotates_by_the_split_bases_and_renews_them(side):
    """Step: Q Qᵀ M = M (the rotations in and out, other side untouched); refresh: each block of
    the new factor diagonal in the renewed basis (float64 check), from the previous basis."""
    n, split = 10, 4
    factor, previous = _psd(n, 2), _psd(n, 3)
    work = Eigenbasis().split_cost().side_work(factor, previous, split, 3, side)
    fn, args = work.step
    matrix = args[0].numpy()
    assert matrix.shape == ((n, 3) if side == "A" else (3, n))
    np.testing.assert_allclose(fn(*args).numpy(), matrix, atol=1e-5)
    fn, args = work.refresh
    q, _ = fn(*args)
    for k, start in enumerate(range(0, n, split)):
        d = min(split, n - start)
        qk = q.numpy()[k, :d, :d].astype(np.float64)
        block = factor[start:start + d, start:start + d]
        rotated = qk.T @ block @ qk
        off = rotated - np.diag(np.diag(rotated))
        assert np.linalg.norm(off) < 0.5 * np.linalg.norm(block)
        np.testing.assert_allclose(qk.T @ qk, np.eye(d), atol=1e-4)


@pytest.mark.parametrize("side", ["A", "G"])
def test_inverse_side_work_multiplies_by_the_damped_split_inverse(side):
    n, split = 10, 4
    factor = _psd(n, 4)
    damping = InverseSplitCost.TIMING_DAMPING
    work = Inverse().split_cost().side_work(factor, factor, split, 3, side)
    blocks = [factor[s:s + split, s:s + split] for s in range(0, n, split)]
    inverse = np.linalg.inv(_block_diag(blocks) + damping * np.eye(n))
    fn, args = work.step
    matrix = args[0].numpy().astype(np.float64)
    expected = inverse @ matrix if side == "A" else matrix @ inverse
    np.testing.assert_allclose(fn(*args).numpy(), expected, rtol=1e-4, atol=1e-4)
    fn, args = work.refresh
    got = fn(*args).numpy()
    for k, block in enumerate(blocks):
        d = block.shape[0]
        np.testing.assert_allclose(got[k, :d, :d], np.linalg.inv(block + damping * np.eye(d)),
                                   rtol=1e-4, atol=1e-4)


# -- split_dim="auto" -------------------------------------------------------------------------------

def _bn_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(40),
                             keras.layers.BatchNormalization(), keras.layers.Activation("tanh"),
                             keras.layers.Dense(24, activation="tanh"), keras.layers.Dense(4)])


def _data(n=96):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 12)).astype("float32")
    return x, rng.integers(0, 4, size=n)


def test_auto_trains_as_its_plan_does(capsys):
    """split_dim="auto" calibrates on fit's first two batches, prints its table and the
    registration table, and then trains exactly as split_dim=<that plan> (6 steps, refreshes
    every 2): the probe's training-mode passes left BatchNorm's statistics as they were."""
    x, y = _data()
    options = dict(learning_rate=0.01, preset="thor_nt", frequency=2, verbose=False)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    auto = thor_tf.wrap(_bn_model(), split_dim="auto", **options)
    auto.compile(loss=loss)
    auto.thor.verbose = True
    moving = [v.numpy() for v in auto.non_trainable_variables]
    report = auto.calibrate_split(_probe_batches(x, y, 16))
    np.testing.assert_array_equal(moving[0], auto.non_trainable_variables[0].numpy())
    printed = capsys.readouterr().out
    assert "split calibrated for the eigenbasis rule" in printed and "split A" in printed
    assert "AdamW ms/step" in printed  # the per-layer cost table
    costs = report["layer_costs"]
    assert set(costs) == {b.name for b in auto.thor.blocks}
    assert all(c["first_order"] > 0 and c["rotations"] >= 0 for c in costs.values())
    plan = auto.thor_optimizer.config.split_dim
    assert isinstance(plan, SplitPlan) and plan == report["plan"]
    assert set(report["dims"]) == {13, 40, 41, 24, 25, 4}
    auto.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    fixed = thor_tf.wrap(_bn_model(), split_dim=plan, **options)
    fixed.compile(loss=loss)
    fixed.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(auto.weights, fixed.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert auto.get_config()["thor_options"]["split_dim"] == plan.get_config()


def test_auto_in_a_custom_loop_takes_the_rules_default_once_said():
    """A custom loop's first ``apply`` before any calibration builds THOR's state: with the
    rule's default split and a warning saying so; the model's options still say "auto" (nothing
    was calibrated) and the split can no longer be calibrated."""
    x, y = _data(32)
    wrapped = thor_tf.wrap(_bn_model(), split_dim="auto", verbose=False, learning_rate=0.01)
    wrapped.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    optimizer = wrapped.optimizer
    assert optimizer.split_pending and wrapped.thor.split_dim == AUTO
    with tf.GradientTape() as tape:
        loss = wrapped.compute_loss(x=x, y=y, y_pred=wrapped(x, training=True))
    grads = tape.gradient(loss, wrapped.trainable_variables)
    with pytest.warns(UserWarning, match="default split_dim=") as said:
        optimizer.apply_gradients(zip(grads, wrapped.trainable_variables))
    assert len([w for w in said if "split_dim='auto'" in str(w.message)]) == 1
    default = Eigenbasis().default_split
    assert not optimizer.split_pending and optimizer.config.split_dim == default
    assert wrapped.thor.split_dim == default  # read from the built optimizer
    assert wrapped.thor.options.split_dim == AUTO
    with pytest.raises(ValueError, match="only before the first step"):
        wrapped.calibrate_split(_probe_batches(x, y, 16))
    with pytest.raises(ValueError, match="built with split_dim"):
        optimizer.resolve_split(64)


def test_auto_in_fit_calibrates_before_the_first_step():
    x, y = _data()
    wrapped = thor_tf.wrap(_bn_model(), split_dim="auto", verbose=False, learning_rate=0.01)
    wrapped.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"])
    assert not wrapped.optimizer.built  # the state's shapes wait for the plan
    wrapped.evaluate(x, y, verbose=0)  # Keras builds optimizers here: not this one yet
    assert not wrapped.optimizer.built
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback to 128
        wrapped.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=1, verbose=0,
                    shuffle=False)
    assert isinstance(wrapped.thor_optimizer.config.split_dim, SplitPlan)
    with pytest.raises(ValueError, match="only before the first step"):
        wrapped.calibrate_split(_probe_batches(x, y, 16))


def test_probe_batches_from_fit_data():
    x, y = _data(50)
    arrays = _probe_batches(x, y, 16)
    assert [b[0].shape[0] for b in arrays] == [16, 16]
    np.testing.assert_array_equal(arrays[1][0], x[16:32])
    small = _probe_batches(x[:10], y[:10], 64)
    assert [b[0].shape[0] for b in small] == [5, 5]
    dataset = _probe_batches(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), None, None)
    assert [int(b[0].shape[0]) for b in dataset] == [8, 8]
    inputs = _probe_batches({"a": x, "b": x}, y, 4)
    assert inputs[0][0]["a"].shape == (4, 12)
    assert _probe_batches(iter([(x, y)]), None, None) is None


def test_auto_outside_fit_uses_the_default_split_and_says_so():
    wrapped = thor_tf.wrap(_bn_model(), split_dim="auto", verbose=False, learning_rate=0.01)
    wrapped.compile(loss="mse")
    with pytest.warns(UserWarning, match=r"split_dim='auto' is calibrated at the start of fit"):
        wrapped.optimizer.build(wrapped.trainable_variables)
    assert wrapped.thor_optimizer.config.split_dim == Eigenbasis.default_split


def test_the_default_split_is_the_rules():
    """split_dim None: the eigenbasis rule's plan (factors wider than 512 unrotated, 128
    otherwise), the inverse rule's 128; a saved config holds the resolved split, so a model
    saved with an explicit 128 loads with 128."""
    model = lambda: keras.Sequential([keras.Input((600,)), keras.layers.Dense(10)])
    eigen = thor_tf.wrap(model(), verbose=False)
    eigen.compile(loss="mse")
    assert eigen.thor_optimizer.config.split_dim == SplitPlan(128, diagonal_above=512)
    assert tuple(eigen.thor.state.layers[0].Q_A.shape) == (601, 1, 1)
    assert tuple(eigen.thor.state.layers[0].Q_G.shape) == (1, 10, 10)
    inverse = thor_tf.wrap(model(), update_rule="inverse", verbose=False)
    inverse.compile(loss="mse")
    assert inverse.thor_optimizer.config.split_dim == 128
    saved = thor_tf.wrap(model(), split_dim=128, verbose=False)
    assert saved.get_config()["thor_options"]["split_dim"] == 128
    restored = thor_tf.ThorModel.from_config(saved.get_config())
    assert restored.thor.options.split_dim == 128
