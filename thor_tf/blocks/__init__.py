"""Kronecker curvature blocks: one class per layer type, registered in one place.

For a layer with (homogeneous) inputs ``ā`` and back-propagated output gradients ``g = dℓ/dz`` of the
per-example loss ``ℓ``, the Fisher block is approximated by ``A ⊗ G`` with

    A = mean over rows of ā āᵀ      [a_dim, a_dim]    (ā = [a, 1] when the bias is folded in)
    G = mean over rows of g gᵀ      [g_dim, g_dim]

(:mod:`thor_tf.blocks.base` states the shapes, orientation and damping conventions.) The registry
maps a Keras layer class to its block class; a layer gets the block of the first class in its
method resolution order that is registered, so subclasses of a registered layer inherit its block
unless they register their own. Users add layer types with :func:`register_block` without editing
the library (the README has a worked example).
"""

from __future__ import annotations

import keras

from thor_tf.blocks.base import KroneckerBlock, block_gram
from thor_tf.blocks.conv1d import Conv1DBlock
from thor_tf.blocks.conv2d import Conv2DBlock
from thor_tf.blocks.dense import DenseBlock
from thor_tf.blocks.einsum_dense import EinsumDenseBlock
from thor_tf.blocks.embedding import EmbeddingBlock
from thor_tf.blocks.lora import LoraABlock, LoraBBlock
from thor_tf.blocks.reversible_embedding import (TiedHeadBlock, TiedLookupBlock,
                                                 UntiedHeadBlock)

_REGISTRY: dict = {}


def register_block(layer_class, block_class):
    """Give every layer of ``layer_class`` (and its subclasses) a ``block_class`` block.

    Args:
      layer_class: a ``keras.layers.Layer`` subclass.
      block_class: a :class:`KroneckerBlock` subclass implementing ``pre_activation`` and
        ``input_rows`` / ``input_sq_norm_sum`` (and ``unsupported_reason`` if some layers of the
        type cannot have a block).

    Registering a class again replaces its block. Models wrapped before keep their blocks.
    """
    if not (isinstance(layer_class, type) and issubclass(layer_class, keras.layers.Layer)):
        raise ValueError(f"`layer_class` must be a keras.layers.Layer subclass; got {layer_class!r}.")
    if not (isinstance(block_class, type) and issubclass(block_class, KroneckerBlock)):
        raise ValueError(
            f"`block_class` must be a thor_tf.blocks.KroneckerBlock subclass; got {block_class!r}.")
    _REGISTRY[layer_class] = block_class


def registered_blocks():
    """``{layer class: block class}``: a copy of the registry."""
    return dict(_REGISTRY)


def registered_layer_class(layer):
    """The nearest class in ``layer``'s MRO that has a registered block, or None."""
    for cls in type(layer).__mro__:
        if cls in _REGISTRY:
            return cls
    return None


#: Block classes whose layers, once LoRA-enabled (``layer.enable_lora(rank)``: kernel frozen,
#: adapters trainable), get the adapters' blocks instead (:mod:`thor_tf.blocks.lora`).
_LORA_VARIANTS = {DenseBlock: LoraABlock, EinsumDenseBlock: LoraABlock}


def block_class_for(layer):
    """The block class for ``layer`` (nearest registered class in its MRO), or None. A
    LoRA-enabled Dense or EinsumDense with the library's block gets :class:`LoraABlock` (which
    brings its B side along as a companion)."""
    cls = registered_layer_class(layer)
    if cls is None:
        return None
    block_class = _REGISTRY[cls]
    if getattr(layer, "lora_enabled", False) and block_class in _LORA_VARIANTS:
        return _LORA_VARIANTS[block_class]
    return block_class


register_block(keras.layers.Dense, DenseBlock)
register_block(keras.layers.Conv2D, Conv2DBlock)
register_block(keras.layers.Conv1D, Conv1DBlock)
register_block(keras.layers.EinsumDense, EinsumDenseBlock)
register_block(keras.layers.Embedding, EmbeddingBlock)
if hasattr(keras.layers, "ReversibleEmbedding"):  # Keras >= 3.11 (KerasHub's subclasses it)
    register_block(keras.layers.ReversibleEmbedding, TiedLookupBlock)

__all__ = ["KroneckerBlock", "DenseBlock", "Conv2DBlock", "Conv1DBlock", "EinsumDenseBlock",
           "EmbeddingBlock", "TiedLookupBlock", "TiedHeadBlock", "UntiedHeadBlock", "LoraABlock",
           "LoraBBlock",
           "block_gram", "register_block", "registered_blocks", "block_class_for",
           "registered_layer_class"]
