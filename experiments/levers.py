"""Levers for long runs: THOR at its default against THOR with one option set changed, paired.

    python experiments/levers.py                       # fashion_cnn, char_gpt at 4x; resumes
    python experiments/levers.py --report-only         # record, tables, plot: all it holds
    python experiments/levers.py --levers floor --workloads char_gpt --multiples 1
    python experiments/levers.py --quick               # tabular MLP, one lever, seed 0 (CI)

Issue 54, item 3. On the horizon study's lengths (``horizon.lengthened_workload``: ``m`` times
the suite's length at the suite's batch) each **lever** (a set of ``thor_tf.wrap`` options,
:data:`LEVERS`) is trained on seeds 0, 1, 2 beside THOR at its default on the same seeds: the
suite's recipe (``suite.train_run``: a seed fixes the initial weights and the batch order;
THOR's ``WarmupCosine(total_steps)`` spans the run), so lever and default of one seed are a
**pair** and their difference is the lever's effect on that seed. "THOR's default" here is
the studies' rule (``run_cache.STUDY_RULE``: relative ε 1e-2, the library's default when these
runs were trained, before 2026-11-30); every lever is set on it, so a cached run and a rerun are
one configuration. The library's default since then is the lever ``releps_big`` (ε 0.1).

* **THOR's default runs** come from the horizon study's cache (``--horizon-cache``, its
  ``horizon_runs.jsonl``: "thor" at rate 0, phase "sweep" or "interleaved", the same workload,
  steps, seed and evaluations) when it holds them, else they are trained here.
* **Target** per workload and length: the best baseline's **seed-0** final there, read from the
  horizon cache's phase "sweep" rows (the baselines' tuning on seed 0; the horizon study's own
  target is their median over seeds, which its tuning does not have yet). Steps to the target:
  the first of the ``--evals`` evaluations at or past it (``suite.reach``); None: never.
* **Paired statistics** per lever, workload and length (:func:`paired`): both sides' finals
  (per seed, median, mean ± sd), the per-seed difference lever − default (median, mean ± sd,
  how many seeds it improves), the same for steps to the target where both reach it.
* **Order**: seed 0 of every lever on every workload first, then seed 1, then seed 2; the
  default's run of a seed after that seed's levers (the horizon study may have trained it
  meanwhile: its cache is read again before each). Then the ``--check`` length (1x) for every
  lever that improves every workload on every seed at the longer lengths: a lever must not lose
  the short runs.

**Resumable**: every finished run is appended to ``--out``/``levers_runs.jsonl`` (one JSON line:
workload, multiple, steps, lever, options, seed, quick, evals, final, curve ``[[step, seconds,
metric, train_loss], ...]``, wall seconds); a rerun trains only what is missing. A lever's
options are part of its key: changing a lever's values retrains it.

Outputs in ``--out`` (default ``docs/results``; ``runs/levers_quick`` with ``--quick``):
``levers.json`` (``{"levers": {name: {"options", "workloads": {workload: {m: cell}}}}}``, a cell
as :func:`cell` makes it), ``levers.png`` (per lever: the paired final differences, signed so
that up is better, seeds as points) and ``levers.md`` (the tables; with the default ``--out``
written to ``docs/levers.md``, its hand-written verdicts kept).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
import types
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from experiments import horizon as hz  # noqa: E402
from experiments import tables  # noqa: E402
from experiments import workloads as wl  # noqa: E402
from experiments.run_cache import (THOR_PEAK, JsonlRuns, read_jsonl, run_outcome,  # noqa: E402
                                   study_rule, total_steps)

ROOT = Path(__file__).resolve().parent.parent
CACHE = "levers_runs.jsonl"
WORKLOADS = ("fashion_cnn", "char_gpt")
EVALS = hz.EVALS            # the horizon study's: its default runs and steps are comparable
#: Weight decay as the baselines apply it: kernels and embeddings, not biases or normalization
#: scales/offsets. ``suite.baseline_optimizer`` excludes every variable of rank < 2; THOR's
#: ``weight_decay_exclude`` goes by name, and these names exclude exactly those on the Fashion
#: CNN; on the char GPT they also exclude the attention's query/key/value biases (rank 2,
#: ``[heads, head_dim]``, decayed by its baselines).
WD_EXCLUDE = ("bias", "gamma", "beta")
#: THOR's weight decay giving ``peak·wd`` the best decaying baseline's ``rate·wd`` at 4x
#: (horizon_runs.jsonl's seed-0 tuning): the Fashion CNN's Muon at 3.3e-3 with 0.004 against
#: THOR's peak 1.44e-2 (1,116 steps): 9.2e-4 -> 1e-3; the char GPT's AdamW and Muon at 9e-3
#: with 0.1 against THOR's 9.8e-3 (2,400 steps): 0.092 -> 0.1, the baselines' own value.
WD_RATE_MATCHED = {"fashion_cnn": 1e-3, "char_gpt": 0.1, "tabular_mlp": 1e-3}


def _weight_decay(value):
    return {"weight_decay": value, "weight_decay_exclude": list(WD_EXCLUDE)}


def _eigenbasis(**options):
    """A lever's spec that sets ``options`` of the eigenbasis rule on every workload (a fresh
    dict per call: :func:`wrap_options` builds the studies' rule with them)."""
    return lambda name: {"rule": dict(options)}


def _on_current_default(**options):
    """:func:`_eigenbasis` with ``options`` on THOR's current default rule
    (``horizon.CURRENT_DEFAULT_LEVER``'s; such a lever is listed in :data:`AGAINST`)."""
    return _eigenbasis(**hz.CURRENT_DEFAULT_LEVER[1]["rule"], **options)


#: name -> (description, options of a workload: a JSON-able spec, :func:`wrap_options`).
LEVERS = {
    "wd_keras": ("decoupled weight decay 0.004 (Keras' AdamW / Muon default; the Fashion "
                 "CNN's baselines'), biases and norms excluded",
                 lambda name: _weight_decay(0.004)),
    "wd_matched": ("decoupled weight decay with THOR's peak·wd = the best decaying baseline's "
                   "rate·wd at 4x (Fashion CNN 1e-3; char GPT 0.1, its baselines' own)",
                   lambda name: _weight_decay(WD_RATE_MATCHED.get(name, 0.004))),
    "floor": ("the cosine ends at 0.1 x the peak instead of 0 (the char GPT baselines' "
              "floor_fraction)", lambda name: {"floor_fraction": 0.1}),
    "beta2": ("the eigenbasis moments' beta_2 0.95 -> 0.99",
              _eigenbasis(beta_2=0.99)),
    "beta2_long": ("the eigenbasis moments' beta_2 0.95 -> 0.999 (Adam's): the step shrinks as "
                   "the gradients do late in a run, as Adam's does (at 16x on the Fashion CNN, "
                   "with the training loss at 0, THOR's steps were 30-110x Adam's: "
                   "docs/anatomy.md)",
                   _eigenbasis(beta_2=0.999)),
    "beta2_grow": ("the eigenbasis moments' beta_2 grows as Adafactor's, min(0.999, 1 - t^-0.8): "
                   "0.95 at step ~42, 0.99 at ~316, 0.999 at ~5,600; the short memory of the "
                   "default early, Adam's late (beta2_long's 0.999 throughout lost the char GPT)",
                   _eigenbasis(beta_2=0.999, beta_2_growth=0.8)),
    "releps": ("the eigenbasis rule's relative epsilon 1e-2 -> 1e-3",
               _eigenbasis(relative_epsilon=1e-3)),
    "releps_big": ("the eigenbasis rule's relative epsilon 1e-2 -> 1e-1: a damping of the "
                   "eigendirections the gradients barely reach (with a large epsilon the step "
                   "tends to Muon's orthogonalized momentum), against THOR fitting the training "
                   "data sooner than the baselines on repeated data (docs/anatomy.md)",
                   _eigenbasis(relative_epsilon=1e-1)),
    "releps_mid": ("the eigenbasis rule's relative epsilon 1e-2 -> 3e-2 (geometric middle of "
                   "the default and releps_big: does a part of releps_big's gain on repeated "
                   "data come at a smaller cost to the fitting workloads?)",
                   _eigenbasis(relative_epsilon=3e-2)),
    "releps_huge": ("the eigenbasis rule's relative epsilon 0.1 -> 0.3 (THOR's current default "
                    "-> three times it): at 16x the suite's length the image workloads "
                    "memorize (training loss ~1e-4, docs/anatomy.md) and end behind the tuned "
                    "baselines, which releps_big's damping of weakly-seen eigendirections did "
                    "not change; does more of it? (a probe for an epsilon that grows late in "
                    "the run: if a constant 0.3 does not help at 16x, less of it will not)",
                    _eigenbasis(relative_epsilon=3e-1)),
    "current": ("THOR's current default (relative epsilon 0.1: releps_big's options) trained "
                "again on the code since 4c34dbd (Newton-Schulz one matrix at a time), whose "
                "round-off differs from releps_big's runs: the reference of the levers measured "
                "since (a reference, not a lever)",
                lambda name: dict(hz.CURRENT_DEFAULT_LEVER[1])),
    "releps_rise": ("the eigenbasis rule's relative epsilon follows the rate on THOR's current "
                    "default: 0.1 at the largest rate so far, rising linearly to 0.5 as the rate "
                    "goes to 0 (Eigenbasis(relative_epsilon=0.1, relative_epsilon_end=0.5); 0.3 "
                    "at half the peak): releps_huge's constant 0.3 helped the CNNs at 4x and the "
                    "ViT at 16x and cost the ViT and the char GPT at 4x, so the default's small "
                    "epsilon while the rate is high and more damping as the cosine anneals",
                    _on_current_default(relative_epsilon_end=0.5)),
    "releps_rise_sized": ("releps_rise's direction at the default's step size: the relative "
                          "epsilon follows the rate from 0.1 to 0.5 as in releps_rise, and each "
                          "block's step in the eigenbasis is scaled to the norm it has at 0.1 "
                          "(Eigenbasis(relative_epsilon=0.1, relative_epsilon_end=0.5, "
                          "step_norm_epsilon=0.1)): under the graft a larger epsilon mostly "
                          "shrinks the step (at 0.5 to ~0.65x 0.1's on the Fashion CNN at 4x), "
                          "so is releps_rise's effect its direction or its size?",
                          _on_current_default(relative_epsilon_end=0.5,
                                              step_norm_epsilon=0.1)),
    "beta1_low": ("the eigenbasis moments' beta_1 0.9 -> 0.8 on THOR's current default "
                  "(relative epsilon 0.1): a first moment of ~5 steps instead of ~10, so the "
                  "orthogonalized step lags the gradient less (lm.py at 2,000 steps, seed 0: "
                  "0.95 / 0.9 / 0.85 / 0.8 / 0.7 / 0.5 ended at 1.6390 / 1.6219 / 1.6166 / "
                  "1.6133 / 1.6209 / 1.6258)",
                  _on_current_default(beta_1=0.8)),
    "beta1_mid": ("the eigenbasis moments' beta_1 0.9 -> 0.85 on THOR's current default "
                  "(relative epsilon 0.1): halfway to beta1_low, which gains on fitting and "
                  "fresh data and loses the topics and breast-cancer held-out figures",
                  _on_current_default(beta_1=0.85)),
    "beta1_rate": ("the eigenbasis moments' beta_1 follows the rate on THOR's current default "
                   "(relative epsilon 0.1), one-cycle momentum: 0.8 at the largest rate so far, "
                   "rising linearly to 0.95 as the rate goes to 0 (Eigenbasis(beta_1=0.8, "
                   "beta_1_end=0.95)): beta1_low's short memory while the rate is high, a long "
                   "one while the cosine anneals (lm.py at 8,000 steps, seed 0: beta_1 0.8 "
                   "level with 0.9 to step ~3,600, behind after)",
                   _on_current_default(beta_1=0.8, beta_1_end=0.95)),
    "beta1_cool": ("the eigenbasis moments' beta_1 follows the rate the other way on THOR's "
                   "current default (relative epsilon 0.1): the default's 0.9 at the largest "
                   "rate so far, falling linearly to beta1_low's 0.8 as the rate goes to 0 "
                   "(Eigenbasis(beta_1=0.9, beta_1_end=0.8)): beta1_rate's longer memory late "
                   "lost what beta1_low gains, so a short memory where the cosine anneals",
                   _on_current_default(beta_1=0.9, beta_1_end=0.8)),
    "neuron_out": ("NorMuon's per-neuron normalization of the orthogonal step on THOR's current "
                   "default (relative epsilon 0.1): each output unit's column of the step divided "
                   "by the root of a running mean (beta_2 0.95) of its squares at unit RMS, then "
                   "back to the step's norm (Eigenbasis(neuron_norm='output')): Newton-Schulz "
                   "leaves the output units of a wide [a, g] step unequal, so some neurons take "
                   "more of it than others",
                   _on_current_default(neuron_norm="output")),
    "neuron_long": ("neuron_out on the step's longer side (Eigenbasis(neuron_norm='long')): per "
                    "input feature of a tall step (a convolution's 9·c_in + 1 rows against "
                    "c_out), per output unit of a wide one, the side whose vectors the orthogonal "
                    "factor does not equalize",
                    _on_current_default(neuron_norm="long")),
    "ns_steps_3": ("the orthogonal step with 3 Newton-Schulz iterations instead of Muon's 5 on "
                   "THOR's current default (Eigenbasis(newton_schulz_steps=3)): the step's "
                   "singular values above 1.8 % of its norm still land in [0.68, 1.2] (5: "
                   "above 0.15 %), the smaller ones grow by up to 41x instead of 485x, so the "
                   "directions the "
                   "eigenbasis Adam step barely holds are raised less, at 3/5 of the products",
                   _on_current_default(newton_schulz_steps=3)),
    "ns_steps_4": ("ns_steps_3 with 4 iterations (Eigenbasis(newton_schulz_steps=4)): "
                   "singular values above 0.5 % of the step's norm land in [0.68, 1.2], smaller "
                   "ones grow by up to 141x: between Muon's 5 and ns_steps_3",
                   _on_current_default(newton_schulz_steps=4)),
    "ns_rate_3": ("the Newton-Schulz iteration count follows the rate on THOR's current default: "
                  "Muon's 5 at the largest rate so far, blended linearly into 3 as the rate "
                  "goes to 0 (Eigenbasis(newton_schulz_steps_end=3): the factor "
                  "w·O_5 + (1 - w)·O_3, w = rate/peak): ns_steps_3 gained the long runs of the "
                  "Fashion CNN and the char GPT and lost the 1x runs of ResNet-20, the ViT, the "
                  "digits CNN and the autoencoder; are the weak directions worth whitening while "
                  "the rate is high and noise once the cosine anneals?",
                  _on_current_default(newton_schulz_steps_end=3)),
    "ns_early_3": ("ns_rate_3 the other way round on THOR's current default: 3 Newton-Schulz "
                   "iterations at the largest rate so far, blended linearly into Muon's 5 as the "
                   "rate goes to 0 (Eigenbasis(newton_schulz_steps=3, "
                   "newton_schulz_steps_end=5)): on seed 0 ns_rate_3 kept none of ns_steps_3's "
                   "gain on the Fashion CNN at 4x (0.8905 against 0.8965) and all of its losses "
                   "on the ViT at 4x and the digits CNN at 1x, so the softer step helps early "
                   "and costs late",
                   _on_current_default(newton_schulz_steps=3, newton_schulz_steps_end=5)),
    "wd_mid": ("decoupled weight decay 0.03 on THOR's current default, biases and norms "
               "excluded: at 16x the image workloads fit their 4,000-8,000 training images by "
               "mid-run and end behind (docs/anatomy.md); with the peak falling as the run "
               "grows, peak·wd·steps/2 is ~0.1 at 1x, 0.2 at 4x, 0.4 at 16x on ResNet-20 "
               "(wd_keras's 0.004 moved the weights by ~0.03 over a run)",
               lambda name: {**hz.CURRENT_DEFAULT_LEVER[1], **_weight_decay(0.03)}),
    "wd_strong": ("decoupled weight decay 0.1 on THOR's current default (wd_mid at 3.3x; the "
                  "char GPT baselines' value, AdamW's common one): peak·wd·steps/2 ~0.3 at 1x, "
                  "0.65 at 4x, 1.3 at 16x on ResNet-20, the shrinkage of SGD's 5e-4 at rate 0.1 "
                  "over a CIFAR schedule; K-FAC's held-out accuracy on BatchNorm ResNets gains "
                  "from decay (Zhang et al. 2018, three mechanisms of weight decay)",
                  lambda name: {**hz.CURRENT_DEFAULT_LEVER[1], **_weight_decay(0.1)}),
    "ema": ("the weights' moving average (Keras' use_ema, momentum 0.99: ~100 steps) is the "
            "model evaluated and returned, as the field's long-run record averages its weights",
            lambda name: {"use_ema": True, "ema_momentum": 0.99}),
    "scale_rms": ("the orthogonal step at Muon's RMS (scale='rms': 0.2·sqrt(max(a, g)) times "
                  "the orthogonal factor) instead of grafted to the eigenbasis Adam step's norm, "
                  "which shrinks with the gradients' signal late in a run (the char GPT's anatomy "
                  "at 4x: THOR's relative steps 0.3-0.5x Muon's in the cosine's last third)",
                  _eigenbasis(scale="rms")),
    "wsd": ("warmup, stable, decay: the rate held at the peak after warmup and the cosine over "
            "the run's last 20 % only (WarmupCosine(decay_fraction=0.2); the field's long runs' "
            "shape), so THOR keeps its early lead's rate longer and anneals as sharply",
            lambda name: {"decay_fraction": 0.2}),
    "fixed_refresh": ("every block refreshed at every cadence point (every 10 steps; "
                      "preset thor_nt, omega1 = omega2 = 0) instead of the trace rule's choice",
                      lambda name: {"preset": "thor_nt"}),
}
#: Levers measured on THOR's current default (``horizon.CURRENT_DEFAULT_LEVER``: the lever whose
#: rule it is, ``releps_big``): each is paired per seed with that lever's runs instead of the
#: study's default (ε 1e-2), so its effect is the change of the one option it adds to the
#: library's default.
AGAINST = {**{name: hz.CURRENT_DEFAULT_LEVER[0] for name in ("beta1_low", "beta1_mid",
                                                             "beta1_rate", "beta1_cool",
                                                             "neuron_out", "neuron_long",
                                                             "releps_huge")},
           "releps_rise": "current", "releps_rise_sized": "current", "ns_steps_3": "current",
           "ns_steps_4": "current", "ns_rate_3": "current",
           "ns_early_3": "current", "wd_mid": "current", "wd_strong": "current"}
DEFAULT_LEVERS = ("wd_keras", "wd_matched", "floor", "beta2", "releps")
QUICK_LEVER = "floor"
DEFAULT = "default"          # the lever name of THOR's default runs trained here


def wrap_options(spec):
    """``[(name, value)]`` for ``suite.compiled_model`` (``args.thor_option``) from a lever's
    spec, on the studies' rule (``run_cache.STUDY_RULE``: the default these levers were measured
    against, relative ε 1e-2): ``"rule"`` builds ``update_rule=study_rule(**rule)``, a list
    becomes a tuple, the rest as it is (``floor_fraction``, ``decay_fraction`` and ``peak`` are
    the schedule's)."""
    options = [] if "rule" in spec else [("update_rule", study_rule())]
    for key, value in spec.items():
        if key == "rule":
            options.append(("update_rule", study_rule(**value)))
        else:
            options.append((key, tuple(value) if isinstance(value, list) else value))
    return options


def _spec_key(spec):
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


# --------------------------------------------------------------------------------------------
# Runs: this study's cache and the horizon study's
# --------------------------------------------------------------------------------------------

class Runs(JsonlRuns):
    """This study's finished runs (``path``, one JSON line each) and the horizon study's cache
    (``horizon``, read again by :meth:`reload`); ``train`` False: a missing run is skipped."""

    def __init__(self, path, horizon, quick, evals, train=True):
        super().__init__(path, quick, evals, train)
        self.horizon_path = horizon
        self.reload()

    def reload(self):
        self.horizon = [r for r in read_jsonl(self.horizon_path)
                        if r.get("quick") == self.quick and r.get("evals") == self.evals]

    @staticmethod
    def key_of(run):
        return (run["workload"], run["steps"], run["lever"], _spec_key(run["options"]),
                run["seed"], run["quick"], run["evals"])

    def lever_run(self, name, steps, lever, spec, seed):
        return self.runs.get((name, steps, lever, _spec_key(spec), seed, self.quick, self.evals))

    def default_run(self, name, steps, seed):
        """THOR's default on ``seed``: the horizon cache's (phase "sweep" first, then
        "interleaved") when it has it, else this study's; None when neither has it."""
        for phase in ("sweep", "interleaved"):
            for run in reversed(self.horizon):
                if (run["workload"], run["steps"], run["optimizer"], run["seed"],
                        run["phase"]) == (name, steps, "thor", seed, phase) and not run["rate"]:
                    return {**run, "source": f"horizon ({phase})"}
        run = self.lever_run(name, steps, DEFAULT, {}, seed)
        return None if run is None else {**run, "source": "levers"}

    def target(self, workload, steps):
        """``(target, {"optimizer", "rate", "seed": 0})``: the best baseline's seed-0 final at
        ``steps`` among the horizon cache's "sweep" rows, or ``(None, None)``."""
        best = None
        sign = 1 if workload.higher_is_better else -1
        for run in self.horizon:
            if (run["workload"], run["steps"], run["phase"], run["seed"]) != (
                    workload.name, steps, "sweep", 0) or run["optimizer"] in ("thor",
                                                                             THOR_PEAK):
                continue
            final = run["final"]
            if final is None or math.isnan(final):
                continue
            if best is None or sign * final > sign * best[0]:
                best = (final, {"optimizer": run["optimizer"], "rate": run["rate"], "seed": 0})
        return best or (None, None)

    def store(self, workload, data, multiple, lever, spec, seed, rows, wall):
        return self.add({"workload": workload.name, "multiple": multiple,
                         "steps": total_steps(workload, data), "batch": workload.batch_size,
                         "lever": lever, "options": spec, "seed": int(seed),
                         "quick": self.quick, "evals": self.evals, **run_outcome(rows, wall)})

    def train_run(self, workload, data, multiple, lever, spec, seed):
        """One run of the suite's recipe (``suite.train_run``) with THOR's options ``spec``."""
        from experiments import suite

        args = argparse.Namespace(quick=self.quick, evals=self.evals,
                                  thor_option=wrap_options(spec))
        rows, started = [], time.perf_counter()
        suite.train_run(workload, data, "thor", 0.0, seed, args, rows.append)
        return self.store(workload, data, multiple, lever, spec, seed, rows,
                          time.perf_counter() - started)


class Lengths:
    """``(workload, data)`` of a workload at a multiple of the suite's length, memoized."""

    def __init__(self, quick):
        self.quick, self._data, self._at = quick, {}, {}

    def at(self, name, multiple):
        if (name, multiple) not in self._at:
            if name not in self._data:
                self._data[name] = wl.ALL_WORKLOADS[name].sized(self.quick).load(self.quick)
            self._at[(name, multiple)] = hz.lengthened_workload(name, multiple, self.quick,
                                                                data=self._data[name])
        return self._at[(name, multiple)]


# --------------------------------------------------------------------------------------------
# Paired statistics
# --------------------------------------------------------------------------------------------

def _mean_sd(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def steps_to(curve, target, higher_is_better):
    """The first evaluated step (after 0) whose metric is at or past ``target``; None: never."""
    if target is None:
        return None
    from experiments import suite

    rows = [{"step": step, "seconds": seconds, "metric": metric}
            for step, seconds, metric, _ in curve]
    step, _ = suite.reach(types.SimpleNamespace(higher_is_better=higher_is_better), rows, target)
    return step


def summary(values):
    """``{"per_seed", "median", "mean", "sd"}`` of ``values`` (None entries left out of the
    statistics)."""
    mean, sd = _mean_sd(values)
    return {"per_seed": list(values), "median": _median(values), "mean": mean, "sd": sd}


def paired(default, lever, higher_is_better):
    """Per-seed pairs ``default[i]``, ``lever[i]`` (finals or steps; None: missing or never):
    ``{"default", "lever"}`` (:func:`summary`), ``"difference"`` (lever − default where both are
    numbers, its :func:`summary`), ``"improved"`` (seeds where the lever is better: higher when
    ``higher_is_better``, else lower), ``"worse"``, ``"pairs"`` (seeds with both)."""
    diffs = [None if a is None or b is None else b - a for a, b in zip(default, lever)]
    sign = 1 if higher_is_better else -1
    both = [d for d in diffs if d is not None]
    return {"default": summary(default), "lever": summary(lever),
            "difference": summary(diffs), "pairs": len(both),
            "improved": sum(1 for d in both if sign * d > 0),
            "worse": sum(1 for d in both if sign * d < 0)}


def reference_run(runs, name, steps, against, seed):
    """The run a lever is paired with on ``seed``: THOR's study default
    (:meth:`Runs.default_run`) when ``against`` is None, else lever ``against``'s run (source
    ``"levers (<against>)"``); None when it is not held."""
    if against is None:
        return runs.default_run(name, steps, seed)
    run = runs.lever_run(name, steps, against, LEVERS[against][1](name), seed)
    return None if run is None else {**run, "source": f"levers ({against})"}


def cell(runs, workload, steps, multiple, lever, spec, seeds):
    """A lever's cell at one workload and length: the seeds where both the lever's and the
    default's runs (or those of the lever it is paired with, :data:`AGAINST`) are held, their
    finals and steps to the target paired (:func:`paired`; steps lower is better), the target
    and where it comes from, where each reference run comes from. None when no seed has both."""
    target, source = runs.target(workload, steps)
    against = AGAINST.get(lever)
    pairs = []
    for seed in seeds:
        base, run = reference_run(runs, workload.name, steps, against, seed), runs.lever_run(
            workload.name, steps, lever, spec, seed)
        if base is not None and run is not None:
            pairs.append((seed, base, run))
    if not pairs:
        return None
    hib = workload.higher_is_better
    step_of = lambda r: steps_to(r["curve"], target, hib)
    finals = paired([b["final"] for _, b, _ in pairs], [r["final"] for _, _, r in pairs], hib)
    reach = paired([step_of(b) for _, b, _ in pairs], [step_of(r) for _, _, r in pairs], False)
    return {"multiple": multiple, "steps": steps, "metric": workload.metric,
            "against": against or DEFAULT, "higher_is_better": hib,
            "seeds": [s for s, _, _ in pairs],
            "target": target, "target_from": source, "final": finals, "steps_to_target": reach,
            "default_sources": [b["source"] for _, b, _ in pairs],
            "wall_seconds": {"default": [b.get("wall_seconds") for _, b, _ in pairs],
                             "lever": [r.get("wall_seconds") for _, _, r in pairs]}}


def holds(c, min_seeds=3):
    """The lever improves the final on every one of at least ``min_seeds`` paired seeds."""
    return c is not None and c["final"]["pairs"] >= min_seeds and (
        c["final"]["improved"] == c["final"]["pairs"])


def loses(c):
    """The lever's mean paired final is worse than the default's by more than its standard
    error (the 1x check: a lever must not lose the short runs)."""
    d = c["final"]["difference"]
    if d["mean"] is None:
        return False
    sign = 1 if c["higher_is_better"] else -1
    se = (d["sd"] or 0.0) / math.sqrt(c["final"]["pairs"])
    return sign * d["mean"] < -se


# --------------------------------------------------------------------------------------------
# Record
# --------------------------------------------------------------------------------------------

def summarize(runs, lengths, levers, names, multiples, seeds):
    record = {}
    for lever in levers:
        description, options = LEVERS[lever]
        cells = {}
        for name in names:
            for m in multiples:
                try:
                    workload, data = lengths.at(name, m)
                except wl.Unavailable:
                    continue
                c = cell(runs, workload, total_steps(workload, data), m, lever,
                         options(name), seeds)
                if c is not None:
                    cells.setdefault(name, {})[str(m)] = c
        record[lever] = {"description": description,
                         "options": {name: options(name) for name in names},
                         "workloads": cells, "verdict": verdict(cells)}
    return record


def verdict(cells):
    """``{"adopt": bool, "why": text}`` from a lever's cells: adopt when it improves the final
    on every seed (3 at least) at every longer length of every workload tried, and does not lose
    (:func:`loses`) any 1x run; a verdict on a run that is still missing seeds says so."""
    long_cells = [(n, m, c) for n, per in cells.items() for m, c in per.items() if m != "1"]
    short = [(n, c) for n, per in cells.items() for m, c in per.items() if m == "1"]
    if not long_cells:
        return {"adopt": False, "why": "no paired runs at a longer length yet"}
    failed = [f"{n} {m}x ({c['final']['improved']} of {c['final']['pairs']} seeds better)"
              for n, m, c in long_cells if c["final"]["improved"] < c["final"]["pairs"]]
    if failed:
        return {"adopt": False, "why": "does not improve every seed on " + ", ".join(failed)}
    few = [f"{n} {m}x" for n, m, c in long_cells if not holds(c)]
    if few:
        return {"adopt": False, "why": "improves every seed so far, but fewer than 3 seeds on "
                                       + ", ".join(few)}
    if len({n for n, _, _ in long_cells}) < 2:
        return {"adopt": False, "why": "holds on one workload only"}
    lost = [n for n, c in short if loses(c)]
    if lost:
        return {"adopt": False, "why": "loses the 1x run of " + ", ".join(lost)}
    if not short:
        return {"adopt": False, "why": "holds at the longer lengths; the 1x check is missing"}
    return {"adopt": True, "why": "improves every seed at every longer length of every "
                                  "workload and does not lose the 1x runs"}


# --------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------

def _f(value, spec, none="–"):
    return none if value is None else format(value, spec)


def _metric_spec(c):
    return ".2%" if c["metric"] == "accuracy" else ".4f"


def _seeds_text(values, spec):
    return ", ".join(_f(v, spec, "never") for v in values)


def _stat_text(s, spec, never="never"):
    if s["mean"] is None:
        return never
    sd = "" if s["sd"] is None else f" ± {format(s['sd'], spec)}"
    return f"{format(s['median'], spec)} ({format(s['mean'], spec)}{sd})"


def markdown(record, commands):
    evals = record.get("evals", EVALS)
    lines = ["Paired per seed (same seed: same initial weights and batch order); finals as "
             "median (mean ± sd) over the seeds; difference: lever − default per seed "
             "(accuracy in points, loss in nats), with how many seeds it improves. Steps: the "
             f"first of the {evals} evaluations at or past the target, the best baseline's "
             f"**seed-0** final at that length (horizon_runs.jsonl's tuning; \"never\": not "
             "reached).", ""]
    for lever, entry in record["levers"].items():
        v = entry["verdict"]
        against = AGAINST.get(lever)
        paired_with = ("" if against is None else
                       f" Paired with `{against}`'s runs"
                       + (" (THOR's default since 2026-11-30)"
                          if against == hz.CURRENT_DEFAULT_LEVER[0] else "")
                       + ", not the study's default: \"default\" below is that lever.")
        lines += [f"### `{lever}`: {entry['description']}", "",
                  f"Options: `{json.dumps(entry['options'])}`.{paired_with} Verdict from the "
                  f"numbers: **{'adopt' if v['adopt'] else 'not adopted'}**: {v['why']}.", ""]
        if not entry["workloads"]:
            lines += ["(no paired runs yet)", ""]
            continue
        rows = []
        for name, per in entry["workloads"].items():
            for m, c in sorted(per.items(), key=lambda kv: int(kv[0])):
                spec = _metric_spec(c)
                dspec = "+.2f" if c["metric"] == "accuracy" else "+.4f"
                scale = 100 if c["metric"] == "accuracy" else 1
                fd = c["final"]["difference"]
                diffs = [None if d is None else scale * d for d in fd["per_seed"]]
                dmean = None if fd["mean"] is None else scale * fd["mean"]
                dsd = "" if fd["sd"] is None else f" ± {format(scale * fd['sd'], dspec[1:])}"
                src = c["target_from"]
                target = ("none" if c["target"] is None else
                          f"{format(c['target'], spec)} ({src['optimizer']} {src['rate']:g}, "
                          f"seed 0)")
                st = c["steps_to_target"]
                sdiff = st["difference"]["per_seed"]
                rows.append((
                    f"{name} {m}× ({c['steps']:,} steps)", ",".join(map(str, c["seeds"])),
                    target, _stat_text(c["final"]["default"], spec),
                    _stat_text(c["final"]["lever"], spec),
                    f"{_seeds_text(diffs, dspec)} (mean {_f(dmean, dspec)}{dsd})",
                    f"{c['final']['improved']}/{c['final']['pairs']}",
                    _seeds_text(st["default"]["per_seed"], "d"),
                    _seeds_text(st["lever"]["per_seed"], "d"),
                    ", ".join("–" if d is None else f"{d:+d}" for d in sdiff)))
        lines += tables.md_table(
            ("workload, length", "seeds", "target (from)", "default final", "lever final",
             "lever − default per seed", "improved", "default steps", "lever steps",
             "steps difference per seed"), rows)
        lines.append("")
    lines += ["Commands:", "", "```"] + commands + ["```", ""]
    return "\n".join(lines)


def plot(record, path):
    """A row per workload (its unit: accuracy in points, loss in nats, signed so that up is
    better), a column per lever: per length the paired final differences lever − default, seeds
    as points, their mean as a bar; rows share their y axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levers = list(record["levers"])
    names = [n for n in record.get("workloads", []) if any(
        n in record["levers"][x]["workloads"] for x in levers)]
    if not levers or not names:
        return None
    fig, axes = plt.subplots(len(names), len(levers), figsize=(2.6 * len(levers),
                                                               2.4 * len(names)),
                             squeeze=False, sharey="row")
    for row, name in zip(axes, names):
        for ax, lever in zip(row, levers):
            per = record["levers"][lever]["workloads"].get(name, {})
            unit = ""
            for x, (m, c) in enumerate(sorted(per.items(), key=lambda kv: int(kv[0]))):
                sign = 100 if c["metric"] == "accuracy" else (1 if c["higher_is_better"] else -1)
                unit = ("accuracy, points" if c["metric"] == "accuracy"
                        else f"{'' if sign > 0 else '−'}{c['metric']}")
                ds = [sign * d for d in c["final"]["difference"]["per_seed"] if d is not None]
                good = statistics.fmean(ds) > 0
                ax.bar(x, statistics.fmean(ds), width=0.6, alpha=0.3,
                       color="tab:green" if good else "tab:red")
                ax.scatter([x] * len(ds), ds, color="k", s=14, zorder=3)
            ax.axhline(0, color="k", lw=0.6)
            ax.set_xticks(range(len(per)), [f"{m}×" for m in sorted(per, key=int)], fontsize=7)
            ax.set_xlim(-0.7, max(len(per), 2) - 0.3)
            ax.tick_params(axis="y", labelsize=7)
            if name == names[0]:
                ax.set_title(lever, fontsize=9)
            if lever == levers[0]:
                ax.set_ylabel(f"{name}\n({unit or 'final'})", fontsize=8)
    fig.suptitle("THOR with a lever − THOR's default, final metric paired per seed (points: "
                 "seeds, bar: mean); up = better", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(record, out, docs=None, quiet=False):
    """``levers.json``, ``levers.png`` and the tables: in ``docs`` (``docs/levers.md``: what is
    above its generated part, the hand-written verdicts, is kept) or ``out/levers.md``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "levers.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    plot(record, out / "levers.png")
    text = markdown(record, record.get("commands") or [record["command"]])
    marker = "<!-- generated by experiments/levers.py: below this line -->"
    path = docs or out / "levers.md"
    head = ""
    if path.exists() and marker in path.read_text():
        head = path.read_text().split(marker)[0]
    path.write_text(head + marker + "\n\n" + text)
    if not quiet:
        print(text, flush=True)


# --------------------------------------------------------------------------------------------
# Plan and command line
# --------------------------------------------------------------------------------------------

def plan(levers, names, multiples, seeds):
    """``[(seed, multiple, name, lever)]`` in training order: per seed every lever on every
    workload, then the runs they are paired with on that seed (the default's, or
    :data:`AGAINST`'s lever's); seed 0 first."""
    order = []
    for seed in seeds:
        for m in multiples:
            for lever in levers:
                order += [(seed, m, name, lever) for name in names]
            for reference in dict.fromkeys(AGAINST.get(lever, DEFAULT) for lever in levers):
                order += [(seed, m, name, reference) for name in names]
    return order


def run_plan(runs, lengths, order, label=""):
    todo = len(order)
    for k, (seed, m, name, lever) in enumerate(order, 1):
        try:
            workload, data = lengths.at(name, m)
        except wl.Unavailable as err:
            print(f"[{name}] skipped: {err}", flush=True)
            continue
        steps = total_steps(workload, data)
        if lever == DEFAULT:
            runs.reload()                    # the horizon study may have trained it meanwhile
            if runs.default_run(name, steps, seed) is not None:
                continue
            spec = {}
        else:
            spec = LEVERS[lever][1](name)
            if runs.lever_run(name, steps, lever, spec, seed) is not None:
                continue
        print(f"[levers{label} {k}/{todo}] {lever} {json.dumps(spec)} {name} {m}x "
              f"({steps} steps) seed {seed}", flush=True)
        runs.train_run(workload, data, m, lever, spec, seed)


def parse_args(argv=None):
    from experiments.cli import parse_ints

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--levers", default=None,
                        help=f"comma list from {','.join(LEVERS)} (default "
                             f"{','.join(DEFAULT_LEVERS)}; --quick {QUICK_LEVER})")
    parser.add_argument("--workloads", default=None,
                        help=f"comma list (default {','.join(WORKLOADS)}; --quick tabular_mlp)")
    parser.add_argument("--multiples", type=parse_ints, default=None,
                        help="lengths as multiples of the suite's (default 4; --quick 1)")
    parser.add_argument("--check", type=lambda t: [] if t == "none" else parse_ints(t),
                        default=None,
                        help="lengths a lever that holds at --multiples is checked at, or "
                             "'none' (default 1; --quick none)")
    parser.add_argument("--seeds", type=parse_ints, default=None,
                        help="comma list (default 0,1,2; --quick 0)")
    parser.add_argument("--evals", type=int, default=None,
                        help=f"evaluations per run after step 0 (default {EVALS}; --quick 4)")
    parser.add_argument("--horizon-cache", default=None,
                        help="the horizon study's run cache: targets and THOR's default runs "
                             "(default docs/results/horizon_runs.jsonl; --quick none)")
    parser.add_argument("--report-only", action="store_true",
                        help="no training: the record, plot and tables from the caches (every "
                             "lever and seed the cache holds unless --levers / --seeds say)")
    parser.add_argument("--out", default=None,
                        help="cache and record directory (default docs/results; --quick "
                             "runs/levers_quick)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one lever, seed 0")
    args = parser.parse_args(argv)
    args.levers_given, args.seeds_given = args.levers, args.seeds
    q = args.quick
    args.levers = [x for x in (args.levers or (QUICK_LEVER if q else ",".join(DEFAULT_LEVERS)))
                   .split(",") if x]
    unknown = [x for x in args.levers if x not in LEVERS]
    if unknown:
        raise SystemExit(f"error: --levers: unknown {unknown}; allowed: {', '.join(LEVERS)}")
    args.workloads = [w for w in (args.workloads or ("tabular_mlp" if q else
                                                     ",".join(WORKLOADS))).split(",") if w]
    unknown = [w for w in args.workloads if w not in wl.ALL_WORKLOADS]
    if unknown:
        raise SystemExit(f"error: --workloads: unknown {unknown}; allowed: "
                         f"{', '.join(wl.ALL_WORKLOADS)}")
    args.multiples = args.multiples or ([1] if q else [4])
    if args.check is None:
        args.check = [] if q else [1]
    args.seeds = args.seeds if args.seeds is not None else ([0] if q else [0, 1, 2])
    args.evals = args.evals or (4 if q else EVALS)
    if args.evals < 1:
        raise SystemExit("error: --evals must be >= 1")
    if args.out is None:
        args.out = "runs/levers_quick" if q else str(ROOT / "docs" / "results")
    if args.horizon_cache is None and not q:
        args.horizon_cache = str(ROOT / "docs" / "results" / hz.CACHE)
    return args


def main(argv=None):
    from experiments.record import stamp

    args = parse_args(argv)
    out = Path(args.out)
    runs = Runs(out / CACHE, args.horizon_cache, args.quick, args.evals,
                train=not args.report_only)
    if args.report_only:
        # Whatever the cache holds, unless told: its levers (in LEVERS' order) and seeds.
        held = [r for r in runs.runs.values() if r["workload"] in args.workloads]
        if args.levers_given is None:
            args.levers = [x for x in LEVERS if any(r["lever"] == x for r in held)]
        if args.seeds_given is None:
            args.seeds = sorted({r["seed"] for r in held}) or args.seeds
    lengths = Lengths(args.quick)
    started = time.perf_counter()
    if not args.report_only:
        run_plan(runs, lengths, plan(args.levers, args.workloads, args.multiples, args.seeds))
        record = summarize(runs, lengths, args.levers, args.workloads, args.multiples, args.seeds)
        checked = [lever for lever in args.levers
                   if all(holds(c) for per in record[lever]["workloads"].values()
                          for c in per.values())
                   and set(record[lever]["workloads"]) == set(args.workloads)]
        if checked and args.check:
            print(f"[levers] {', '.join(checked)} hold at {args.multiples}x: checked at "
                  f"{args.check}x", flush=True)
            run_plan(runs, lengths, plan(checked, args.workloads, args.check, args.seeds),
                     " check")
    runs.reload()
    multiples = sorted(set(args.multiples) | set(args.check))
    levers = summarize(runs, lengths, args.levers, args.workloads, multiples, args.seeds)
    record = {"levers": levers, "workloads": args.workloads, "multiples": args.multiples,
              "check": args.check, "seeds": args.seeds, "evals": args.evals,
              "quick": args.quick, "cache": CACHE,
              "horizon_cache": None if args.horizon_cache is None else str(args.horizon_cache),
              **stamp(argv),
              "trained": runs.trained, "seconds": round(time.perf_counter() - started, 1)}
    docs = ROOT / "docs" / "levers.md" if out.resolve() == (ROOT / "docs" / "results").resolve() \
        else None
    write_outputs(record, out, docs)
    return record


if __name__ == "__main__":
    main()
