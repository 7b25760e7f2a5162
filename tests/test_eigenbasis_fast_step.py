"""The eigenbasis rule's faster steady step (issue 33, item 2) against float64 references.

* ``rotate_in`` / ``rotate_out`` (the bases' transposes taken by the products, 1×1 blocks
  skipped, a short last block at its true size) against ``Q_Aᵀ M Q_G`` / ``Q_A M Q_Gᵀ`` with
  the block-diagonal bases written out densely in float64, padding included.
* Newton–Schulz on many tensors at once (``newton_schulz_many``, as the rule calls it) and the
  bucketed orthogonalization (mixed shapes, zero-padded to shared sizes) against each matrix's
  float64 iteration and scale, within 4× the float32 iteration's own error
  (tests/test_newton_schulz.py has the iteration's methods one by one).
* Blocks of one shape rotated as one stack: each member against its own float64 products, their
  moments carried into new bases as one stack against float64 (and kept where a basis did not
  change or a block did not refresh), and a model with two such layers against the same model
  with every block preconditioned and carried alone.
* A model with a Conv2D, a wide Dense (Gram path), an Embedding (1×1 A blocks) and a head,
  6 steps with refreshes at every other step: the weights as the step before this change
  computed them (dense block-diagonal rotations, the plain iteration per shape, emulated here in
  float64 by patching the rule's helpers) to float32 round-off of the step.
"""

import numpy as np
import keras
import pytest
import tensorflow as tf

import thor_tf
from thor_tf.rules import Eigenbasis, eigenbasis as eigenbasis_module, eigenbasis_ops
from thor_tf.rules import eigenbasis_refresh
from thor_tf.rules.eigenbasis_ops import (newton_schulz, newton_schulz_many, rotate_in,
                                          rotate_out)

from test_eigenbasis import EVERY_2
from test_newton_schulz import np_newton_schulz, spread, within_float32_error


def _dense_block_diag(q, n):
    nb, d, _ = q.shape
    full = np.zeros((nb * d, nb * d))
    for i in range(nb):
        full[i * d:(i + 1) * d, i * d:(i + 1) * d] = q[i]
    return full[:n, :n]


def _orthogonal_blocks(rng, nb, d, n):
    """``[nb, d, d]`` random orthogonal blocks, identity on the padding past ``n``."""
    q = np.stack([np.linalg.qr(rng.normal(size=(d, d)))[0] for _ in range(nb)])
    pad = nb * d - n
    if pad:
        q[-1, d - pad:, :] = 0.0
        q[-1, :, d - pad:] = 0.0
        q[-1, d - pad:, d - pad:] = np.eye(pad)
    return q


@pytest.mark.parametrize("a,d_a,g,d_g", [(10, 10, 32, 32), (289, 128, 64, 64), (7, 3, 10, 4),
                                         (65, 1, 64, 64), (129, 128, 10, 10), (40, 16, 50, 16),
                                         (250, 32, 70, 8), (5, 8, 6, 8)])
def test_rotations_match_dense_block_diagonal_products(a, d_a, g, d_g):
    """Padded last blocks both ways: multiplied at their true size (over 1/8 of the product is
    padding: 289 = 2·128 + 33, the bias row of 129, a single short block of 5 or 6) and padded
    (250 of 256, 70 of 72)."""
    rng = np.random.default_rng(a + g)
    nb_a, nb_g = -(-a // d_a), -(-g // d_g)
    q_a = _orthogonal_blocks(rng, nb_a, d_a, a) if d_a > 1 else np.ones((a, 1, 1))
    q_g = _orthogonal_blocks(rng, nb_g, d_g, g)
    m = rng.normal(size=(a, g))
    dense_a, dense_g = _dense_block_diag(q_a, a), _dense_block_diag(q_g, g)
    args = [tf.constant(v, tf.float32) for v in (m, q_a, q_g)]
    tol = 1e-5 * np.abs(m).max() * np.sqrt(max(d_a, d_g))
    np.testing.assert_allclose(rotate_in(*args).numpy(), dense_a.T @ m @ dense_g, atol=tol, rtol=0)
    np.testing.assert_allclose(rotate_out(*args).numpy(), dense_a @ m @ dense_g.T, atol=tol, rtol=0)
    # Which way each side went: a padded product pads x (a Pad op), one at true size does not.
    def padded_product(n, d):
        padding = -(-n // d) * d - n
        return d > 1 and 0 < padding <= eigenbasis_ops.RAGGED_PADDING * (n + padding)

    graph = tf.function(rotate_in).get_concrete_function(*args).graph
    pads = sum(op.type == "Pad" for op in graph.get_operations())
    assert pads == padded_product(a, d_a) + padded_product(g, d_g)


PRODUCTS = ("MatMul", "BatchMatMulV2", "Einsum", "Mul")


@pytest.mark.parametrize("a,d_a,g,d_g", [(10, 10, 32, 32), (289, 128, 64, 64), (7, 3, 10, 4),
                                         (65, 1, 64, 64), (129, 128, 10, 10), (250, 32, 70, 8),
                                         (257, 128, 64, 64)])
def test_stacked_rotations_are_each_blocks_rotations(a, d_a, g, d_g):
    """Three blocks of one shape rotated as one stack (``[3, a, g]``, bases ``[3, nb, d, d]``,
    as the rule does for a Transformer's query/key/value or a ResNet stage's convolutions): each
    member equals its own dense block-diagonal products in float64, and the stack takes as many
    products as one block does (not three times as many)."""
    rng = np.random.default_rng(3 * a + g)
    nb_a, nb_g, members = -(-a // d_a), -(-g // d_g), 3
    q_a = np.stack([_orthogonal_blocks(rng, nb_a, d_a, a) if d_a > 1 else np.ones((a, 1, 1))
                    for _ in range(members)])
    q_g = np.stack([_orthogonal_blocks(rng, nb_g, d_g, g) for _ in range(members)])
    m = rng.normal(size=(members, a, g))
    args = [tf.constant(v, tf.float32) for v in (m, q_a, q_g)]
    tol = 1e-5 * np.abs(m).max() * np.sqrt(max(d_a, d_g))
    got_in, got_out = rotate_in(*args).numpy(), rotate_out(*args).numpy()
    for n in range(members):
        dense_a, dense_g = _dense_block_diag(q_a[n], a), _dense_block_diag(q_g[n], g)
        np.testing.assert_allclose(got_in[n], dense_a.T @ m[n] @ dense_g, atol=tol, rtol=0)
        np.testing.assert_allclose(got_out[n], dense_a @ m[n] @ dense_g.T, atol=tol, rtol=0)

    def products(*xs):
        graph = tf.function(rotate_in).get_concrete_function(*xs).graph
        return sum(op.type in PRODUCTS for op in graph.get_operations())

    assert products(*args) == products(*(x[0] for x in args)) > 0


def _same_shape_model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])


def _run_same_shapes(steps=6):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(16 * steps, 6)).astype("float32")
    y = rng.integers(0, 3, 16 * steps)
    model = thor_tf.wrap(_same_shape_model(), learning_rate=1e-2, split_dim=4, verbose=False,
                         **EVERY_2)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = [v.numpy() for v in model.trainable_variables]
    for s in range(steps):
        model.train_on_batch(x[16 * s:16 * (s + 1)], y[16 * s:16 * (s + 1)])
    return start, [v.numpy() for v in model.trainable_variables], model


def test_blocks_of_one_shape_take_the_steps_each_takes_alone(monkeypatch):
    """Two hidden Dense layers of one shape (``[9, 8]``: A in blocks of 4, 4 and a bias row)
    are preconditioned, and their moments carried, as one stack: 6 steps with refreshes at every
    other step train the same weights, to float32 round-off of the step, as every block
    preconditioned and carried alone."""
    seen = []
    with monkeypatch.context() as patch:
        def recording(matrix, q_a, q_g):
            seen.append(tuple(matrix.shape))
            return rotate_in(matrix, q_a, q_g)

        patch.setattr(eigenbasis_module, "rotate_in", recording)
        start, stacked, model = _run_same_shapes()
    assert (2, 9, 8) in seen and (7, 8) in seen and (9, 3) in seen, seen  # one stack of two
    assert sum(s["refreshes"] for s in model.thor.layer_stats()) >= 8
    with monkeypatch.context() as patch:
        patch.setattr(Eigenbasis, "_stack_key", staticmethod(id))  # every block alone
        _, alone, _ = _run_same_shapes()
    moved = max(np.abs(a - s).max() for a, s in zip(alone, start))
    assert moved > 1e-3
    assert max(np.abs(t - a).max() for t, a in zip(stacked, alone)) < 1e-4 * moved


def test_stacked_moment_carry_against_float64_and_the_blocks_it_must_keep():
    """The moments of three blocks of one shape carried into new bases as one stack: a block that
    refreshed and changed its basis gets ``R_Aᵀ m R_G`` and ``(R_A∘R_A)ᵀ v (R_G∘R_G)`` with
    ``R = Q_oldᵀ Q_new`` (float64, dense block-diagonal); one that refreshed to the same basis
    and one not selected keep their moments bit for bit; before the first step nothing moves."""
    import types

    rng = np.random.default_rng(11)
    a, d_a, g, d_g = 9, 4, 6, 6
    nb_a = -(-a // d_a)
    helds, new = [], []
    for n in range(3):
        q_a_old = _orthogonal_blocks(rng, nb_a, d_a, a)
        q_g_old = _orthogonal_blocks(rng, 1, d_g, g)
        changed = n == 0 or n == 2
        q_a = _orthogonal_blocks(rng, nb_a, d_a, a) if changed else q_a_old
        q_g = _orthogonal_blocks(rng, 1, d_g, g) if changed else q_g_old
        helds.append(types.SimpleNamespace(
            Q_A=tf.Variable(q_a_old, dtype=tf.float32), Q_G=tf.Variable(q_g_old, dtype=tf.float32),
            m=tf.Variable(rng.normal(size=(a, g)), dtype=tf.float32),
            v=tf.Variable(rng.uniform(size=(a, g)), dtype=tf.float32)))
        new.append(((tf.constant(q_a, tf.float32), None), (tf.constant(q_g, tf.float32), None)))
    flags = [tf.constant(True), tf.constant(True), tf.constant(False)]  # block 2: not selected
    out = eigenbasis_refresh.carried_stacked(helds, new, flags, tf.constant(True))
    h = helds[0]
    q_a_old, q_g_old = (_dense_block_diag(q.numpy().astype(np.float64), n)
                        for q, n in ((h.Q_A, a), (h.Q_G, g)))
    q_a, q_g = (_dense_block_diag(q.numpy().astype(np.float64), n)
                for q, n in ((new[0][0][0], a), (new[0][1][0], g)))
    r_a, r_g = q_a_old.T @ q_a, q_g_old.T @ q_g
    m, v = (t.numpy().astype(np.float64) for t in (h.m, h.v))
    np.testing.assert_allclose(out[0][0].numpy(), r_a.T @ m @ r_g, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out[0][1].numpy(), (r_a ** 2).T @ v @ r_g ** 2, atol=1e-5, rtol=0)
    assert np.abs(out[0][0].numpy() - m).max() > 0.1  # it did move
    for n in (1, 2):
        assert np.array_equal(out[n][0].numpy(), helds[n].m.numpy())
        assert np.array_equal(out[n][1].numpy(), helds[n].v.numpy())
    before_first_step = eigenbasis_refresh.carried_stacked(helds, new, flags,
                                                          tf.constant(False))
    for held, (m_n, v_n) in zip(helds, before_first_step):
        assert np.array_equal(m_n.numpy(), held.m.numpy())
        assert np.array_equal(v_n.numpy(), held.v.numpy())


def test_many_tensors_at_once_are_each_their_own_iteration():
    """``newton_schulz_many`` (the gain's recursion once on all eigenvalues, as the rule calls
    it per step): batches of different shapes (wide, tall, square; one with a NaN matrix) each
    give the float64 iteration of each matrix, the NaN one zeros; under ``"iterate"`` too."""
    rng = np.random.default_rng(11)
    shapes = [(2, 6, 15), (3, 12, 5), (1, 7, 7), (2, 9, 1), (1, 1, 7)]
    xs = [np.stack([spread(rng, shape[1:]) for _ in range(shape[0])]).astype(np.float32)
          for shape in shapes]
    xs[1][2, 0, 0] = np.nan
    for method in ("spectral", "iterate"):
        got = [t.numpy() for t in newton_schulz_many(xs, method=method)]
        for x, g in zip(xs, got):
            assert g.shape == x.shape
            for m in range(x.shape[0]):
                if np.all(np.isfinite(x[m])):
                    assert within_float32_error(g[m], x[m].astype(np.float64))
                elif method == "spectral":
                    assert not np.any(g[m])


def test_auto_evaluates_through_eigh_without_a_gpu_and_by_products_with_one(monkeypatch):
    """The default ``method="auto"``: ``eigh`` where TensorFlow sees no GPU (this machine), the
    products where it sees one. Told apart by a NaN matrix: zeros through ``eigh``, NaN by the
    products."""
    x = np.full((1, 4, 6), np.nan, np.float32)
    assert not np.any(newton_schulz(x).numpy())  # spectral
    real = tf.config.list_logical_devices
    monkeypatch.setattr(tf.config, "list_logical_devices",
                        lambda kind=None: ["/GPU:0"] if kind == "GPU" else real(kind))
    assert np.all(np.isnan(newton_schulz(x).numpy()))  # iterate


def test_orthogonalization_matches_each_matrix():
    """Mixed shapes (near heights and widths, tall and wide, some through float64 ``eigh``):
    each comes out as its own float64 iteration at its own scale."""
    rng = np.random.default_rng(3)
    shapes = [(65, 64), (64, 65), (32, 64), (65, 256), (257, 64), (64, 64), (5, 3), (66, 64),
              (67, 63)]
    mats = [rng.normal(size=s) for s in shapes]
    for scale in ("graft", "rms"):
        rule = Eigenbasis(scale=scale)
        got = rule._orthogonalized([tf.constant(m, tf.float32) for m in mats])
        for m, o in zip(mats, got):
            assert o.shape == m.shape
            scaled = ((lambda o: o * np.linalg.norm(m) / np.linalg.norm(o)) if scale == "graft"
                      else (lambda o: o * 0.2 * np.sqrt(max(m.shape))))
            assert within_float32_error(o.numpy(), m, scaled)


def test_orthogonalization_neither_transposes_nor_batches():
    """Each update is iterated as the 2-D matrix it is: tall or wide, through the products'
    transpose flags (no ``Transpose``), and with 2-D products (no ``BatchMatMul``, which costs
    more than the same products one by one on CPU)."""
    rule = Eigenbasis()

    def op_types(shapes):
        fn = tf.function(lambda *us: rule._orthogonalized(list(us)))
        graph = fn.get_concrete_function(
            *[tf.TensorSpec(s, tf.float32) for s in shapes]).graph
        return [op.type for op in graph.get_operations()]

    for shapes in ([(257, 64)], [(65, 64), (66, 64), (67, 63)], [(65, 64), (66, 64), (64, 66)]):
        types = op_types(shapes)
        assert "Transpose" not in types and "BatchMatMulV2" not in types
        assert types.count("MatMul") == 15 * len(shapes)  # 5 steps of 3 products each


def _mixed_model():
    keras.utils.set_random_seed(0)
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    image = keras.Input((6, 6, 1), name="image")
    e = keras.layers.Flatten()(keras.layers.Embedding(11, 4, name="embed")(tokens))
    c = keras.layers.Flatten()(keras.layers.Conv2D(3, 3, activation="relu", name="conv")(image))
    h = keras.layers.Dense(8, activation="tanh", name="wide")(keras.layers.Concatenate()([e, c]))
    return keras.Model([tokens, image], keras.layers.Dense(3, name="head")(h))


def _before_this_change(monkeypatch):
    """The step as it was computed before: dense block-diagonal rotations in float64 and the
    plain iteration per shape in float64 (``np_newton_schulz``), scaled as the rule scales."""

    def dense(q, n):
        nb, d = int(q.shape[0]), int(q.shape[-1])
        q = tf.cast(q, tf.float64)
        full = tf.reshape(q[:, :, None, :] * tf.eye(nb, dtype=tf.float64)[:, None, :, None],
                          [nb * d, nb * d])
        return full[:n, :n]

    def rotate(matrix, q_a, q_g, inward):
        m = tf.cast(matrix, tf.float64)
        qa, qg = dense(q_a, int(m.shape[0])), dense(q_g, int(m.shape[1]))
        out = (tf.matmul(tf.matmul(qa, m, transpose_a=True), qg) if inward
               else tf.matmul(tf.matmul(qa, m), qg, transpose_b=True))
        return tf.cast(out, tf.float32)

    monkeypatch.setattr(Eigenbasis, "_stack_key", staticmethod(id))  # each block alone

    def orthogonalized(self, updates, rate=None, largest=None):
        out = []
        for u in updates:
            o = tf.numpy_function(lambda x: np_newton_schulz(x).astype(np.float32), [u], tf.float32)
            o = tf.reshape(o, u.shape)
            out.append(o * tf.norm(u) / tf.norm(o))
        return out

    monkeypatch.setattr(eigenbasis_module, "rotate_in", lambda m, a, g: rotate(m, a, g, True))
    monkeypatch.setattr(eigenbasis_refresh, "rotate_in", lambda m, a, g: rotate(m, a, g, True))
    monkeypatch.setattr(eigenbasis_module, "rotate_out", lambda m, a, g: rotate(m, a, g, False))
    monkeypatch.setattr(Eigenbasis, "_orthogonalized", orthogonalized)


def _run_mixed(steps=6):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 11, (16 * steps, 6))
    images = rng.normal(size=(16 * steps, 6, 6, 1)).astype("float32")
    labels = rng.integers(0, 3, 16 * steps)
    model = thor_tf.wrap(_mixed_model(), learning_rate=1e-2, split_dim=8, verbose=False,
                         **EVERY_2)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = [v.numpy() for v in model.trainable_variables]
    for s in range(steps):
        rows = slice(16 * s, 16 * (s + 1))
        model.train_on_batch([tokens[rows], images[rows]], labels[rows])
    return start, [v.numpy() for v in model.trainable_variables], model


def test_faster_step_gives_the_steps_of_before(monkeypatch):
    start, fast, model = _run_mixed()
    kinds = {b.name: b.kind for b in model.thor.blocks}
    assert set(kinds.values()) == {"embedding", "conv2d", "dense"}
    assert sum(s["refreshes"] for s in model.thor.layer_stats()) >= 8  # refreshes happened
    with monkeypatch.context() as patch:
        _before_this_change(patch)
        _, before, _ = _run_mixed()
    moved = max(np.abs(b - s).max() for b, s in zip(before, start))
    assert moved > 1e-3
    assert max(np.abs(f - b).max() for f, b in zip(fast, before)) < 1e-3 * moved
