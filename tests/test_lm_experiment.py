"""The language-model driver (experiments/lm.py), without the network: a synthetic text (a
repeating sentence) trains the tiny ``--quick`` model with THOR and AdamW end to end through the
suite's harness (whose summary arithmetic tests/test_suite.py checks). The corpus itself:
tests/test_text.py.
"""

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from experiments import text

ROOT = Path(__file__).resolve().parents[1]


def _lm():
    from experiments import lm
    return lm


def test_no_network_no_cache_exits_saying_what_to_do(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _lm().main(["--quick", "--no-download", "--cache-dir", str(tmp_path / "empty"),
                    "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "not available" in capsys.readouterr().err


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
