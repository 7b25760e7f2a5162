"""experiments/anatomy.py: the staleness measure against closed forms and a dense float64
reference, the schedule's phases, and the quick run end to end (the record's schema)."""

import json
import math

import numpy as np
import pytest
import scipy.linalg

from experiments import anatomy


def rotation(angle):
    c, s = math.cos(angle), math.sin(angle)
    return np.array([[c, -s], [s, c]])


def two_by_two_closed_form(l1, l2, angle):
    """Off-diagonal energy fraction of diag(l1, l2) seen in a basis rotated by ``angle``:
    the off-diagonal entry is (l2 - l1) sin(angle) cos(angle), twice."""
    return abs(l1 - l2) * abs(math.sin(2 * angle)) / math.sqrt(2 * (l1 ** 2 + l2 ** 2))


@pytest.mark.parametrize("phi,theta", [(0.3, 0.0), (0.3, 0.2), (1.1, -0.7), (0.0, math.pi / 4)])
def test_two_by_two_against_the_closed_form(phi, theta):
    l1, l2 = 3.0, 0.5
    v = rotation(phi)
    factor = v @ np.diag([l1, l2]) @ v.T
    # The basis that diagonalizes the factor: 0; the identity: the factor's own off-diagonal.
    assert anatomy.offdiag_fraction(factor, v[None]) == pytest.approx(0.0, abs=1e-12)
    assert anatomy.offdiag_fraction(factor, np.eye(2)[None]) == pytest.approx(
        two_by_two_closed_form(l1, l2, phi), abs=1e-12)
    # The eigenbasis turned by theta: the closed form in theta; any scale of the factor.
    q = (v @ rotation(theta))[None]
    expected = two_by_two_closed_form(l1, l2, theta)
    assert anatomy.offdiag_fraction(factor, q) == pytest.approx(expected, abs=1e-12)
    assert anatomy.offdiag_fraction(1e-7 * factor, q) == pytest.approx(expected, abs=1e-12)
    assert anatomy.offdiag_fraction(factor, anatomy.eigenbases(factor, 1, 2)) == pytest.approx(
        0.0, abs=1e-12)


def test_split_blocks_padding_and_what_the_split_leaves_out():
    # n = 5 cut in blocks of 3: a 3x3 block and a 2x2 one padded to 3; entries across blocks.
    a, b, c, p, q, eps = 4.0, 2.0, 1.0, 5.0, 0.25, 0.3
    theta, psi = 0.4, 0.9
    r3 = np.eye(3)
    r3[:2, :2] = rotation(theta)
    f1 = r3 @ np.diag([a, b, c]) @ r3.T
    f2 = rotation(psi) @ np.diag([p, q]) @ rotation(psi).T
    factor = np.zeros((5, 5))
    factor[:3, :3], factor[3:, 3:] = f1, f2
    factor[0, 4] = factor[4, 0] = eps
    inside = math.sqrt(np.sum(f1 ** 2) + np.sum(f2 ** 2))
    blocks = anatomy.split_blocks(factor, 2, 3)
    np.testing.assert_array_equal(blocks[0], f1)
    np.testing.assert_array_equal(blocks[1][:2, :2], f2)
    assert not blocks[1][2].any() and not blocks[1][:, 2].any()
    # The first block's exact eigenbasis, the second left as the identity: only f2's
    # off-diagonal (p - q) sin(psi) cos(psi), twice, remains.
    bases = np.stack([r3, np.eye(3)])
    off = math.sqrt(2) * abs(p - q) * abs(math.sin(psi) * math.cos(psi))
    assert anatomy.offdiag_fraction(factor, bases) == pytest.approx(off / inside, abs=1e-12)
    # The identity on both: f1's off-diagonal (a - b) sin cos too.
    off1 = math.sqrt(2) * abs(a - b) * abs(math.sin(theta) * math.cos(theta))
    assert anatomy.offdiag_fraction(factor, anatomy.identity_bases(2, 3)) == pytest.approx(
        math.hypot(off, off1) / inside, abs=1e-12)
    assert anatomy.outside_fraction(factor, 2, 3) == pytest.approx(
        math.sqrt(2) * eps / math.sqrt(inside ** 2 + 2 * eps ** 2), abs=1e-12)
    # Fresh eigenbases of the blocks diagonalize them, padding included.
    assert anatomy.offdiag_fraction(factor, anatomy.eigenbases(factor, 2, 3)) == pytest.approx(
        0.0, abs=1e-12)


def test_a_side_kept_as_its_diagonal_and_the_batch_noise_floor():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 6))
    factor = x.T @ x / 40
    off = factor - np.diag(np.diag(factor))
    measures = anatomy.side_staleness([factor, 2 * factor], np.ones((6, 1, 1)))
    assert measures["in_use"] == measures["identity"] == measures["fresh_other"] == 0.0
    assert measures["outside"] == pytest.approx(np.linalg.norm(off) / np.linalg.norm(factor),
                                                abs=1e-12)
    # Two probe batches with the same factor (up to scale): a basis fresh from the other is 0.
    w, v = np.linalg.eigh(factor)
    turned = v @ scipy.linalg.expm(0.1 * (np.triu(np.ones((6, 6)), 1)
                                          - np.triu(np.ones((6, 6)), 1).T))
    measures = anatomy.side_staleness([factor, 3 * factor], turned[None])
    assert measures["fresh_other"] == pytest.approx(0.0, abs=1e-12)
    dense = turned.T @ factor @ turned
    expected = np.linalg.norm(dense - np.diag(np.diag(dense))) / np.linalg.norm(factor)
    assert measures["in_use"] == pytest.approx(expected, abs=1e-12)
    assert measures["identity"] == pytest.approx(np.linalg.norm(off) / np.linalg.norm(factor),
                                                 abs=1e-12)


def test_phases_and_the_baselines_steps_to_thors_values():
    # 100 steps, warmup 5: the cosine's thirds end at 5 + 95/3 and 5 + 190/3.
    phases = [anatomy.phase_of(s, 100, 5) for s in (1, 5, 6, 36, 37, 68, 69, 100)]
    assert phases == [0, 0, 1, 1, 2, 2, 3, 3]
    thor = {"evals": [{"step": 0, "train_loss": 2.0, "test_loss": 2.0, "test_metric": 0.1},
                      {"step": 10, "train_loss": 1.0, "test_loss": 1.1, "test_metric": 0.6},
                      {"step": 20, "train_loss": 0.5, "test_loss": 0.7, "test_metric": 0.8}]}
    base = {"evals": [{"step": 0, "train_loss": 2.0, "test_loss": 2.0, "test_metric": 0.1},
                      {"step": 10, "train_loss": 1.5, "test_loss": 1.5, "test_metric": 0.5},
                      {"step": 20, "train_loss": 0.9, "test_loss": 1.0, "test_metric": 0.7},
                      {"step": 30, "train_loss": 0.4, "test_loss": 0.8, "test_metric": 0.9}]}
    anatomy.add_match(thor, base, higher_is_better=True)
    assert thor["evals"][1]["match"] == {"train_loss": 2.0, "test_loss": 2.0, "test_metric": 2.0}
    assert thor["evals"][2]["match"] == {"train_loss": 1.5, "test_loss": None, "test_metric": 1.5}


def dense_reference(factor, q_blocks):
    """The measure with the whole block-diagonal basis as one dense matrix (float64)."""
    nb, d, _ = q_blocks.shape
    n, size = factor.shape[0], nb * d
    padded = np.zeros((size, size))
    padded[:n, :n] = factor
    mask = scipy.linalg.block_diag(*[np.ones((d, d))] * nb)
    restricted = padded * mask
    q = scipy.linalg.block_diag(*q_blocks)
    rotated = q.T @ restricted @ q
    return np.linalg.norm(rotated - np.diag(np.diag(rotated))) / np.linalg.norm(restricted)


def test_quick_run_writes_the_record(tmp_path, monkeypatch):
    from thor_tf.split.probe import batch_factors

    checked = []
    measure = anatomy.staleness

    def staleness_checked(model, probes):
        # The first measurement, against the dense reference from the model's own state.
        out = measure(model, probes)
        if not checked:
            factors = batch_factors(model, probes)
            for name, sides in out.items():
                bases = model.thor.bases(name)
                for side, key, k in (("A", "Q_A", 0), ("G", "Q_G", 1)):
                    if side in sides and sides[side]["block"] > 1:
                        ref = np.mean([dense_reference(f[name][k], bases[key].astype(np.float64))
                                       for f in factors])
                        checked.append((name, side))
                        assert sides[side]["in_use"] == pytest.approx(ref, rel=1e-9, abs=1e-12)
        return out

    monkeypatch.setattr(anatomy, "staleness", staleness_checked)
    records = anatomy.main(["--quick", "--evals", "3", "--out", str(tmp_path)])
    assert checked  # the rotated sides of a CNN were compared
    record = json.loads((tmp_path / "anatomy_digits_cnn_1x.json").read_text())
    assert records[0]["runs"].keys() == record["runs"].keys() == {"thor/0", "muon/0"}
    assert (tmp_path / "anatomy_digits_cnn_1x.png").stat().st_size > 10_000
    for key in ("workload", "multiple", "total_steps", "warmup_steps", "baseline",
                "baseline_rate", "baseline_rate_source", "phases", "table", "seeds"):
        assert key in record, key
    total = record["total_steps"]
    for key, run in record["runs"].items():
        evals = run["evals"]
        assert [p["step"] for p in evals] == [0] + anatomy.suite.eval_steps(total, 3)
        # The held-out metric measured here is the suite's own at the end (the record keeps 5
        # significant digits).
        assert evals[-1]["test_metric"] == pytest.approx(run["final_metric"], abs=1e-5)
        for p in evals:
            assert p["gap"] == pytest.approx(p["test_loss"] - p["train_loss"],
                                             abs=1e-4 * max(1.0, p["test_loss"]))
        sizes = run["step_sizes"]
        assert [s["step"] for s in sizes] == list(range(0, total, run["step_every"]))
        assert all(v > 0 for s in sizes[1:] for v in s["layers"].values())
        assert set(sizes[0]["layers"]) == {"conv1", "conv2", "dense1", "predictions"}
    thor = record["runs"]["thor/0"]["evals"]
    for p in thor[1:]:
        assert set(p["layers"]) == {"conv1", "conv2", "dense1", "predictions"}
        for stats in p["layers"].values():
            assert stats["age"] == p["step"] - stats["last_refresh_step"]
        for sides in p["staleness"].values():
            for m in sides.values():
                assert all(0.0 <= m[k] <= 1.0 + 1e-9 for k in
                           ("in_use", "identity", "fresh_other", "outside"))
        assert "match" in p
    assert [row["phase"] for row in record["phases"]["thor"]] == list(anatomy.PHASES)
