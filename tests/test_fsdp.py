"""The recipes under FSDP, on 2 CPU processes over gloo (issue 26).

torch's FSDP2 (`fully_shard`) runs on CPU; Accelerate 1.15 switches its FSDP plugin on only for
GPU process groups, so the product refuses an FSDP config on CPU (test_scale_out.py). Here the
test-only hook of tests/fault_hooks (FT_ACCUM_TEST_FSDP_ON_CPU) switches it on as Accelerate
does on GPUs; everything else is the real launch of the shipped accelerate_configs/fsdp.yaml
(in fp32): sharded parameters, gradients and optimizer state, SHARDED_STATE_DICT checkpoints.

Each run uses a row count that leaves the last window short and uneven across the processes.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    FAULT_HOOKS,
    RECIPES,
    ROOT,
    RTOL,
    assert_same_run,
    final_weights,
    free_port,
    make_documents,
    read_metrics,
    recipe_args,
    relative_error,
    run_in_process,
    tiny_lm_args,
    write_jsonl,
)
from safetensors.torch import load_file

from ft_accum.data.rewards import arithmetic_task
from ft_accum.testing import (
    make_conversations,
    make_preference_pairs,
    make_rows,
    make_sentence_pairs,
    make_tagged_rows,
    make_text_pairs,
    make_tiny_chat_lm,
    make_tiny_t5,
    make_tiny_tagger,
    preference_args,
    run_with_stack_dump,
    runs_script,
)

pytestmark = pytest.mark.launch
SGD = {"optim": "sgd", "learning_rate": 0.5, "max_grad_norm": 0}


@pytest.fixture(scope="module")
def fsdp_config(tmp_path_factory) -> Path:
    config = yaml.safe_load((ROOT / "accelerate_configs" / "fsdp.yaml").read_text())
    assert config["distributed_type"] == "FSDP" and config["fsdp_config"]["fsdp_version"] == 2
    path = tmp_path_factory.mktemp("fsdp") / "fsdp_fp32.yaml"
    path.write_text(yaml.safe_dump(config | {"mixed_precision": "no"}))  # fp32: exact comparisons
    return path


def recipe_script(recipe: str, args: list[str]) -> list[str]:
    # --config=none: these runs set what they rely on, not the recipe's shipped config (see ft_accum.testing).
    return [str(RECIPES / f"{recipe}.py"), "--config=none", *args]


def fsdp_command(config: Path, script: list[str], launcher: str = "accelerate"):
    """The FSDP launch of `script`: a recipe and its arguments (`recipe_script`), or ft_accum.testing.runs_script."""
    prefix = (
        [sys.executable, "-m", "accelerate.commands.launch"]
        if launcher == "accelerate"
        else [str(Path(sys.executable).parent / "ft-accum"), "launch"]
    )
    cmd = [*prefix, "--config_file", str(config), "--main_process_port", str(free_port()), *script]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(FAULT_HOOKS),
           "FT_ACCUM_TEST_FSDP_ON_CPU": "1"}  # fmt: skip
    return cmd, env


def fsdp_launch(config: Path, runs: dict[Path, tuple[str, list[str]]], work_dir: Path) -> None:
    """One FSDP launch of every {output_dir: (recipe, arguments)} run, one after another
    (ft_accum.testing.runs_script: the processes import everything once)."""
    cmd, env = fsdp_command(config, runs_script(list(runs.values()), work_dir))
    result = run_with_stack_dump(cmd, env, timeout=300 * len(runs), cwd=ROOT)
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-5000:]}"
    banner = "FSDP (sharded parameters, gradients and optimizer state), 2 processes"
    assert result.stdout.count(banner) == len(runs), result.stdout[-3000:]
    for out in runs:
        results = json.loads((out / "all_results.json").read_text())
        assert results["distributed_type"] == "FSDP" and results["num_processes"] == 2, results


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    path = tmp_path_factory.mktemp("fsdp-docs")
    return {
        "train": write_jsonl(path / "train.jsonl", make_documents(17, seed=11)),  # windows of 8: the last holds 1
        "validation": write_jsonl(path / "validation.jsonl", make_documents(8, seed=12)),
    }


def lm_args(model_dir, data, out, micro, **settings):
    split = (
        {"per_device_train_batch_size": 8}
        if micro == 8
        else {"per_device_train_batch_size": 2, "effective_batch_size": 8}
    )
    return tiny_lm_args(model_dir, data, out, **SGD, **split, **settings)


def other_recipe_runs(root: Path, tiny_model_dir: Path, chat_model: Path) -> dict[str, tuple[str, list, list]]:
    """{name: (recipe, one-process arguments at 8 × 1, FSDP arguments at 2 × 2 × 2)} for the recipes
    FSDP serves besides the two above, each on a tiny model of its kind and 41 rows (13 pairs) that
    leave the last window short and uneven across the processes: BERT classifiers (sequence, tokens,
    a sentence pair's score), a T5 (its embedding shared by both stacks and the output layer:
    run_setup.fit_fsdp_units), DPO with LoRA (the reference is the policy with its adapters off) and
    GRPO with LoRA (3 updates of 8 completions, the rounds sampled on every rank)."""

    def files(name, rows):
        return {split: write_jsonl(root / f"{name}-{split}.jsonl", rows(n, seed=i))
                for i, (split, n) in enumerate((("train", 41), ("validation", 9)))}  # fmt: skip

    tagger, t5 = make_tiny_tagger(root / "tagger"), make_tiny_t5(root / "t5", tiny_model_dir)
    settings = {
        "text_classification": (tiny_model_dir, files("text", make_rows), {"max_seq_length": 48}),
        "token_classification": (tagger, files("tags", make_tagged_rows), {"max_seq_length": 64}),
        # Scores of 0 and 5 under a squared loss: at SGD's 0.5 the weights blow up (gradient norms of 1e5),
        # where fp32's summation order alone moves them by more than 1e-5.
        "sentence_pair_regression": (
            tiny_model_dir,
            files("pairs", make_sentence_pairs),
            {"max_seq_length": 48, "learning_rate": 0.01},
        ),
        "seq2seq": (t5, files("s2s", make_text_pairs), {"max_source_length": 48, "max_target_length": 16}),
        # GRPO with LoRA: rounds sampled on every rank, completions that stop early or run to the limit.
        "grpo": (
            make_tiny_chat_lm(root / "eos-lm", eos_scale=60),
            files("prompts", lambda n, seed: arithmetic_task(n, seed).to_list()),
            {
                "reward_funcs": "ft_accum.testing:varied_reward",
                "num_generations": 4,
                "max_completion_length": 8,
                "max_train_steps": 3,
                "use_lora": True,
            },
        ),  # fmt: skip
    }
    runs = {}
    for recipe, (model, data, extra) in settings.items():
        runs[recipe] = tuple(
            [recipe]
            + [recipe_args(model, data, root / recipe / name, **{**SGD, **extra, **split})
               for name, split in (("one", {"per_device_train_batch_size": 8}),
                                   ("fsdp", {"per_device_train_batch_size": 2, "effective_batch_size": 8}))]
        )  # fmt: skip
    pairs = {"train": write_jsonl(root / "prefs-train.jsonl", make_preference_pairs(13, seed=5)),
             "validation": write_jsonl(root / "prefs-val.jsonl", make_preference_pairs(5, seed=6))}  # fmt: skip
    runs["preference_tuning"] = (
        "preference_tuning",
        preference_args(chat_model, pairs, root / "dpo" / "one", "dpo", True, 8, 1),
        preference_args(chat_model, pairs, root / "dpo" / "fsdp", "dpo", True, 2, 2),
    )
    return runs


def output_of(args: list[str]) -> Path:
    return Path(next(a for a in args if a.startswith("--output_dir=")).split("=", 1)[1])


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory, tiny_llama_dir, tiny_model_dir, documents, fsdp_config):
    """Each run in one process and under FSDP, the FSDP runs in one launch:
    - causal LM full fine-tuning, 6 epochs of 17 documents (18 updates), one process at 8 × 1 and
      FSDP at 2 × 2 × 2, checkpointing every 4;
    - instruction-tuning LoRA (adapters sharded with the frozen base), on the instruction recipe's
      assistant-only token counts; the causal-LM recipe's LoRA is the same peft wrapping."""
    root = tmp_path_factory.mktemp("fsdp-runs")
    settings = {"num_train_epochs": 6, "checkpointing_steps": 4}
    chat_model = make_tiny_chat_lm(root / "chat-model")
    chats = {"train": write_jsonl(root / "train.jsonl", make_conversations(13, seed=3)),
             "validation": write_jsonl(root / "val.jsonl", make_conversations(4, seed=4))}  # fmt: skip

    def chat_args(out, micro, accumulation):
        return recipe_args(chat_model, chats, out, per_device_train_batch_size=micro,
                           gradient_accumulation_steps=accumulation, use_lora=True, max_seq_length=512,
                           exact_match_max_words=1, max_new_tokens=2, merge_lora=True, **SGD)  # fmt: skip

    run_in_process("causal_lm", lm_args(tiny_llama_dir, documents, root / "full" / "one", 8, **settings))
    run_in_process("instruction_tuning", chat_args(root / "lora" / "one", 8, 1))
    others = other_recipe_runs(root, tiny_model_dir, chat_model)
    for recipe, one, _ in others.values():
        run_in_process(recipe, one)
    fsdp_launch(
        fsdp_config,
        {
            root / "full" / "fsdp": (
                "causal_lm",
                lm_args(tiny_llama_dir, documents, root / "full" / "fsdp", 2, **settings),
            ),
            root / "lora" / "fsdp": ("instruction_tuning", chat_args(root / "lora" / "fsdp", 2, 2)),
            **{output_of(fsdp): (recipe, fsdp) for recipe, _, fsdp in others.values()},
        },
        root,
    )
    return root, settings, {name: (output_of(fsdp), output_of(one)) for name, (_, one, fsdp) in others.items()}


def test_full_fine_tuning_under_fsdp_matches_one_process(fsdp_runs):
    root, _, _ = fsdp_runs
    assert [m["samples_seen"] for m in read_metrics(root / "full" / "fsdp")][:3] == [8, 16, 17]
    assert_same_run(root / "full" / "fsdp", root / "full" / "one")


def test_instruction_tuning_lora_under_fsdp_matches_one_process(fsdp_runs):
    """The adapter, and the model it is merged into (--merge_lora: merge_and_unload on every rank, of
    the sharded weights, then one gathered save)."""
    root, _, _ = fsdp_runs
    assert_same_run(root / "lora" / "fsdp", root / "lora" / "one")
    merged, reference = (
        load_file(str(root / "lora" / run / "final_merged" / "model.safetensors")) for run in ("fsdp", "one")
    )
    assert relative_error(merged, reference) <= RTOL
    # the merge changed the base: the adapter's update is in the merged weights
    base = load_file(str(next((root / "chat-model").glob("*.safetensors"))))
    assert relative_error(base, reference) > 10 * RTOL


@pytest.mark.parametrize(
    "recipe",
    [
        "text_classification",
        "token_classification",
        "sentence_pair_regression",
        "seq2seq",
        "preference_tuning",
        "grpo",
    ],
)
def test_every_other_recipe_under_fsdp_matches_one_process(fsdp_runs, recipe):
    fsdp, one = fsdp_runs[2][recipe]
    assert [m["samples_seen"] for m in read_metrics(fsdp)] == [m["samples_seen"] for m in read_metrics(one)]
    # Every row once, the short last window counted exactly (41 rows, 13 pairs; GRPO: 3 updates of 8 completions).
    assert read_metrics(fsdp)[-1]["samples_seen"] in (41, 13, 24)
    assert any(m["grad_norm"] > 0 for m in read_metrics(fsdp))
    assert_same_run(fsdp, one)


def test_the_graceful_stop_under_fsdp(tmp_path, fsdp_runs, tiny_llama_dir, documents, fsdp_config):
    """killpg(SIGTERM) through ft-accum launch: both ranks stop at the same update, the sharded
    checkpoint is complete when the launcher returns, and the saved command resumes from it to the
    same final weights as the uninterrupted FSDP run, bit for bit (the resume of a sharded
    checkpoint: a periodic one is written by the same save)."""
    root, settings, _ = fsdp_runs
    out = tmp_path / "stopped"
    args = lm_args(tiny_llama_dir, documents, out, 2, **{**settings, "checkpointing_steps": None})
    cmd, env = fsdp_command(fsdp_config, recipe_script("causal_lm", args), "ft-accum")
    env["FT_ACCUM_SLOW_UPDATE_SECONDS"] = "0.3"  # 18 updates: long enough for the signal to land mid-run
    with open(tmp_path / "log", "w") as log:
        process = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 3):
        assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()[-3000:]
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(timeout=300) == 143, (tmp_path / "log").read_text()[-3000:]
    stopped_at = len(read_metrics(out))
    assert 3 <= stopped_at < 18
    assert [p.parent.name for p in (out / "checkpoints").glob("step_*/training_state.json")] == [
        f"step_{stopped_at:06d}"
    ]
    checkpoint = out / "checkpoints" / f"step_{stopped_at:06d}"
    assert any(p.name.startswith("pytorch_model_fsdp") for p in checkpoint.iterdir()), "not a sharded checkpoint"
    assert "Traceback" not in (tmp_path / "log").read_text()

    resume = (out / "resume_command.txt").read_text().strip()
    assert resume.startswith("ACCELERATE_USE_CPU=true ft-accum launch --config_file ")
    env["FT_ACCUM_SLOW_UPDATE_SECONDS"] = "0"
    resumed = subprocess.run(["bash", "-c", resume], env={**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"},
                             cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert resumed.returncode == 0, (resumed.returncode, resumed.stdout[-3000:], resumed.stderr[-3000:])
    assert json.loads((out / "all_results.json").read_text())["distributed_type"] == "FSDP"
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in read_metrics(root / "full" / "fsdp")]
    ours, theirs = final_weights(out), final_weights(root / "full" / "fsdp")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
