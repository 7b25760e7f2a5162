"""Diagonal-block factors and their robust split inversion."""

import numpy as np
import tensorflow as tf

from reference import block_diagonal_part, mean_outer
from thor_tf.blocks import block_gram
from thor_tf.rules.inverse_ops import invert_blocks, split_inverse, split_layout


def test_block_gram_is_the_block_diagonal_part_of_the_mean_outer_product():
    rows = np.random.default_rng(0).normal(size=(40, 11))
    full = mean_outer(rows)
    for split in (1, 3, 4, 11, 64):  # 1: the diagonal alone
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


def test_size_buckets_join_sizes_within_the_ratio():
    from thor_tf.buckets import size_buckets

    assert size_buckets([9, 16, 32, 64, 72, 96, 116]) == {116: [116, 96], 72: [72, 64], 32: [32],
                                                          16: [16], 9: [9]}
    assert size_buckets([5, 5, 4], ratio=0.75) == {5: [5, 4]}


def test_padded_batched_inversion_matches_each_block_and_keeps_the_others():
    """Blocks of sizes 3 and 4 (a factor of dim 3 in one block, one of dim 7 in 4+3(+1 pad))
    padded to 4 in one batch: the selected ones are the float64 inverses of their damped blocks
    (1 on padding), the unselected keep their inverses in use."""
    from thor_tf.buckets import batched_layout, pad_blocks
    from thor_tf.rules.inverse_ops import invert_selected

    rng = np.random.default_rng(3)
    small = mean_outer(rng.normal(size=(20, 3)))[None]                      # [1, 3, 3], dim 3
    big = mean_outer(rng.normal(size=(20, 7)))
    big_blocks = np.zeros((2, 4, 4))
    big_blocks[0] = big[:4, :4]
    big_blocks[1, :3, :3] = big[4:, 4:]                                     # dim 7: 1 padding
    owner, mask, counts = batched_layout([(0, 1, 3, 3), (1, 2, 4, 7)], 4)
    blocks = tf.concat([pad_blocks(tf.constant(small, tf.float32), 4),
                        tf.constant(big_blocks, tf.float32)], axis=0)
    in_use = tf.constant(np.stack([np.full((4, 4), 7.0)] * 3), tf.float32)
    damping = tf.constant([0.1, 0.2], tf.float32)
    out = invert_selected(blocks, in_use, mask, tf.gather(damping, owner),
                           tf.constant([False, True, True])).numpy()
    np.testing.assert_array_equal(out[0], 7.0)                              # not selected
    np.testing.assert_allclose(out[1], np.linalg.inv(big[:4, :4] + 0.2 * np.eye(4)), rtol=1e-4)
    np.testing.assert_allclose(out[2, :3, :3], np.linalg.inv(big[4:, 4:] + 0.2 * np.eye(3)),
                               rtol=1e-4)
    np.testing.assert_allclose(out[2, 3, 3], 1.0, rtol=1e-6)                # padding: identity
    out = invert_selected(blocks, in_use, mask, tf.gather(damping, owner),
                           tf.constant([True, False, False])).numpy()
    np.testing.assert_allclose(out[0, :3, :3], np.linalg.inv(small[0] + 0.1 * np.eye(3)), rtol=1e-4)
    np.testing.assert_allclose(out[0, 3, 3], 1.0, rtol=1e-6)


def test_owned_blocks_are_inverted_and_the_others_are_zero_so_a_sum_over_owners_is_complete():
    from thor_tf.rules.inverse_ops import invert_owned
    rows = np.random.default_rng(4).normal(size=(30, 10))
    factor = mean_outer(rows)
    blocks = block_gram(tf.constant(rows, tf.float32), 4)  # blocks 4, 4, 2 (+2 padding)
    owners = np.array([1, 0, 1])
    parts = [invert_owned(blocks, 0.1, 10, tf.constant(owners == r)).numpy() for r in (0, 1)]
    assert not parts[0][[0, 2]].any() and not parts[1][1].any()
    total = parts[0] + parts[1]
    for b, (start, stop) in enumerate([(0, 4), (4, 8), (8, 10)]):
        expected = np.linalg.inv(factor[start:stop, start:stop] + 0.1 * np.eye(stop - start))
        size = stop - start
        np.testing.assert_allclose(total[b, :size, :size], expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(total[2, 2:, 2:], np.eye(2), atol=1e-6)  # padding: identity
