"""Which layers of a model get a Kronecker block, which stay first order, and why.

:func:`find_candidates` walks a model once, at ``wrap``: every layer whose type has a registered
block (:mod:`thor_tf.blocks`) and no structural reason against one is a *candidate*. A layer whose
class overrides the registered type's ``call`` (a user's subclass) is checked on a probe batch:
it keeps its block only if its own ``call`` produces ``z`` where the block observes it, exactly
once, equal to what the block's ``pre_activation`` computes from the recorded input, in training
and inference mode. Otherwise it stays first order with the reason.

:func:`first_order_layers` lists, for the variables an optimizer trains, the layers that are
trained first order, each named as the user named it (an LSTM, not its inner cell) and with a
reason. :func:`registration_table` is the one table ``wrap`` prints.
"""

from __future__ import annotations

import abc
import re

import keras
import numpy as np
import tensorflow as tf

from thor_tf import _keras_compat, capture
from thor_tf.blocks import block_class_for, registered_layer_class
from thor_tf.block_diagonal import split_layout
from thor_tf.split.plan import AUTO

class NormalizationByName(abc.ABC):
    """``isinstance(layer, NormalizationByName)``: a Keras layer whose class (or a base class) is
    named like a normalization — ``RMSNormalization``, KerasHub's ``LlamaLayerNorm``,
    ``MistralLayerNormalization``, ``QwenLayerNorm``, ``Phi3LayerNorm``, ``GemmaRMSNorm``... —
    which subclass ``keras.layers.Layer``, not ``LayerNormalization``."""

    _PATTERN = re.compile(r"(RMS|Layer|Group|Batch|Instance)Norm(alization)?$")

    @classmethod
    def __subclasshook__(cls, klass):
        if not issubclass(klass, keras.layers.Layer):
            return NotImplemented
        return any(cls._PATTERN.search(base.__name__) for base in klass.__mro__) or NotImplemented


#: Layers whose parameters are first order by design (no warning at wrap).
EXPECTED_FIRST_ORDER = (
    keras.layers.BatchNormalization,
    keras.layers.LayerNormalization,
    keras.layers.GroupNormalization,
    NormalizationByName,
)


def _known_reasons():
    """``[(layer classes, reason)]`` for the layer types without a block, first match wins."""
    layers = keras.layers
    names = lambda *n: tuple(getattr(layers, k) for k in n if hasattr(layers, k))  # noqa: E731
    return [
        (EXPECTED_FIRST_ORDER, "normalization, first order by design"),
        (names("RNN", "LSTM", "GRU", "SimpleRNN", "Bidirectional", "ConvLSTM1D", "ConvLSTM2D",
               "ConvLSTM3D"),
         "recurrent: weights shared over time steps, no block type"),
        (names("Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose"),
         "transposed convolution, no block type"),
        (names("DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D", "SeparableConv2D"),
         "depthwise/separable convolution, no block type"),
        (names("Conv3D"), "3-D convolution, no block type"),
    ]


def first_order_reason(layer):
    """Why ``layer`` (a type without a registered block) is trained first order."""
    for classes, reason in _known_reasons():
        if classes and isinstance(layer, classes):
            return reason
    return "no block type; thor_tf.register_block adds one"


def check_exclude(model, exclude):
    """``ValueError`` naming the ``exclude`` entries that match no layer of ``model``."""
    layers = _keras_compat.flatten_layers(model)
    names = {layer.name for layer in layers}
    paths = {getattr(layer, "path", None) for layer in layers}
    unknown = [e for e in exclude if e not in names and e not in paths]
    if unknown:
        raise ValueError(f"`exclude` names layers the model does not have: {unknown}; its layers "
                         f"are {sorted(names)}.")


def _probe_input(block):
    """A small random input of the shape the layer was built for, or None if unknown."""
    shapes = getattr(block.layer, "_build_shapes_dict", None) or {}
    if len(shapes) != 1:
        return None
    shape = next(iter(shapes.values()))
    if not isinstance(shape, (tuple, list)) or not shape:
        return None
    shape = [2 if i == 0 or s is None else int(s) for i, s in enumerate(shape)]
    rng = np.random.default_rng(0)
    if block.kernel_attribute == "embeddings":
        return tf.constant(rng.integers(0, block.in_dim, size=shape), tf.int32)
    return tf.constant(rng.normal(size=shape), block.layer.compute_dtype)


def probe_reason(block):
    """None if the layer's own ``call`` computes ``z`` as ``block`` observes it, else the reason.

    Runs the layer twice (training and inference) on a probe batch with a private store; the
    layer's non-trainable variables (moving statistics, RNG state) are put back afterwards, so
    the user's model is left as it was.
    """
    layer = block.layer
    x = _probe_input(block)
    if x is None:
        return "call overridden; no input shape to check it on"
    state = [(v, v.numpy()) for v in layer.non_trainable_variables]
    store = capture.CaptureStore()
    capture.install(block, store)
    try:
        for training in (True, False):
            with tf.GradientTape():
                layer(x, training=training)
            records = store.take([block.name]).get(block.name, [])
            if len(records) != 1 or not records[0].usable:
                return ("call overridden; its z is not produced by the layer's own "
                        f"{block.observe_point()} once per "
                        "call")
            record = records[0]
            expected = block.pre_activation(record.inputs)
            if not block.matches(record) or expected.shape != record.z.shape or not np.allclose(
                    np.asarray(record.z, np.float64), np.asarray(expected, np.float64),
                    rtol=1e-4, atol=1e-5):
                mode = "training" if training else "inference"
                return (f"call overridden; its z differs from {type(block).__name__}'s in "
                        f"{mode} mode (register a block for it)")
    except Exception as err:  # noqa: BLE001 - any failure means: not provably the block's z
        return f"call overridden; could not be checked ({type(err).__name__})"
    finally:
        capture.uninstall(layer)
        for variable, value in state:
            variable.assign(value)
    return None


def find_candidates(model, exclude=()):
    """``(candidates, structural)``: blocks for every layer that can have one, in the model's
    weight order, and ``[(layer, reason)]`` for layers of a block type that cannot."""
    exclude = set(exclude or ())
    candidates, structural = [], []
    for layer in _keras_compat.flatten_layers(model):
        block_class = block_class_for(layer)
        if block_class is None:
            continue
        if layer.name in exclude or getattr(layer, "path", None) in exclude:
            structural.append((layer, "excluded"))
            continue
        reason = block_class.unsupported_reason(layer)
        block = None
        if reason is None:
            block = block_class(layer.name, layer)
            if type(layer).call is not registered_layer_class(layer).call:
                reason = probe_reason(block)
        if reason is None:
            candidates.append(block)
            # A tied embedding's output projection, a LoRA layer's B side: a second block.
            candidates.extend(c for c in block.companion_blocks()
                              if type(c).unsupported_reason(layer) is None)
        else:
            structural.append((layer, reason))
    unsure = [b for b in candidates if getattr(b, "needs_call_check", False)]
    if unsure:
        called = blocks_called(model, candidates)
        if called is not None:
            candidates = [b for b in candidates if b not in unsure or b.name in called]
    weight_index = {id(v): i for i, v in enumerate(model.weights)}
    candidates.sort(key=lambda b: weight_index[id(b.kernel)])
    _unique_names(candidates)
    return candidates, structural


def blocks_called(model, blocks):
    """The names of ``blocks`` that one forward pass of ``model`` calls (the layers' own ``call``
    code routes each call to a block, :mod:`thor_tf.capture`), or None if that cannot be seen.

    The pass is symbolic (placeholders in a scratch graph: nothing computed, no variable
    changed), on the Functional model's inputs, in inference mode. It sees calls that the
    model's graph does not record: a layer called inside another layer's ``call``, e.g. the
    ``ReversibleEmbedding`` inside ``keras_hub.layers.TokenAndPositionEmbedding``, which the
    keras-io miniature GPT never calls with ``reverse=True`` (its head is a Dense)."""
    by_layer = {}
    for block in blocks:
        by_layer.setdefault(id(block.layer), []).append(block)
    store = capture.CaptureStore()
    seen = set()

    def forward(inputs):
        with store.step():
            model(inputs, training=False)
            seen.update(store.take([b.name for b in blocks]))

    installed = []
    try:
        for group in by_layer.values():
            if capture.is_installed(group[0].layer):
                return None
            capture.install(group, store)
            installed.append(group[0].layer)
        if not _keras_compat.symbolic_forward(model, forward):
            return None
    except Exception:  # noqa: BLE001 - a model that cannot run on placeholders: no answer
        return None
    finally:
        for layer in installed:
            capture.uninstall(layer)
    return seen


def _unique_names(blocks):
    """Layer names repeat in nested models and layers with sublayers (MultiHeadAttention's
    "query", ...): use the layer's path there ("block0_attention/query"), and the position if
    even that repeats."""
    names = [b.name for b in blocks]
    if len(set(names)) == len(names):
        return
    for block in blocks:
        if names.count(block.name) > 1:
            # A second block's suffix ("/reverse", "/lora_b") stays after the path.
            base = block.layer.name
            suffix = block.name[len(base):] if block.name.startswith(base) else ""
            path = getattr(block.layer, "path", None)
            block.name = path + suffix if path else block.name
    names = [b.name for b in blocks]
    for i, block in enumerate(blocks):
        if names.count(block.name) > 1:
            block.name = f"{i}:{block.name}"


def first_order_layers(model, candidates, structural, trainable_variables):
    """``[(layer, reason)]``: the layers whose variables in ``trainable_variables`` are trained
    first order, outermost first. A layer with no block inside it is listed once, as the user
    named it (an LSTM, not its cell); a layer with blocks inside (MultiHeadAttention, a custom
    layer holding a Conv2D) is looked into. Structural fallbacks come with their own reason."""
    trained = {id(v) for v in trainable_variables}
    block_layers = {id(b.layer) for b in candidates}
    structural_reason = {id(layer): reason for layer, reason in structural}
    # A layer whose blocks' kernels are all untrained but that trains other variables: LoRA
    # enabled after wrap (the adapters came after discovery), or a kernel frozen alone.
    trained_blocks = {id(b.layer) for b in candidates if id(b.kernel) in trained}
    for block in candidates:
        layer = block.layer
        if id(layer) not in trained_blocks and id(layer) not in structural_reason:
            structural_reason[id(layer)] = (
                "LoRA enabled after wrap: wrap the model after enable_lora"
                if getattr(layer, "lora_enabled", False) else "its kernel is not trained")
    holders = block_layers | set(structural_reason)
    out, seen = [], set()

    def visit(layer):
        if id(layer) in seen:
            return
        seen.add(id(layer))
        if id(layer) in structural_reason:
            if any(id(v) in trained for v in layer.trainable_variables):
                out.append((layer, structural_reason[id(layer)]))
            return
        if id(layer) in block_layers:
            return
        inside = _keras_compat.flatten_layers(layer)
        if not any(id(sub) in holders for sub in inside):
            if any(id(v) in trained for v in layer.trainable_variables):
                out.append((layer, first_order_reason(layer)))
            return
        own = getattr(layer, "_trainable_variables", [])
        if not isinstance(layer, keras.Model) and any(id(v) in trained for v in own):
            out.append((layer, first_order_reason(layer)))
        for child in _keras_compat.flatten_layers(layer, recursive=False):
            visit(child)

    for child in _keras_compat.flatten_layers(model, recursive=False):
        visit(child)
    return out


def registration_table(blocks, first_order, frozen_layers, split_dim):
    """The one table ``wrap`` prints: layers, block kinds, factor sizes, splits, fallbacks."""

    def split_text(dim, size):
        nb, size = split_layout(dim, size)
        return f"{size}x{nb}" if nb > 1 else f"{size}"

    rows = [("layer", "block", "A", "G", "split A", "split G")]
    for b in blocks:
        if split_dim == AUTO:  # chosen at the start of fit
            texts = tuple("1" if size == 1 else "auto" for size in b.split_sizes(1 << 30))
        else:
            texts = tuple(split_text(dim, size)
                          for dim, size in zip((b.a_dim, b.g_dim), b.split_sizes(split_dim)))
        rows.append((b.name, b.kind, str(b.a_dim), str(b.g_dim)) + texts)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"thor_tf: {len(blocks)} layers with Kronecker blocks "
             f"(split_dim {split_dim}; split shown as size x blocks)"]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)))
    if first_order:
        items = [f"{layer.name} ({type(layer).__name__}: {reason})" for layer, reason in first_order]
        lines.append("  first order: " + ", ".join(items))
    else:
        lines.append("  first order: none")
    if frozen_layers:
        # trainable=False, or another optimizer's (a GAN's generator under the d_optimizer).
        # One name per layer (a layer with two blocks, e.g. a tied embedding, is listed once).
        names = list(dict.fromkeys(layer.name for layer in frozen_layers))
        lines.append("  not trained by this optimizer: " + ", ".join(names))
    return "\n".join(lines)
