"""LoRA adapters: two Kronecker blocks in series on a LoRA-enabled ``Dense`` / ``EinsumDense``.

Keras' ``layer.enable_lora(rank, lora_alpha=None)`` freezes the kernel ``W`` and adds two trainable
factors, ``lora_kernel_a`` (``A``: the kernel's shape with its last axis replaced by ``r``) and
``lora_kernel_b`` (``B``: ``[r, e]``, ``e`` the kernel's last axis). The layer computes with
``W + s·(A·B)`` (``A·B`` a matmul over ``r``), ``s = lora_alpha / lora_rank`` (``lora_alpha``
defaults to the rank: ``s = 1``). For a Dense on rows ``x [in]`` with ``g = dℓ/dz [out]``:

    z = x·W + s·(x·A)·B + b
    ∇A = x ⊗ (s·g·Bᵀ)                       A side: a = x        over in,  g_A = s·g·Bᵀ  over r
    ∇B = (s·x·A) ⊗ g,   ∇b = g               B side: a = [s·x·A, 1] over r(+1), g_B = g  over out

(``⊗``: outer product, row-major vec as in :mod:`thor_tf.blocks.base`), so each adapter has the
exact per-row Kronecker structure of a Dense layer and gets its own block: :class:`LoraABlock`
(``"<layer>/lora_a"``, kernel ``lora_kernel_a``) and :class:`LoraBBlock` (``"<layer>/lora_b"``,
kernel ``lora_kernel_b``, the layer's bias folded in as its homogeneous coordinate). The scale
``s`` sits where the layer applies it: on the B side's input ``u = s·x·A`` (what ``B``
multiplies), and through ``∂z/∂u`` on the A side's output gradient. Each block's ``A ⊗ G`` is the
mean over rows of ``vec(∇) vec(∇)ᵀ`` of its own variable: the K-FAC block of that variable alone
(the cross terms between ``A`` and ``B`` are left out, as between any two layers). The frozen
kernel ``W`` has no block and no factor work.

EinsumDense (``"<input>,<kernel>-><output>"`` that factors as Dense, see
:mod:`thor_tf.blocks.einsum_dense`, with the kernel's last axis an output axis): the kernel's axes
are the contracted axes ``c``, the other output axes ``o'`` (e.g. the heads of an attention
projection ``"abc,cde->abde"``, kernel ``[C, heads, head_dim]``) and the last axis ``e``. LoRA
factors the kernel as a matrix ``[c·o', e]``, so ``A`` is ``[c, o', r]`` and ``B`` ``[r, e]``:

    u[p, o', k] = Σ_c x[p, c]·A[c, o', k]          (the A side: an EinsumDense from c to (o', k))
    z[p, o', e] = Σ_k s·u[p, o', k]·B[k, e] + ...
    A side: rows p,        a = x[p, c]         over c,  g_A = s·Σ_e g[p, o', e]·B[k, e]  over (o', k)
    B side: rows (p, o'),  a = s·u[p, o', :]   over r,  g_B = g[p, o', :]                over e

The B side's rows run over the positions and the other output axes (``P_B = P·|o'|``: B is
shared by every head as a Dense kernel is shared by every position). Its bias is folded only
when the layer's bias spans exactly ``e`` and there is no ``o'`` (else it is first order).

Both blocks observe the layer's one ``z`` (its activation's argument, as the Dense block does):
the B side reads the A side's records (:attr:`~thor_tf.blocks.KroneckerBlock.shares_records_of`),
so a call is recorded once. QLoRA (``quantize("int8"/"int4")`` then ``enable_lora``) is covered:
Keras' quantized calls add ``s·(x·A)·B`` before the bias and the activation as the float call
does, the hooks observe ``quantized_call`` too, and neither block reads the kernel. Not covered:
an equation whose kernel's last axis is contracted, the float8/GPTQ/AWQ modes and
``Embedding.enable_lora`` (those stay first order, with the reason in the registration table).
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf
from keras import ops

from thor_tf.blocks.base import KroneckerBlock, joined_row_weights, positions_per_example
from thor_tf.blocks.einsum_dense import analyze_equation


#: Quantization modes whose call adds ``s·(x·A)·B`` to the quantized product before the bias and
#: the activation, as the float call does (QLoRA): the adapters' blocks never read the kernel.
QUANTIZED_CALLS_CHECKED = (None, "int8", "int4")


def lora_scale(layer):
    """``s = lora_alpha / lora_rank``: the factor Keras applies to ``A·B``."""
    return float(layer.lora_alpha) / float(layer.lora_rank)


def lora_reason(layer):
    """Why a LoRA-enabled layer's adapters cannot have blocks (a short phrase), or None."""
    if not getattr(layer, "built", True) or getattr(layer, "lora_kernel_a", None) is None:
        return "not built"
    mode = getattr(getattr(layer, "dtype_policy", None), "quantization_mode", None)
    if mode not in QUANTIZED_CALLS_CHECKED:
        return f"LoRA on a {mode}-quantized layer"
    if isinstance(layer, keras.layers.EinsumDense):
        plan, reason = analyze_equation(layer.equation)
        if plan is None:
            return reason
        if plan["kernel"][-1] not in plan["out_axes"]:
            return "LoRA on an equation whose kernel's last axis is contracted"
    elif not isinstance(layer, keras.layers.Dense):
        return "LoRA on a layer that is neither Dense nor EinsumDense"
    return None


class _Geometry:
    """Rows of ``x`` and ``dℓ/dz`` and the matrix views of ``A`` for one LoRA layer (module)."""

    def __init__(self, layer):
        a_shape = tuple(int(s) for s in layer.lora_kernel_a.shape)
        b_shape = tuple(int(s) for s in layer.lora_kernel_b.shape)
        self.rank = b_shape[0]
        self.e = b_shape[1]
        if isinstance(layer, keras.layers.EinsumDense):
            plan, _ = analyze_equation(layer.equation)
            inp, ker, out = plan["input"], plan["kernel"], plan["output"]
            size = dict(zip(ker, a_shape[:-1] + (self.e,)))
            last = ker[-1]
            contracted = plan["contracted"]
            others = [c for c in plan["out_axes"] if c != last]
            self.in_dim = math.prod(size[c] for c in contracted)
            self.n_other = math.prod(size[c] for c in others)
            self._x_perm = [inp.index(c) for c in plan["positions"] + contracted]
            self._g_perm = [out.index(c) for c in plan["positions"] + others + [last]]
            # A's axes are the kernel's with the last one replaced by r: to (contracted, o', r).
            self._a_perm = [ker.index(c) for c in contracted + others] + [len(ker) - 1]
            self._a_inverse = [self._a_perm.index(i) for i in range(len(ker))]
            self._a_matrix_shape = [size[c] for c in contracted + others] + [self.rank]
            self.a_shape = a_shape
            self.output_rank = len(out)
            self._z_axes = [out.index(c) for c in plan["out_axes"]]
        else:  # Dense: [..., in] -> [..., out]
            self.in_dim = a_shape[0]
            self.n_other = 1
            self._x_perm = self._g_perm = self._a_perm = None
            self.a_shape = a_shape
            self.output_rank = None
        #: Features of ``z`` per row of the layer (the kernel's output axes).
        self.z_width = self.n_other * self.e

    def x_rows(self, inputs):
        x = tf.cast(inputs, tf.float32)
        if self._x_perm is not None:
            x = tf.transpose(x, self._x_perm)
        return tf.reshape(x, [-1, self.in_dim])

    def g_rows(self, g):
        """``[R, n_other, e]`` float32 rows of an output-shaped tensor."""
        g = tf.cast(g, tf.float32)
        if self._g_perm is not None:
            g = tf.transpose(g, self._g_perm)
        return tf.reshape(g, [-1, self.n_other, self.e])

    def a_matrix(self, value):
        """``A`` ``[in, n_other·r]`` (columns ``(o', k)``, ``k`` fastest)."""
        a = tf.cast(value, tf.float32)
        if self._a_perm is not None:
            a = tf.transpose(a, self._a_perm)
        return tf.reshape(a, [self.in_dim, self.n_other * self.rank])

    def a_from_matrix(self, matrix):
        if self._a_perm is None:
            return tf.reshape(matrix, self.a_shape)
        return tf.transpose(tf.reshape(matrix, self._a_matrix_shape), self._a_inverse)

    def matches(self, z):
        shape = z.shape
        if shape.rank is None:
            return True
        if self.output_rank is None:
            width = shape[-1]
            return width is None or int(width) == self.e
        if shape.rank != self.output_rank:
            return False
        sizes = [shape[i] for i in self._z_axes]
        return None in sizes or math.prod(int(s) for s in sizes) == self.z_width


def _pre_activation(layer, inputs):
    """``z`` as Keras' LoRA layer computes it: ``W + s·A·B`` as the kernel (module docstring)."""
    delta = lora_scale(layer) * ops.matmul(layer.lora_kernel_a, layer.lora_kernel_b)
    kernel = ops.cast(ops.add(layer._kernel, delta), layer.compute_dtype)
    if isinstance(layer, keras.layers.EinsumDense):
        z = ops.einsum(layer.equation, inputs, kernel)
    else:
        z = ops.matmul(inputs, kernel)
    if layer.bias is not None:
        z = ops.add(z, layer.bias)
    return z


def _expand_masks(masks, repeats):
    """Per-position row masks repeated for rows that run over positions × ``repeats``."""
    if masks is None or repeats == 1:
        return masks
    return [None if m is None else tf.repeat(m, repeats) for m in masks]


class _LoraBlock(KroneckerBlock):
    """What the two adapter blocks share: the layer's ``z``, its rows, the scale."""

    @classmethod
    def unsupported_reason(cls, layer):
        return lora_reason(layer)

    def _setup(self, name, layer):
        self.layer = layer
        self.geometry = _Geometry(layer)
        self.kernel = getattr(layer, self.kernel_attribute)
        self.kernel_shape = tuple(int(s) for s in self.kernel.shape)

    @property
    def scale(self):
        return lora_scale(self.layer)

    def pre_activation(self, inputs):
        return _pre_activation(self.layer, inputs)

    def matches(self, record):
        return self.geometry.matches(record.z)

    @property
    def mask_width(self):
        # A loss mask has one weight per position of z (its rows are z's size over z_width).
        return self.geometry.z_width

    def positions(self, records):
        # Rows per example of this block: z's size over the features of one of its rows.
        return positions_per_example(records, self._row_width)

    def input_sq_norm_sum(self, inputs):
        rows = self.input_rows(inputs)
        return tf.reduce_sum(tf.square(rows)), tf.cast(tf.shape(rows)[0], tf.float32)

    def trace_g(self, output_grads, masks=None):
        rows = [self.output_rows(g) for g in output_grads]
        norms = tf.reduce_sum(tf.square(tf.concat(rows, axis=0)), axis=-1)
        if masks is None:
            return tf.reduce_mean(norms)
        weights = joined_row_weights(masks, rows)
        return tf.reduce_sum(norms * weights) / tf.maximum(tf.reduce_sum(weights), 1.0)


class LoraABlock(_LoraBlock):
    """The A side of a LoRA layer: kernel ``lora_kernel_a``, ``a = x`` over the contracted axes,
    ``g_A = s·g·Bᵀ`` over ``(o', r)``; no bias."""

    kind = "lora A"
    kernel_attribute = "lora_kernel_a"

    def __init__(self, name, layer):
        self._setup(name, layer)
        self.name = f"{name}/lora_a"
        geometry = self.geometry
        self.bias = None
        self.in_dim = self.a_dim = geometry.in_dim
        self.g_dim = geometry.n_other * geometry.rank
        self._row_width = geometry.z_width  # one row per position

    def companion_blocks(self):
        """The B side: a second block on the same layer, reading this block's records."""
        return [LoraBBlock(self.name[: -len("/lora_a")], self.layer, a_side=self)]

    def to_matrix(self, kernel_value, bias_value=None):
        return self.geometry.a_matrix(kernel_value)

    def from_matrix(self, matrix):
        return self.geometry.a_from_matrix(matrix), None

    def input_rows(self, inputs):
        return self.geometry.x_rows(inputs)

    def output_rows(self, g):
        b = tf.cast(self.layer.lora_kernel_b, tf.float32)                # [r, e]
        rows = tf.einsum("roe,ke->rok", self.geometry.g_rows(g), b) * self.scale
        return tf.reshape(rows, [-1, self.g_dim])


class LoraBBlock(_LoraBlock):
    """The B side of a LoRA layer: kernel ``lora_kernel_b`` ``[r, e]``, ``a = s·x·A`` over ``r``
    (and the bias coordinate), ``g_B = g`` over ``e``; rows over positions × ``o'``."""

    kind = "lora B"
    kernel_attribute = "lora_kernel_b"

    def __init__(self, name, layer, a_side=None):
        self._setup(name, layer)
        self.name = f"{name}/lora_b"
        #: The A side, whose records (the same calls) this block reads.
        self.shares_records_of = a_side
        geometry = self.geometry
        bias = getattr(layer, "bias", None)
        if isinstance(layer, keras.layers.EinsumDense):
            plan, _ = analyze_equation(layer.equation)
            folded = (bias is not None and geometry.n_other == 1
                      and set(layer.bias_axes or "") == {plan["kernel"][-1]})
        else:
            folded = bias is not None
        self.bias = bias if folded else None
        self.in_dim = geometry.rank
        self.a_dim = geometry.rank + (1 if self.bias is not None else 0)
        self.g_dim = geometry.e
        self._row_width = geometry.e  # one row per position and other output axis
        self.mask_repeats = geometry.n_other  # a position's mask weight, per other output axis

    def to_matrix(self, kernel_value, bias_value=None):
        m = tf.cast(kernel_value, tf.float32)
        if self.bias is not None:
            m = tf.concat([m, tf.reshape(tf.cast(bias_value, tf.float32), [1, self.g_dim])], 0)
        return m

    def from_matrix(self, matrix):
        bias = None
        if self.bias is not None:
            bias = tf.reshape(matrix[self.in_dim], tuple(int(s) for s in self.bias.shape))
        return matrix[: self.in_dim], bias

    def input_rows(self, inputs):
        geometry = self.geometry
        a = geometry.a_matrix(self.layer.lora_kernel_a)                  # [in, n_other·r]
        u = tf.matmul(geometry.x_rows(inputs), a) * self.scale
        return tf.reshape(u, [-1, geometry.rank])

    def output_rows(self, g):
        return tf.reshape(self.geometry.g_rows(g), [-1, self.g_dim])

    def factor_a(self, records, split_dim=None, masks=None):
        return super().factor_a(records, split_dim, _expand_masks(masks, self.geometry.n_other))

    def factor_g(self, output_grads, split_dim=None, masks=None):
        return super().factor_g(output_grads, split_dim,
                                _expand_masks(masks, self.geometry.n_other))

    def trace_a(self, records, masks=None):
        return super().trace_a(records, _expand_masks(masks, self.geometry.n_other))

    def trace_g(self, output_grads, masks=None):
        return super().trace_g(output_grads, _expand_masks(masks, self.geometry.n_other))
