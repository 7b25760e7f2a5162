"""Tests for experiments.datasets (no network: every non-embedded source is faked in tmp_path)."""

import gzip
import os
import pickle
import struct

import numpy as np
import pytest

from experiments import datasets as data

FASHION_DEBIAN = "/usr/share/datasets/fashion-mnist"


# ----------------------------------------------------------------- fixtures

def _write_idx(path, arr, code=0x08, gz=True):
    arr = np.asarray(arr)
    header = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    payload = header + arr.astype(arr.dtype.newbyteorder(">")).tobytes()
    with (gzip.open if gz else open)(path, "wb") as f:
        f.write(payload)


def _fake_fashion(directory, n_train=12, n_test=6, seed=0):
    """Write the four Fashion-MNIST IDX files with random content; return the arrays."""
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    arrays = {
        "train-images-idx3-ubyte.gz": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte.gz": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte.gz": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte.gz": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    for fname, arr in arrays.items():
        _write_idx(os.path.join(directory, fname), arr)
    return arrays


@pytest.fixture
def no_local_data(tmp_path, monkeypatch):
    """Point every search path at empty directories; return (debian_dir, keras_dir)."""
    debian = tmp_path / "debian" / "fashion-mnist"
    keras_dir = tmp_path / "keras" / "datasets"
    monkeypatch.setattr(data, "DEBIAN_FASHION_MNIST_DIR", str(debian))
    monkeypatch.setattr(data, "KERAS_DATASETS_DIRS", (str(keras_dir),))
    return debian, keras_dir


# ----------------------------------------------------------------- IDX parsing

@pytest.mark.parametrize("code,dtype", [(0x08, np.uint8), (0x0B, np.int16),
                                        (0x0C, np.int32), (0x0D, np.float32),
                                        (0x0E, np.float64)])
@pytest.mark.parametrize("gz", [True, False])
def test_read_idx_roundtrip(tmp_path, code, dtype, gz):
    arr = (np.arange(2 * 3 * 4) - 5).reshape(2, 3, 4).astype(dtype)
    if dtype == np.uint8:
        arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    path = str(tmp_path / ("a.idx.gz" if gz else "a.idx"))
    _write_idx(path, arr, code=code, gz=gz)
    out = data.read_idx(path)
    assert out.shape == (2, 3, 4)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, arr)


def test_read_idx_rejects_bad_files(tmp_path):
    bad_magic = tmp_path / "bad.gz"
    with gzip.open(bad_magic, "wb") as f:
        f.write(b"\x01\x00\x08\x01" + struct.pack(">I", 3) + b"abc")
    with pytest.raises(ValueError, match="magic"):
        data.read_idx(str(bad_magic))
    short = tmp_path / "short.gz"
    with gzip.open(short, "wb") as f:
        f.write(b"\x00\x00\x08\x01" + struct.pack(">I", 5) + b"abc")
    with pytest.raises(ValueError, match="payload"):
        data.read_idx(str(short))


# ----------------------------------------------------------------- fashion_mnist

def test_fashion_from_debian_dir(no_local_data):
    debian, _ = no_local_data
    arrays = _fake_fashion(str(debian))
    assert data.available_locally("fashion_mnist")
    ds = data.load_dataset("fashion_mnist", verbose=False)
    assert ds.name == "fashion_mnist" and ds.num_classes == 10
    assert ds.x_train.shape == (12, 28, 28, 1) and ds.x_test.shape == (6, 28, 28, 1)
    assert ds.input_shape == (28, 28, 1)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    np.testing.assert_allclose(
        ds.x_train[..., 0], arrays["train-images-idx3-ubyte.gz"] / 255.0, rtol=1e-6
    )
    np.testing.assert_array_equal(ds.y_test, arrays["t10k-labels-idx1-ubyte.gz"])
    assert str(debian) in ds.source


def test_fashion_from_keras_cache(no_local_data):
    _, keras_dir = no_local_data
    _fake_fashion(str(keras_dir / "fashion-mnist"), n_train=5, n_test=3)
    ds = data.load_dataset("fashion_mnist", verbose=False)
    assert ds.x_train.shape == (5, 28, 28, 1)
    assert "fashion-mnist" in ds.source and str(keras_dir) in ds.source


def test_fashion_missing_no_download_lists_paths(no_local_data):
    debian, keras_dir = no_local_data
    assert not data.available_locally("fashion_mnist")
    with pytest.raises(RuntimeError) as info:
        data.load_dataset("fashion_mnist", download=False, verbose=False)
    msg = str(info.value)
    assert str(debian) in msg and str(keras_dir / "fashion-mnist") in msg
    assert "apt-get install -y dataset-fashion-mnist" in msg


@pytest.fixture
def fake_network(monkeypatch):
    """Downloads allowed (the tests' THOR_TF_NO_DOWNLOAD removed) against a fake network: the
    connection probe succeeds or fails as ``state["up"]`` says, without a socket; returns
    ``state`` (``probes``: the hosts tried)."""
    import socket

    state = {"up": True, "probes": []}

    class Connection:
        def close(self):
            pass

    def connect(address, timeout=None):
        state["probes"].append((address, timeout))
        if not state["up"]:
            raise OSError("[Errno -2] Name or service not known")
        return Connection()

    monkeypatch.delenv("THOR_TF_NO_DOWNLOAD", raising=False)
    monkeypatch.setattr(socket, "create_connection", connect)
    return state


def test_failed_download_is_runtime_error(no_local_data, fake_network, monkeypatch):
    keras = pytest.importorskip("keras")

    def boom():
        raise OSError("no network")

    monkeypatch.setattr(keras.datasets.fashion_mnist, "load_data", boom)
    with pytest.raises(RuntimeError, match="apt-get install -y dataset-fashion-mnist"):
        data.load_dataset("fashion_mnist", verbose=False)


def test_no_network_fails_fast_before_the_keras_download(no_local_data, fake_network,
                                                         monkeypatch):
    """The connection probe fails (no network): Keras' download is never called."""
    keras = pytest.importorskip("keras")
    calls = []
    monkeypatch.setattr(keras.datasets.fashion_mnist, "load_data", lambda: calls.append(1))
    fake_network["up"] = False
    with pytest.raises(RuntimeError, match="Name or service not known"):
        data.load_dataset("fashion_mnist", verbose=False)
    assert calls == [] and fake_network["probes"] == [(data.DOWNLOAD_HOST, data.CONNECT_TIMEOUT)]


# ----------------------------------------------------------------- auto

def test_auto_falls_back_to_digits(no_local_data, capsys):
    ds = data.load_dataset("auto", verbose=True)
    out = capsys.readouterr().out
    assert ds.name == "digits"
    assert "fashion_mnist not found locally" in out and "using digits" in out


def test_auto_prefers_fashion(no_local_data, capsys):
    debian, _ = no_local_data
    _fake_fashion(str(debian))
    ds = data.load_dataset("auto", verbose=True)
    assert ds.name == "fashion_mnist"
    assert "using fashion_mnist" in capsys.readouterr().out


def test_auto_quiet(no_local_data, capsys):
    data.load_dataset("auto", verbose=False)
    assert capsys.readouterr().out == ""


def test_tests_never_download(no_local_data, monkeypatch):
    """THOR_TF_NO_DOWNLOAD (set by conftest.py): auto gives digits without a connection."""
    import socket

    assert os.environ.get("THOR_TF_NO_DOWNLOAD")
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: pytest.fail("network"))
    assert data.resolve_auto(verbose=False) == "digits"
    with pytest.raises(RuntimeError, match="download=False"):
        data.load_dataset("fashion_mnist", verbose=False)


def test_auto_downloads_fashion_when_the_network_allows(no_local_data, fake_network, monkeypatch,
                                                        capsys):
    keras = pytest.importorskip("keras")
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (7, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 7, dtype=np.uint8)
    monkeypatch.setattr(keras.datasets.fashion_mnist, "load_data",
                        lambda: ((images, labels), (images[:3], labels[:3])))
    ds = data.load_dataset("auto", verbose=True)
    assert ds.name == "fashion_mnist" and ds.num_train == 7
    assert "downloaded by keras.datasets.fashion_mnist" in capsys.readouterr().out


def test_auto_falls_back_to_digits_in_one_line_when_the_download_fails(no_local_data,
                                                                      fake_network, capsys):
    fake_network["up"] = False
    ds = data.load_dataset("auto", verbose=True)
    lines = capsys.readouterr().out.splitlines()
    assert ds.name == "digits"
    assert "the Keras download failed: [Errno -2] Name or service not known" in lines[0]
    assert "using digits" in lines[0] and "apt-get install -y dataset-fashion-mnist" in lines[0]
    assert len(lines) == 2  # that line and the one saying what was loaded


# ----------------------------------------------------------------- digits

def test_digits_shapes_range_split():
    ds = data.load_dataset("digits", verbose=False)
    assert ds.x_train.shape == (1437, 8, 8, 1) and ds.x_test.shape == (360, 8, 8, 1)
    assert ds.y_train.shape == (1437,) and ds.y_test.shape == (360,)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert ds.x_train.min() >= 0.0 and ds.x_train.max() == 1.0
    assert ds.input_shape == (8, 8, 1) and ds.num_classes == 10
    # stratified: every class in both splits, test counts 36 +- 1
    assert set(np.unique(ds.y_test)) == set(range(10))
    assert np.all(np.abs(np.bincount(ds.y_test) - 36) <= 1)
    assert "load_digits" in ds.source


def test_digits_deterministic_and_seeded():
    a = data.load_dataset("digits", verbose=False, seed=0)
    b = data.load_dataset("digits", verbose=False, seed=0)
    c = data.load_dataset("digits", verbose=False, seed=1)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert not np.array_equal(a.y_test, c.y_test)


def test_max_train_max_test():
    full = data.load_dataset("digits", verbose=False)
    a = data.load_dataset("digits", max_train=100, max_test=30, verbose=False)
    b = data.load_dataset("digits", max_train=100, max_test=30, verbose=False)
    assert a.x_train.shape == (100, 8, 8, 1) and a.x_test.shape == (30, 8, 8, 1)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    # a shuffled subset, not just the first 100 of the split
    assert not np.array_equal(a.y_train, full.y_train[:100])
    # max_test does not change which training examples are kept
    c = data.load_dataset("digits", max_train=100, max_test=10, verbose=False)
    np.testing.assert_array_equal(a.y_train, c.y_train)
    # n larger than the split keeps everything
    d = data.load_dataset("digits", max_train=10**6, verbose=False)
    assert d.num_train == 1437


@pytest.mark.parametrize("bad", [0, -3, 2.5, "10"])
def test_bad_max_train(bad):
    with pytest.raises(ValueError, match="max_train"):
        data.load_dataset("digits", max_train=bad, verbose=False)


# ----------------------------------------------------------------- pad_to

def test_pad_to_32_digits_upsamples():
    base = data.load_dataset("digits", verbose=False)
    ds = data.load_dataset("digits", pad_to=32, verbose=False)
    assert ds.x_train.shape == (1437, 32, 32, 1) and ds.input_shape == (32, 32, 1)
    # nearest x4: each source pixel becomes a 4x4 block
    np.testing.assert_array_equal(ds.x_train[:, ::4, ::4], base.x_train)
    np.testing.assert_array_equal(ds.x_train[:, 3::4, 1::4], base.x_train)


def test_pad_to_32_fashion_zero_pads(no_local_data):
    debian, _ = no_local_data
    _fake_fashion(str(debian))
    base = data.load_dataset("fashion_mnist", verbose=False)
    ds = data.load_dataset("fashion_mnist", pad_to=32, verbose=False)
    assert ds.x_train.shape == (12, 32, 32, 1) and ds.input_shape == (32, 32, 1)
    np.testing.assert_array_equal(ds.x_train[:, 2:30, 2:30], base.x_train)
    border = ds.x_train.copy()
    border[:, 2:30, 2:30] = 0
    assert not border.any()


def test_pad_to_too_small():
    with pytest.raises(ValueError, match="pad_to"):
        data.load_dataset("digits", pad_to=6, verbose=False)
    with pytest.raises(ValueError, match="pad_to"):
        data.load_dataset("digits", pad_to=0, verbose=False)


def test_pad_to_same_size_is_noop():
    a = data.load_dataset("digits", verbose=False)
    b = data.load_dataset("digits", pad_to=8, verbose=False)
    np.testing.assert_array_equal(a.x_train, b.x_train)


# ----------------------------------------------------------------- mnist / cifar10 caches

def test_mnist_from_keras_cache(no_local_data):
    _, keras_dir = no_local_data
    os.makedirs(keras_dir)
    rng = np.random.default_rng(0)
    np.savez(
        keras_dir / "mnist.npz",
        x_train=rng.integers(0, 256, (7, 28, 28), dtype=np.uint8),
        y_train=rng.integers(0, 10, 7, dtype=np.uint8),
        x_test=rng.integers(0, 256, (4, 28, 28), dtype=np.uint8),
        y_test=rng.integers(0, 10, 4, dtype=np.uint8),
    )
    assert data.available_locally("mnist")
    ds = data.load_dataset("mnist", verbose=False)
    assert ds.x_train.shape == (7, 28, 28, 1) and ds.y_test.dtype == np.int64
    assert 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0


def test_mnist_missing_no_download(no_local_data):
    with pytest.raises(RuntimeError, match="mnist.npz"):
        data.load_dataset("mnist", download=False, verbose=False)


@pytest.mark.parametrize("nested", [False, True])
def test_cifar10_from_keras_cache(no_local_data, nested):
    _, keras_dir = no_local_data
    d = keras_dir / "cifar-10-batches-py"
    if nested:  # Keras 3 layout
        d = keras_dir / "cifar-10-batches-py-target" / "cifar-10-batches-py"
    os.makedirs(d)
    rng = np.random.default_rng(0)
    first = None
    for fname in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        imgs = rng.integers(0, 256, (2, 3, 32, 32), dtype=np.uint8)
        first = imgs if first is None else first
        batch = {b"data": imgs.reshape(2, -1), b"labels": [1, 2]}
        with open(d / fname, "wb") as f:
            pickle.dump(batch, f)
    assert data.available_locally("cifar10")
    ds = data.load_dataset("cifar10", verbose=False)
    assert ds.x_train.shape == (10, 32, 32, 3) and ds.x_test.shape == (2, 32, 32, 3)
    # stored channels-first, returned NHWC
    np.testing.assert_allclose(ds.x_train[0], first[0].transpose(1, 2, 0) / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(ds.y_test, [1, 2])


# ----------------------------------------------------------------- names

def test_bad_name_lists_allowed():
    with pytest.raises(ValueError) as info:
        data.load_dataset("imagenet")
    for n in ("fashion_mnist", "mnist", "digits", "cifar10", "auto"):
        assert n in str(info.value)
    with pytest.raises(ValueError, match="digits"):
        data.available_locally("imagenet")


def test_digits_always_available(no_local_data):
    assert data.available_locally("digits") and data.available_locally("auto")
    assert not data.available_locally("mnist") and not data.available_locally("cifar10")


# ----------------------------------------------------------------- the real files

@pytest.mark.skipif(
    not os.path.isfile(os.path.join(FASHION_DEBIAN, "t10k-labels-idx1-ubyte.gz")),
    reason="dataset-fashion-mnist not installed",
)
def test_real_fashion_mnist_debian(monkeypatch):
    monkeypatch.setattr(data, "DEBIAN_FASHION_MNIST_DIR", FASHION_DEBIAN)
    ds = data.load_dataset("fashion_mnist", max_train=200, max_test=100, verbose=False)
    assert ds.x_train.shape == (200, 28, 28, 1) and ds.x_test.shape == (100, 28, 28, 1)
    assert ds.y_train.min() >= 0 and ds.y_train.max() <= 9
    assert 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0
    # the full test split has exactly 1000 images per class
    full = data.read_idx(os.path.join(FASHION_DEBIAN, "t10k-labels-idx1-ubyte.gz"))
    assert full.shape == (10000,) and np.all(np.bincount(full) == 1000)
