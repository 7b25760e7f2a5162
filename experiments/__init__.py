"""experiments: the comparison experiments of thor_tf (datasets, models, runners).

Installed with the project as ``experiments`` (its folder is ``experiments/``); the
library itself (``thor_tf``) does not depend on it. Its extra requirements (scikit-learn for the
embedded digits, matplotlib for plots) come with ``pip install -e ".[experiments]"``.

* :mod:`.datasets` - MNIST-family and CIFAR-10 loaders with offline paths;
* :mod:`.text` - the character corpus of ``lm.py`` (Shakespeare, fetched once; or any text);
* :mod:`.models` - the model zoo (MLP, CNN, CIFAR ResNets, ResNet-50);
* :mod:`.cli`, :mod:`.runner`, :mod:`.reports` - command line, training runs, summary/plots;
* :mod:`.timing` - the timing harness of every comparison script (docs/timing.md);
* :mod:`.workloads` - the workloads of ``suite.py`` (data, model, loss, metric, baseline grids);
* ``mnist.py``, ``resnet.py``, ``transformer.py``, ``lm.py``, ``suite.py``: the comparison scripts
  (``python experiments/mnist.py``).
"""
