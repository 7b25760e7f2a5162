"""experiments: the benchmark harness of thor_tf and the studies over it.

Installed with the project as ``experiments`` (``pip install -e ".[experiments]"`` adds
scikit-learn for the embedded digits and matplotlib for plots); the library itself
(``thor_tf``) does not depend on it. The harness:

* :mod:`.workloads` - the workload registry: a workload is one entry (data, model, loss, metric,
  batch, baselines' grids, its table label) (docs/adding_a_workload.md);
* :mod:`.datasets`, :mod:`.text`, :mod:`.models` - data with offline paths, the char corpus, the
  model zoo;
* :mod:`.baselines` - the first-order baselines' one recipe (SGD-momentum, Adam, AdamW, Muon);
* :mod:`.train` - the one training loop (segments between untimed evaluations);
* :mod:`.timing` - the one timer (run clock, segments, first and steady seconds, machine load,
  step timers: docs/timing.md);
* :mod:`.interleave` - two runs in turn on one host (seconds that can be compared);
* :mod:`.run_cache` - the studies' one cache of finished runs (JSON lines: a rerun trains only
  what is missing);
* :mod:`.record`, :mod:`.worker` - the record stamp (commit, date, machine, command) and writer,
  the fresh-process worker;
* :mod:`.report` - README's table and the docs tables from ``docs/results/``; :mod:`.tables` -
  the parts tables share (the ``metrics.csv`` reader, the number formatter, the markdown table);
  :mod:`.cli` - the command-line parsing the drivers share.

The drivers over it (``python experiments/<name>.py``): ``mnist.py`` (the main job),
``lm.py``, ``finetune.py``, ``suite.py``, ``batch_scaling.py``,
``horizon.py``, ``levers.py``, ``anatomy.py``, ``distributed.py``.
"""
