"""Tied embeddings: one matrix ``E [V, D]`` used as the token lookup and as the output projection.

``keras.layers.ReversibleEmbedding`` (KerasHub's GPT-2, Gemma, Llama; Keras ≥ 3.11) looks tokens up
with ``call(x)`` and, with ``tie_weights=True``, computes logits with ``call(h, reverse=True)`` as
``h @ Eᵀ``. The gradient of ``E`` is the sum of the two uses':

    ∇E = ∇_lookup + ∇_head,   ∇_lookup = Σ_rows onehot(x) g_Lᵀ  [V, D],   ∇_head = Σ_rows g_H hᵀ  [V, D]

and its Fisher block is a sum of two Kronecker products (DESIGN §8): the lookup's
``diag(f) ⊗ G_L`` (as :class:`~thor_tf.blocks.EmbeddingBlock`) and the head's ``G_H ⊗ A_H`` with
``A_H = E[h hᵀ]`` over D and ``G_H`` over V (a Dense head of kernel ``Eᵀ``, transposed).

The approximation (``thor_tf`` 's choice): each use keeps its own exact Kronecker block — two
blocks on the one variable, :class:`TiedLookupBlock` (``"<name>"``) and :class:`TiedHeadBlock`
(``"<name>/reverse"``), each with its own factors, split inverses and trace-rule decisions — and
the step is the sum of the per-use natural gradients of the gradient split by use,

    ΔE = F_L⁻¹ ∇_lookup + F_H⁻¹ ∇_head,

with ``∇_lookup`` summed from the hooks' records (a scatter of the lookup's ``dL/dz`` rows by
token: O(B·T·D)) and ``∇_head = ∇E − ∇_lookup``. This is the natural gradient of the *untied*
parameterization ``(E_L, E_H)`` pulled back through the tie (``E_L = E_H = E``): exact where the two
uses' curvatures do not overlap, up to 2× the tied natural gradient ``(F_L + F_H)⁻¹ ∇E`` in
directions both see (the KL clip bounds the step's size). It is not the naive single Kronecker
product of summed factors (the "tied" registration kfac-pytorch tried, gpauloski/kfac-pytorch#25,
after Zhang et al. 2019 App. A.1, whose cross terms ``diag(f) ⊗ A_H`` and ``G_H ⊗ G_L`` the two uses
never produce). The exact inverse of the damped two-term sum (simultaneous diagonalization of the
V- and D-side factor pairs, block by block) is left for later. With one use absent from a step the
step is exactly that use's block (:class:`EmbeddingBlock`, or a bias-free Dense head on ``Eᵀ``).

Cost at GPT-2's V = 50,257, D = 768, split 128: the lookup's A is V floats (1×1 blocks); the
head's G is 393 blocks of 128² (25.8 MB float32, as much again for its inverse) — never V×V; its A
is D×D. Per step the extra work is the lookup-gradient scatter (B·T·D adds) and one more [V, D]
block product.
"""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from thor_tf.blocks.base import KroneckerBlock
from thor_tf.blocks.embedding import EmbeddingBlock


def _is_reverse(args, kwargs):
    """Whether a ``ReversibleEmbedding`` call is the output projection (``reverse=True``)."""
    if "reverse" in kwargs:
        return bool(kwargs["reverse"])
    return len(args) > 1 and bool(args[1])


def _head_reason(layer):
    """Why a ``ReversibleEmbedding``'s ``reverse=True`` call cannot have a block, or None."""
    if getattr(layer, "logit_soft_cap", None) is not None:
        return "soft-capped logits (z is not the call's output)"
    if getattr(layer, "reverse_dtype", None) is not None:
        return "reverse_dtype set"
    return None


def _same_rank(record):
    """A head call maps ``[..., D]`` to ``[..., V]``: ``z`` has the input's rank."""
    rank_in, rank_z = record.inputs.shape.rank, record.z.shape.rank
    return rank_in is None or rank_z is None or rank_z == rank_in


class TiedLookupBlock(EmbeddingBlock):
    """The lookup use of a ``ReversibleEmbedding`` (an :class:`EmbeddingBlock`); it brings its
    tied head (:class:`TiedHeadBlock`) along as a companion when the weights are tied."""

    kind = "embedding"

    def accepts_call(self, args, kwargs):
        return not _is_reverse(args, kwargs)

    def reverse_in_graph(self):
        """Whether the model's graph (Functional) calls the layer with ``reverse=True``: True or
        False from its nodes, None when they do not say (no nodes: the layer is called inside
        another layer's ``call``, as in ``keras_hub.layers.TokenAndPositionEmbedding``, or the
        model is subclassed)."""
        nodes = getattr(self.layer, "_inbound_nodes", None) or []
        calls = [getattr(node, "arguments", None) for node in nodes]
        if not calls or any(c is None for c in calls):
            return None
        return any(_is_reverse(c.args, c.kwargs) for c in calls)

    def companion_blocks(self):
        """The head: tied (:class:`TiedHeadBlock`, on the one matrix) or untied
        (:class:`UntiedHeadBlock`, on ``reverse_embeddings``: Llama, Mistral, Phi-3), unless the
        model's graph (Functional) never calls the layer with ``reverse=True`` (BERT's token
        embedding: a lookup only). When the
        graph does not say, the head is kept subject to discovery's check of one symbolic forward
        pass (:attr:`TiedHeadBlock.needs_call_check`)."""
        layer = self.layer
        in_graph = self.reverse_in_graph()
        if in_graph is False:
            return []
        if getattr(layer, "tie_weights", False):
            head = TiedHeadBlock(f"{self.name}/reverse", layer, lookup=self)
        elif getattr(layer, "reverse_embeddings", None) is not None:
            head = UntiedHeadBlock(f"{self.name}/reverse", layer)
        else:
            return []
        head.needs_call_check = in_graph is None
        return [head]

    def tied_head(self, blocks):
        """The :class:`TiedHeadBlock` of the same layer among ``blocks``, or None."""
        return next((b for b in blocks if isinstance(b, TiedHeadBlock) and b.layer is self.layer),
                    None)

    def lookup_gradient(self, records, z_grads):
        """``∇_lookup = Σ_rows onehot(x) dL/dzᵀ`` ``[V, D]`` float32 of this replica's calls
        (``z_grads``: ``dL/dz`` of each record, unscaled)."""
        tokens = tf.concat([self._tokens(r.inputs) for r in records], axis=0)
        rows = tf.concat([tf.reshape(tf.cast(g, tf.float32), [-1, self.g_dim]) for g in z_grads],
                         axis=0)
        return tf.math.unsorted_segment_sum(rows, tokens, self.vocabulary)


class _HeadUse:
    """What both head blocks share: the layer's ``reverse=True`` calls, on vectors (``z`` of the
    input's rank), where the layer can have a head block at all."""

    @classmethod
    def unsupported_reason(cls, layer):
        return super().unsupported_reason(layer) or _head_reason(layer)

    def accepts_call(self, args, kwargs):
        return _is_reverse(args, kwargs)

    def matches(self, record):
        return _same_rank(record) and super().matches(record)


class TiedHeadBlock(_HeadUse, KroneckerBlock):
    """The output-projection use of a tied ``ReversibleEmbedding``: ``z = h @ Eᵀ``.

    A Dense head without bias whose kernel is ``Eᵀ`` ``[D, V]``: ``a = h`` (``a_dim = D``),
    ``g = dℓ/dz`` over the V logits (``g_dim = V``, split like any Dense output). Its gradient
    matrix is ``∇_headᵀ`` (:meth:`to_matrix` transposes the ``[V, D]`` gradient of ``E``).
    """

    kind = "tied head"
    kernel_attribute = "embeddings"
    observe = "output"
    #: Whether discovery must check, on a symbolic forward pass, that the model calls the layer
    #: with ``reverse=True`` at all (the graph did not say;
    #: :func:`thor_tf.discovery.find_candidates`).
    needs_call_check = False

    def __init__(self, name, layer, lookup=None):
        super().__init__(name, layer)
        vocabulary, width = (int(s) for s in self.kernel.shape)
        self.bias = None
        self.kernel_shape = (vocabulary, width)
        self.in_dim = self.a_dim = width
        self.g_dim = vocabulary
        self.lookup = lookup


    def pre_activation(self, inputs):
        return ops.matmul(inputs, ops.transpose(self.layer.embeddings))


    def to_matrix(self, kernel_value, bias_value=None):
        if isinstance(kernel_value, tf.IndexedSlices):
            kernel_value = tf.convert_to_tensor(kernel_value)
        return tf.transpose(tf.cast(kernel_value, tf.float32))

    def from_matrix(self, matrix):
        return tf.transpose(matrix), None

    def input_rows(self, inputs):
        return tf.reshape(tf.cast(inputs, tf.float32), [-1, self.in_dim])

    def input_sq_norm_sum(self, inputs):
        x = tf.cast(inputs, tf.float32)
        return tf.reduce_sum(tf.square(x)), tf.cast(tf.size(x) // self.in_dim, tf.float32)


class UntiedHeadBlock(_HeadUse, KroneckerBlock):
    """The output projection of an *untied* ``ReversibleEmbedding`` (``tie_weights=False``):
    ``z = h @ R`` with its own variable ``R = reverse_embeddings`` ``[D, V]`` — a bias-free Dense
    (``a = h`` over D, ``g = dℓ/dz`` over the V logits), a block of its own beside the lookup's
    (two variables: no split of a gradient, unlike the tied head). Without it every step saw the
    ``reverse=True`` call on the lookup block, which does not match it, and left the whole layer
    first order (KerasHub's Llama, Mistral and Phi-3 token embeddings never refreshed)."""

    kind = "untied head"
    kernel_attribute = "reverse_embeddings"
    observe = "output"
    needs_call_check = False

    def __init__(self, name, layer):
        super().__init__(name, layer)
        self.bias = None
        self.a_dim = self.in_dim


    def pre_activation(self, inputs):
        return ops.matmul(inputs, self.layer.reverse_embeddings)


    def input_rows(self, inputs):
        return tf.reshape(tf.cast(inputs, tf.float32), [-1, self.in_dim])

    def input_sq_norm_sum(self, inputs):
        x = tf.cast(inputs, tf.float32)
        return tf.reduce_sum(tf.square(x)), tf.cast(tf.size(x) // self.in_dim, tf.float32)
