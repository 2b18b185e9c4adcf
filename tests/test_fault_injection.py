"""Fault injection through the real `accelerate launch`: SIGKILL, a corrupted checkpoint, a failing disk.

The claim under test: a run killed at any moment and resumed with `--resume_from_checkpoint latest`
(or, for one worker of 2 killed under torchrun's `--max_restarts`, restarted and resumed by itself)
ends with final weights *bit-identical* (max abs difference 0.0) to an uninterrupted run with the
same seed, on CPU, for 1 and 2 processes; and `metrics.jsonl` then holds every update exactly once.
"""

import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    FAULT_HOOKS,
    final_weights,
    kill_when,
    launch,
    launch_command,
    make_rows,
    max_abs_difference,
    read_metrics,
    run_in_process,
    tiny_args,
    write_jsonl,
)

from ft_accum.cli.launching import process_tree
from ft_accum.training import checkpointing
from ft_accum.training.run_outputs import truncate_metrics

pytestmark = pytest.mark.launch

# 96 rows, 2 × 2 per update: 24 updates per epoch, 48 in all, a checkpoint after every one.
COMMON = {
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "num_train_epochs": 2,
    "checkpointing_steps": 1,
}
TOTAL_UPDATES = 48


@pytest.fixture(scope="module")
def data(tmp_path_factory, data_files):
    train = write_jsonl(tmp_path_factory.mktemp("fault-data") / "train.jsonl", make_rows(96, seed=4))
    return {**data_files, "train": train}


@pytest.fixture(scope="module")
def dropout_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny BERT with dropout 0.1, so a resume that did not restore every RNG would differ."""
    import shutil

    from transformers import BertForSequenceClassification

    path = tmp_path_factory.mktemp("tiny-bert-dropout")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    model = BertForSequenceClassification.from_pretrained(
        tiny_model_dir, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1
    )
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, dropout_model_dir, data):
    out = tmp_path_factory.mktemp("uninterrupted")
    run_in_process("text_classification", tiny_args(dropout_model_dir, data, out, **COMMON))
    return out


def crashed_after(run_dir: Path, step: int, output_dir: Path) -> Path:
    """What a run killed right after update `step` leaves: its checkpoints up to `step` and the
    metrics logged so far, copied from an uninterrupted run of the same settings."""
    for checkpoint in checkpointing.list_checkpoints(run_dir):
        if int(checkpoint.name.split("_")[1]) <= step:
            shutil.copytree(checkpoint, output_dir / "checkpoints" / checkpoint.name)
    shutil.copy(run_dir / "metrics.jsonl", output_dir / "metrics.jsonl")
    truncate_metrics(output_dir, step)  # the recipe's own trim, as a resume does
    return output_dir


def start(args: list[str], num_processes: int = 1, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd, launch_env = launch_command("text_classification", args, num_processes)
    env = launch_env | (env or {})
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def completed_updates(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_three_seeded_kills_then_resume_is_bit_identical(tmp_path, dropout_model_dir, data, uninterrupted):
    """Killed mid-update in epoch 1, mid-update in epoch 2, then inside a checkpoint write; resumed each time."""
    rng = random.Random(2026)
    first, second = rng.randint(3, 20), rng.randint(26, 38)
    during_write = rng.randint(second + 3, TOTAL_UPDATES - 2)
    out = tmp_path / "run"
    args = tiny_args(dropout_model_dir, data, out, **COMMON)
    resume = tiny_args(dropout_model_dir, data, out, resume_from_checkpoint="latest", **COMMON)

    # A random delay after update k is logged puts the kill somewhere inside update k + 1 (or its checkpoint).
    for target, command in ((first, args), (second, resume)):
        process = start(command)
        kill_when(
            process,
            lambda target=target: completed_updates(out) >= target,
            f"update {target}",
            delay=rng.uniform(0, 0.05),
        )
    # The third kill lands inside the write of checkpoint step_<during_write>: every file is written,
    # but the folder is not yet renamed into place (tests/fault_hooks/sitecustomize.py stops it there).
    tmp = out / "checkpoints" / f".tmp-{checkpointing.checkpoint_name(during_write)}"
    frozen = tmp_path / "frozen"
    hook = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(FAULT_HOOKS), os.environ.get("PYTHONPATH")])),
        "FT_ACCUM_FREEZE_BEFORE_PUBLISHING": tmp.name,
        "FT_ACCUM_FROZEN_MARKER": str(frozen),
    }
    process = start(resume, env=hook)
    kill_when(process, frozen.exists, f"the write of checkpoint {during_write}")
    assert tmp.exists(), "the kill did not land inside the checkpoint write"
    assert checkpointing.latest_checkpoint(out).name == checkpointing.checkpoint_name(during_write - 1)
    assert not (out / "final").exists(), "the run finished before the last kill: nothing was resumed"

    launch("text_classification", resume)

    assert [m["step"] for m in read_metrics(out)] == list(range(1, TOTAL_UPDATES + 1)), (
        "an update is missing or logged twice"
    )
    assert not list((out / "checkpoints").glob(".tmp-*")), "the half-written checkpoint was not cleaned up"
    assert max_abs_difference(final_weights(out), final_weights(uninterrupted)) == 0.0


def test_a_worker_killed_under_max_restarts_resumes_by_itself_and_matches_an_uninterrupted_two_process_run(
    tmp_path, dropout_model_dir, data
):
    """One of 2 workers SIGKILLed after update 30 under `ft-accum launch --max_restarts 1`: torchrun stops
    the other and restarts both, which rendezvous again (training/elastic_restart.py) and resume by
    themselves (`--resume_from_checkpoint auto`) from the last complete checkpoint."""
    settings = {**COMMON, "per_device_train_batch_size": 1}  # 1 × 2 accumulation × 2 processes: the same 4 per update
    out, whole = tmp_path / "run", tmp_path / "whole"
    args = tiny_args(dropout_model_dir, data, out, resume_from_checkpoint="auto", **settings)
    cmd, env = launch_command("text_classification", args, num_processes=2, launcher="ft-accum")
    cmd[2:2] = ["--max_restarts", "1"]  # after `ft-accum launch`
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while completed_updates(out) < 30:
        assert process.poll() is None, f"the run ended before update 30:\n{process.stderr.read()[-3000:]}"
        time.sleep(0.001)
    time.sleep(random.Random(7).uniform(0, 0.05))
    workers = [p for p in process_tree(process.pid) if p != process.pid and "text_classification.py" in _command(p)]
    assert len(workers) == 2, workers
    os.kill(max(workers), signal.SIGKILL)
    assert process.wait(timeout=300) == 0, process.stderr.read()[-3000:]
    results = json.loads((out / "all_results.json").read_text())
    assert (results["torchelastic_restart_count"], results["num_processes"]) == (1, 2), results
    assert [m["step"] for m in read_metrics(out)] == list(range(1, TOTAL_UPDATES + 1))

    # Uninterrupted, and with no checkpoints: writing them must not change the run either.
    uninterrupted = tiny_args(dropout_model_dir, data, whole, **{**settings, "checkpointing_steps": None})
    result = launch("text_classification", uninterrupted, num_processes=2)
    assert "1 micro × 2 accumulation × 2 processes = 4 samples per update" in result.stdout, "not 2 real processes"
    assert max_abs_difference(final_weights(out), final_weights(whole)) == 0.0


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def test_a_failed_checkpoint_write_stops_with_a_clear_error_and_keeps_the_previous_one(
    tmp_path, dropout_model_dir, data, uninterrupted, capsys
):
    """A disk that fills up mid-save, simulated with RLIMIT_FSIZE: writes past the limit fail with EFBIG.
    Then the newest checkpoint truncated, as a full disk leaves one written in place: skipped (that
    resume runs in this process: which checkpoint it picks does not depend on the launcher)."""
    out = crashed_after(uninterrupted, 3, tmp_path / "run")
    previous = checkpointing.latest_checkpoint(out)
    model_bytes = (previous / "model.safetensors").stat().st_size
    before = checkpointing.checkpoint_problem(previous)
    assert before is None

    def small_disk():
        # The model file still fits; the optimizer state (twice its size) does not.
        resource.setrlimit(resource.RLIMIT_FSIZE, (model_bytes + 4096, model_bytes + 4096))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write with EFBIG instead of killing the process

    cmd, env = launch_command(
        "text_classification", tiny_args(dropout_model_dir, data, out, resume_from_checkpoint="latest", **COMMON)
    )
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, preexec_fn=small_disk)

    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert (
        len(errors) == 1 and "could not write checkpoint" in errors[0] and f"from the intact {previous}" in errors[0]
    ), result.stderr[-3000:]
    assert 'text_classification.py", line' not in result.stderr, "a traceback from the recipe"
    assert checkpointing.latest_checkpoint(out) == previous and checkpointing.checkpoint_problem(previous) is None
    assert not list((out / "checkpoints").glob(".tmp-*")), "the partial checkpoint was left behind"

    # What a full disk leaves of a checkpoint written in place (not ours: ours publish by rename): its
    # weights cut short. The resume must skip it for the one before, and still end bit-identical.
    weights = previous / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    capsys.readouterr()
    with pytest.warns(UserWarning, match=f"skipping checkpoint {re.escape(str(previous))}"):
        run_in_process(
            "text_classification", tiny_args(dropout_model_dir, data, out, resume_from_checkpoint="latest", **COMMON)
        )
    assert f"Resumed from {out / 'checkpoints' / checkpointing.checkpoint_name(2)}" in capsys.readouterr().out
    assert [m["step"] for m in read_metrics(out)] == list(range(1, TOTAL_UPDATES + 1))
    assert max_abs_difference(final_weights(out), final_weights(uninterrupted)) == 0.0
