"""Every recipe's shipped defaults under every shipped engine (issue 42).

Each recipe in recipes/ runs as a user would start it: its own config (recipes/configs/<name>.yaml),
its own default model loaded from its real checkpoint (the bundled MiniLM, the digits ResNet),
its own data. Only the size is cut: the model to its first layer (the test hook
FT_ACCUM_TEST_NUM_LAYERS, `ft-accum check --num_layers`' cut), the bundled SmolLM2 replaced by a
tiny Llama with its real tokenizer and chat template (FT_ACCUM_TEST_SMOLLM2_DIR), the rows and
the updates. Every
recipe runs in turn in one launch per engine (`runs_script`), on 2 CPU processes:
- the shipped DDP config (accelerate_configs/multi_gpu_ddp.yaml) over gloo;
- the shipped FSDP config (accelerate_configs/fsdp.yaml) with the test hook that switches
  Accelerate's FSDP plugin on for CPU (FT_ACCUM_TEST_FSDP_ON_CPU).
Both in fp32 (`--mixed_precision no`, as on a CPU). Each run exits 0 and writes all_results.json,
with the sample where its config asks for one; or, where docs/scale_out.md's engine table says
FSDP refuses the model, stops before training in one line that names the config to use instead.

The stuck collective: process 1 skips one collective (the test hook FT_ACCUM_TEST_SKIP_COLLECTIVE);
the launch exits non-zero within --ddp_timeout + 30 s with the one-line reason, leaves no process,
and the resume command it printed completes.

That every recipe under FSDP makes the same updates as one process is tests/test_fsdp.py's.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import FAULT_HOOKS, RECIPES, ROOT, free_port, make_rows, tiny_args, write_jsonl

from ft_accum.testing import launch_command, make_tiny_bert, run_with_stack_dump, runs_script

pytestmark = pytest.mark.launch
CONFIGS = {"ddp": "multi_gpu_ddp.yaml", "fsdp": "fsdp.yaml"}
# Rows that leave the last micro-batch short and uneven across the 2 processes.
SIZES = ["--max_train_steps=2", "--max_train_samples=37", "--max_eval_samples=5"]


def refused_under_fsdp() -> dict[str, str]:
    """{recipe file: reason} for the rows of docs/scale_out.md's engine table whose FSDP column says refused."""
    table = (ROOT / "docs" / "scale_out.md").read_text().split("### Each recipe under each engine")[1]
    rows = re.findall(r"^\| `(\w+)\.py` \| ([^|]*) \| ([^|]*) \|$", table, flags=re.M)
    assert rows, "docs/scale_out.md has no engine table"
    return {name: fsdp.strip() for name, _, fsdp in rows if fsdp.strip().startswith("refused")}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def shipped_defaults(request, tmp_path_factory, chat_lm_dir):
    """One launch of every recipe's shipped defaults under the engine `request.param`: (engine, output dirs, exits)."""
    engine = request.param
    root = tmp_path_factory.mktemp(f"shipped-{engine}")
    config = yaml.safe_load((ROOT / "accelerate_configs" / CONFIGS[engine]).read_text()) | {"mixed_precision": "no"}
    (root / "accelerate.yaml").write_text(yaml.safe_dump(config))
    runs, outputs = [], {}
    for recipe in sorted(RECIPES.glob("*.py")):
        own_config = RECIPES / "configs" / f"{recipe.stem}.yaml"
        outputs[recipe.stem] = root / recipe.stem
        args = [f"--config={own_config}"] if own_config.is_file() else []
        runs.append((recipe.stem, [*args, *SIZES, f"--output_dir={outputs[recipe.stem]}"]))
    exits = root / "exits.json"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(root / "accelerate.yaml"),
           "--num_processes", "2", "--main_process_port", str(free_port()),
           *runs_script(runs, root, exits)]  # fmt: skip
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(FAULT_HOOKS),
           "FT_ACCUM_TEST_NUM_LAYERS": "1", "FT_ACCUM_TEST_SMOLLM2_DIR": str(chat_lm_dir)}  # fmt: skip
    if engine == "fsdp":
        env["FT_ACCUM_TEST_FSDP_ON_CPU"] = "1"
    result = run_with_stack_dump(cmd, env, timeout=300 * len(runs), cwd=ROOT)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return engine, outputs, {e["recipe"]: e for e in json.loads(exits.read_text())}, result


def test_every_recipe_finishes_its_shipped_defaults_or_refuses_in_one_line(shipped_defaults):
    engine, outputs, exits, result = shipped_defaults
    refused = refused_under_fsdp() if engine == "fsdp" else {}
    assert set(exits) == set(outputs)
    for recipe, out in outputs.items():
        if recipe in refused:
            message = exits[recipe]["message"]
            assert exits[recipe]["code"] == 1 and "\n" not in message, (recipe, message)
            assert message.startswith("error: FSDP cannot serve") and "multi_gpu_ddp.yaml" in message, message
            assert not (out / "all_results.json").exists() and not (out / "checkpoints").exists()
            continue
        assert (exits[recipe]["code"], exits[recipe]["message"]) == (0, ""), exits[recipe]
        results = json.loads((out / "all_results.json").read_text())
        expected = {"ddp": "MULTI_CPU", "fsdp": "FSDP"}[engine]
        assert (results["distributed_type"], results["num_processes"]) == (expected, 2), (recipe, results)
        assert results["num_update_steps"] == 2, (recipe, results)
        own_config = RECIPES / "configs" / f"{recipe}.yaml"
        if own_config.is_file() and yaml.safe_load(own_config.read_text()).get("generate_prompt"):
            # The sample that hung under FSDP: generated on every rank, written once.
            assert results["sample"].startswith(yaml.safe_load(own_config.read_text())["generate_prompt"]), results
    assert "Traceback" not in result.stderr, result.stderr[-5000:]


@pytest.fixture(scope="module")
def stuck_rank_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("stuck")
    data = {"train": write_jsonl(root / "train.jsonl", make_rows(41, seed=1)),
            "validation": write_jsonl(root / "val.jsonl", make_rows(9, seed=2))}  # fmt: skip
    return root, make_tiny_bert(root / "model"), data


def test_a_rank_that_skips_a_collective_stops_the_launch_in_one_line_and_the_run_resumes(stuck_rank_setup):
    """Process 1 skips the first collective of the evaluation after update 6 (41 rows at 8 per update:
    6 updates an epoch, checkpoints every 2). Process 0 waits in it for --ddp_timeout, then the
    launch stops with the one-line reason; nothing is left running; the printed resume completes.
    The checkpoint due at update 6, the epoch's last, waits for the epoch's evaluation (so that a resume
    from it has none left to redo): the stuck evaluation leaves update 4's as the last complete one."""
    root, model, data = stuck_rank_setup
    out, timeout = root / "out", 10
    args = tiny_args(model, data, out, per_device_train_batch_size=2, effective_batch_size=8, num_train_epochs=2,
                     checkpointing_steps=2, ddp_timeout=timeout)  # fmt: skip
    cmd, env = launch_command("text_classification", args, num_processes=2)
    env |= {"PYTHONPATH": str(FAULT_HOOKS), "FT_ACCUM_TEST_SKIP_COLLECTIVE": "eval:6"}
    started = time.monotonic()
    result = run_with_stack_dump(cmd, env, timeout=300, cwd=ROOT)
    seconds = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "test hook: process 1 skips" in output, output[-4000:]
    assert seconds < timeout + 30 + 20, seconds  # + 20 s: the run itself, up to update 6, on a loaded CI machine
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert errors, output[-4000:]
    reason = errors[0]
    assert "a process stopped joining collective operations (after update 6, in eval)" in reason, reason
    assert f"waited {timeout} s (--ddp_timeout)" in reason, reason
    checkpoint = out / "checkpoints" / "step_000004"
    assert f"the last complete checkpoint is {checkpoint}" in reason, reason
    assert (checkpoint / "training_state.json").is_file()
    assert not any(str(out) in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))
    assert 'text_classification.py", line' not in result.stderr  # the recipe's line, not its traceback

    resume = reason.split("resume with: ", 1)[1]
    assert resume.endswith("--resume_from_checkpoint latest")
    env.pop("FT_ACCUM_TEST_SKIP_COLLECTIVE")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    resumed = subprocess.run(shlex.split(resume.replace("ACCELERATE_USE_CPU=true ", "")), env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert json.loads((out / "all_results.json").read_text())["num_update_steps"] == 12
