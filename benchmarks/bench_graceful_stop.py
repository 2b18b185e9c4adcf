"""How a stop signal ends a run, through `accelerate launch` and through `ft-accum launch`.

    python benchmarks/bench_graceful_stop.py [--launchers accelerate ft-accum] [--out results.json]

For each launcher and each way a run is stopped (SLURM's `scancel` and Ctrl-C signal the whole
process group; `docker stop` and a Kubernetes eviction signal the container's first process, the
launcher, alone), it starts the text-classification recipe on a tiny BERT (built from a config,
no download; each checkpoint
write made 2 s longer, as a real model's is, by tests/fault_hooks), waits for 3 updates, sends the signal, and records the moment the launcher
returns: seconds from the signal, its exit status, whether the stop's checkpoint was complete
at that moment, and whether a traceback was printed. Leftover processes are then killed.
Nothing here needs a GPU; the figures in docs/reliability.md come from this script on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ft_accum.testing import (  # noqa: E402
    launch_command,
    make_rows,
    make_tiny_bert,
    tiny_args,
    write_jsonl,
)

SCENARIOS = {
    "killpg SIGTERM, 1 process": (1, signal.SIGTERM, "group"),
    "killpg SIGINT, 1 process": (1, signal.SIGINT, "group"),
    "SIGTERM to the launcher alone, 1 process": (1, signal.SIGTERM, "launcher"),
    "SIGTERM to the launcher as PID 1 of a PID namespace (docker stop), 1 process": (1, signal.SIGTERM, "pid 1"),
    "killpg SIGTERM, 2 processes": (2, signal.SIGTERM, "group"),
    "SIGTERM to the launcher alone, 2 processes": (2, signal.SIGTERM, "launcher"),
}


def start_run(launcher: str, args: list[str], num_processes: int, log: Path, namespace: bool) -> subprocess.Popen:
    """The launch in a session of its own; its output goes to `log`, not a pipe: a pipe's reader
    would wait for every process that holds it, the recipe included, not for the launcher."""
    cmd, env = launch_command("text_classification", args, num_processes, launcher=launcher)
    # A checkpoint write of about 2 s, as a real model's takes (a tiny model's takes milliseconds).
    hooks = os.pathsep.join(filter(None, [str(ROOT / "tests" / "fault_hooks"), env.get("PYTHONPATH")]))
    env |= {"PYTHONPATH": hooks, "FT_ACCUM_SLOW_PUBLISH_SECONDS": "2"}
    if namespace:  # the launcher as PID 1 of a new PID namespace, as in a container (needs root)
        cmd = ["unshare", "--fork", "--pid", "--mount-proc", *cmd]
    with open(log, "w") as f:
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def stop_checkpoint_complete(out: Path) -> bool:
    return any((out / "checkpoints").glob("step_*/training_state.json"))


def measure(launcher: str, scenario: str, model: Path, data: dict, work: Path) -> dict:
    num_processes, signum, target = SCENARIOS[scenario]
    out = work / f"{launcher}-{scenario.replace(' ', '_').replace(',', '')}"
    args = tiny_args(model, data, out, per_device_train_batch_size=4, effective_batch_size=8, max_train_steps=400,
                     num_train_epochs=100)  # fmt: skip
    log = work / f"{out.name}.log"
    process = start_run(launcher, args, num_processes, log, namespace=target == "pid 1")
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 3):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{scenario}: the run ended before it could be signalled:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    sent = time.monotonic()
    if target == "group":
        os.killpg(process.pid, signum)
    elif target == "launcher":
        os.kill(process.pid, signum)
    else:  # unshare's child is the launcher, PID 1 in its namespace
        import psutil

        os.kill(psutil.Process(process.pid).children()[0].pid, signum)
    try:
        process.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    seconds = time.monotonic() - sent
    complete = stop_checkpoint_complete(out)
    with_traceback = "Traceback (most recent call last)" in log.read_text()
    try:  # orphans still running (the recipe outlives a launcher that did not wait)
        os.killpg(process.pid, signal.SIGKILL)
        orphans = True
    except ProcessLookupError:
        orphans = False
    resume = (out / "resume_command.txt").read_text().strip() if (out / "resume_command.txt").exists() else None
    return {
        "launcher": launcher,
        "scenario": scenario,
        "seconds_to_launcher_exit": round(seconds, 2),
        "exit_status": process.returncode if process.returncode >= 0 else 128 - process.returncode,
        "checkpoint_complete_at_exit": complete,
        "traceback_printed": with_traceback,
        "processes_left_running": orphans,
        "resume_command": resume,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--launchers", nargs="+", default=["accelerate", "ft-accum"], choices=["accelerate", "ft-accum"]
    )
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    options = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    work = Path(tempfile.mkdtemp(prefix="bench-stop-"))
    model = make_tiny_bert(work / "model")
    data = {
        "train": write_jsonl(work / "train.jsonl", make_rows(48, seed=1)),
        "validation": write_jsonl(work / "validation.jsonl", make_rows(12, seed=2)),
    }
    rows = []
    print("| launcher | stopped by | s to launcher exit | exit | checkpoint at exit | traceback | left running |")
    print("|---|---|---|---|---|---|---|")
    for launcher in options.launchers:
        for scenario in options.scenarios:
            row = measure(launcher, scenario, model, data, work)
            rows.append(row)
            print(f"| {launcher} launch | {scenario} | {row['seconds_to_launcher_exit']} | {row['exit_status']} | "
                  f"{'complete' if row['checkpoint_complete_at_exit'] else 'absent'} | "
                  f"{'yes' if row['traceback_printed'] else 'no'} | {'yes' if row['processes_left_running'] else 'no'} |",
                  flush=True)  # fmt: skip
    if options.out:
        options.out.write_text(json.dumps(rows, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
