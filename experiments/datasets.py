"""Small image-classification datasets with offline-first loading.

``load_dataset(name, ...)`` returns a :class:`Dataset` whose arrays follow one
convention for every source:

* images: ``float32`` in ``[0, 1]``, NHWC, shape ``(N, H, W, C)``;
* labels: ``int64`` class ids, shape ``(N,)``.

Supported names (see :data:`DATASET_NAMES`):

=================  ==========  ===============================================
name               shape       where it is looked for, in order
=================  ==========  ===============================================
``fashion_mnist``  28x28x1     Debian ``dataset-fashion-mnist`` files, the Keras
                               cache, then a Keras download
``mnist``          28x28x1     Keras cache ``mnist.npz``, then a Keras download
``digits``         8x8x1       scikit-learn (embedded; never downloads)
``cifar10``        32x32x3     Keras cache ``cifar-10-batches-py``, then a Keras
                               download
``auto``           --          ``fashion_mnist`` if present locally, else
                               downloaded by Keras, else ``digits``
=================  ==========  ===============================================

Nothing here touches the network unless a dataset is missing locally *and*
``download=True`` (the default); the Keras download is only a last resort.
It fails fast: a connection to the download host is tried first (a few seconds at
most), and the environment variable ``THOR_TF_NO_DOWNLOAD`` (any non-empty value;
the tests set it) turns every download off.

The search locations are module-level constants (:data:`DEBIAN_FASHION_MNIST_DIR`,
:data:`KERAS_DATASETS_DIRS`) so that tests, or users with data in odd places,
can redirect them.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import pickle
import struct
from typing import Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "DATASET_NAMES",
    "DEBIAN_FASHION_MNIST_DIR",
    "KERAS_DATASETS_DIRS",
    "Dataset",
    "available_locally",
    "load_dataset",
    "read_idx",
    "resolve_auto",
]

#: Names accepted by :func:`load_dataset`.
DATASET_NAMES = ("auto", "fashion_mnist", "mnist", "digits", "cifar10")

#: Where Debian's ``dataset-fashion-mnist`` package installs its files.
DEBIAN_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"


def _default_keras_datasets_dirs() -> Tuple[str, ...]:
    # Mirror keras.src.backend.config: $KERAS_HOME, else ~/.keras, with /tmp/.keras
    # as Keras' own fallback when the home directory is not writable.
    dirs = []
    if os.environ.get("KERAS_HOME"):
        dirs.append(os.path.join(os.path.expanduser(os.environ["KERAS_HOME"]), "datasets"))
    dirs.append(os.path.join(os.path.expanduser("~"), ".keras", "datasets"))
    dirs.append(os.path.join("/tmp", ".keras", "datasets"))
    out = []
    for d in dirs:  # de-duplicate, keep order
        if d not in out:
            out.append(d)
    return tuple(out)


#: Keras ``datasets`` cache directories searched, in order.
KERAS_DATASETS_DIRS: Tuple[str, ...] = _default_keras_datasets_dirs()

_FASHION_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
_CIFAR10_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)

# Datasets whose images are so small that padding alone would leave them a
# speck in the middle of a 32x32 canvas; these are upsampled (nearest) instead.
_UPSAMPLE_FOR_PAD = frozenset({"digits"})

# Stored image side of each dataset, to reject a too-small pad_to before loading.
_IMAGE_SIDE = {"fashion_mnist": 28, "mnist": 28, "digits": 8, "cifar10": 32}

_NUM_DIGITS_TEST = 360  # 1797 - 360 = 1437 train, about a 80/20 split


@dataclasses.dataclass
class Dataset:
    """A train/test split held in memory.

    Attributes:
        x_train: ``float32`` array ``(N_train, H, W, C)`` with values in ``[0, 1]``.
        y_train: ``int64`` array ``(N_train,)`` of class ids in ``[0, num_classes)``.
        x_test: ``float32`` array ``(N_test, H, W, C)``.
        y_test: ``int64`` array ``(N_test,)``.
        name: the dataset actually loaded (never ``"auto"``).
        num_classes: number of classes.
        input_shape: ``(H, W, C)`` of one image (after any ``pad_to``).
        source: human-readable description of where the data came from.
    """

    x_train: np.ndarray = dataclasses.field(repr=False)
    y_train: np.ndarray = dataclasses.field(repr=False)
    x_test: np.ndarray = dataclasses.field(repr=False)
    y_test: np.ndarray = dataclasses.field(repr=False)
    name: str
    num_classes: int
    input_shape: Tuple[int, int, int]
    source: str

    @property
    def num_train(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def num_test(self) -> int:
        return int(self.x_test.shape[0])


# --------------------------------------------------------------------------- IDX

# IDX type codes (third header byte) -> big-endian NumPy dtype.
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: str) -> np.ndarray:
    """Read an IDX file (the MNIST / Fashion-MNIST format), gzip or plain.

    Header: two zero bytes, a type code, the number of dimensions ``ndim``,
    then ``ndim`` big-endian uint32 sizes; the data follow in C order.

    Returns:
        An array of the stored shape, in native byte order (uint8 for images
        and labels of the MNIST family).

    Raises:
        ValueError: if the header is malformed or the payload size does not
            match the header.
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number)")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise ValueError(
            f"{path}: unknown IDX type code 0x{code:02x}; "
            f"allowed: {', '.join(f'0x{c:02x}' for c in _IDX_DTYPES)}"
        )
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise ValueError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", raw[4:header_len])
    dtype = _IDX_DTYPES[code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header_len != expected:
        raise ValueError(
            f"{path}: IDX payload has {len(raw) - header_len} bytes, header "
            f"shape {shape} needs {expected}"
        )
    arr = np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(shape)
    return arr.astype(dtype.newbyteorder("="))


# ------------------------------------------------------------------ search paths

def _fashion_dirs() -> list:
    # Read the module globals at call time so monkeypatching them works.
    return [DEBIAN_FASHION_MNIST_DIR] + [
        os.path.join(d, "fashion-mnist") for d in KERAS_DATASETS_DIRS
    ]


def _mnist_files() -> list:
    return [os.path.join(d, "mnist.npz") for d in KERAS_DATASETS_DIRS]


def _cifar10_dirs() -> list:
    out = []
    for d in KERAS_DATASETS_DIRS:
        # Keras 2 extracted here; Keras 3's get_file(extract=True) nests one level.
        out.append(os.path.join(d, "cifar-10-batches-py"))
        out.append(os.path.join(d, "cifar-10-batches-py-target", "cifar-10-batches-py"))
    return out


def _find_dir(dirs: Sequence[str], files: Sequence[str]) -> Optional[str]:
    for d in dirs:
        if all(os.path.isfile(os.path.join(d, f)) for f in files):
            return d
    return None


def _find_file(paths: Sequence[str]) -> Optional[str]:
    for p in paths:
        if os.path.isfile(p):
            return p
    return None


def _check_name(name: str) -> None:
    if name not in DATASET_NAMES:
        raise ValueError(
            f"name must be one of {', '.join(repr(n) for n in DATASET_NAMES)}; "
            f"got {name!r}"
        )


def available_locally(name: str) -> bool:
    """Whether ``name`` can be loaded without the network.

    ``"digits"`` and ``"auto"`` are always available (scikit-learn embeds the
    digits data).
    """
    _check_name(name)
    if name in ("digits", "auto"):
        return True
    if name == "fashion_mnist":
        return _find_dir(_fashion_dirs(), _FASHION_FILES) is not None
    if name == "mnist":
        return _find_file(_mnist_files()) is not None
    return _find_dir(_cifar10_dirs(), _CIFAR10_FILES) is not None  # cifar10


def resolve_auto(download: bool = True, verbose: bool = True) -> str:
    """What ``"auto"`` loads: ``"fashion_mnist"`` when it is on the machine (Debian's package,
    Keras' cache) or Keras downloads it now (into its cache; only when ``download`` and the
    network allow, see :func:`_keras_download`), else ``"digits"``. ``verbose``: one line saying
    which and why (for digits, also how to get Fashion-MNIST)."""
    found = _find_dir(_fashion_dirs(), _FASHION_FILES)
    if found is not None:
        if verbose:
            print(f"auto: using fashion_mnist (found locally in {found})")
        return "fashion_mnist"
    why = "downloads are off"
    if downloads_allowed(download):
        try:
            _load_fashion_mnist(download=True)
        except RuntimeError as err:
            why = f"the Keras download failed: {str(err.__cause__ or err).splitlines()[0]}"
        else:
            if verbose:
                print("auto: using fashion_mnist (downloaded by keras.datasets.fashion_mnist)")
            return "fashion_mnist"
    if verbose:
        print(f"auto: fashion_mnist not found locally (looked in {', '.join(_fashion_dirs())}) "
              f"and {why}; using digits (scikit-learn, embedded). For Fashion-MNIST: apt-get "
              f"install -y dataset-fashion-mnist (Debian/Ubuntu), or with internet python -c "
              f"'import keras; keras.datasets.fashion_mnist.load_data()'")
    return "digits"


# ---------------------------------------------------------------------- loaders
# Each raw loader returns (x_train, y_train, x_test, y_test, source) with images
# still in their stored dtype (uint8 0..255, or float 0..16 for digits).

def _download_failed(name: str, looked_at: Sequence[str], how: str, err: Exception):
    paths = "\n  ".join(looked_at)
    return RuntimeError(
        f"{name}: not found locally and the Keras download failed "
        f"({type(err).__name__}: {err}).\nLooked at:\n  {paths}\n"
        f"To get the data offline: {how}\n"
        "(Or use name='digits' / 'auto', which needs no download.)"
    )


def _not_local(name: str, looked_at: Sequence[str], how: str):
    paths = "\n  ".join(looked_at)
    return RuntimeError(
        f"{name}: not found locally and download=False.\nLooked at:\n  {paths}\n"
        f"To get the data offline: {how}"
    )


#: Where ``keras.datasets`` downloads MNIST, Fashion-MNIST and CIFAR-10 from (Keras 3).
DOWNLOAD_HOST = ("storage.googleapis.com", 443)
#: Seconds to wait for a connection to :data:`DOWNLOAD_HOST`, and then for each read.
CONNECT_TIMEOUT, READ_TIMEOUT = 3.0, 30.0


def downloads_allowed(download: bool = True) -> bool:
    """``download``, unless the environment variable ``THOR_TF_NO_DOWNLOAD`` is set (non-empty)."""
    return bool(download) and not os.environ.get("THOR_TF_NO_DOWNLOAD")


def _keras_download(name: str, looked_at: Sequence[str], how: str, download: bool):
    """``(tr_x, tr_y, te_x, te_y)`` from ``keras.datasets.<name>.load_data()`` (needs internet;
    Keras keeps the files in its cache, where the next load finds them).

    Fails fast without a network: a connection to :data:`DOWNLOAD_HOST` is tried first (at most
    :data:`CONNECT_TIMEOUT` seconds), and the download's reads time out after
    :data:`READ_TIMEOUT` seconds. Raises the offline RuntimeError (what was looked at, how to get
    the data) when downloads are off (``download`` False or ``THOR_TF_NO_DOWNLOAD``) or fail.
    """
    if not downloads_allowed(download):
        raise _not_local(name, looked_at, how)
    import socket

    previous = socket.getdefaulttimeout()
    try:
        socket.create_connection(DOWNLOAD_HOST, timeout=CONNECT_TIMEOUT).close()
        socket.setdefaulttimeout(READ_TIMEOUT)
        import keras

        (tr_x, tr_y), (te_x, te_y) = getattr(keras.datasets, name).load_data()
    except Exception as e:  # network, SSL, HTTP errors all look different
        raise _download_failed(name, looked_at, how, e) from e
    finally:
        socket.setdefaulttimeout(previous)
    return tr_x, tr_y, te_x, te_y


def _load_fashion_mnist(download: bool):
    d = _find_dir(_fashion_dirs(), _FASHION_FILES)
    if d is not None:
        tr_x, tr_y, te_x, te_y = (read_idx(os.path.join(d, f)) for f in _FASHION_FILES)
        return tr_x, tr_y, te_x, te_y, f"IDX files in {d}"
    looked = _fashion_dirs()
    how = (
        "`apt-get install -y dataset-fashion-mnist` (installs into "
        f"{DEBIAN_FASHION_MNIST_DIR}), or copy {', '.join(_FASHION_FILES)} into "
        f"{os.path.join(KERAS_DATASETS_DIRS[0], 'fashion-mnist')}"
    )
    tr_x, tr_y, te_x, te_y = _keras_download("fashion_mnist", looked, how, download)
    return tr_x, tr_y, te_x, te_y, "keras.datasets.fashion_mnist (downloaded)"


def _load_mnist(download: bool):
    p = _find_file(_mnist_files())
    if p is not None:
        with np.load(p, allow_pickle=False) as f:
            return f["x_train"], f["y_train"], f["x_test"], f["y_test"], f"npz file {p}"
    looked = _mnist_files()
    how = f"copy mnist.npz (keys x_train, y_train, x_test, y_test) to {looked[0]}"
    tr_x, tr_y, te_x, te_y = _keras_download("mnist", looked, how, download)
    return tr_x, tr_y, te_x, te_y, "keras.datasets.mnist (downloaded)"


def _read_cifar_batch(path: str):
    with open(path, "rb") as f:
        d = pickle.load(f, encoding="bytes")
    # The python-pickle batches store rows of 3072 = 3 x 32 x 32, channels first.
    x = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return x, np.asarray(d[b"labels"])


def _load_cifar10(download: bool):
    d = _find_dir(_cifar10_dirs(), _CIFAR10_FILES)
    if d is not None:
        parts = [_read_cifar_batch(os.path.join(d, f"data_batch_{i}")) for i in range(1, 6)]
        te_x, te_y = _read_cifar_batch(os.path.join(d, "test_batch"))
        tr_x = np.concatenate([p[0] for p in parts])
        tr_y = np.concatenate([p[1] for p in parts])
        return tr_x, tr_y, te_x, te_y, f"pickle batches in {d}"
    looked = _cifar10_dirs()
    how = (
        "extract cifar-10-python.tar.gz (from https://www.cs.toronto.edu/~kriz/) "
        f"so that {os.path.join(looked[0], 'data_batch_1')} exists"
    )
    tr_x, tr_y, te_x, te_y = _keras_download("cifar10", looked, how, download)
    if tr_x.shape[-1] != 3:  # Keras honours image_data_format="channels_first"
        tr_x, te_x = tr_x.transpose(0, 2, 3, 1), te_x.transpose(0, 2, 3, 1)
    return tr_x, tr_y, te_x, te_y, "keras.datasets.cifar10 (downloaded)"


def _load_digits(seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x, y = d.images, d.target  # (1797, 8, 8) float64 in 0..16
    tr_x, te_x, tr_y, te_y = train_test_split(
        x, y, test_size=_NUM_DIGITS_TEST, stratify=y, random_state=seed
    )
    return tr_x, tr_y, te_x, te_y, "sklearn.datasets.load_digits (embedded)"


# ------------------------------------------------------------------ processing

def _to_float_nhwc(x: np.ndarray, scale: float) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32) / np.float32(scale)
    if x.ndim == 3:  # grayscale stored as (N, H, W)
        x = x[..., None]
    return x


def _pad_images(x: np.ndarray, pad_to: int, name: str, upsample: bool) -> np.ndarray:
    """Bring ``(N, H, W, C)`` images to ``(N, pad_to, pad_to, C)``.

    Nearest-neighbour upsampling by ``pad_to // H`` first when ``upsample``,
    then zero padding, split evenly (any odd pixel goes to the bottom/right).
    """
    h, w = x.shape[1], x.shape[2]
    if pad_to < max(h, w):
        raise ValueError(
            f"pad_to must be >= the image size of {name} ({h}x{w}); got {pad_to}"
        )
    if upsample:
        k = pad_to // max(h, w)
        if k > 1:
            x = np.repeat(np.repeat(x, k, axis=1), k, axis=2)
            h, w = x.shape[1], x.shape[2]
    top, left = (pad_to - h) // 2, (pad_to - w) // 2
    if top or left or h != pad_to or w != pad_to:
        x = np.pad(x, ((0, 0), (top, pad_to - h - top), (left, pad_to - w - left), (0, 0)))
    return x


def _check_count(n, arg):
    if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0):
        raise ValueError(f"{arg} must be a positive int or None; got {n!r}")


def _subsample(x, y, n, rng):
    if n is None:
        return x, y
    idx = rng.permutation(x.shape[0])[: int(n)]
    return x[idx], y[idx]


def load_dataset(
    name: str,
    *,
    max_train: Optional[int] = None,
    max_test: Optional[int] = None,
    pad_to: Optional[int] = None,
    verbose: bool = True,
    seed: int = 0,
    download: bool = True,
) -> Dataset:
    """Load a dataset into memory (see the module docstring for names/sources).

    Args:
        name: one of :data:`DATASET_NAMES`.
        max_train, max_test: if given, keep the first ``n`` examples after a
            shuffle seeded by ``seed`` (the same ``n`` and ``seed`` always give
            the same subset).
        pad_to: if given, make images ``pad_to x pad_to``: 28x28 images are
            zero-padded (2 px each side for 32); 8x8 digits are upsampled
            (nearest, x4 for 32) then padded if needed. Must be >= image size.
        verbose: print one line saying what was loaded from where (and, for
            ``"auto"``, which dataset was chosen and why).
        seed: seeds the digits train/test split and the subsampling.
        download: allow the Keras download as a last resort. With ``False``
            (or ``THOR_TF_NO_DOWNLOAD`` set) a missing dataset raises at once,
            and ``"auto"`` gives digits, without touching the network.

    Returns:
        A :class:`Dataset`.

    Raises:
        ValueError: bad ``name``, ``max_train``, ``max_test`` or ``pad_to``.
        RuntimeError: the data are not available locally and could not be
            downloaded; the message lists the paths searched and how to
            install the data.
    """
    # Validate everything before touching the (possibly large) files.
    _check_name(name)
    _check_count(max_train, "max_train")
    _check_count(max_test, "max_test")
    if pad_to is not None and (
        isinstance(pad_to, bool) or not isinstance(pad_to, (int, np.integer)) or pad_to <= 0
    ):
        raise ValueError(f"pad_to must be a positive int or None; got {pad_to!r}")

    if name == "auto":
        name = resolve_auto(download=download, verbose=verbose)

    if pad_to is not None and pad_to < _IMAGE_SIDE[name]:
        side = _IMAGE_SIDE[name]
        raise ValueError(
            f"pad_to must be >= the image size of {name} ({side}x{side}); got {pad_to}"
        )

    if name == "fashion_mnist":
        raw, scale, num_classes = _load_fashion_mnist(download), 255.0, 10
    elif name == "mnist":
        raw, scale, num_classes = _load_mnist(download), 255.0, 10
    elif name == "cifar10":
        raw, scale, num_classes = _load_cifar10(download), 255.0, 10
    else:  # digits
        raw, scale, num_classes = _load_digits(seed), 16.0, 10
    tr_x, tr_y, te_x, te_y, source = raw

    y_train = np.asarray(tr_y, dtype=np.int64).reshape(-1)
    y_test = np.asarray(te_y, dtype=np.int64).reshape(-1)
    # Subsample the stored (uint8) arrays before converting, to keep memory small.
    # Independent streams so max_test does not change which training examples are kept.
    tr_x, y_train = _subsample(tr_x, y_train, max_train, np.random.default_rng([seed, 0]))
    te_x, y_test = _subsample(te_x, y_test, max_test, np.random.default_rng([seed, 1]))
    x_train, x_test = _to_float_nhwc(tr_x, scale), _to_float_nhwc(te_x, scale)

    if pad_to is not None:
        up = name in _UPSAMPLE_FOR_PAD
        x_train = _pad_images(x_train, int(pad_to), name, up)
        x_test = _pad_images(x_test, int(pad_to), name, up)

    ds = Dataset(
        x_train=np.ascontiguousarray(x_train),
        y_train=y_train,
        x_test=np.ascontiguousarray(x_test),
        y_test=y_test,
        name=name,
        num_classes=num_classes,
        input_shape=tuple(int(s) for s in x_train.shape[1:]),
        source=source,
    )
    if verbose:
        print(
            f"{name}: {ds.num_train} train / {ds.num_test} test, "
            f"input_shape={ds.input_shape}, from {source}"
        )
    return ds
