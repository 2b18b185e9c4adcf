"""The recipe runners: recipes in this process (`run_in_process`) and through the real `accelerate launch` (`launch`, `launch_runs`), and the flags of their tiny runs. The recipes are found beside the package (a source checkout): `recipes/` is a folder of scripts, not a package."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ft_accum.training.recipe_modules import load_recipe_module
from ft_accum.training.run_setup import reset_accelerate_state

ROOT = Path(__file__).resolve().parents[2]


RECIPES = ROOT / "recipes"


CPU_CONFIG = ROOT / "accelerate_configs" / "cpu.yaml"


# The test hooks every launched process imports at start-up (tests/fault_hooks/sitecustomize.py).
FAULT_HOOKS = ROOT / "tests" / "fault_hooks"


def recipe_args(model_dir: Path, data: dict[str, Path], output_dir: Path, **settings) -> list[str]:
    """Flags for a fast, deterministic run of any recipe on a tiny model (fp32, no LR scaling, no
    tracker). `settings` add to or override these; a value of None drops the flag."""
    defaults = {
        "model_name_or_path": model_dir,
        "train_file": data["train"],
        "validation_file": data["validation"],
        "learning_rate": 1e-3,
        "lr_scaling": "none",
        "num_warmup_steps": 0,
        "weight_decay": 0.0,
        "num_train_epochs": 1,
        "output_dir": output_dir,
        "report_to": "none",
        "seed": 7,
    }
    return [f"--{k}={v}" for k, v in {**defaults, **settings}.items() if v is not None]


def tiny_args(model_dir: Path, data: dict[str, Path], output_dir: Path, **overrides) -> list[str]:
    """`recipe_args` for the classification recipes: 48 tokens per sequence."""
    return recipe_args(model_dir, data, output_dir, **{"max_seq_length": 48, **overrides})


def load_recipe(name: str):
    """Import recipes/<name>.py as a module (recipes/ is a folder of scripts, not a package)."""
    return load_recipe_module(RECIPES / f"{name}.py")


def run_in_process(name: str, args: list[str]) -> dict:
    """Call the recipe's main(argv) here, then reset Accelerate's process-wide singletons."""
    try:
        return load_recipe(name).main(["--config=none", *args])  # see launch_command
    finally:
        reset_accelerate_state()


def free_port() -> int:
    """A free port for a launch's rendezvous, below Linux's ephemeral range (32768+), in a block of its
    own for each pytest-xdist worker. A port the OS hands out (`bind(0)`) can be handed out again to a
    test running at the same time in another worker, or taken meanwhile by a gloo connection. A
    shared port is one suspect, not a proven cause, of a DDP launch that hung once under xdist
    (docs/tests.md)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    block = 20000 + 1000 * (int(worker) % 12 if worker.isdigit() else 0)
    for port in random.sample(range(block, block + 1000), 1000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {block}–{block + 999}")


def run_with_stack_dump(cmd: list[str], env: dict, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)`, but a run that hangs past `timeout` fails
    with each of its Python processes' stacks (faulthandler on SIGABRT) instead of a bare timeout.
    The signal goes to every descendant: torchrun starts its workers in sessions of their own."""
    import psutil  # an Accelerate dependency

    process = subprocess.Popen(
        cmd, env=env | {"PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = [*psutil.Process(process.pid).children(recursive=True), psutil.Process(process.pid)]
        for member in tree:  # workers first, so their stacks print before the launcher's ends them
            with contextlib.suppress(psutil.NoSuchProcess):
                member.send_signal(signal.SIGABRT)
        try:
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            for member in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    member.kill()
            stdout, stderr = process.communicate()
        raise AssertionError(
            f"hung for {timeout} s: {cmd}\nstacks on SIGABRT:\n{stdout[-3000:]}\n{stderr[-20000:]}"
        ) from None
    return subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)


def launch_command(
    name: str,
    args: list[str],
    num_processes: int = 1,
    config_file: str | Path | None = None,
    launcher: str = "accelerate",
    script: list[str] | None = None,
    lowmem: bool = False,
) -> tuple[list[str], dict]:
    """The real launch command line and environment: one process with `config_file` (default: the
    CPU config), or `num_processes` CPU processes under DDP over gloo. `launcher` "accelerate" is
    `accelerate launch`; "ft-accum" is `ft-accum launch`, the same options (ft_accum/cli/launcher.py).
    `script` (a script and its arguments) replaces the recipe and `args` after the launcher's options.
    `lowmem`: the launch may import bitsandbytes and torchao, which tests/conftest.py hides from the
    processes tests launch (as an install without the [lowmem] extra has none)."""
    env = dict(os.environ)
    if lowmem:
        env["FT_ACCUM_TEST_WITHOUT_LOWMEM"] = "0"
    if launcher == "accelerate":
        prefix = [sys.executable, "-m", "accelerate.commands.launch"]
    else:
        prefix = [str(Path(sys.executable).parent / "ft-accum"), "launch"]
    if num_processes == 1:
        cmd = [*prefix, "--config_file", str(config_file or CPU_CONFIG)]
    else:
        # `--cpu --num_processes 2` silently runs one process in accelerate 1.15; this runs two
        # (torchrun, DistributedType.MULTI_CPU, gloo). The cores are shared out, not oversubscribed
        # (a thread count already set, as under the suite's xdist workers, is kept).
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // num_processes))
        env |= {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": threads}
        cmd = [
            *prefix,
            "--multi_gpu",
            "--num_processes",
            str(num_processes),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
        ]
    # --config none first: tests set what they rely on, not the recipe's shipped config (a later --config wins).
    return [*cmd, *(script or [str(RECIPES / f"{name}.py"), "--config=none", *args])], env


def launch(
    name: str,
    args: list[str],
    num_processes: int = 1,
    check: bool = True,
    script: list[str] | None = None,
    timeout: float = 300,
    lowmem: bool = False,
) -> subprocess.CompletedProcess:
    cmd, env = launch_command(name, args, num_processes, script=script, lowmem=lowmem)
    result = run_with_stack_dump(cmd, env, timeout=timeout, cwd=ROOT)
    if check and result.returncode != 0:
        raise AssertionError(f"launch failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def runs_script(runs: list[tuple[str, list[str]]], work_dir: Path, exits: Path | None = None) -> list[str]:
    """What a launch runs in place of a recipe to run each (recipe name, arguments) of `runs`, one
    after another in the same processes (ft_accum/testing/recipe_runs.py). With `exits`, a run that
    ends in an error does not end the launch: each run's exit is written there. Each run starts from
    --config=none; arguments that give `--config recipes/configs/<name>.yaml` run the shipped config."""
    runs_file = Path(work_dir) / "runs.json"
    runs_file.write_text(json.dumps([[name, ["--config=none", *args]] for name, args in runs]))
    return [str(Path(__file__).with_name("recipe_runs.py")), str(runs_file), *([str(exits)] if exits else [])]


def launch_runs(
    name: str, runs: list[list[str]], num_processes: int, work_dir: Path, lowmem: bool = False
) -> subprocess.CompletedProcess:
    """Several runs of one recipe in one real launch (`runs_script`): each process imports everything
    once instead of once per run. Fails, with the output, if any run fails."""
    script = runs_script([(name, args) for args in runs], work_dir)
    return launch(name, [], num_processes, script=script, timeout=300 * len(runs), lowmem=lowmem)


def preference_args(model_dir, files, output_dir, loss, use_lora, micro, accumulation, *extra) -> list[str]:
    """preference_tuning's flags for an exactness test: SGD without clipping, warm-up, decay or LR
    scaling, so an update is linear in its gradient and a wrong normaliser shows at its full size."""
    return [
        f"--model_name_or_path={model_dir}", f"--train_file={files['train']}",
        f"--validation_file={files['validation']}", f"--output_dir={output_dir}", f"--loss={loss}",
        f"--per_device_train_batch_size={micro}", f"--gradient_accumulation_steps={accumulation}",
        "--optim=sgd", "--learning_rate=0.5", "--max_grad_norm=0", "--num_warmup_steps=0", "--weight_decay=0",
        "--lr_scaling=none", "--num_train_epochs=1", "--max_seq_length=96", "--seed=3", "--report_to=none",
        *(["--use_lora", "--lora_r=4"] if use_lora else []), *extra,
    ]  # fmt: skip


def tiny_lm_args(model_dir: Path, data: dict[str, Path], output_dir: Path, **overrides) -> list[str]:
    """`recipe_args` for causal_lm: blocks of 48 tokens."""
    return recipe_args(model_dir, data, output_dir, **{"block_size": 48, **overrides})


def load_script(path: str | Path, name: str | None = None):
    """Import a script (a recipe or a benchmark) as a module by its path, without touching sys.path."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def kill_when(process: subprocess.Popen, ready, what: str, delay: float = 0.0, timeout: float = 300) -> None:
    """SIGKILL the whole process group `delay` seconds after `ready()` holds (polled every millisecond), and
    wait until every process of it is gone (the output folder's lock with it)."""
    from ft_accum.cli.launching import process_tree

    deadline = time.time() + timeout
    while not ready():
        if process.poll() is not None:
            output = process.stderr.read()[-3000:] if process.stderr else ""
            raise AssertionError(f"the run ended before {what}:\n{output}")
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)
    time.sleep(delay)
    # Stop every process first, so none can finish the update or checkpoint in between, then kill.
    tree = process_tree(process.pid)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    for pid in process_tree(process.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()
    for pid in tree:  # reap-free wait until the workers are gone (they are not our children)
        while not _has_exited(pid):
            time.sleep(0.01)


def _has_exited(pid: int) -> bool:
    """Gone, or a zombie whose every thread has exited: only then are its files (and their flocks) closed.
    A killed process's main thread turns zombie first, while its other threads are still exiting."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return True
    return fields[0] in "ZX" and int(fields[17]) <= 1  # the state, and num_threads (field 20 of proc(5))
