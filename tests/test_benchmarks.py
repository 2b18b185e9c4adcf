"""The benchmark scripts' smoke tests: `benchmarks/run_all.py --quick` end to end (tiny models, once),
the other scripts' quick modes, and `gpu_check.py --dry_run`.

CI never runs the timings. The default run checks that every script starts and shows its --help,
the quick modes of the low-memory and optimizer benchmarks and of profile_update.py (whose host
synchronisations per update the test bounds), and one `gpu_check.py` check on one cell.
The three long ones (run_all, the loss and packing quick modes, and the full GPU-check dry run: about
3 minutes of test time, 2 minutes on 2 workers) are marked `benchmarks` and run with `pytest --benchmarks`:
before a change to benchmarks/ lands, and before a GPU session (docs/tests.md).
"""

import importlib.util
import json
import os
import runpy
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_run_all():
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCHMARKS = pytest.mark.benchmarks  # skipped unless `pytest --benchmarks` (tests/conftest.py)


@pytest.mark.parametrize(
    "script",
    # The two without a command line (bench_memory_planner.py, deepspeed_cpu_probe.py) run when started.
    sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if "ArgumentParser(" in p.read_text()),
)
def test_every_benchmark_script_starts_and_shows_its_help(script, capsys):
    """Imports, options and help text of each script, in the default run: what the skipped quick modes
    would catch first."""
    assert "usage:" in run_script(script, "--help", capsys=capsys)  # run_script: exit code 0 too


@pytest.mark.launch
@BENCHMARKS
def test_run_all_quick_writes_every_section(tmp_path):
    run_all = load_run_all()
    (tmp_path / "README.md").write_text(
        "# Benchmarks\n\nhand-written text\n\n<!-- run_all:begin -->\nold\n<!-- run_all:end -->\n\nmore text\n"
    )
    run_all.main(["--quick", "--output_dir", str(tmp_path)])

    readme = (tmp_path / "README.md").read_text()
    assert (
        "hand-written text" in readme and "more text" in readme and "\nold\n" not in readme
    )  # only the block is replaced
    assert "These figures are not measurements" in readme
    for title in run_all.TITLES.values():
        assert f"### {title}" in readme
    assert "Not run yet" not in readme
    for plot in ("loop_overhead.png", "memory.png"):
        assert (tmp_path / "results" / plot).stat().st_size > 1000

    correctness = json.loads((tmp_path / "results" / "correctness.json").read_text())["columns"]
    for column, methods in correctness.items():
        assert methods["ft-accum"]["relative_error"] < 1e-5, column
    # Controls: the table must be able to show an error where there is one.
    assert correctness["LM, padded, GPT-2"]["naive `loss / N`"]["relative_error"] > 1e-2
    assert correctness["classification, fixed length, 4+4+4+2"]["naive `loss / N`"]["relative_error"] > 1e-2

    overhead = json.loads((tmp_path / "results" / "loop_overhead.json").read_text())
    assert {t["task"] for t in overhead["tables"]} == {"classification", "lm"}
    for table in overhead["tables"]:
        assert all(rate > 0 for rate in table["median"].values())
    ddp = json.loads((tmp_path / "results" / "ddp.json").read_text())["recipes"]
    assert all(t["median"]["2"] > 0 for t in ddp.values())  # bench_ddp itself asserts that 2 processes ran
    accuracy = json.loads((tmp_path / "results" / "time_to_accuracy.json").read_text())
    assert "skipped" in accuracy or len(accuracy["runs"]) == 5  # SST-2 lives in ../shared, absent on CI


def run_script(name: str, *args: str, capsys=None, exit_code: int = 0) -> str:
    """`python benchmarks/<name> args`, run in this process (runpy, as __main__): the script is the
    same, without a new interpreter importing torch and transformers each time. What it printed;
    the script's exit code must be `exit_code`."""
    from ft_accum.testing import reset_accelerate_state

    # patch.dict restores the environment: gpu_check.py sets ACCELERATE_MIXED_PRECISION per run.
    with mock.patch.object(sys, "argv", [str(ROOT / "benchmarks" / name), *args]), mock.patch.dict(os.environ):
        try:
            runpy.run_path(str(ROOT / "benchmarks" / name), run_name="__main__")
        except SystemExit as exc:
            assert (exc.code or 0) == exit_code, exc.code
        else:
            assert exit_code == 0
        finally:
            reset_accelerate_state()
    return capsys.readouterr().out if capsys else ""


@pytest.mark.launch
def test_the_recipe_adds_at_most_one_host_synchronisation_per_update(tmp_path):
    run_script("profile_update.py", "--quick", "--output", str(tmp_path / "profile.json"))
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert set(profile) == {"quick", "plain", "recipe, logits", "recipe"}
    # The window's all-reduce, and none per micro-batch: a sync per micro-batch stalls a GPU's queue.
    assert profile["recipe"]["host_syncs_per_update"] <= profile["plain"]["host_syncs_per_update"] + 1


@pytest.mark.launch
@BENCHMARKS
def test_output_loss_and_packing_benchmarks_run_quick(tmp_path):
    run_script("bench_output_loss.py", "--quick", "--output", str(tmp_path / "output_loss.json"))
    results = json.loads((tmp_path / "output_loss.json").read_text())
    assert {row["micro"] for row in results["memory"]} == {1, 2}
    assert all(set(row["seconds"]) == {"model", "logits", "chunked"} for row in results["time"])
    run_script("bench_packing.py", "--quick", "--output", str(tmp_path / "packing.json"))
    packing = json.loads((tmp_path / "packing.json").read_text())
    assert all(rate > 0 for rate in packing["median_assistant_tokens_per_second"].values())


@pytest.mark.launch
@BENCHMARKS
def test_grpo_benchmarks_run_quick(tmp_path):
    run_script("bench_grpo_generation.py", "--quick", "--output", str(tmp_path / "grpo_generation.json"))
    runs = json.loads((tmp_path / "grpo_generation.json").read_text())["runs"]
    assert set(runs) == {"1 a call", "8 a call"}
    # Either way a round samples its 8 prompts × G 4 completions.
    assert all(r["completions"] == 32 for run in runs.values() for r in run["rounds"])
    run_script("bench_grpo_log_probs.py", "--quick", "--output", str(tmp_path / "grpo_log_probs.json"))
    seconds = json.loads((tmp_path / "grpo_log_probs.json").read_text())["seconds"]
    assert len(seconds["chunked"]) == len(seconds["unchunked"]) == 2


def test_low_memory_benchmark_runs_quick(tmp_path):
    pytest.importorskip("bitsandbytes")
    run_script("bench_low_memory.py", "--quick", "--output", str(tmp_path / "low_memory.json"))
    runs = json.loads((tmp_path / "low_memory.json").read_text())["runs"]
    # Quick leaves out torchao's stochastic rounding (a cold compile); test_low_memory.py runs that path.
    assert set(runs) == {"fp32 + AdamW", "fp32 + 8-bit AdamW", "bf16 + AdamW", "bf16 + 8-bit AdamW"}
    assert runs["fp32 + AdamW"]["loss_gap_to_fp32_adamw"]["final"] == 0
    state = {name: run["bytes_gib"]["optimizer_state"] for name, run in runs.items()}
    assert state["bf16 + 8-bit AdamW"] < 0.5 * state["fp32 + AdamW"]
    for run in runs.values():
        assert run["bytes_gib"]["optimizer_state"] == pytest.approx(
            run["bytes_gib"]["predicted_optimizer_state"], rel=0.02
        )


def test_optimizer_candidates_benchmark_runs_quick(tmp_path):
    pytest.importorskip("bitsandbytes")
    run_script("bench_optimizer_candidates.py", "--quick", "--output", str(tmp_path / "candidates.json"))
    results = json.loads((tmp_path / "candidates.json").read_text())["results"]
    # Quick leaves out torchao's candidates (cold compiles); test_low_memory.py runs torchao's 8-bit AdamW.
    assert set(results) == {"torch fused AdamW (fp32 states)", "bitsandbytes AdamW8bit"}
    eight_bit = results["bitsandbytes AdamW8bit"]
    assert eight_bit["state_bytes_per_parameter"] == pytest.approx(2 * (1 + 4 / 256))
    assert 0 < eight_bit["distance_to_fp32_adamw_over_its_move"] < 0.1


@pytest.mark.launch
@BENCHMARKS
def test_gpu_check_dry_run_exercises_every_check_it_can_on_cpu(tmp_path, capsys):
    """The GPU check must not first break on the GPU machine: its dry run runs checks 1–4 and 6–10 on CPU."""
    args = ("--dry_run", "--checks", "1,2,3,4,5,6,7,8,9,10", "--output", str(tmp_path / "gpu_check.json"))
    out = run_script("gpu_check.py", *args, capsys=capsys)
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    checks = " ".join(r["check"] for r in rows)
    parts = ("(8 × 1) = (2 × 4)", "planner / recipe peak", "12 GB table", "throughput", "instruction tuning",
             "GRPO planner / training peak", "GRPO generation, 1 prompt(s) a generate() call",
             "distillation planner / recipe peak", "contrastive planner / recipe peak",
             "vision-language planner / recipe peak")  # fmt: skip
    for part in parts:
        assert part in checks, part
    assert all(r["pass"] for r in rows) and "| check | measured |" in out
    # One cell per recipe, and the low-memory ones through the recipe with their flags: bf16 weights
    # with 8-bit AdamW, and QLoRA.
    assert [r["cell"] for r in rows if "cell" in r] == [
        "tiny-bert-base-uncased text_classification 32 full",
        "tiny-t5-base seq2seq 32 full",
        "tiny-llama-3.1-8b causal_lm 64 full-8bit",
        "tiny-llama-3.1-8b causal_lm 64 qlora",
    ]


@pytest.mark.launch
def test_gpu_check_runs_the_checks_asked_for_as_the_gpu_machine_does(tmp_path):
    """As benchmarks/gpu_run.sh runs it there: the MiniLM's config and tokenizer without its weights
    (benchmarks/gpu_prepare.py), and the checks in the order given, where one that raises is a failed
    row and the rest still run."""
    import shutil

    from ft_accum.data.offline_assets import bundled_minilm_dir

    minilm = tmp_path / "minilm"
    shutil.copytree(bundled_minilm_dir(), minilm, ignore=shutil.ignore_patterns("model.safetensors"))
    args = ("--dry_run", "--checks", "11,3", "--cells", "t5", "--minilm_dir", str(minilm))
    run_script("gpu_check.py", *args, "--output", str(tmp_path / "g.json"), exit_code=1)
    results = json.loads((tmp_path / "g.json").read_text())
    assert results["minilm_weights"].startswith("random")
    broken, cell = results["rows"]
    assert broken["check"] == "check 11" and "no check 11" in broken["measured"] and not broken["pass"]
    assert cell["cell"] == "tiny-t5-base seq2seq 32 full" and cell["pass"]


def test_gpu_prepare_keeps_only_the_bitsandbytes_libraries_the_gpu_machine_loads(tmp_path):
    """The carried bitsandbytes wheel keeps its CPU and CUDA 13 libraries (the machine's torch is a
    CUDA 13 build) and a RECORD that lists only what is in the wheel."""
    import zipfile

    module = runpy.run_path(str(ROOT / "benchmarks" / "gpu_prepare.py"))
    names = [f"bitsandbytes/libbitsandbytes_{k}.so" for k in ("cpu", "cuda118", "cuda128", "cuda130", "rocm64")]
    names.append("bitsandbytes/__init__.py")
    wheel = tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in names:
            archive.writestr(name, name)
        archive.writestr("bitsandbytes-0.50.2.dist-info/RECORD", "".join(f"{n},sha256=x,1\n" for n in names))
    module["without_files"](wheel, module["UNUSED_BITSANDBYTES_LIBRARY"])
    with zipfile.ZipFile(wheel) as archive:
        kept = [n for n in archive.namelist() if not n.endswith("RECORD")]
        record = archive.read("bitsandbytes-0.50.2.dist-info/RECORD").decode()
    assert [Path(n).name for n in kept] == ["libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so", "__init__.py"]
    assert [line.split(",")[0] for line in record.splitlines()] == kept


def test_gpu_run_script_parses():
    """benchmarks/gpu_run.sh runs only on the GPU machine: a syntax error there would cost a loan."""
    import subprocess

    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_run.sh")], check=True)


@pytest.mark.launch
@BENCHMARKS
def test_the_search_benchmark_runs_quick(tmp_path, capsys):
    printed = run_script("bench_search.py", "--quick", "--folder", str(tmp_path), capsys=capsys)
    assert "| grid, 12 runs |" in printed and "| TPE + median pruning (warm-up 0), 12 trials |" in printed
    assert (tmp_path / "search_warmup0" / "report" / "search_history.png").stat().st_size > 1000
