"""The shared recipe skeleton: every recipe offers every general feature, and a signal stops a run
gracefully (checkpoint, resume command, 128 + signum) so that the resumed run is bit-identical."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, read_metrics, run_in_process, tiny_args

RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.py"))

# Every recipe offers every general feature: the flags are the shared TrainingArguments (parsed by the same
# code for every recipe), and what each recipe does with them is checked by behaviour, over every file in
# recipes/, by tests/test_recipe_contract.py (`ft-accum check`), not by matching hook names in its source.


def test_the_features_run_together_in_one_recipe(tmp_path, tiny_model_dir, data_files):
    """Schedule, noise scale, OOM retry (armed), sync_each_batch and checkpoints in one real run."""
    out = tmp_path / "all"
    results = run_in_process("text_classification", tiny_args(
        tiny_model_dir, data_files, out, per_device_train_batch_size=2, effective_batch_size=8, num_train_epochs=2,
        accumulation_schedule="epoch1:16", measure_noise_scale=True, auto_micro_batch=True, sync_each_batch=True,
        checkpointing_steps=2))  # fmt: skip
    records = read_metrics(out)
    assert {r["effective_batch_size"] for r in records} == {8, 16}
    assert all("noise_scale" in r for r in records)
    assert results["num_update_steps"] == len(records) and (out / "checkpoints").is_dir()


def slow_run_args(tiny_model_dir, data_files, out):
    # Enough updates that the signal lands mid-run, in several epochs, with dropout-free tiny BERT.
    return tiny_args(tiny_model_dir, data_files, out, per_device_train_batch_size=4, effective_batch_size=8,
                     max_train_steps=150, num_train_epochs=100)  # fmt: skip


def load_final(output_dir):
    from safetensors.torch import load_file

    return load_file(str(output_dir / "final" / "model.safetensors"))


@pytest.mark.launch
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130)])  # through the launcher: test_launcher_stop.py
def test_a_signal_exits_with_128_plus_its_number_after_saving(tmp_path, tiny_model_dir, data_files, signum, code):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / "text_classification.py"),
        *slow_run_args(tiny_model_dir, data_files, out),
    ]
    process = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before it could be signalled"
        time.sleep(0.05)
    process.send_signal(signum)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == code, output[-3000:]
    assert f"python {cmd[1]}" in output and "--resume_from_checkpoint latest" in output
    assert any((out / "checkpoints").glob("step_*/training_state.json"))
