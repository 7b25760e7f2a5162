"""experiments.record: what a record says about how it was made."""

import json
import subprocess
import sys

from experiments import record


def test_command_is_relative_to_the_checkout_and_keeps_the_arguments():
    script = record.ROOT / "scripts" / "bench_overhead.py"
    assert record.command(["--quick", "--out", "x.json"], script) == \
        "python scripts/bench_overhead.py --quick --out x.json"
    # A script outside the checkout keeps its absolute path.
    assert record.command([], "/elsewhere/run.py") == "python /elsewhere/run.py"


def test_commit_marks_uncommitted_code(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    assert record.git_commit(tmp_path) is None  # not a checkout
    git("init", "-q")
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "a.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "a")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, check=True,
                          capture_output=True, text=True).stdout.strip()
    assert record.git_commit(tmp_path) == head
    (tmp_path / "notes.txt").write_text("not code\n")  # outside thor_tf/experiments/scripts
    assert record.git_commit(tmp_path) == head
    (tmp_path / "experiments" / "a.py").write_text("x = 2\n")
    assert record.git_commit(tmp_path) == head + "+dirty"


def test_write_stamps_the_record_and_draws_its_plot(tmp_path):
    drawn = []
    out = tmp_path / "sub" / "r.json"
    written = record.write(out, {"value": 3, "date": "kept"}, lambda data, path: drawn.append(
        (data, path)), plot_data=[1, 2], argv=["--x"], script=sys.argv[0])
    stored = json.loads(out.read_text())
    assert stored == written and stored["value"] == 3
    assert stored["date"] == "kept"  # a field the record has wins over the stamp's
    assert stored["machine"] == record.machine() and stored["command"].endswith(" --x")
    assert drawn == [([1, 2], out.with_suffix(".png"))]
