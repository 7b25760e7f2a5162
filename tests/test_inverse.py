"""Diagonal-block factors and their robust split inversion."""

import numpy as np
import tensorflow as tf

from reference import block_diagonal_part, mean_outer
from thor_tf.blocks import block_gram
from thor_tf.inverse import invert_blocks, split_inverse, split_layout


def test_block_gram_is_the_block_diagonal_part_of_the_mean_outer_product():
    rows = np.random.default_rng(0).normal(size=(40, 11))
    full = mean_outer(rows)
    for split in (3, 4, 11, 64):
        blocks = block_gram(tf.constant(rows, tf.float32), split).numpy()
        nb, size = split_layout(11, split)
        assert blocks.shape == (nb, size, size)
        dense = np.zeros((nb * size, nb * size))
        for b in range(nb):
            dense[b * size:(b + 1) * size, b * size:(b + 1) * size] = blocks[b]
        np.testing.assert_allclose(dense[:11, :11], block_diagonal_part(full, size), rtol=1e-5, atol=1e-6)
        assert np.all(dense[11:] == 0)  # zero padding


def test_split_inverse_inverts_each_damped_diagonal_block():
    rows = np.random.default_rng(1).normal(size=(30, 10))
    factor = mean_outer(rows)
    inv = split_inverse(tf.constant(factor, tf.float32), 0.1, 4).numpy()  # blocks 4, 4, 2(+2 pad)
    for b, (start, stop) in enumerate([(0, 4), (4, 8), (8, 10)]):
        expected = np.linalg.inv(factor[start:stop, start:stop] + 0.1 * np.eye(stop - start))
        np.testing.assert_allclose(inv[b][: stop - start, : stop - start], expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(inv[2][2:, 2:], np.eye(2))  # padding stays identity


def test_failed_cholesky_retries_in_float64_and_never_stores_non_finite():
    indefinite = np.diag([1.0, -0.5, 2.0]).astype(np.float32)[None]  # not positive definite
    inv = invert_blocks(tf.constant(indefinite), 0.01, 3).numpy()
    assert np.all(np.isfinite(inv))
    poisoned = np.full((1, 3, 3), np.nan, np.float32)
    previous = 3.0 * np.eye(3, dtype=np.float32)[None]
    kept = invert_blocks(tf.constant(poisoned), 0.01, 3, previous=tf.constant(previous)).numpy()
    np.testing.assert_array_equal(kept, previous)
    # A healthy block next to a poisoned one is still inverted.
    mixed = np.stack([np.eye(3, dtype=np.float32) * 4.0, poisoned[0]])
    out = invert_blocks(tf.constant(mixed), 0.0, 6, previous=tf.constant(np.stack([previous[0]] * 2))).numpy()
    np.testing.assert_allclose(out[0], np.eye(3) / 4.0, rtol=1e-5)
    np.testing.assert_array_equal(out[1], previous[0])
