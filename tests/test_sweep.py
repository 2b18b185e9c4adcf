"""`ft-accum sweep`: through the real CLI, each run through the real `accelerate launch`, on CPU."""

import csv
import json
import os
import subprocess
import sys

import pytest
import yaml
from conftest import (
    CPU_CONFIG,
    FAULT_HOOKS,
    ROOT,
    final_weights,
    kill_when,
    max_abs_difference,
    read_metrics,
    run_in_process,
    tiny_args,
)

from ft_accum.cli import sweep as sweep_module
from ft_accum.cli.main import main as cli_main

TINY = {
    "max_seq_length": 48,
    "learning_rate": 1e-3,
    "lr_scaling": "none",
    "num_warmup_steps": 0,
    "weight_decay": 0.0,
    "num_train_epochs": 1,
    "report_to": "none",
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2,
}


def write_sweep(tmp_path, tiny_model_dir, data_files, name="sweep.yaml", **spec):
    base = {
        **TINY,
        "model_name_or_path": str(tiny_model_dir),
        "train_file": str(data_files["train"]),
        "validation_file": str(data_files["validation"]),
        **spec.pop("base", {}),
    }
    path = tmp_path / name
    path.write_text(
        yaml.safe_dump(
            {
                "recipe": "text_classification",
                "accelerate_config": str(CPU_CONFIG),
                "output_dir": str(tmp_path / "sweep_out"),
                "base": base,
                **spec,
            }
        )
    )
    return path


def sweep_command(path, *extra):
    return [sys.executable, "-m", "ft_accum.cli.main", "sweep", str(path), *extra]


def read_results(tmp_path):
    with open(tmp_path / "sweep_out" / "results.csv") as f:
        return list(csv.DictReader(f))


def read_state(tmp_path):
    return json.loads((tmp_path / "sweep_out" / "sweep_state.json").read_text())["runs"]


@pytest.mark.launch
def test_a_sweep_finishes_its_runs_isolates_a_failure_and_replans_an_out_of_memory_run(
    tmp_path, tiny_model_dir, data_files
):
    """One sweep of two runs: one whose model does not exist, which fails alone with its error
    recorded; and one that runs out of memory, which is replanned at half the micro-batch with the
    same effective batch and finishes with metrics of its own. (A run that finishes at once is
    test_a_killed_sweep_resumes_without_repeating_finished_runs's first.)"""
    # Fault injection in the recipe processes (tests/fault_hooks): any training forward with more than
    # 4 samples fails as a CUDA OOM would. The recipe runs without --auto_micro_batch, so the run dies of it.
    runs = [
        {"seed": 3, "model_name_or_path": str(tmp_path / "no-such-model")},
        {"learning_rate": 3e-3, "seed": 4, "per_device_train_batch_size": 8, "effective_batch_size": 16},
    ]
    path = write_sweep(tmp_path, tiny_model_dir, data_files, base={"max_train_steps": 2}, runs=runs)
    spec = yaml.safe_load(path.read_text())
    del spec["base"]["gradient_accumulation_steps"]
    spec["base"]["effective_batch_size"] = 8
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "PYTHONPATH": str(FAULT_HOOKS), "FT_ACCUM_TEST_OOM_ABOVE_ROWS": "4"}
    result = subprocess.run(sweep_command(path), capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[run 1/2]" in result.stdout and "sweep done: 0 ok, 1 ok after a replan, 1 failed" in result.stdout

    state = read_state(tmp_path)
    failed, replanned = state.values()
    assert [failed["status"], replanned["status"]] == ["failed", "replanned"]
    assert failed["error"].startswith("error: --model_name_or_path") and "does not exist" in failed["error"]
    assert any("does not exist" in line for line in failed["log_tail"])
    assert replanned["attempts"] == 2 and replanned["replanned_args"]["per_device_train_batch_size"] == 4

    rows = read_results(tmp_path)
    assert [r["status"] for r in rows] == ["failed", "replanned"]
    row, run_dir = rows[1], tmp_path / "sweep_out" / list(state)[1]
    assert row["effective_batch_size"] == "16" and row["per_device_train_batch_size"] == "4" and row["updates"] == "2"
    assert 0.0 <= float(row["eval_accuracy"]) <= 1.0
    # Its own metrics: those of the replanned attempt, which trained at micro-batch 4.
    assert float(row["eval_loss"]) == json.loads((run_dir / "all_results.json").read_text())["eval_loss"]
    assert {r["per_device_train_batch_size"] for r in read_metrics(run_dir)} == {4}
    assert (tmp_path / "sweep_out" / "results.md").read_text().count("| failed |") == 1


@pytest.mark.launch
def test_a_killed_sweep_resumes_without_repeating_finished_runs(tmp_path, tiny_model_dir, data_files):
    path = write_sweep(
        tmp_path,
        tiny_model_dir,
        data_files,
        base={"checkpointing_steps": 1, "per_device_train_batch_size": 2},
        grid={"seed": [1, 2]},  # run 1 finishes, run 2 is killed mid-run
    )
    out = tmp_path / "sweep_out"
    process = subprocess.Popen(
        sweep_command(path), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    checkpoint_3 = out / "seed=2" / "checkpoints" / "step_000003"
    kill_when(process, checkpoint_3.exists, "run 2's third checkpoint", timeout=600)  # as a power cut would
    assert not (out / "seed=2" / "all_results.json").exists(), "run 2 finished before the kill"
    run_1_results = (out / "seed=1" / "all_results.json").read_text()

    result = subprocess.run(sweep_command(path), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    state = read_state(tmp_path)
    assert [r["status"] for r in state.values()] == ["ok"] * 2
    assert state["seed=1"]["attempts"] == 1 and (out / "seed=1" / "all_results.json").read_text() == run_1_results
    assert state["seed=2"]["attempts"] == 2 and "Resumed from" in (out / "seed=2" / "log.txt").read_text()
    # Both rows of the results: the runs that finished, the first at once, with their own metrics.
    rows = read_results(tmp_path)
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(0.0 <= float(r["eval_accuracy"]) <= 1.0 for r in rows)
    assert len({r["eval_loss"] for r in rows}) == 2, "different runs should not give identical losses"
    assert (out / "results.md").read_text().count("| ok |") == 2
    # Run 2, resumed, ends where an uninterrupted run with its settings ends.
    whole = tmp_path / "whole"
    run_in_process(
        "text_classification",
        tiny_args(
            tiny_model_dir,
            data_files,
            whole,
            **{**TINY, "checkpointing_steps": 1, "per_device_train_batch_size": 2, "seed": 2},
        ),
    )
    assert max_abs_difference(final_weights(out / "seed=2"), final_weights(whole)) == 0.0


def test_an_edited_sweep_file_is_detected(tmp_path, tiny_model_dir, data_files, capsys):
    path = write_sweep(tmp_path, tiny_model_dir, data_files, grid={"learning_rate": [1e-3, 3e-3]})
    sweep = sweep_module.load_sweep(path)
    (tmp_path / "sweep_out").mkdir()
    state = sweep_module.reconcile_state(sweep, tmp_path / "sweep_out")
    state["runs"]["lr=0.001"]["status"] = "ok"
    sweep_module.write_state(tmp_path / "sweep_out", state)

    # A new grid value: a new run is added, the finished one stays finished.
    path.write_text(path.read_text().replace("- 0.003", "- 0.003\n  - 0.01"))
    cli_main(["sweep", str(path), "--dry-run"])
    listing = capsys.readouterr().out
    assert "3 run(s)" in listing and "lr=0.001" in listing and "ok" in listing and "lr=0.01 " in listing
    assert (
        sweep_module.reconcile_state(sweep_module.load_sweep(path), tmp_path / "sweep_out")["runs"]["lr=0.01"][
            "status"
        ]
        == "pending"
    )

    # A changed base setting changes runs already queued: refused, not mixed.
    path.write_text(path.read_text().replace("num_train_epochs: 1", "num_train_epochs: 2"))
    with pytest.raises(SystemExit, match="changed the settings of run"):
        cli_main(["sweep", str(path)])


@pytest.mark.parametrize(
    "spec, argv, message",
    [
        ({"recipe": "no_such_recipe"}, [], "unknown recipe 'no_such_recipe'"),
        ({"grid": {"learning_rat": [1e-3]}}, [], "learning_rat is not a setting of text_classification.py"),
        ({"grid": {}}, [], "the grid is empty"),
        ({"grid": {"learning_rate": []}}, [], "the grid is empty"),
        ({"grid": {"seed": [1]}}, ["--time_budget", "eight hours"], "cannot read the duration 'eight hours'"),
    ],
)
def test_sweep_bad_input_fails_before_anything_runs(tmp_path, tiny_model_dir, data_files, spec, argv, message):
    path = write_sweep(tmp_path, tiny_model_dir, data_files, **spec)
    if "recipe" in spec:
        contents = yaml.safe_load(path.read_text())
        contents["recipe"] = spec["recipe"]
        path.write_text(yaml.safe_dump(contents))
    with pytest.raises(SystemExit) as error:
        cli_main(["sweep", str(path), *argv])
    assert message in str(error.value) and str(error.value).startswith("error: ")
    assert not (tmp_path / "sweep_out" / "sweep_state.json").exists()


def test_time_budget_parsing():
    assert sweep_module.parse_duration("8h") == 8 * 3600
    assert sweep_module.parse_duration("1h30m") == 5400 and sweep_module.parse_duration("45s") == 45
    assert sweep_module.parse_duration(90) == 90


@pytest.mark.launch
def test_a_second_sweep_on_a_busy_folder_refuses_with_the_holders_pid(tmp_path, tiny_model_dir, data_files):
    """One sweep per output folder: a second would queue the same runs and rewrite sweep_state.json."""
    path = write_sweep(tmp_path, tiny_model_dir, data_files, grid={"learning_rate": [1e-3]})
    (tmp_path / "sweep_out").mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from ft_accum.training.run_outputs import lock_output_dir; "
         f"lock_output_dir({str(tmp_path / 'sweep_out')!r}); print('locked', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = subprocess.run(sweep_command(path), capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert result.returncode != 0
        assert f"is in use by another run (PID {holder.pid})" in result.stderr.strip().splitlines()[-1]
    finally:
        holder.kill()
        holder.wait()
