"""A DDP run's end cannot deadlock in the process group's destructor (ft_accum/training/process_group_teardown.py)."""

import re

import pytest

# Each round ends as a recipe does (RunTracker.finish, then run_main): a barrier, end_training()'s
# destroy_process_group, the DDP model released, then the kept group. A process's main thread keeps
# the GIL between blocking calls for up to a second (the switch interval), which holds the race's
# window open: without the kept group, 4 of 4 two-process runs of this loop hung within 40 rounds.
TEARDOWN_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from ft_accum.training.process_group_teardown import keep_process_group, release_process_group

rounds, rank, world_size = int(sys.argv[1]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False)
sys.setswitchinterval(1.0)
for round in range(rounds):
    dist.init_process_group("gloo", store=dist.PrefixStore(f"round-{round}", store), rank=rank, world_size=world_size)
    model = DistributedDataParallel(torch.nn.Linear(8, 2))
    model(torch.randn(4, 8)).sum().backward()
    dist.all_reduce(torch.ones(1))  # a tensor Python made, in the barrier's prior work
    dist.barrier()
    keep_process_group()
    dist.destroy_process_group()
    del model  # DDP's Reducer: with the GIL held, the group's last reference but the kept one
    release_process_group()
print(f"rank {rank} of {world_size}: {rounds} rounds", flush=True)
"""


@pytest.mark.launch
def test_the_process_group_outlives_the_ddp_model(tmp_path):
    """100 DDP runs' ends in one 2-process launch (about 10 s), each exiting as a recipe does; a hang
    fails with every process's stack after 120 s."""
    from conftest import launch

    script = tmp_path / "teardown.py"
    script.write_text(TEARDOWN_SCRIPT)
    result = launch("", [], num_processes=2, script=[str(script), "100"], timeout=120)
    # the two processes' lines can interleave on the launcher's stdout
    assert sorted(re.findall(r"rank (\d) of (\d): 100 rounds", result.stdout)) == [("0", "2"), ("1", "2")]


def test_a_recipe_keeps_its_group_until_its_train_has_returned(tmp_path, monkeypatch, tiny_model_dir, data_files):
    """The wiring: RunTracker.finish keeps the group before end_training(), run_main releases it
    after train() has returned (and its locals with it)."""
    from conftest import run_in_process, tiny_args

    from ft_accum.training import process_group_teardown

    events = []
    monkeypatch.setattr(process_group_teardown, "keep_process_group", lambda: events.append("kept"))
    monkeypatch.setattr(process_group_teardown, "release_process_group", lambda: events.append("released"))
    results = run_in_process("text_classification", tiny_args(tiny_model_dir, data_files, tmp_path))
    events.append("returned")
    assert results["num_processes"] == 1 and events == ["kept", "released", "returned"]
