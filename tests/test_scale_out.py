"""Scale-out on real engines, on CPU.

- DDP (MULTI_CPU over gloo), with and without Accelerate's `sync_each_batch`, on rows that do not
  divide: tests/test_text_classification.py (one launch for its DDP runs).
- FSDP on 2 CPU processes (gloo): torch's FSDP2 runs on CPU, but Accelerate 1.15 turns its FSDP
  plugin on only for GPU process groups. The product therefore refuses an FSDP config on CPU in
  one line (it would silently run DDP), and the tests switch the plugin on with a test-only hook
  (tests/fault_hooks, FT_ACCUM_TEST_FSDP_ON_CPU) to check the recipes under the real engine:
  the same updates as one process, sharded save and exact resume, the graceful stop.
- Without ACCELERATE_USE_CPU, an FSDP or multi-GPU config on this CPU-only machine starts
  processes that would each train alone; refused in one line that names the config's engine.
"""

import os
import re
import sys

import pytest
import yaml
from conftest import RECIPES, ROOT, free_port, tiny_args

from ft_accum.testing import run_with_stack_dump

pytestmark = pytest.mark.launch


@pytest.mark.parametrize(
    "config_name, cpu, expected",
    [
        # Real launches: what the launcher sets from each config (ACCELERATE_USE_FSDP, WORLD_SIZE) is
        # what the check reads. The FSDP config without ACCELERATE_USE_CPU is refused by the same
        # WORLD_SIZE check as the DDP one: test_an_fsdp_launch_without_gpus_is_refused_naming_fsdp.
        ("fsdp.yaml", True, "the Accelerate config asks for FSDP, but this launch would run MULTI_CPU"),
        (
            "multi_gpu_ddp.yaml",
            False,
            "accelerate launch started 2 processes for multi-GPU DDP, but each one runs alone",
        ),
    ],
)
def test_a_config_runs_the_engine_it_names_or_is_refused_naming_it(
    tmp_path, tiny_model_dir, data_files, config_name, cpu, expected
):
    config = yaml.safe_load((ROOT / "accelerate_configs" / config_name).read_text()) | {"mixed_precision": "no"}
    path = tmp_path / config_name
    path.write_text(yaml.safe_dump(config))
    # The FSDP case goes through ft-accum launch: 2 processes refuse, one line in all, no torchrun report
    # after it; the DDP case through plain accelerate launch, which prints it once per process.
    launcher = (
        ["ft-accum", "launch"] if config_name == "fsdp.yaml" else [sys.executable, "-m", "accelerate.commands.launch"]
    )
    command = [*launcher, "--config_file", str(path), "--main_process_port",
               str(free_port()), str(RECIPES / "text_classification.py"),
               *tiny_args(tiny_model_dir, data_files, tmp_path / "out", max_train_steps=1)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"} | ({"ACCELERATE_USE_CPU": "true"} if cpu else {})
    result = run_with_stack_dump(command, env, timeout=300, cwd=ROOT)
    output = result.stderr + result.stdout
    assert result.returncode != 0 and f"error: {expected}" in output, output[-3000:]
    # Counted in the text, not by line: two processes' lines can share one (their writes interleave).
    assert output.count(f"error: {expected}") == (1 if launcher[0] == "ft-accum" else 2), output[-3000:]
    if launcher[0] == "ft-accum":
        assert "torch.distributed.elastic" not in output and "ChildFailedError" not in output, output[-3000:]
    # An error through the launcher is the recipe's one line: accelerate launch adds its own
    # CalledProcessError traceback, the recipe none (tests/test_bad_inputs.py has the others in-process).
    assert 'text_classification.py", line' not in result.stderr
    if config_name == "multi_gpu_ddp.yaml":  # a DDP config's refusal must not talk of FSDP or DeepSpeed
        assert not {"FSDP", "DeepSpeed"} & set(output.split(expected)[1].splitlines()[0].split())
    assert not (tmp_path / "out" / "all_results.json").exists()


def test_an_fsdp_launch_without_gpus_is_refused_naming_fsdp(monkeypatch):
    """What each of the 2 processes of `accelerate launch --config_file fsdp.yaml` sees on a CPU
    machine (a stand-in Accelerator): WORLD_SIZE 2 from torchrun, ACCELERATE_USE_FSDP from the
    config, and a plain one-process run."""
    from types import SimpleNamespace

    import torch
    from accelerate.utils import DistributedType

    from ft_accum.core.errors import ConfigError
    from ft_accum.training.run_outputs import check_accelerator

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    alone = SimpleNamespace(
        mixed_precision="no", device=torch.device("cpu"), num_processes=1, distributed_type=DistributedType.NO
    )
    expected = "accelerate launch started 2 processes for FSDP, but each one runs alone (NO, 1 process)"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        check_accelerator(alone)


def test_deepspeed_refuses_token_weighted_losses_and_warns_that_it_is_untested(monkeypatch):
    """A unit test with a stand-in Accelerator: DeepSpeed does not run through the recipes on this
    CPU machine. benchmarks/deepspeed_cpu_probe.py measured, with real ZeRO-2 on 2 CPU processes,
    the window scale set before the backward (the recipes' form since issue 54) exact, but no recipe
    has run under DeepSpeed with it: token losses stay refused, sample losses warned."""
    from types import SimpleNamespace

    import torch
    from accelerate.utils import DistributedType

    from ft_accum.core.errors import ConfigError
    from ft_accum.training.run_outputs import check_accelerator

    printed = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    accelerator = SimpleNamespace(
        mixed_precision="bf16",
        device=torch.device("cpu"),
        num_processes=2,
        distributed_type=DistributedType.DEEPSPEED,
        print=printed.append,
    )
    with pytest.raises(ConfigError, match="DeepSpeed cannot run this recipe exactly.*tokens.*DDP"):
        check_accelerator(accelerator, loss_weighted_by="tokens")
    check_accelerator(accelerator)
    assert len(printed) == 1 and "counted windows" in printed[0]
    printed.clear()
    accelerator.distributed_type = DistributedType.MULTI_GPU
    check_accelerator(accelerator, loss_weighted_by="tokens")
    assert printed == []
