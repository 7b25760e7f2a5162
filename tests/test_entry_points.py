"""Every entry point of the benchmarks imports and parses its command line: a driver in
experiments/ or a script in scripts/ broken by a change to the harness fails here at once (their
training paths run in the tests of their modules: test_suite, test_interleave, test_horizon, ...)."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _entry_points():
    found = []
    for folder in ("experiments", "scripts"):
        for path in sorted((ROOT / folder).glob("*.py")):
            if '__name__ == "__main__"' in path.read_text():
                found.append(f"{folder}.{path.stem}")
    return found


ENTRY_POINTS = _entry_points()


def test_the_entry_points_are_found():
    assert {"experiments.suite", "experiments.horizon", "experiments.report",
            "scripts.bench_interleaved", "scripts.calibrate_split_dim"} <= set(ENTRY_POINTS)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_point_imports_and_prints_its_usage(name, capsys):
    module = importlib.import_module(name)
    main = getattr(module, "main")
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0, name
    out = capsys.readouterr().out
    assert re.match(r"usage: ", out), (name, out[:200])
