"""The results tables are built from the records in docs/results/ (``python -m
experiments.report``): README's table and docs/results.md must equal what the records
give, and a new suite record dropped in must change them. No training; JSON and CSV only."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from experiments import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_and_results_page_match_the_records():
    stale = [path for path, text in report.render(ROOT).items()
             if open(os.path.join(ROOT, path)).read() != text]
    assert not stale, (f"{stale} differ from the records in docs/results/: run "
                       "`python -m experiments.report` and commit the result")


def test_every_record_says_its_commit_and_machine():
    for name, record in report.load_records(ROOT).items():
        assert record.get("commit"), name
        assert record.get("machine") or record.get("platform"), name


def test_readme_table_has_one_row_per_workload_with_its_record():
    records = report.load_records(ROOT)
    block = report.readme_block(records, ROOT)
    rows = [line for line in block.splitlines() if line.startswith("| ") and "record" in line]
    # 2 main jobs, the LM, 2 LoRA ranks; the LM's long run once its record exists
    assert len(rows) == len(records["suite"]["results"]) + 5 + ("lm_long" in records)
    for line in rows:
        target = line.rsplit("](", 1)[1].split(")", 1)[0]
        assert os.path.exists(os.path.join(ROOT, target)), line


def test_a_new_suite_record_regenerates_the_table(tmp_path):
    """What the lead does after `scripts/bench_interleaved.py --out docs/results/suite.json`:
    the report picks the new record up (here: one workload's finals and ratios changed)."""
    shutil.copytree(os.path.join(ROOT, "docs", "results"), tmp_path / "docs" / "results")
    shutil.copy(os.path.join(ROOT, "README.md"), tmp_path / "README.md")
    shutil.copy(os.path.join(ROOT, "docs", "batch_scaling.md"),
                tmp_path / "docs" / "batch_scaling.md")
    shutil.copy(os.path.join(ROOT, "docs", "horizon.md"), tmp_path / "docs" / "horizon.md")
    suite_path = tmp_path / "docs" / "results" / "suite.json"
    record = json.loads(suite_path.read_text())
    record.pop("commit")  # an older script's record: shown as such, not an error
    fashion = record["results"]["fashion_cnn"]
    fashion.update(thor_final=0.9123, steps_ratio=0.61, seconds_ratio=0.77,
                   timing={**fashion.get("timing", {}), "comparable": True})
    suite_path.write_text(json.dumps(record))
    rendered = report.render(tmp_path)
    row = next(line for line in rendered["README.md"].splitlines()
               if line.startswith("| Fashion-MNIST CNN |"))
    cells = row.split(" | ")
    assert cells[3] == "**91.23 %**" and cells[5:7] == ["0.61×", "0.77×"], row
    assert "commit not recorded" in rendered["docs/results.md"]
    assert rendered["README.md"] != open(os.path.join(ROOT, "README.md")).read()


def test_check_mode_exits_zero_on_the_committed_files():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", "import sys; from experiments import report; "
                           "sys.exit(report.main(['--check']))"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_batch_scaling_record_gives_readme_its_line_and_the_page_its_table():
    """README's line on larger batches and docs/batch_scaling.md's table come from the
    batch-scaling record: a changed cell changes both."""
    records = report.load_records(ROOT)
    record = json.loads(json.dumps(records["batch_scaling"]))
    name = next(iter(record["workloads"]))
    w = record["workloads"][name]
    largest = str(max(int(b) for b in w["batches"]))
    cell = w["batches"][largest]
    base = cell["best_baseline"]
    cell["thor"].update(steps_to_target=10, final=0.5)
    cell[base].update(steps_to_target=40)
    cell["paired_seconds"] = {"per_seed": {"0": 0.3}, "median": 0.3, "only_thor_seeds": []}
    line = report.batch_scaling_line(record)
    assert f"at batch {int(largest):,} ({int(largest) // w['base_batch']}×): steps 0.25×, " \
           f"seconds 0.30×" in line, line
    table = "\n".join(report.batch_scaling_block(record).splitlines())
    assert "| 10 / 40 | 0.30× |" in table
    cell[base].update(steps_to_target=None)
    assert "only THOR reaches the target" in report.batch_scaling_line(record)


def test_a_driver_row_of_a_loss_compares_lower_as_better():
    """``main_job_row`` on ``lm.py``'s record (a loss: lower is better): THOR ahead when its
    final is at or below the target; seconds only when the record says they are comparable."""
    summary = {"target": 1.656, "best_baseline": "muon", "higher_is_better": False,
               "steps_ratio": 0.85, "seconds_ratio": 0.99, "timing": {"comparable": False},
               "optimizers": {"thor": {"final": 1.631, "total_steps": 2000},
                              "muon": {"lr": 3e-3, "final": 1.656}}}
    record = {"_path": "docs/results/lm.json", "seeds": [0, 1, 2], "workload": summary}
    row = report.main_job_row(record, "LM", "loss")
    assert row["ahead"] and row["baseline"].startswith("Muon") and "1.656" in row["baseline"]
    assert row["steps_ratio"] == "0.85×" and row["seconds_ratio"] == "not comparable"
    assert row["seeds"] == 3 and row["steps"] == 2000
    summary["timing"]["comparable"] = True
    summary["optimizers"]["thor"]["final"] = 1.7
    row = report.main_job_row(record, "LM", "loss")
    assert row["seconds_ratio"] == "0.99×" and not row["ahead"]


def test_the_long_lm_record_adds_its_row_after_the_lm_and_is_optional():
    """``lm_8000.json`` (``lm.py --steps 8000``) is read when present: its row follows lm.py's
    2,000-step row, with its own steps; without it the table is as before."""
    records = report.load_records(ROOT)
    records.pop("lm_long", None)
    short = report.all_rows(records)
    long = dict(records["lm"], _path="docs/results/lm_8000.json")
    long["workload"] = json.loads(json.dumps(records["lm"]["workload"]))
    long["workload"]["optimizers"]["thor"]["total_steps"] = 8000
    rows = report.all_rows({**records, "lm_long": long})
    assert len(rows) == len(short) + 1
    at = next(i for i, r in enumerate(rows) if r["record"] == "docs/results/lm.json")
    assert rows[at + 1]["record"] == "docs/results/lm_8000.json" and rows[at + 1]["steps"] == 8000


def test_the_horizon_line_names_a_baseline_whose_median_over_seeds_beats_the_leaders():
    """The leader is chosen on seed 0; run on every seed (``--every-baseline``), another
    baseline's median final can be better: README's line then gives THOR's steps to it too. A
    baseline on seed 0 only, or with a worse median, is not named."""
    from experiments import report

    def cell(vs):
        return {"best_baseline": "adam", "target": 0.884, "steps_ratio": 0.27,
                "seconds_ratio": None, "thor": {"seeds": [0, 1, 2], "steps_to_target": 670},
                "adam": {"steps_to_target": 2455}, "vs": vs}

    better = {"adam": {"target": 0.884, "seeds": [0, 1, 2], "steps_ratio": 0.27},
              "muon": {"target": 0.8885, "seeds": [0, 1, 2], "steps_ratio": 0.9172}}
    record = {"seeds": [0, 1, 2], "workloads": {"fashion_cnn": {"lengths": {"16": cell(better)}}}}
    assert "16× 0.27× (0.92× against Muon's better median final)" in report.horizon_line(record)
    for muon in ({"target": 0.8885, "seeds": [0], "steps_ratio": 0.21},
                 {"target": 0.880, "seeds": [0, 1, 2], "steps_ratio": 0.5}):
        record["workloads"]["fashion_cnn"]["lengths"]["16"] = cell({**better, "muon": muon})
        assert "against Muon" not in report.horizon_line(record)
