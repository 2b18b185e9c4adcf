"""Several machines and SLURM (issue 64), under a real one-node SLURM (ft_accum/testing/slurm_cluster.py):
the shipped examples/slurm_train.sbatch as 2 tasks, each one `ft-accum launch` acting as one machine
of a 2-machine DDP group on CPU; the same without SLURM; a job requeued by `scontrol requeue` and
one preempted by a higher partition resume by themselves (`--resume_from_checkpoint auto`) and end
bit-identical to the uninterrupted job, every update logged once."""

import json
import os
import shutil
import subprocess
import time

import pytest
import torch
import yaml
from conftest import FAULT_HOOKS, ROOT, free_port, make_rows, read_metrics, tiny_args, write_jsonl

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


@pytest.fixture(scope="module")
def two_machines(setup, tmp_path_factory):
    """Two `ft-accum launch --num_machines 2 --machine_rank r` on 127.0.0.1, without SLURM: one 2-process
    group. Its output is the uninterrupted run the SLURM job must end at."""
    root, out, port = setup[0], tmp_path_factory.mktemp("two") / "run", free_port()
    launches = [
        subprocess.Popen(["ft-accum", "launch", "--config_file", str(root / "accelerate.yaml"), "--machine_rank",
                          str(rank), "--main_process_port", str(port), "recipes/text_classification.py",
                          *machine_args(setup), f"--output_dir={out}"],
                         cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)
    ]  # fmt: skip
    outputs = [launch.communicate(timeout=300)[0] for launch in launches]
    assert [launch.returncode for launch in launches] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    return out


def test_two_machines_match_one_process(setup, two_machines):
    assert json.loads((two_machines / "all_results.json").read_text())["num_processes"] == 2
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
