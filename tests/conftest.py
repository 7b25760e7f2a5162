import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The tests never download data (experiments/datasets.py; the scripts run here inherit it).
os.environ["THOR_TF_NO_DOWNLOAD"] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "update_rule(name): run the module's models with this thor_tf update rule as "
                   "the default (the tests of THOR's inverse rule: its K-FAC step, KL clip, damping "
                   "and momentum, written before the eigenbasis rule became the default)")


@pytest.fixture(autouse=True)
def _default_update_rule(request, monkeypatch):
    marker = request.node.get_closest_marker("update_rule")
    if marker is not None:
        import thor_tf.rules

        monkeypatch.setattr(thor_tf.rules, "DEFAULT_RULE", marker.args[0])
