"""Conv2D (channels_last, groups=1) by KFC: ``x`` is ``[N, H, W, Cin]``, ``z`` ``[N, Ho, Wo, Cout]``.

A's rows are the im2col patches; A itself comes by default from shifted views of the input
(:mod:`thor_tf.blocks.conv_factor`), never forming the patch matrix. ``Conv2DBlock.a_factor_method
= "im2col"`` restores the patch path (the reference; both are exact).
"""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from thor_tf.blocks.base import KroneckerBlock, row_count
from thor_tf.blocks.conv_factor import Geometry, conv_factor_a

#: How :meth:`Conv2DBlock.factor_a` computes A: "shifted" (default, from shifted views of the
#: input) or "im2col" (patch rows and :func:`~thor_tf.blocks.base.block_gram`).
A_FACTOR_METHODS = ("shifted", "im2col")


class Conv2DBlock(KroneckerBlock):
    """Conv2D (channels_last, groups=1) by im2col: one row per example and output position."""

    kind = "conv2d"
    #: One of :data:`A_FACTOR_METHODS`. "shifted" measured 2.6x (conv1), 6.8x (conv2) and 5.0x
    #: (ResNet-20 stage 3) faster than "im2col", with 8x less peak memory on conv2, on a 2-core
    #: CPU at split_dim 128 (docs/results/bench_conv_factor.json, made by scripts/bench_conv_factor.py at c598086).
    a_factor_method = "shifted"

    @classmethod
    def unsupported_reason(cls, layer):
        reason = super().unsupported_reason(layer)
        if reason is None and getattr(layer, "groups", 1) != 1:
            reason = f"groups={layer.groups}"
        if reason is None and layer.data_format != "channels_last":
            reason = "channels_first"
        return reason

    def pre_activation(self, inputs):
        layer = self.layer
        z = layer.convolution_op(inputs, layer.kernel)
        if layer.use_bias:
            z = ops.add(z, ops.reshape(layer.bias, (1, 1, 1, layer.filters)))
        return z

    def __init__(self, name, layer):
        super().__init__(name, layer)
        self.kh, self.kw = (int(k) for k in layer.kernel_size)
        self.strides = [1, int(layer.strides[0]), int(layer.strides[1]), 1]
        self.rates = [1, int(layer.dilation_rate[0]), int(layer.dilation_rate[1]), 1]
        self.padding = layer.padding.upper()

    def _image(self, inputs):
        """``[N, H, W, Cin]`` float32 input of one call, as the 2-D window sees it."""
        return tf.cast(inputs, tf.float32)

    def geometry(self):
        """The layer's window as a :class:`~thor_tf.blocks.conv_factor.Geometry`."""
        return Geometry((self.kh, self.kw), (self.strides[1], self.strides[2]),
                        (self.rates[1], self.rates[2]), self.padding)

    def factor_signature(self):
        # Conv1DBlock inherits this: its kind and causal padding are part of it.
        return (type(self), self.kernel_shape, self.bias is not None, tuple(self.strides),
                tuple(self.rates), self.padding, getattr(self, "left_pad", 0),
                self.a_factor_method)

    def factor_a(self, records, split_dim=None, masks=None):
        """Diagonal blocks of A, ``[nb, d, d]`` float32, exactly as the base class computes them
        from im2col rows; by default without forming those rows (see :attr:`a_factor_method`).
        With row ``masks`` (a per-position loss whose terms align with the output positions) from
        the im2col rows."""
        if self.a_factor_method == "im2col" or masks is not None:
            return super().factor_a(records, split_dim, masks)
        if self.a_factor_method != "shifted":
            raise ValueError(f"a_factor_method must be one of {A_FACTOR_METHODS}; "
                             f"got {self.a_factor_method!r}.")
        split = None if split_dim is None else self.split_sizes(split_dim)[0]
        images = [self._image(r.inputs) for r in records]
        return conv_factor_a(images, self.geometry(), self.bias is not None, split)

    def input_rows(self, inputs):
        x = self._image(inputs)
        patches = tf.image.extract_patches(
            x, sizes=[1, self.kh, self.kw, 1], strides=self.strides, rates=self.rates,
            padding=self.padding)
        return tf.reshape(patches, [-1, self.in_dim])

    def input_sq_norm_sum(self, inputs):
        # Σ over patches of ||patch||² = a one-channel convolution of Σ_c x² with a ones kernel:
        # each output position sums the squares under its receptive field. No patches formed.
        x = self._image(inputs)
        energy = tf.reduce_sum(tf.square(x), axis=-1, keepdims=True)
        ones = tf.ones([self.kh, self.kw, 1, 1], tf.float32)
        per_position = tf.nn.conv2d(
            energy, ones, strides=self.strides, padding=self.padding, dilations=self.rates)
        return tf.reduce_sum(per_position), row_count(per_position)
