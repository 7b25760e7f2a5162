"""Conv1D (channels_last, groups=1) by KFC, as Conv2D with height 1.

Shapes: ``x`` is ``[N, T, Cin]``, ``z`` ``[N, T_out, Cout]``, the kernel ``[k, Cin, Cout]``.

Rows of A are the patches over T, one per example and output position (``P = T_out``), with
features in (k, Cin) order: the kernel reshaped to ``[k·Cin, Cout]`` (bias appended as the last
row when the layer has one) is the block matrix. Everything is Conv2D's on ``[N, 1, T, Cin]``
(patches, trace, and A from shifted views by default) with a ``1×k`` window, the layer's stride
and dilation; ``padding="causal"`` pads ``dilation·(k−1)`` zeros on the left and then takes valid
patches, as Keras' ``Conv1D.call`` does.
"""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from thor_tf.blocks.base import KroneckerBlock
from thor_tf.blocks.conv2d import Conv2DBlock


class Conv1DBlock(Conv2DBlock):
    """Conv1D (channels_last, groups=1): one row of A per example and output time step."""

    kind = "conv1d"

    # unsupported_reason: Conv2DBlock's (not built, LoRA, quantized, groups, channels_first).

    def __init__(self, name, layer):
        KroneckerBlock.__init__(self, name, layer)
        self.kh, self.kw = 1, int(layer.kernel_size[0])
        self.stride = int(layer.strides[0])
        self.dilation = int(layer.dilation_rate[0])
        self.strides = [1, 1, self.stride, 1]
        self.rates = [1, 1, self.dilation, 1]
        self.causal = layer.padding == "causal"
        # Causal: left padding by hand, then valid patches (Keras' Conv1D.call does the same).
        self.left_pad = self.dilation * (self.kw - 1) if self.causal else 0
        self.padding = "VALID" if self.causal else layer.padding.upper()

    def pre_activation(self, inputs):
        layer = self.layer
        x, padding = inputs, layer.padding
        if self.causal:
            x = ops.pad(x, [[0, 0], [self.left_pad, 0], [0, 0]])
            padding = "valid"
        z = ops.conv(x, layer.kernel, strides=list(layer.strides), padding=padding,
                     dilation_rate=layer.dilation_rate, data_format=layer.data_format)
        if layer.use_bias:
            z = ops.add(z, ops.reshape(layer.bias, (1, 1, layer.filters)))
        return z

    def _image(self, inputs):
        """``[N, T, C]`` -> ``[N, 1, T(+causal padding), C]`` float32: Conv2D's input rows, trace
        and A factor (both methods) then apply unchanged."""
        x = tf.cast(inputs, tf.float32)
        if self.left_pad:
            x = tf.pad(x, [[0, 0], [self.left_pad, 0], [0, 0]])
        return x[:, None]
