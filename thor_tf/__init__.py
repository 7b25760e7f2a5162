"""thor_tf: Kronecker-factored natural gradient (THOR / K-FAC) for Keras 3 on TensorFlow 2.

One line turns a Keras model into one that trains with THOR::

    model = thor_tf.wrap(model)          # prints the registration table
    model.compile(loss=..., metrics=...) # THOR is the default optimizer
    model.fit(...)

Public API: :func:`wrap`, :class:`ThorModel`, :class:`ThorOptimizer`, the update rules
(:mod:`thor_tf.rules`: ``"eigenbasis"``, the default, and ``"inverse"``), the schedules
(:mod:`thor_tf.schedules`), the trace rule's options (:class:`TraceRule`) and presets
(:data:`PRESETS`), the split per factor dimension (:class:`SplitPlan`; ``split_dim="auto"``
calibrates one in ``fit``), the block-diagonal algebra (:mod:`thor_tf.block_diagonal`), the layer-type registry (:func:`register_block`,
:class:`KroneckerBlock`). Datasets and the model zoo of the experiments live in the separate
package ``experiments`` (``experiments/``).
"""

def _check_tensorflow():
    try:
        import tensorflow as tf
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "thor_tf needs TensorFlow >= 2.16 (Keras 3): pip install 'tensorflow-cpu>=2.16' "
            "(or 'tensorflow[and-cuda]>=2.16' for GPUs), or pip install 'thor_tf[cpu]'.") from err
    major, minor = (int(p) for p in tf.__version__.split(".")[:2])
    if (major, minor) < (2, 16):  # pragma: no cover
        raise ImportError(f"thor_tf needs TensorFlow >= 2.16 (Keras 3); found {tf.__version__}.")
    import keras

    if tuple(int(p) for p in keras.__version__.split(".")[:2]) < (3, 8):  # pragma: no cover
        raise ImportError(f"thor_tf needs Keras >= 3.8 (the oldest tested, .ci/floor); found "
                          f"{keras.__version__}: pip install 'keras>=3.8'.")


_check_tensorflow()

from thor_tf import block_diagonal  # noqa: E402
from thor_tf.blocks import KroneckerBlock, register_block  # noqa: E402
from thor_tf.model import ThorModel, wrap  # noqa: E402
from thor_tf.optimizer import ThorOptimizer  # noqa: E402
from thor_tf.trace_rule import PRESETS, TraceRule  # noqa: E402
from thor_tf.split.plan import SplitPlan  # noqa: E402
from thor_tf import rules, schedules  # noqa: E402

__all__ = ["wrap", "ThorModel", "ThorOptimizer", "PRESETS", "TraceRule", "SplitPlan",
           "block_diagonal", "rules", "schedules", "register_block", "KroneckerBlock"]
__version__ = "0.1.0"
