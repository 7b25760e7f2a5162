"""Conv2D (channels_last, groups=1) by im2col (KFC): ``x`` is ``[N, H, W, Cin]``, ``z`` ``[N, Ho, Wo, Cout]``."""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from thor_tf.blocks.base import KroneckerBlock


class Conv2DBlock(KroneckerBlock):
    """Conv2D (channels_last, groups=1) by im2col: one row per example and output position."""

    kind = "conv2d"

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

    def input_rows(self, inputs):
        x = tf.cast(inputs, tf.float32)
        patches = tf.image.extract_patches(
            x, sizes=[1, self.kh, self.kw, 1], strides=self.strides, rates=self.rates,
            padding=self.padding)
        return tf.reshape(patches, [-1, self.in_dim])

    def input_sq_norm_sum(self, inputs):
        # Σ over patches of ||patch||² = a one-channel convolution of Σ_c x² with a ones kernel:
        # each output position sums the squares under its receptive field. No patches formed.
        x = tf.cast(inputs, tf.float32)
        energy = tf.reduce_sum(tf.square(x), axis=-1, keepdims=True)
        ones = tf.ones([self.kh, self.kw, 1, 1], tf.float32)
        per_position = tf.nn.conv2d(
            energy, ones, strides=self.strides, padding=self.padding, dilations=self.rates)
        rows = tf.cast(tf.reduce_prod(tf.shape(per_position)[:-1]), tf.float32)
        return tf.reduce_sum(per_position), rows
