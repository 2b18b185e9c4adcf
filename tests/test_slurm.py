"""Several machines and SLURM (issue 64), under a real one-node SLURM (ft_accum/testing/slurm_cluster.py):
the shipped examples/slurm_train.sbatch as 2 tasks, each one `ft-accum launch` acting as one machine
of a 2-machine DDP group on CPU; the same without SLURM; a job requeued by `scontrol requeue` and
one preempted by a higher partition resume by themselves (`--resume_from_checkpoint auto`) and end
bit-identical to the uninterrupted job, every update logged once."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import torch
import yaml
from conftest import FAULT_HOOKS, ROOT, free_port, make_rows, read_metrics, tiny_args, write_jsonl

from ft_accum.cli.launching import process_tree
from ft_accum.testing import final_weights, make_tiny_bert, relative_error, run_in_process
from ft_accum.testing.slurm_cluster import SlurmCluster

pytestmark = pytest.mark.launch
SCRIPT = ROOT / "examples" / "slurm_train.sbatch"
# 2 epochs of 37 rows at 2 per process and no accumulation: 20 updates, long enough to interrupt.
LONGER = {"gradient_accumulation_steps": 1, "num_train_epochs": 2}
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A real SLURM (munge, slurmctld, slurmd) for this module's tests, stopped after them."""
    if reason := SlurmCluster.missing():
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny BERT, 37 rows (no split divides them), a 2-machine DDP config on 127.0.0.1, and one process's
    run of the 20 updates the machines make (2 epochs at 4 rows per update)."""
    root = tmp_path_factory.mktemp("machines")
    data = {"train": write_jsonl(root / "train.jsonl", make_rows(37, seed=1)),
            "validation": write_jsonl(root / "val.jsonl", make_rows(5, seed=2))}  # fmt: skip
    model = make_tiny_bert(root / "model")
    config = yaml.safe_load((ROOT / "accelerate_configs" / "multi_node_ddp.yaml").read_text())
    config |= {"mixed_precision": "no", "num_processes": 2, "main_process_ip": "127.0.0.1"}
    (root / "accelerate.yaml").write_text(yaml.safe_dump(config))
    run_in_process("text_classification", tiny_args(model, data, root / "one", per_device_train_batch_size=4,
                                                    gradient_accumulation_steps=1, num_train_epochs=2))  # fmt: skip
    return root, model, data


def machine_args(setup) -> list[str]:
    """Each machine's flags: 2 rows per process, 2 processes, 4 rows per update, 2 epochs: 20 updates."""
    root, model, data = setup
    args = tiny_args(
        model, data, "unused", per_device_train_batch_size=2, gradient_accumulation_steps=1, num_train_epochs=2
    )
    return [a for a in args if not a.startswith("--output_dir")]


def launch_env(**extra) -> dict:
    return {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONPATH": str(FAULT_HOOKS), **extra}  # fmt: skip


def log_of(out) -> str:
    return "".join(p.read_bytes()[-4000:].decode(errors="replace") for p in out.parent.glob(f"{out.name}-*.log"))


def launch_machines(setup, out, port: int, log: str) -> list[subprocess.Popen]:
    """Two `ft-accum launch --num_machines 2 --machine_rank r` on 127.0.0.1, each in a session of its own
    (a machine), writing its output to `out`-`log`-r.log; checkpoints after every update, resumed by
    themselves (--resume_from_checkpoint auto)."""
    flags = [*machine_args(setup), "--checkpointing_steps=1", "--resume_from_checkpoint=auto", "--ddp_timeout=60"]
    return [
        subprocess.Popen(["ft-accum", "launch", "--config_file", str(setup[0] / "accelerate.yaml"), "--machine_rank",
                          str(rank), "--main_process_port", str(port), "recipes/text_classification.py", *flags,
                          f"--output_dir={out}"], cwd=ROOT, env=launch_env(FT_ACCUM_SLOW_UPDATE_SECONDS="0.2"),
                         stdout=open(f"{out}-{log}-{rank}.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
        for rank in (0, 1)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def two_machines(setup, tmp_path_factory):
    """Two machines without SLURM, one 2-process group, and a lost machine: machine 1 (its launcher, torchrun's
    agent and its worker) is SIGKILLed after update 5; machine 0 stops at once with one line naming the lost machine
    (no hang, no torchrun report); both launched again resume from the last complete checkpoint and
    finish. Its output is the run the SLURM job must end at (a resumed run is bit-identical to an
    uninterrupted one: tests/test_fault_injection.py)."""
    out, port = tmp_path_factory.mktemp("two") / "run", free_port()
    first = launch_machines(setup, out, port, "lost")
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").is_file() or (out / "metrics.jsonl").read_text().count("\n") < 5:
        assert time.monotonic() < deadline and first[0].poll() is None, log_of(out)
        time.sleep(0.05)
    for pid in process_tree(first[1].pid):  # the machine going down: launcher, agent and worker (its own session)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    assert first[0].wait(timeout=120) == 1 and time.monotonic() - started < 60, log_of(out)
    first[1].wait()
    output = (out.parent / f"{out.name}-lost-0.log").read_text()
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(
        r"lost its connection to (the process on 127\.0\.0\.1|process 1)\b", errors[0]
    )
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-3000:]
    assert not (out / "final").exists()
    again = launch_machines(setup, out, free_port(), "again")
    assert [launch.wait(timeout=300) for launch in again] == [0, 0], log_of(out)
    assert "Resumed from" in (out.parent / f"{out.name}-again-0.log").read_text()
    return out


def test_two_machines_match_one_process(setup, two_machines):
    assert json.loads((two_machines / "all_results.json").read_text())["num_processes"] == 2
    assert [r["step"] for r in read_metrics(two_machines)] == list(range(1, 21))  # each update once
    assert [r["samples_seen"] for r in read_metrics(two_machines)][-1] == 2 * 37
    assert relative_error(final_weights(two_machines), final_weights(setup[0] / "one")) <= 1e-5


def wait_for_updates(slurm, job, out, count: int) -> None:
    deadline = time.monotonic() + 300
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= count):
        assert time.monotonic() < deadline and slurm.job(job).get("JobState") not in ENDED, log_of(out)
        time.sleep(0.2)


def test_the_shipped_script_survives_requeue_and_preemption(slurm, setup, two_machines, tmp_path):
    """The shipped examples/slurm_train.sbatch, 2 tasks on this host, each `ft-accum launch` one machine of a
    2-machine group. After 3 updates, `scontrol requeue`; after 3 more of the requeued run, a job in the
    higher partition that needs the node (ours gets its --signal, USR1, and is requeued). Each time every
    process finishes its update and one checkpoint is saved; the requeued job resumes from it by itself
    (`--resume_from_checkpoint auto`). It ends bit-identical to the uninterrupted run, every update in
    metrics.jsonl once, both requeues counted."""
    root, out = setup[0], tmp_path / "run"
    values = {
        "NUM_MACHINES": "2", "PROCESSES_PER_MACHINE": "1", "ACCELERATE_CONFIG": str(root / "accelerate.yaml"),
        "RECIPE": "recipes/text_classification.py", "RECIPE_ARGS": " ".join(machine_args(setup)),
        "OUTPUT_DIR": str(out), "MAIN_IP": "127.0.0.1", "MAIN_PORT": str(free_port()),
        "FT_ACCUM_SLOW_UPDATE_SECONDS": "0.2",
    }  # fmt: skip
    job = slurm.submit(SCRIPT, "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
                       f"--chdir={ROOT}", f"--output={tmp_path / 'run-%j.log'}", env=launch_env(**values))  # fmt: skip
    wait_for_updates(slurm, job, out, 3)
    slurm.run(["scontrol", "requeue", str(job)])
    wait_for_updates(slurm, job, out, len(read_metrics(out)) + 3)
    assert slurm.job(job)["Restarts"] == "1"
    slurm.run(["sbatch", "--parsable", "--partition=high", "--ntasks=2", "--cpus-per-task=1",
               f"--output={tmp_path / 'high.log'}", "--wrap", "sleep 1"])  # fmt: skip
    fields = slurm.wait_for(job, ENDED, 300)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "2"), log_of(out)
    assert "Traceback" not in log_of(out), log_of(out)
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 21))
    results = json.loads((out / "all_results.json").read_text())
    assert (results["num_processes"], results["slurm_restart_count"]) == (2, 2)
    ours, theirs = final_weights(out), final_weights(two_machines)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_resume_auto_starts_afresh_or_resumes(setup, tmp_path):
    """--resume_from_checkpoint auto with nothing to resume is a fresh start; run again on a finished
    run's folder, it resumes its last checkpoint (and ends at the same update) instead of refusing."""
    root, model, data = setup
    args = tiny_args(model, data, tmp_path / "run", per_device_train_batch_size=8, checkpointing_steps=2)
    run_in_process("text_classification", [*args, "--resume_from_checkpoint=auto"])
    first = final_weights(tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "final")
    run_in_process("text_classification", [*args, "--resume_from_checkpoint=auto"])
    assert all(torch.equal(first[k], v) for k, v in final_weights(tmp_path / "run").items())


def test_the_shipped_search_script_as_a_slurm_array_runs_each_trial_once(slurm, setup, tmp_path):
    """examples/slurm_search.sbatch as an array of 2 workers on one study of 2 trials. Task 1's sweep is
    killed mid-trial (scancel --batch --signal=KILL: kill -9 of the sweep alone); its run, signalled by
    the kernel as its parent dies, stops at a checkpoint, and the trial stays RUNNING for the other
    worker (its owner's process is gone) or the array submitted again to take up from that checkpoint:
    both trials COMPLETE, one of them resumed with its parameters, none started afresh twice, every
    update logged once."""
    from test_search import launches, load_study, write_search

    root, model, data = setup
    path = write_search(tmp_path, model, data, base={"checkpointing_steps": 1, "per_device_train_batch_size": 2,
                        "num_train_epochs": 1}, n_trials=2, pruner="none", seed=None)  # fmt: skip
    out = tmp_path / "search_out"
    env = launch_env(SWEEP_FILE=str(path), FT_ACCUM_SLOW_UPDATE_SECONDS="0.3")

    def submit() -> int:
        return slurm.submit(ROOT / "examples" / "slurm_search.sbatch", "--array=0-1", "--gres=none",
                            "--cpus-per-task=1", f"--output={tmp_path / 'search-%A_%a.log'}", env=env)  # fmt: skip

    def states(job: int) -> list[str]:
        return re.findall(r"JobState=(\w+)", slurm.run(["scontrol", "show", "job", str(job)], check=False).stdout)

    job = submit()
    deadline = time.monotonic() + 300
    while not all((out / f"trial_{n:04d}" / "checkpoints" / "step_000002").exists() for n in (0, 1)):
        assert time.monotonic() < deadline and "FAILED" not in states(job), log_of(tmp_path / "search")
        time.sleep(0.2)
    params = {t.number: t.params for t in load_study(tmp_path).get_trials()}
    slurm.run(["scancel", "--batch", "--signal=KILL", f"{job}_1"])
    while not all(state in ENDED for state in states(job)):
        assert time.monotonic() < deadline, states(job)
        time.sleep(0.5)
    again = submit()
    while not all(state in ENDED for state in states(again)):
        assert time.monotonic() < deadline + 300, states(again)
        time.sleep(0.5)
    trials = load_study(tmp_path).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"], log_of(tmp_path / "search")
    assert {t.number: t.params for t in trials} == params  # the taken-up trial kept its parameters
    for trial in trials:
        run = out / f"trial_{trial.number:04d}"
        assert [r["step"] for r in read_metrics(run)] == list(range(1, len(read_metrics(run)) + 1))
    resumed = [t for t in trials if "Resumed from" in (out / f"trial_{t.number:04d}" / "log.txt").read_text()]
    assert len(resumed) == 1, log_of(tmp_path / "search")
    assert sorted(launches(out / f"trial_{t.number:04d}") for t in trials) == [1, 2]  # the resumed one twice
