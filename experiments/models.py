"""Built-in Keras models for the experiments and for calibration.

Every builder returns an **uncompiled** Functional ``keras.Model`` that maps
``(batch, *input_shape)`` float inputs (NHWC for images) to ``(batch,
num_classes)`` class probabilities: the last layer is always
``Dense(num_classes, activation="softmax")`` named ``"predictions"``. Losses
should therefore be used with ``from_logits=False``.

Only standard layers are used (``Dense``, ``Conv2D``, ``BatchNormalization``,
pooling, ``Add``/``Activation``), so a K-FAC/THOR optimizer can find the layers
it preconditions by type. Convolutions followed by BatchNormalization have
``use_bias=False`` (BN's beta makes the bias redundant).

Use :func:`build` to pick a model by name (see :data:`MODEL_NAMES`).
"""

from __future__ import annotations

import functools
from typing import Sequence, Tuple

import keras
from keras import layers

__all__ = [
    "MODEL_NAMES",
    "build",
    "cnn",
    "mlp",
    "mlp_wide",
    "resnet20",
    "resnet32",
    "resnet50",
    "resnet56",
    "resnet_cifar",
    "vit",
    "PositionEmbedding",
    "build_gpt",
    "reversible_embedding",
]

#: Names accepted by :func:`build`.
MODEL_NAMES = ("mlp", "mlp_wide", "cnn", "resnet20", "resnet32", "resnet56", "resnet50", "vit")

# BatchNorm settings of the reference implementations (PyTorch / MindSpore:
# momentum 0.1 in their convention = 0.9 in Keras', eps 1e-5). Keras' default
# momentum 0.99 makes the moving statistics lag badly in short experiments.
_BN = dict(momentum=0.9, epsilon=1e-5)
_CONV_INIT = "he_normal"  # He et al. 2015 init, as in the ResNet papers


def _check_shape(input_shape, *, image: bool) -> Tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in input_shape)
    except TypeError:
        raise ValueError(f"input_shape must be a sequence of ints; got {input_shape!r}") from None
    if image and len(shape) != 3:
        raise ValueError(f"input_shape must be (height, width, channels); got {input_shape!r}")
    if not shape or any(s <= 0 for s in shape):
        raise ValueError(f"input_shape must be non-empty with positive sizes; got {input_shape!r}")
    return shape


def _check_classes(num_classes) -> int:
    try:
        ok = not isinstance(num_classes, bool) and int(num_classes) == num_classes >= 1
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"num_classes must be a positive integer; got {num_classes!r}")
    return int(num_classes)


def _head(x, num_classes: int):
    return layers.Dense(num_classes, activation="softmax", name="predictions")(x)


# ------------------------------------------------------------------ small models

def mlp(
    input_shape: Sequence[int],
    num_classes: int,
    hidden: Sequence[int] = (784,),
    activation: str = "relu",
    name: str = "mlp",
) -> keras.Model:
    """Fully-connected net: ``Flatten -> Dense(h, activation) for h in hidden -> softmax``.

    Args:
        input_shape: shape of one example, e.g. ``(28, 28, 1)``.
        num_classes: number of output classes.
        hidden: widths of the hidden layers (may be empty: softmax regression).
        activation: any Keras activation name for the hidden layers.
        name: the model's name.
    """
    shape = _check_shape(input_shape, image=False)
    num_classes = _check_classes(num_classes)
    hidden = tuple(hidden)
    if any(int(h) != h or h < 1 for h in hidden):
        raise ValueError(f"hidden must be a sequence of positive ints; got {hidden!r}")
    inputs = keras.Input(shape=shape, name="input")
    x = layers.Flatten(name="flatten")(inputs)
    for i, h in enumerate(hidden, start=1):
        x = layers.Dense(int(h), activation=activation, name=f"dense{i}")(x)
    return keras.Model(inputs, _head(x, num_classes), name=name)


def mlp_wide(input_shape: Sequence[int], num_classes: int) -> keras.Model:
    """:func:`mlp` with two hidden layers of 1024 ReLU units."""
    return mlp(input_shape, num_classes, hidden=(1024, 1024), name="mlp_wide")


def cnn(input_shape: Sequence[int], num_classes: int) -> keras.Model:
    """Small MNIST-family CNN.

    ``Conv(32,3x3,relu) -> MaxPool2 -> Conv(64,3x3,relu) -> MaxPool2 -> Flatten
    -> Dense(128,relu) -> softmax``. Convolutions and pooling use
    ``padding="same"`` so that tiny inputs (8x8 digits: 8 -> 4 -> 2) still build.
    """
    shape = _check_shape(input_shape, image=True)
    num_classes = _check_classes(num_classes)
    inputs = keras.Input(shape=shape, name="input")
    x = layers.Conv2D(32, 3, padding="same", activation="relu", name="conv1")(inputs)
    x = layers.MaxPooling2D(2, padding="same", name="pool1")(x)
    x = layers.Conv2D(64, 3, padding="same", activation="relu", name="conv2")(x)
    x = layers.MaxPooling2D(2, padding="same", name="pool2")(x)
    x = layers.Flatten(name="flatten")(x)
    x = layers.Dense(128, activation="relu", name="dense1")(x)
    return keras.Model(inputs, _head(x, num_classes), name="cnn")


# ------------------------------------------------------------------ CIFAR ResNets

def _conv_bn(x, filters, kernel, strides, name, relu=True):
    x = layers.Conv2D(
        filters, kernel, strides=strides, padding="same", use_bias=False,
        kernel_initializer=_CONV_INIT, name=f"{name}_conv",
    )(x)
    x = layers.BatchNormalization(**_BN, name=f"{name}_bn")(x)
    if relu:
        x = layers.Activation("relu", name=f"{name}_relu")(x)
    return x


def _basic_block(x, filters, strides, name):
    """He et al. 2016 basic block: two 3x3 conv-BN, projection shortcut on shape change."""
    shortcut = x
    if strides != 1 or x.shape[-1] != filters:
        shortcut = _conv_bn(x, filters, 1, strides, f"{name}_proj", relu=False)
    y = _conv_bn(x, filters, 3, strides, f"{name}_1")
    y = _conv_bn(y, filters, 3, 1, f"{name}_2", relu=False)
    y = layers.Add(name=f"{name}_add")([shortcut, y])
    return layers.Activation("relu", name=f"{name}_out")(y)


def resnet_cifar(
    depth: int, input_shape: Sequence[int] = (32, 32, 3), num_classes: int = 10
) -> keras.Model:
    """CIFAR ResNet of He et al. (2016), ``depth = 6n + 2``.

    3x3 conv(16) stem, then three stages of ``n`` basic blocks with 16/32/64
    filters (stages 2 and 3 start with stride 2 and a 1x1 projection shortcut,
    i.e. option B), global average pooling and a softmax Dense. ResNet-20 has
    19 3x3 convs + 2 projections = 21 ``Conv2D`` layers.
    """
    try:
        ok = not isinstance(depth, bool) and int(depth) == depth >= 8 and (depth - 2) % 6 == 0
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"depth must be 6n+2 with n >= 1 (e.g. 20, 32, 56); got {depth!r}")
    n = (int(depth) - 2) // 6
    shape = _check_shape(input_shape, image=True)
    num_classes = _check_classes(num_classes)
    inputs = keras.Input(shape=shape, name="input")
    x = _conv_bn(inputs, 16, 3, 1, "stem")
    for stage, filters in enumerate((16, 32, 64), start=1):
        for block in range(1, n + 1):
            strides = 2 if (stage > 1 and block == 1) else 1
            x = _basic_block(x, filters, strides, f"stage{stage}_block{block}")
    x = layers.GlobalAveragePooling2D(name="avg_pool")(x)
    return keras.Model(inputs, _head(x, num_classes), name=f"resnet{int(depth)}")


def resnet20(input_shape: Sequence[int] = (32, 32, 3), num_classes: int = 10) -> keras.Model:
    """:func:`resnet_cifar` with depth 20."""
    return resnet_cifar(20, input_shape, num_classes)


def resnet32(input_shape: Sequence[int] = (32, 32, 3), num_classes: int = 10) -> keras.Model:
    """:func:`resnet_cifar` with depth 32."""
    return resnet_cifar(32, input_shape, num_classes)


def resnet56(input_shape: Sequence[int] = (32, 32, 3), num_classes: int = 10) -> keras.Model:
    """:func:`resnet_cifar` with depth 56."""
    return resnet_cifar(56, input_shape, num_classes)


# ------------------------------------------------------------------ ResNet-50

def _bottleneck(x, filters, strides, name):
    """ResNet v1.5 bottleneck: 1x1(f) -> 3x3(f, stride) -> 1x1(4f), projection if needed.

    v1.5 puts the stride on the 3x3 conv (v1 had it on the first 1x1), as in
    torchvision and MindSpore's model_zoo.
    """
    out = 4 * filters
    shortcut = x
    if strides != 1 or x.shape[-1] != out:
        shortcut = _conv_bn(x, out, 1, strides, f"{name}_proj", relu=False)
    y = _conv_bn(x, filters, 1, 1, f"{name}_1")
    y = _conv_bn(y, filters, 3, strides, f"{name}_2")
    y = _conv_bn(y, out, 1, 1, f"{name}_3", relu=False)
    y = layers.Add(name=f"{name}_add")([shortcut, y])
    return layers.Activation("relu", name=f"{name}_out")(y)


def resnet50(input_shape: Sequence[int] = (224, 224, 3), num_classes: int = 1000) -> keras.Model:
    """ImageNet ResNet-50 (bottleneck v1.5), built from scratch (no weights download).

    7x7/2 conv(64)-BN-ReLU, 3x3/2 max-pool, stages of [3, 4, 6, 3] bottlenecks
    with 64/128/256/512 (x4) filters (stride 2 at the start of stages 2-4),
    global average pooling, softmax Dense: 1 + 16*3 + 4 = 53 ``Conv2D`` layers.
    All padding is ``"same"``, so small inputs such as ``(32, 32, 3)`` build
    (spatial size 32 -> 16 -> 8 -> 8 -> 4 -> 2 -> 1).
    """
    shape = _check_shape(input_shape, image=True)
    num_classes = _check_classes(num_classes)
    inputs = keras.Input(shape=shape, name="input")
    x = _conv_bn(inputs, 64, 7, 2, "stem")
    x = layers.MaxPooling2D(3, strides=2, padding="same", name="stem_pool")(x)
    for stage, (filters, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        for block in range(1, blocks + 1):
            strides = 2 if (stage > 1 and block == 1) else 1
            x = _bottleneck(x, filters, strides, f"stage{stage}_block{block}")
    x = layers.GlobalAveragePooling2D(name="avg_pool")(x)
    return keras.Model(inputs, _head(x, num_classes), name="resnet50")


# ------------------------------------------------------------------ dispatch


# The package name models were saved under (the harness was thor_tf_experiments).
@keras.saving.register_keras_serializable(package="thor_tf_experiments")
class PositionEmbedding(layers.Layer):
    """Adds a learned ``Embedding(tokens, dim)`` of the token positions to ``[N, tokens, dim]``.

    The positions are looked up for every example (``[N, tokens]`` indices), so the embedding's
    output gradient is per example and THOR's Embedding block sees N·tokens rows, as for words.
    """

    def __init__(self, tokens, dim, **kwargs):
        super().__init__(**kwargs)
        self.tokens, self.dim = int(tokens), int(dim)
        self.embedding = layers.Embedding(self.tokens, self.dim, name="position_embedding")

    def build(self, input_shape):
        self.embedding.build((None, self.tokens))

    def call(self, x):
        positions = keras.ops.broadcast_to(keras.ops.arange(self.tokens)[None],
                                           (keras.ops.shape(x)[0], self.tokens))
        return x + keras.ops.cast(self.embedding(positions), x.dtype)

    def get_config(self):
        return {**super().get_config(), "tokens": self.tokens, "dim": self.dim}


def vit(
    input_shape: Sequence[int] = (28, 28, 1),
    num_classes: int = 10,
    patch: int | None = None,
    dim: int = 64,
    depth: int = 2,
    heads: int = 4,
    mlp_dim: int = 128,
) -> keras.Model:
    """A small Vision Transformer: patch embedding, learned position embedding, ``depth``
    pre-LayerNorm blocks of MultiHeadAttention and a convolutional MLP, mean pooling, softmax.

    The layers cover every block type of thor_tf: the patch embedding is a strided ``Conv2D``
    (``patch`` × ``patch``; default 4 for 28×28 inputs, 2 for 8×8), the positions an
    ``Embedding``, attention four ``EinsumDense`` projections per block, the MLP a ``Conv1D``
    (kernel 3 over the token sequence, as in convolutional-FFN ViTs) and a ``Dense``, the head a
    ``Dense``. LayerNorm trains first order.
    """
    shape = _check_shape(input_shape, image=True)
    num_classes = _check_classes(num_classes)
    if patch is None:
        patch = 4 if shape[0] >= 16 else 2
    if shape[0] % patch or shape[1] % patch:
        raise ValueError(f"patch must divide the image size {shape[:2]}; got {patch}")
    tokens = (shape[0] // patch) * (shape[1] // patch)
    inputs = keras.Input(shape)
    x = layers.Conv2D(dim, patch, strides=patch, name="patch_embed")(inputs)
    x = layers.Reshape((tokens, dim))(x)
    x = PositionEmbedding(tokens, dim, name="positions")(x)
    for i in range(depth):
        h = layers.LayerNormalization(epsilon=1e-6, name=f"block{i}_ln1")(x)
        h = layers.MultiHeadAttention(heads, dim // heads, name=f"block{i}_attention")(h, h)
        x = layers.Add(name=f"block{i}_add1")([x, h])
        h = layers.LayerNormalization(epsilon=1e-6, name=f"block{i}_ln2")(x)
        h = layers.Conv1D(mlp_dim, 3, padding="same", activation="gelu", name=f"block{i}_mlp1")(h)
        h = layers.Dense(dim, name=f"block{i}_mlp2")(h)
        x = layers.Add(name=f"block{i}_add2")([x, h])
    x = layers.LayerNormalization(epsilon=1e-6, name="final_ln")(x)
    x = layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = layers.Dense(num_classes, activation="softmax", name="predictions")(x)
    return keras.Model(inputs, outputs, name="vit")


@functools.cache
def reversible_embedding():
    """The class of the tied token embedding: ``keras.layers.ReversibleEmbedding`` (Keras >= 3.11,
    the layer thor_tf gives a lookup and a head block on one matrix), else a minimal stand-in
    with its API on older Keras: an ``Embedding`` whose ``call(h, reverse=True)`` is ``h @ Eᵀ``."""
    if hasattr(keras.layers, "ReversibleEmbedding"):
        return keras.layers.ReversibleEmbedding

    # The package name models were saved under (the harness was thor_tf_experiments).
    @keras.saving.register_keras_serializable(package="thor_tf_experiments")
    class ReversibleEmbedding(keras.layers.Embedding):
        def call(self, inputs, reverse=False):
            if not reverse:
                return super().call(inputs)
            kernel = keras.ops.cast(self.embeddings, self.compute_dtype)
            return keras.ops.matmul(inputs, keras.ops.transpose(kernel))

        def compute_output_spec(self, inputs, reverse=False):
            if not reverse:
                return super().compute_output_spec(inputs)
            return keras.KerasTensor((*inputs.shape[:-1], self.input_dim), dtype=self.compute_dtype)

    return ReversibleEmbedding


def build_gpt(vocab_size, block=64, layers=4, heads=4, width=128, tie_embeddings=False):
    """The char GPT (uncompiled Functional model): ``[N, block]`` int tokens -> ``[N, block, V]``
    logits. Kernels and the token embedding start from N(0, 0.02²) (GPT-2/nanoGPT), biases at 0,
    positions from ``models.PositionEmbedding`` (Keras' default Embedding init)."""
    kl = keras.layers  # ``layers`` is the block count here
    if width % heads:
        raise ValueError(f"--width ({width}) must be a multiple of --heads ({heads})")
    init = keras.initializers.RandomNormal(stddev=0.02)
    tokens = keras.Input((block,), dtype="int32", name="tokens")
    embedding = reversible_embedding()(vocab_size, width, embeddings_initializer=init,
                                       name="token_embedding")
    x = embedding(tokens)
    x = PositionEmbedding(block, width, name="positions")(x)
    for i in range(layers):
        h = kl.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln1")(x)
        h = kl.MultiHeadAttention(heads, width // heads, kernel_initializer=init,
                                  name=f"block{i}_attention")(h, h, use_causal_mask=True)
        x = kl.Add(name=f"block{i}_add1")([x, h])
        h = kl.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln2")(x)
        h = kl.Dense(4 * width, activation="gelu", kernel_initializer=init,
                     name=f"block{i}_mlp_up")(h)
        h = kl.Dense(width, kernel_initializer=init, name=f"block{i}_mlp_down")(h)
        x = kl.Add(name=f"block{i}_add2")([x, h])
    x = kl.LayerNormalization(epsilon=1e-5, name="final_ln")(x)
    if tie_embeddings:
        logits = embedding(x, reverse=True)
    else:
        logits = kl.Dense(vocab_size, kernel_initializer=init, name="lm_head")(x)
    return keras.Model(tokens, logits, name="char_gpt")


_BUILDERS = {
    "mlp": mlp,
    "mlp_wide": mlp_wide,
    "cnn": cnn,
    "resnet20": resnet20,
    "resnet32": resnet32,
    "resnet56": resnet56,
    "resnet50": resnet50,
    "vit": vit,
}


def build(name: str, input_shape: Sequence[int], num_classes: int, **kwargs) -> keras.Model:
    """Build the model called ``name`` (one of :data:`MODEL_NAMES`).

    Extra keyword arguments go to the builder (e.g. ``hidden=`` for ``"mlp"``).
    """
    if name not in _BUILDERS:
        raise ValueError(
            f"name must be one of {', '.join(repr(n) for n in MODEL_NAMES)}; got {name!r}"
        )
    return _BUILDERS[name](input_shape, num_classes, **kwargs)
