"""The recipe contract (docs/writing_a_recipe.md), checked over every file in recipes/.

No list of recipes and no per-recipe settings: each file found is run through `ft-accum check`
(its `main`, in this process: the same code as the command, without a new interpreter importing
torch and transformers each time) on its offline default (its own config, model and data, 20 rows
so that the last window is short, one validation row, the model cut to its first layer; the bundled
SmolLM2 replaced by a tiny Llama with its tokenizer and chat template): a bad flag
is one `error:` line, (8 × 1) and (2 × 4) give the same updates and weights, a resume is
bit-identical.
tests/test_configs.py checks that each docstring command is a launch of this same run.
A new recipe that follows the guide passes without this file edited. Each recipe's own behaviour
(its data format, its metric, DDP on uneven rows through `accelerate launch`) is tested in its
own test file.
"""

import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import ROOT, make_documents, tiny_lm_args, write_jsonl

from ft_accum.cli.check import end_of_run_under_fsdp
from ft_accum.cli.check import main as ft_accum_check
from ft_accum.data import offline_assets

pytestmark = pytest.mark.launch


def check(capsys, recipe: Path, *flags: str) -> tuple[int, str]:
    """`ft-accum check recipe flags`: (exit code, what it printed)."""
    capsys.readouterr()
    code = ft_accum_check([str(recipe), *flags])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.py")), ids=lambda p: p.stem)
def test_every_recipe_keeps_the_contract(recipe, capsys, monkeypatch, chat_lm_dir):
    # The default SmolLM2 is a tiny Llama with its real tokenizer and chat template, as in tests/test_engines.py:
    # one layer of the real one keeps its 28M-parameter embedding, most of each run's time and nothing checked.
    monkeypatch.setattr(offline_assets, "bundled_smollm2_dir", lambda cache_dir=None: chat_lm_dir)
    # One validation row: evaluation is run, not compared, and each default's first row fills a batch.
    # --skip_fsdp: tests/test_engines.py runs every recipe's shipped defaults under FSDP in one launch.
    code, out = check(capsys, recipe, "--num_layers", "1", "--eval_rows", "1", "--skip_fsdp")
    table = out[out.index(f"ft-accum check {recipe}") :]
    assert code == 0 and "6 of 6 passed" in table and "FAIL" not in table, table


def test_a_copy_with_the_classic_bug_fails_the_check_with_the_size_of_the_error(tmp_path, tiny_gpt2_dir, capsys):
    """A copy of the causal-LM recipe that backpropagates each micro-batch's token mean (loss / its own
    token count, as copies of Accelerate's example do) instead of the window's scale: micro-batches of
    unequal length then weigh their tokens unequally, and the check must fail and say by how much."""
    source = (ROOT / "recipes" / "causal_lm.py").read_text()
    correct = "accelerator.backward(loss_sum * window.scale)"
    assert correct in source
    buggy = tmp_path / "my_causal_lm.py"
    buggy.write_text(source.replace(correct, "accelerator.backward(loss_sum / count_items(batch))"))
    data = {"train": write_jsonl(tmp_path / "train.jsonl", make_documents(24, seed=11)),
            "validation": write_jsonl(tmp_path / "val.jsonl", make_documents(4, seed=12))}  # fmt: skip
    flags = tiny_lm_args(tiny_gpt2_dir, data, tmp_path / "unused")
    flags = [f for f in flags if not f.startswith("--output_dir")]
    code, out = check(capsys, buggy, *flags, "--skip_fsdp")
    assert code == 1, out[-3000:]
    failed = [line for line in out.splitlines() if " FAIL " in line]
    assert any("grad_norm of every update" in line for line in failed), out[-2000:]
    error = float(next(line for line in failed if "grad_norm" in line).split("relative error ")[1].split()[0])
    assert error > 1e-3, error  # far beyond the 1e-5 bound: the check reports the size
    assert "the recipe breaks the contract" in out

    # The same flags on the shipped recipe pass: the failure is the bug, not the flags.
    assert check(capsys, ROOT / "recipes" / "causal_lm.py", *flags, "--skip_fsdp")[0] == 0


def test_a_copy_whose_sample_runs_on_the_main_process_only_fails_the_fsdp_check(tmp_path, tiny_llama_dir, capsys):
    """The hang of issue 42 in a copied template: the end-of-run sample generated on the main process
    only. Under FSDP the main process then waits in an all-gather that the other never joins; check 4
    (2 CPU processes under the shipped fsdp.yaml) fails instead of hanging, and the shipped recipe,
    with the same flags, passes it."""
    source = (ROOT / "recipes" / "causal_lm.py").read_text()
    every_rank = "    if not task.generate_prompt:\n        return {}\n"
    assert every_rank in source
    copy = tmp_path / "my_causal_lm.py"
    copy.write_text(
        source.replace(
            every_rank,
            every_rank.replace("task.generate_prompt", "(task.generate_prompt and accelerator.is_main_process)"),
        )
    )
    data = {"train": write_jsonl(tmp_path / "train.jsonl", make_documents(20, seed=11)),
            "validation": write_jsonl(tmp_path / "val.jsonl", make_documents(4, seed=12))}  # fmt: skip
    flags = [f for f in tiny_lm_args(tiny_llama_dir, data, tmp_path / "unused") if not f.startswith("--output_dir")]
    flags += ["--generate_prompt", "the bank", "--max_new_tokens", "3", "--ddp_timeout", "10"]
    # Check 4 alone (checks 1-3 are the contract test's, on the shipped recipe), on the copy and on the
    # shipped recipe at once: the copy's launch mostly waits out --ddp_timeout, the other's runs meanwhile.
    check_4 = functools.partial(end_of_run_under_fsdp, flags=flags, rows=20, eval_rows=4, num_layers=None)
    with ThreadPoolExecutor(2) as pool:
        copied = pool.submit(check_4, copy, work=tmp_path / "copy")
        shipped = pool.submit(check_4, ROOT / "recipes" / "causal_lm.py", work=tmp_path / "shipped")
        copied, shipped = copied.result(), shipped.result()
    # The copy fails it, and the shipped recipe with the same flags passes: the failure is the bug, not the flags.
    assert not copied.passed and "a process stopped joining collective operations" in copied.measured, copied
    assert shipped.passed, shipped
