"""A stop signal through the real launcher, measured from the moment the launcher returns (issue 26).

Users wait for the launcher, not for the recipe: a scheduler ends the job, and a container its
processes, when the launcher exits. So each test starts `ft-accum launch` (Accelerate's launch
with a stop that waits, ft_accum/cli/launcher.py) in a session of its own, signals it as SLURM,
Ctrl-C or `docker stop` would, waits for the launcher process alone, and only then looks: the
stop's checkpoint must be complete, no process of the launch left, the exit status 128 + signal,
no traceback, and the resume command (the launch command as typed) written and printed.

Each checkpoint write is made 1 s longer by tests/fault_hooks (a tiny model writes its checkpoint
in milliseconds, a real one in seconds): a launcher that returned before the recipe finished
would be caught every time. `accelerate launch` itself fails these tests
(benchmarks/bench_graceful_stop.py, docs/reliability.md).
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml
from conftest import (
    CPU_CONFIG,
    FAULT_HOOKS,
    ROOT,
    final_weights,
    launch_command,
    read_metrics,
    run_in_process,
    tiny_args,
)

from ft_accum.training import graceful_stop
from ft_accum.training.graceful_stop import resume_command

pytestmark = pytest.mark.launch


def run_args(model_dir, data_files, out, **overrides):
    # Many short updates: the signal lands mid-run, after the third.
    settings = {"per_device_train_batch_size": 4, "effective_batch_size": 8, "max_train_steps": 400,
                "num_train_epochs": 100, **overrides}  # fmt: skip
    return tiny_args(model_dir, data_files, out, **settings)


def start(args, num_processes=1, config_file=None, publish_seconds=1.0, namespace=False, update_seconds=0.0):
    cmd, env = launch_command("text_classification", args, num_processes, config_file, launcher="ft-accum")
    if namespace:  # the launcher as PID 1 of a new PID namespace, as in a container
        cmd = ["unshare", "--fork", "--pid", "--mount-proc", *cmd]
    env |= {"PYTHONPATH": str(FAULT_HOOKS), "FT_ACCUM_SLOW_PUBLISH_SECONDS": str(publish_seconds),
            "FT_ACCUM_SLOW_UPDATE_SECONDS": str(update_seconds)}  # fmt: skip
    log = Path(args[[a.split("=")[0] for a in args].index("--output_dir")].split("=", 1)[1] + ".log")
    with open(log, "w") as f:  # a file, not a pipe: a pipe's reader would wait for the recipe too
        process = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return process, log


def wait_for_updates(process, out, count=3):
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().count("\n") >= count):
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before it could be signalled"
        time.sleep(0.05)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def stop_checkpoints(out):
    return sorted(p.parent.name for p in (out / "checkpoints").glob("step_*/training_state.json"))


def assert_stopped_cleanly(process, log, out, code, max_train_steps) -> tuple[int, str]:
    """What must hold once the launcher has returned: nothing of the launch still running or
    writing, the exit status, no traceback, one complete checkpoint at the update it stopped after,
    and the resume command written and printed. (The update it stopped after, the command.)"""
    assert not group_alive(process.pid), "a process of the launch outlived the launcher"
    output = log.read_text()
    assert process.returncode == code, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    stopped_at = len(read_metrics(out))
    assert stop_checkpoints(out) == [f"step_{stopped_at:06d}"] and 3 <= stopped_at < max_train_steps
    assert not list((out / "checkpoints").glob(".tmp-*"))
    saved = (out / "resume_command.txt").read_text().strip()
    assert saved in output and saved.endswith("--resume_from_checkpoint latest")
    return stopped_at, saved


@pytest.mark.parametrize(
    "num_processes, signum, target, code",
    [
        # 1 process, killpg SIGTERM (SLURM's scancel): test_the_saved_resume_command_continues_bit_identically...
        pytest.param(1, signal.SIGINT, "group", 130, id="1 process, killpg SIGINT (Ctrl-C)"),
        pytest.param(1, signal.SIGTERM, "launcher", 143, id="1 process, SIGTERM to the launcher alone (docker stop)"),
        pytest.param(1, signal.SIGTERM, "pid 1", 143, id="1 process, SIGTERM to PID 1 of a PID namespace (container)"),
        # 2 processes, SIGTERM to every process: tests/test_slurm.py's requeue and preemption (2 machines).
    ],
)
def test_the_checkpoint_is_complete_when_the_launcher_returns(
    tmp_path, tiny_model_dir, data_files, num_processes, signum, target, code
):
    if target == "pid 1" and subprocess.run(["unshare", "--fork", "--pid", "--mount-proc", "true"]).returncode:
        pytest.skip("this machine cannot create a PID namespace (unshare needs root)")
    out = tmp_path / "run"
    process, log = start(run_args(tiny_model_dir, data_files, out), num_processes, namespace=target == "pid 1")
    wait_for_updates(process, out)
    if target == "group":
        os.killpg(process.pid, signum)
    elif target == "launcher":
        os.kill(process.pid, signum)
    else:  # unshare's child: the launcher, PID 1 inside its namespace; a PID 1 without a handler ignores SIGTERM
        import psutil

        os.kill(psutil.Process(process.pid).children()[0].pid, signum)
    process.wait(timeout=300)
    stopped_at, saved = assert_stopped_cleanly(process, log, out, code, max_train_steps=400)
    assert saved.startswith(f"ft-accum launch --config_file {CPU_CONFIG} ")


def test_the_saved_resume_command_continues_bit_identically_in_the_same_precision(
    tmp_path, tiny_model_dir, data_files
):
    """1 process, killpg SIGTERM (SLURM's scancel), in bf16 on CPU from a config file: the stop is
    checked as above, and the resume command must carry the config, or the run would continue in
    fp32 (issue 26). The resumed run must end bit-identical to an uninterrupted one."""
    config = yaml.safe_load(CPU_CONFIG.read_text()) | {"mixed_precision": "bf16"}
    bf16_config = tmp_path / "cpu_bf16.yaml"
    bf16_config.write_text(yaml.safe_dump(config))
    # 16 updates (bf16 autocast on a CPU is slow), each 0.1 s longer in the stopped run so the signal lands mid-run.
    settings = {"max_train_steps": 16, "num_train_epochs": 10}

    reference = tmp_path / "reference"  # uninterrupted, in this process: bf16 as the config's launch sets it
    with mock.patch.dict(os.environ, {"ACCELERATE_MIXED_PRECISION": "bf16"}):
        assert (
            run_in_process("text_classification", run_args(tiny_model_dir, data_files, reference, **settings))[
                "mixed_precision"
            ]
            == "bf16"
        )

    out = tmp_path / "stopped"
    process, log = start(run_args(tiny_model_dir, data_files, out, **settings), config_file=bf16_config,
                         update_seconds=0.1)  # fmt: skip
    wait_for_updates(process, out)
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=300)
    _, resume = assert_stopped_cleanly(process, log, out, 143, max_train_steps=16)
    assert resume.startswith(f"ft-accum launch --config_file {bf16_config} ")
    bin_dir = str(Path(sys.executable).parent)  # where `ft-accum` is installed
    subprocess.run(["bash", "-c", resume], env={**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"]},
                   cwd=ROOT, check=True, capture_output=True, timeout=600)  # fmt: skip
    assert json.loads((out / "all_results.json").read_text())["mixed_precision"] == "bf16"
    ours, theirs = final_weights(out), final_weights(reference)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)  # bit-identical, not merely close
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in read_metrics(reference)]


def test_a_second_signal_stops_at_once(tmp_path, tiny_model_dir, data_files):
    """The first SIGTERM starts a checkpoint that (by the fault hook) takes 60 s to publish; a second
    one, after the launcher's forwarding window, ends the launch at once, leaving no checkpoint."""
    out = tmp_path / "run"
    process, log = start(run_args(tiny_model_dir, data_files, out), publish_seconds=60)
    wait_for_updates(process, out)
    os.killpg(process.pid, signal.SIGTERM)
    time.sleep(graceful_stop.DUPLICATE_SECONDS + 1.0)
    assert process.poll() is None, "the first signal did not wait for the checkpoint"
    sent = time.monotonic()
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(timeout=30) == 143
    assert time.monotonic() - sent < 10
    time.sleep(0.5)
    assert not group_alive(process.pid) and stop_checkpoints(out) == []


def test_a_repeat_within_the_forwarding_window_is_the_same_signal(monkeypatch):
    """torchrun's agent and ft-accum launch pass on the signal that killpg already delivered: that
    repeat must not count as the second signal that stops at once."""
    killed, now = [], [100.0]
    monkeypatch.setattr(graceful_stop.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(graceful_stop.os, "kill", lambda pid, signum: killed.append(signum))
    monkeypatch.setattr(graceful_stop.signal, "signal", lambda signum, handler: signal.SIG_DFL)
    stop = graceful_stop.GracefulStop()
    stop._handle(signal.SIGTERM, None)
    now[0] += 0.01
    stop._handle(signal.SIGTERM, None)  # the launcher's forward
    assert stop.signal == signal.SIGTERM and killed == []
    now[0] += graceful_stop.DUPLICATE_SECONDS
    stop._handle(signal.SIGTERM, None)  # the user's second signal
    assert killed == [signal.SIGTERM]


def test_the_resume_command_is_the_launch_as_typed():
    launched = "ACCELERATE_USE_CPU=true ft-accum launch --multi_gpu --num_processes 2 recipes/x.py --seed 3"
    assert resume_command(["recipes/x.py"], launch_command=launched) == f"{launched} --resume_from_checkpoint latest"
    parent = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "bf16.yaml", "recipes/x.py",
              "--resume_from_checkpoint", "old"]  # fmt: skip
    assert resume_command(["recipes/x.py"], parent, {"ACCELERATE_USE_CPU": "true"}, launch_command="") == (
        "ACCELERATE_USE_CPU=true accelerate launch --config_file bf16.yaml recipes/x.py --resume_from_checkpoint latest"
    )
    assert resume_command(["recipes/x.py", "--seed=3"], [], launch_command="") == (
        "python recipes/x.py --seed=3 --resume_from_checkpoint latest"
    )
    assert shlex.split(resume_command(["a b.py"], [], launch_command=""))[1] == "a b.py"


def test_a_killed_launchers_error_folder_is_removed_by_the_next_launch(tmp_path):
    """A launcher killed with SIGKILL leaves its error folder; the next one removes it, not a live one's."""
    import subprocess
    import sys

    from ft_accum.cli.launcher import ERROR_DIR_PREFIX, remove_stale_error_dirs

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, live = (
        tmp_path / f"{ERROR_DIR_PREFIX}{gone.stdout.strip()}-x1",
        tmp_path / f"{ERROR_DIR_PREFIX}{os.getpid()}-x2",
    )
    for folder in (dead, live):
        folder.mkdir()
        (folder / "rank-1").write_text("error: ...")
    remove_stale_error_dirs(str(tmp_path))
    assert not dead.exists() and live.exists()
