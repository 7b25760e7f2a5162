"""Conv2D / Conv1D A factor from shifted input views (thor_tf.blocks.conv_factor) against float64
NumPy references: explicit patches (loops over output positions and kernel offsets), explicit
outer products, and the diagonal blocks of the split layout cut out by hand."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from reference import conv1d_patches, conv_patches, homogeneous, mean_outer
from thor_tf.blocks import conv_factor
from thor_tf.blocks.conv1d import Conv1DBlock
from thor_tf.blocks.conv2d import Conv2DBlock
from thor_tf.capture import Record

RTOL = 1e-5


def split_blocks(m, d):
    """``[nb, d, d]`` diagonal blocks of ``m`` cut at multiples of ``d``, the last zero-padded
    (``d`` None or >= n: ``m`` itself as one block)."""
    n = m.shape[0]
    if d is None or d >= n:
        return m[None]
    nb = -(-n // d)
    out = np.zeros((nb, d, d))
    for b in range(nb):
        lo, hi = b * d, min((b + 1) * d, n)
        out[b, :hi - lo, :hi - lo] = m[lo:hi, lo:hi]
    return out


def assert_close(got, want, rtol=RTOL):
    """Relative to the largest entry of the reference (entries near 0 are compared absolutely)."""
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale)


def conv_block(cin, kernel, strides=(1, 1), padding="same", dilation=(1, 1), use_bias=True):
    layer = keras.layers.Conv2D(3, kernel, strides=strides, padding=padding,
                                dilation_rate=dilation, use_bias=use_bias)
    layer.build((None, None, None, cin))
    return Conv2DBlock("conv", layer)


def reference_a(xs, kernel, strides, padding, dilation, use_bias, split):
    """Float64 A's diagonal blocks over the explicit patches of every call in ``xs``."""
    rows = [conv_patches(x.astype(np.float64), kernel, strides, padding, dilation) for x in xs]
    rows = np.concatenate([r.reshape(-1, r.shape[-1]) for r in rows])
    return split_blocks(mean_outer(homogeneous(rows, use_bias)), split)


def records(*xs):
    return [Record(tf.constant(x), None) for x in xs]


CASES = [
    # kernel, strides, padding, dilation, use_bias, cin, split_dim
    ((3, 3), (1, 1), "same", (1, 1), True, 4, 16),    # split a multiple of Cin
    ((3, 3), (2, 2), "same", (1, 1), True, 3, 8),     # split straddles offsets, last block padded
    ((3, 3), (2, 2), "valid", (1, 1), False, 3, 5),
    ((3, 2), (1, 1), "same", (2, 2), True, 2, None),  # dilation 2, full factor
    ((2, 3), (2, 1), "valid", (2, 2), False, 2, 4),
    ((1, 1), (1, 1), "valid", (1, 1), True, 5, 5),    # 1x1: the bias alone in the last block
    ((1, 1), (1, 1), "valid", (1, 1), True, 5, 4),    # channel 4 and the bias in the last block
    ((1, 1), (2, 2), "same", (1, 1), False, 5, None),
    ((3, 3), (1, 1), "same", (1, 1), True, 2, 100),   # split >= a_dim: one exact block
    # split 1: the diagonal alone (conv_diagonal_sums), strides, dilation, VALID, no bias
    ((3, 3), (2, 2), "same", (1, 1), True, 3, 1),
    ((2, 3), (2, 1), "valid", (2, 2), False, 2, 1),
    ((3, 2), (1, 1), "same", (2, 2), True, 2, 1),
    ((1, 1), (1, 1), "valid", (1, 1), True, 5, 1),
]


@pytest.mark.parametrize("strategy", ["pairs", "concat"])
@pytest.mark.parametrize("kernel,strides,padding,dilation,use_bias,cin,split", CASES)
def test_shifted_factor_matches_explicit_patches(kernel, strides, padding, dilation, use_bias, cin,
                                                 split, strategy):
    x = np.random.default_rng(0).normal(size=(2, 7, 6, cin)).astype("float32")
    geometry = conv_factor.Geometry(kernel, strides, dilation, padding.upper())
    got = conv_factor.conv_factor_a([tf.constant(x)], geometry, use_bias, split, strategy)
    assert_close(got, reference_a([x], kernel, strides, padding, dilation, use_bias, split))


@pytest.mark.parametrize("method", ["shifted", "im2col"])
def test_block_factor_a_both_methods_two_calls(method, monkeypatch):
    """A layer called twice (different sizes): A is the mean over the rows of both calls."""
    monkeypatch.setattr(Conv2DBlock, "a_factor_method", method)
    rng = np.random.default_rng(1)
    x1 = rng.normal(size=(2, 6, 6, 3)).astype("float32")
    x2 = rng.normal(size=(3, 5, 7, 3)).astype("float32")
    block = conv_block(3, (3, 3), strides=(2, 2))
    got = block.factor_a(records(x1, x2), split_dim=10)
    assert_close(got, reference_a([x1, x2], (3, 3), (2, 2), "same", (1, 1), True, 10))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_inputs_give_float32_statistics(dtype):
    x = np.random.default_rng(2).normal(size=(2, 6, 5, 4)).astype("float32")
    half = tf.cast(tf.constant(x), dtype)
    block = conv_block(4, (3, 3))
    got = block.factor_a([Record(half, None)], split_dim=12)
    assert got.dtype == tf.float32
    # The reference sees the same rounded inputs: only the statistics' precision is tested.
    rounded = tf.cast(half, tf.float32).numpy()
    assert_close(got, reference_a([rounded], (3, 3), (1, 1), "same", (1, 1), True, 12))


@pytest.mark.parametrize("split", [8, 1])
def test_dynamic_spatial_sizes_under_tf_function(split):
    block = conv_block(2, (3, 3), strides=(2, 2))
    fn = tf.function(lambda x: block.factor_a([Record(x, None)], split_dim=split),
                     input_signature=[tf.TensorSpec([None, None, None, 2], tf.float32)])
    for shape in [(2, 7, 6, 2), (1, 4, 9, 2)]:
        x = np.random.default_rng(3).normal(size=shape).astype("float32")
        assert_close(fn(x), reference_a([x], (3, 3), (2, 2), "same", (1, 1), True, split))


@pytest.mark.parametrize("split", [5, 1])
@pytest.mark.parametrize("padding,stride,dilation", [("causal", 1, 2), ("same", 2, 1), ("valid", 1, 1)])
def test_conv1d_uses_the_shifted_path(padding, stride, dilation, split):
    x = np.random.default_rng(4).normal(size=(3, 9, 4)).astype("float32")
    layer = keras.layers.Conv1D(2, 3, strides=stride, padding=padding, dilation_rate=dilation)
    layer.build((None, None, 4))
    block = Conv1DBlock("conv", layer)
    assert block.a_factor_method == "shifted"
    rows = conv1d_patches(x.astype(np.float64), 3, stride, padding, dilation)
    want = split_blocks(mean_outer(homogeneous(rows.reshape(-1, rows.shape[-1]), True)), split)
    assert_close(block.factor_a(records(x), split_dim=split), want)


def test_block_segments_cover_the_features_in_order():
    # Cin 3, 4 offsets, bias: a_dim 13 cut in blocks of 5 -> [0:5], [5:10], [10:13] (+2 padding).
    blocks = conv_factor.block_segments(3, 4, True, 5)
    S = conv_factor.Segment
    assert blocks == [[S(0, 0, 3), S(1, 0, 2)], [S(1, 2, 3), S(2, 0, 3), S(3, 0, 1)],
                      [S(3, 1, 3), S(None, 0, 1)]]


def test_unknown_method_is_refused(monkeypatch):
    monkeypatch.setattr(Conv2DBlock, "a_factor_method", "fft")
    with pytest.raises(ValueError, match="a_factor_method"):
        conv_block(2, (3, 3)).factor_a(records(np.zeros((1, 4, 4, 2), "float32")))
