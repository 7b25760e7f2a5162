"""EinsumDense: ``z = einsum(equation, x, kernel) (+ bias)`` for equations that factor as Dense.

An equation ``"<input>,<kernel>-><output>"`` factors when every kernel axis is either *contracted*
(in the input, not in the output) or an *output axis* (in the output, not in the input), and every
other input axis is a *position* (in the output: the batch axis and e.g. the sequence axis). Then,
for each example and position ``p``, ``z[p, o] = Σ_c x[p, c] · W[c, o]`` with ``c`` the flattened
contracted axes and ``o`` the flattened output axes, both in the kernel's axis order: Dense on rows.

    A rows: x with the position axes first (input order) and the contracted axes last (kernel
            order), flattened to ``[N·P, in]``
    G rows: dℓ/dz with the position axes first and the kernel's output axes last (kernel order),
            flattened to ``[N·P, out]``
    P     : the product of the position axes other than the batch axis
    matrix: the kernel transposed to (contracted axes, output axes) and reshaped to ``[in, out]``;
            :meth:`from_matrix` is the exact inverse

MultiHeadAttention's projections are of this kind: query/key/value ``"abc,cde->abde"`` (in = C,
out = heads·head_dim, P = T), output ``"abcd,cde->abe"`` (in = heads·head_dim, out = E). Dense-like
uses ``"ab,bc->ac"`` and ``"abc,cd->abd"`` reduce to Dense exactly.

Bias: Keras' bias covers ``bias_axes``, possibly a subset of the output axes. It is folded into A as
the homogeneous coordinate only when it spans exactly the kernel's output axes; otherwise
``self.bias`` is None, so the engine leaves the bias variable first order (its plain gradient).

Equations that do not factor (ellipsis, an axis in the kernel, the input and the output, an input
axis summed away, a repeated axis, the batch axis contracted) stay first order, with the reason in
the registration table.
"""

from __future__ import annotations

import math
import re

import tensorflow as tf
from keras import ops

from thor_tf.blocks.base import KroneckerBlock


def analyze_equation(equation):
    """Split an EinsumDense equation into its Kronecker structure.

    Returns:
      ``(plan, reason)``: ``plan`` a dict with ``input``, ``kernel``, ``output`` (the three axis
      strings), ``positions`` (input axes kept in the output, input order), ``contracted`` and
      ``out_axes`` (kernel axes, kernel order); ``reason`` None. When the equation does not factor:
      ``(None, reason)`` with a short phrase.
    """
    if "..." in equation:
        return None, "ellipsis in equation"
    match = re.fullmatch(r"\s*([a-zA-Z]+)\s*,\s*([a-zA-Z]+)\s*->\s*([a-zA-Z]+)\s*", equation)
    if match is None:
        return None, f"equation {equation!r} not of the form x,w->z"
    inp, ker, out = match.groups()
    for spec in (inp, ker, out):
        if len(set(spec)) != len(spec):
            return None, f"repeated axis in {spec!r}"
    shared = [c for c in ker if c in inp and c in out]
    if shared:
        return None, f"kernel axis {shared[0]!r} is also an input and output axis"
    summed = [c for c in inp if c not in ker and c not in out]
    if summed:
        return None, f"input axis {summed[0]!r} is summed away"
    if inp[0] not in out:
        return None, "batch axis contracted"
    plan = {
        "input": inp, "kernel": ker, "output": out,
        "positions": [c for c in inp if c in out],
        "contracted": [c for c in ker if c in inp],
        "out_axes": [c for c in ker if c in out],
    }
    return plan, None


class EinsumDenseBlock(KroneckerBlock):
    """EinsumDense whose kernel maps contracted input axes to output axes (see the module)."""

    kind = "einsum_dense"

    @classmethod
    def unsupported_reason(cls, layer):
        reason = super().unsupported_reason(layer)
        if reason is None:
            _, reason = analyze_equation(layer.equation)
        return reason

    def __init__(self, name, layer):
        self.name = name
        self.layer = layer
        self.kernel = layer.kernel
        plan, reason = analyze_equation(layer.equation)
        if plan is None:
            raise ValueError(f"EinsumDense {layer.name!r}: {reason}")
        self.plan = plan
        inp, ker, out = plan["input"], plan["kernel"], plan["output"]
        self.kernel_shape = tuple(int(s) for s in self.kernel.shape)
        size = dict(zip(ker, self.kernel_shape))
        self.in_dim = math.prod(size[c] for c in plan["contracted"])
        self.g_dim = math.prod(size[c] for c in plan["out_axes"])
        # Kernel -> [contracted..., out_axes...] and back.
        self._kernel_perm = [ker.index(c) for c in plan["contracted"] + plan["out_axes"]]
        self._kernel_inverse = [self._kernel_perm.index(i) for i in range(len(ker))]
        self._matrix_kernel_shape = [size[c] for c in plan["contracted"] + plan["out_axes"]]
        # Input -> [positions..., contracted...]; output -> [positions..., out_axes...].
        self._input_perm = [inp.index(c) for c in plan["positions"] + plan["contracted"]]
        self._output_perm = [out.index(c) for c in plan["positions"] + plan["out_axes"]]
        self._out_axes = len(plan["out_axes"])

        bias_axes = layer.bias_axes or ""
        bias = getattr(layer, "bias", None)
        folded = (bias is not None and len(bias_axes) == len(plan["out_axes"])
                  and set(bias_axes) == set(plan["out_axes"]))
        # A bias over a subset of the output axes is not a homogeneous coordinate of A: None here
        # leaves it to the first-order update (the engine only touches a block's own bias).
        self.bias = bias if folded else None
        if folded:
            in_output_order = [c for c in out if c in bias_axes]
            self._bias_shape = tuple(int(s) for s in bias.shape)
            self._bias_compact = [size[c] for c in in_output_order]
            self._bias_perm = [in_output_order.index(c) for c in plan["out_axes"]]
            self._bias_inverse = [self._bias_perm.index(i) for i in range(len(self._bias_perm))]
        self.a_dim = self.in_dim + (1 if self.bias is not None else 0)

    def matches(self, record):
        # z has the equation's output axes; the kernel's output axes make up g_dim.
        shape = record.z.shape
        if shape.rank is None:
            return True
        if shape.rank != len(self._output_perm):
            return False
        sizes = [shape[i] for i in self._output_perm[len(self._output_perm) - self._out_axes:]]
        return None in sizes or math.prod(int(s) for s in sizes) == self.g_dim

    def pre_activation(self, inputs):
        z = ops.einsum(self.layer.equation, inputs, self.layer.kernel)
        if self.layer.bias is not None:
            z = ops.add(z, self.layer.bias)
        return z

    # -- gradients <-> block matrix -------------------------------------------------------------
    def to_matrix(self, kernel_value, bias_value=None):
        k = _transpose(tf.cast(kernel_value, tf.float32), self._kernel_perm)
        m = tf.reshape(k, [self.in_dim, self.g_dim])
        if self.bias is not None:
            b = tf.reshape(tf.cast(bias_value, tf.float32), self._bias_compact)
            b = tf.reshape(_transpose(b, self._bias_perm), [1, self.g_dim])
            m = tf.concat([m, b], axis=0)
        return m

    def from_matrix(self, matrix):
        k = tf.reshape(matrix[: self.in_dim], self._matrix_kernel_shape)
        kernel = _transpose(k, self._kernel_inverse)
        bias = None
        if self.bias is not None:
            compact = [self._bias_compact[i] for i in self._bias_perm]
            b = tf.reshape(matrix[self.in_dim], compact)
            bias = tf.reshape(_transpose(b, self._bias_inverse), self._bias_shape)
        return kernel, bias

    # -- statistics -----------------------------------------------------------------------------
    def input_rows(self, inputs):
        x = _transpose(tf.cast(inputs, tf.float32), self._input_perm)
        return tf.reshape(x, [-1, self.in_dim])

    def input_sq_norm_sum(self, inputs):
        x = tf.cast(inputs, tf.float32)  # every input entry is in exactly one row
        return tf.reduce_sum(tf.square(x)), tf.cast(tf.size(x) // self.in_dim, tf.float32)

    def output_rows(self, g):
        g = _transpose(tf.cast(g, tf.float32), self._output_perm)
        return tf.reshape(g, [-1, self.g_dim])

    def trace_g(self, output_grads, masks=None):
        if masks is not None:
            return super().trace_g(output_grads, masks)
        total = tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in output_grads])
        count = tf.add_n([tf.cast(tf.size(g) // self.g_dim, tf.float32) for g in output_grads])
        return total / count


def _transpose(x, perm):
    """``tf.transpose(x, perm)``, or ``x`` itself for the identity permutation (a Transformer's
    query/key/value/output projections: every permutation here is the identity, and each
    Transpose is an op to trace and run at every step; the same values)."""
    if list(perm) == list(range(len(perm))):
        return x
    return tf.transpose(x, perm)
