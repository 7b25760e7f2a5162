"""Seconds to the target with THOR's and the best baseline's training interleaved in one process,
segment by segment (:mod:`experiments.interleave`; it writes ``docs/results/suite.json``).

    python scripts/bench_interleaved.py --out docs/results/suite.json   # ~17 min, 7 workloads
    python scripts/bench_interleaved.py --quick     # the tabular MLP, one seed: the harness
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from experiments.interleave import main  # noqa: E402

if __name__ == "__main__":
    main()
