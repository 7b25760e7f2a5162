"""Tests for experiments.models: every model builds on small inputs and outputs probabilities."""

import keras
import numpy as np
import pytest

from experiments import models as zoo


def _trainable(model):
    # count_params() also counts BN moving statistics; papers/torchvision do not.
    return int(sum(np.prod(w.shape) for w in model.trainable_weights))


def _count(model, cls):
    return sum(type(layer) is cls for layer in model.layers)


def _check_forward(model, input_shape, num_classes, batch=2):
    x = np.random.default_rng(0).random((batch, *input_shape), dtype=np.float32)
    y = np.asarray(model(x, training=False))
    assert y.shape == (batch, num_classes)
    assert np.all(y >= 0)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-5)
    last = model.layers[-1]
    assert isinstance(last, keras.layers.Dense) and last.units == num_classes
    assert last.activation is keras.activations.softmax


@pytest.mark.parametrize(
    "name,input_shape",
    [
        ("mlp", (8, 8, 1)),
        ("mlp", (28, 28, 1)),
        ("mlp_wide", (8, 8, 1)),
        ("cnn", (8, 8, 1)),
        ("cnn", (28, 28, 1)),
        ("resnet20", (8, 8, 3)),
        ("resnet32", (8, 8, 1)),
        ("resnet56", (8, 8, 1)),
    ],
)
def test_build_and_forward(name, input_shape):
    model = zoo.build(name, input_shape, 7)
    assert model.name == name
    _check_forward(model, input_shape, 7)


def test_mlp_layers():
    m = zoo.mlp((28, 28, 1), 10)
    dense = [l for l in m.layers if isinstance(l, keras.layers.Dense)]
    assert [d.units for d in dense] == [784, 10]
    assert m.count_params() == 784 * 784 + 784 + 784 * 10 + 10
    w = zoo.mlp_wide((28, 28, 1), 10)
    assert [d.units for d in w.layers if isinstance(d, keras.layers.Dense)] == [1024, 1024, 10]
    t = zoo.build("mlp", (4,), 3, hidden=(5, 6), activation="tanh")
    assert [d.units for d in t.layers if isinstance(d, keras.layers.Dense)] == [5, 6, 3]
    assert t.layers[2].activation is keras.activations.tanh
    s = zoo.mlp((4,), 3, hidden=())  # softmax regression
    assert _count(s, keras.layers.Dense) == 1


def test_cnn_layers():
    m = zoo.cnn((28, 28, 1), 10)
    convs = [l for l in m.layers if isinstance(l, keras.layers.Conv2D)]
    assert [c.filters for c in convs] == [32, 64]
    assert [d.units for d in m.layers if isinstance(d, keras.layers.Dense)] == [128, 10]
    # 28 -> 14 -> 7 after two 2x2 pools
    assert m.get_layer("flatten").output.shape[-1] == 7 * 7 * 64


def test_resnet20_structure():
    m = zoo.resnet20((32, 32, 3), 10)
    convs = [l for l in m.layers if isinstance(l, keras.layers.Conv2D)]
    assert len(convs) == 21  # 19 3x3 + 2 1x1 projections
    assert sum(c.kernel_size == (3, 3) for c in convs) == 19
    proj = [c for c in convs if c.kernel_size == (1, 1)]
    assert len(proj) == 2 and all(c.strides == (2, 2) for c in proj)
    assert all(not c.use_bias for c in convs)
    assert sorted({c.filters for c in convs}) == [16, 32, 64]
    assert _count(m, keras.layers.BatchNormalization) == 21
    assert _count(m, keras.layers.Dense) == 1
    assert _count(m, keras.layers.GlobalAveragePooling2D) == 1
    # He et al. report 0.27M parameters for ResNet-20 (272,474 with option B)
    assert _trainable(m) == 272_474
    _check_forward(m, (32, 32, 3), 10)


@pytest.mark.parametrize("depth,n_conv", [(32, 33), (56, 57)])
def test_resnet_cifar_depths(depth, n_conv):
    m = zoo.resnet_cifar(depth, (8, 8, 3), 10)
    assert m.name == f"resnet{depth}"
    assert _count(m, keras.layers.Conv2D) == n_conv


@pytest.mark.parametrize("depth", [18, 21, 2, 0, 52, 20.5, "20", None])
def test_resnet_cifar_bad_depth(depth):
    with pytest.raises(ValueError, match="depth"):
        zoo.resnet_cifar(depth, (32, 32, 3), 10)


def test_resnet50_small_input():
    m = zoo.resnet50((32, 32, 3), 10)
    convs = [l for l in m.layers if isinstance(l, keras.layers.Conv2D)]
    assert len(convs) == 53  # 1 stem + 16 blocks x 3 + 4 projections
    assert convs[0].kernel_size == (7, 7) and convs[0].strides == (2, 2)
    assert all(not c.use_bias for c in convs)
    # v1.5: the stride-2 convs inside blocks are the 3x3 ones (and the projections)
    strided = [c for c in convs[1:] if c.strides == (2, 2)]
    assert len(strided) == 6
    assert sum(c.kernel_size == (3, 3) for c in strided) == 3
    assert _count(m, keras.layers.Dense) == 1
    _check_forward(m, (32, 32, 3), 10)


def test_resnet50_imagenet_param_count():
    # Building the graph is cheap; no forward pass at 224x224.
    m = zoo.resnet50()
    assert m.output.shape[-1] == 1000
    assert _trainable(m) == 25_557_032  # torchvision resnet50


def test_build_bad_name_lists_allowed():
    with pytest.raises(ValueError) as info:
        zoo.build("vgg16", (32, 32, 3), 10)
    for n in zoo.MODEL_NAMES:
        assert repr(n) in str(info.value)


@pytest.mark.parametrize(
    "call,arg",
    [
        (lambda: zoo.cnn((28, 28), 10), "input_shape"),
        (lambda: zoo.mlp((28, 28, 1), 0), "num_classes"),
        (lambda: zoo.mlp((28, 28, 1), 10, hidden=(0,)), "hidden"),
        (lambda: zoo.resnet20((32, 32, 3), 2.5), "num_classes"),
    ],
)
def test_argument_validation(call, arg):
    with pytest.raises(ValueError, match=arg):
        call()


def test_models_are_uncompiled_and_trainable_on_one_batch():
    m = zoo.cnn((8, 8, 1), 3)
    assert not m.compiled
    m.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).random((4, 8, 8, 1), dtype=np.float32)
    y = np.array([0, 1, 2, 0])
    loss = m.train_on_batch(x, y)
    assert np.isfinite(loss)


def test_vit_gives_every_block_kind_of_its_layers():
    """The ViT (Conv2D patches, position Embedding, MultiHeadAttention's EinsumDense, Dense MLP and
    head) wrapped: a block for each of those layer kinds, and one THOR step trains it."""
    import thor_tf

    model = thor_tf.wrap(zoo.build("vit", (8, 8, 1), 3), learning_rate=1e-3, verbose=False)
    model.compile(loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).random((4, 8, 8, 1), dtype=np.float32)
    assert np.isfinite(model.train_on_batch(x, np.array([0, 1, 2, 0])))
    kinds = {s["kind"] for s in model.thor.layer_stats()}
    assert {"conv2d", "dense", "einsum_dense"} <= kinds, kinds
