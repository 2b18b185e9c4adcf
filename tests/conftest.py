"""Shared fixtures over the helpers of `ft_accum.testing`: a tiny BERT and tiny causal LMs built from
configs, word-level tokenizers, and generated data. Nothing here touches the network.

The helpers are imported here so that test modules can keep `from conftest import ...`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ft_accum.testing import (  # noqa: F401  (re-exported for the test modules)
    COMMON,
    CPU_CONFIG,
    FAULT_HOOKS,
    RECIPES,
    ROOT,
    TOPICS,
    copy_checkpoint,
    final_weights,
    free_port,
    kill_when,
    launch,
    launch_command,
    launch_runs,
    load_recipe,
    make_documents,
    make_rows,
    make_tiny_bert,
    make_tiny_chat_lm,
    make_tiny_lm,
    max_abs_difference,
    read_evaluations,
    read_metrics,
    recipe_args,
    relative_error,
    run_in_process,
    runs_script,
    snapshot,
    tiny_args,
    tiny_lm_args,
    write_jsonl,
)

# Offline for every test and every process they launch.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

# pytest runs on every core (`-n auto`, pyproject.toml): one xdist worker per core, each single-threaded,
# and so is every process a test launches. Two workers with two OpenMP threads each would fight for
# the cores (spinning OpenMP threads slow down sharply when oversubscribed).
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def launches_run_without_the_lowmem_extra():
    """Every process a test launches imports tests/fault_hooks/sitecustomize.py, which hides
    bitsandbytes and torchao from it, as an install without the [lowmem] extra has neither: they
    cost every launched process imports (transformers and peft import them when installed; 9.9 →
    9.1 CPU-s for a tiny text-classification run, docs/tests.md), and a recipe must not need them
    unless asked. `launch(..., lowmem=True)` lets a
    launch use them. Set here, not at import: xdist workers start after this file is imported,
    and they must keep both for the low-memory tests they run in-process."""
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "FT_ACCUM_TEST_WITHOUT_LOWMEM")}
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAULT_HOOKS), saved["PYTHONPATH"]]))
    os.environ["FT_ACCUM_TEST_WITHOUT_LOWMEM"] = "1"
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: the cores this process may run on (a container's cpuset included), at most 4; none
    (no workers, the tests in this process) on a single core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, 4) if cores >= 2 else 0


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer, 32-wide BERT classifier with dropout 0, saved like a hub checkpoint."""
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def data_files(tmp_path_factory) -> dict[str, Path]:
    path = tmp_path_factory.mktemp("data")
    return {
        "train": write_jsonl(path / "train.jsonl", make_rows(48, seed=1)),
        "validation": write_jsonl(path / "validation.jsonl", make_rows(12, seed=2)),
    }


@pytest.fixture(scope="session", params=["gpt2", "llama"])
def tiny_lm_dir(request, tmp_path_factory) -> Path:
    return make_tiny_lm(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory) -> Path:
    return make_tiny_lm("gpt2", tmp_path_factory.mktemp("tiny-gpt2-recipe"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_lm("llama", tmp_path_factory.mktemp("tiny-llama-recipe"))


@pytest.fixture(scope="session")
def llama_64_dir(tmp_path_factory) -> Path:
    """A tiny Llama 64 wide: bitsandbytes' CPU kernels need layers of at least one 64-weight block.
    Its MLP is 64 wide too: torchao's 8-bit AdamW compiles its step once per parameter shape, each
    compile seconds long on a cold cache (CI's), and one width leaves three shapes instead of five."""
    return make_tiny_lm("llama", tmp_path_factory.mktemp("tiny-llama-64"), width=64, intermediate_size=64)


@pytest.fixture(scope="session")
def chat_lm_dir(tmp_path_factory) -> Path:
    """A tiny Llama with SmolLM2-135M-Instruct's real tokenizer and chat template."""
    return make_tiny_chat_lm(tmp_path_factory.mktemp("tiny-chat-lm"))


@pytest.fixture(scope="session")
def lm_data_files(tmp_path_factory) -> dict[str, Path]:
    path = tmp_path_factory.mktemp("lm-data")
    return {
        "train": write_jsonl(path / "train.jsonl", make_documents(24, seed=11)),
        "validation": write_jsonl(path / "validation.jsonl", make_documents(8, seed=12)),
    }


# fp32, dropout 0, the same samples per update: runs differ only in summation order (~1e-7 relative
# per operation); 1e-5 leaves room for a few AdamW steps, while a wrong weighting is ≥ 1e-2.
RTOL = 1e-5


def assert_same_run(out: Path, reference: Path) -> None:
    """Same updates as the reference run: per-update loss, gradient norm and counts, and final weights."""
    ours, theirs = read_metrics(out), read_metrics(reference)
    assert [m["step"] for m in ours] == [m["step"] for m in theirs]
    for a, b in zip(ours, theirs):
        # grad_norm is measured before clipping: it catches any wrong scale of the gradient, which
        # AdamW's updates alone would hide (Adam is nearly invariant to a constant gradient scale).
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=RTOL)
        assert a["loss"] == pytest.approx(b["loss"], rel=RTOL)
        assert a["samples_seen"] == b["samples_seen"] and a["tokens_seen"] == b["tokens_seen"]
    assert relative_error(final_weights(out), final_weights(reference)) <= RTOL


def error_of(recipe: str, args: list[str]) -> str:
    """The recipe's one-line error message for bad input (it must not be a traceback)."""
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(recipe, args)
    message = str(exit_info.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--benchmarks",
        action="store_true",
        help="also run the tests marked `benchmarks`: the benchmark scripts' long quick modes and "
        "gpu_check.py --dry_run (about 2 more minutes with 2 workers)",
    )


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `benchmarks` are skipped, with the option that runs them as the reason, unless
    `--benchmarks` is given: they smoke-test benchmark scripts, not the library or the recipes, and
    take about 3 minutes of test time, 1.5 of CI's 12 minutes on 2 workers (docs/tests.md).

    Each xdist worker's share starts with its part of the long tests (marked `launch`), then short
    ones. xdist's worksteal hands worker j the j-th of k equal slices of this list, and an idle worker
    steals from the end of another's: so the workers end on short tests, not one of them on a
    minute-long launch while the other waits. The long tests of one module go to one worker: they
    share its module-scoped fixtures (test_fsdp.py's FSDP launch, test_fault_injection.py's
    uninterrupted run), which each worker that ran one of them would build again."""
    skipped = set()
    if not config.getoption("--benchmarks"):
        skip = pytest.mark.skip(reason="a benchmark script's long smoke test: run with `pytest --benchmarks`")
        for item in items:
            if item.get_closest_marker("benchmarks"):
                item.add_marker(skip)
                skipped.add(item)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))

    def is_long(item) -> bool:
        return item.get_closest_marker("launch") is not None and item not in skipped

    slow = [item for item in items if is_long(item)]
    fast = [item for item in items if not is_long(item)]
    modules: dict[Path, list] = {}
    for item in slow:
        modules.setdefault(item.path, []).append(item)
    shares: list[list] = [[] for _ in range(workers)]
    for module in sorted(modules.values(), key=len, reverse=True):  # the largest first, to the emptiest share
        min(shares, key=len).extend(module)
    ordered, remaining = [], len(items)
    for worker in range(workers):
        size = remaining // (workers - worker)  # the slice xdist sends this worker (check_schedule)
        take = max(0, size - len(shares[worker]))
        ordered += shares[worker] + fast[:take]
        fast = fast[take:]
        remaining -= size
    items[:] = ordered + fast
