"""peft's LoRA variants in every recipe that has --use_lora (issue 28): --use_rslora, --use_dora
and LoRA+ (--loraplus_lr_ratio). Each takes effect (the scale, the magnitude vectors, the B
matrices' LR through the schedule) and each keeps (8 × 1) = (2 × 4) exact, with a short last
window, and an exact resume, through `ft-accum check` on a recipe that has the flag."""

import math

import pytest
from conftest import ROOT, error_of, make_documents, tiny_lm_args, write_jsonl

from ft_accum.cli.check import check, format_table
from ft_accum.core.batch_arithmetic import BatchPlan
from ft_accum.models.lora import LoraSettings, apply_lora
from ft_accum.testing import make_conversations, make_preference_pairs
from ft_accum.training.arguments import TrainingArguments
from ft_accum.training.run_setup import build_optimizer
from ft_accum.training.update_plan import set_peak_learning_rate


def lora_model(model_dir, **variant):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return apply_lora(model, LoraSettings(r=4, alpha=8, dropout=0.0, target_modules="all-linear", **variant), False)


def test_rslora_scales_by_alpha_over_the_square_root_of_the_rank(tiny_llama_dir):
    from peft.tuners.lora import LoraLayer

    def scales(model):
        return sorted({round(m.scaling["default"], 9) for m in model.modules() if isinstance(m, LoraLayer)})

    assert scales(lora_model(tiny_llama_dir, use_rslora=True)) == [round(8 / math.sqrt(4), 9)]
    assert scales(lora_model(tiny_llama_dir)) == [8 / 4]


def test_dora_trains_a_magnitude_per_output_feature(tiny_llama_dir):
    trainable = {n for n, p in lora_model(tiny_llama_dir, use_dora=True).named_parameters() if p.requires_grad}
    magnitudes = {n for n in trainable if "lora_magnitude_vector" in n}
    assert magnitudes and len(magnitudes) == len({n for n in trainable if "lora_A" in n})


def test_loraplus_keeps_the_b_matrices_at_ratio_times_the_lr_through_the_schedule(tiny_llama_dir):
    """B's LR is 16 × A's at every update: under the linear decay, and after an accumulation
    schedule re-scales the peak LR (which once set every group to the same LR)."""
    from transformers import get_scheduler

    model = lora_model(tiny_llama_dir)
    args = TrainingArguments(optim="sgd", weight_decay=0.0, learning_rate=1e-3)  # no --base_batch_size: not scaled
    plan = BatchPlan(micro=4, accumulation=2, processes=1)
    optimizer = build_optimizer(model, args, plan=plan, no_decay=("bias",), loraplus_lr_ratio=16.0)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    b = next(p for n, p in model.named_parameters() if "lora_B" in n)
    a = next(p for n, p in model.named_parameters() if "lora_A" in n)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=10)
    for step in range(6):
        assert group_of[id(b)]["lr"] == pytest.approx(16 * group_of[id(a)]["lr"]), step
        optimizer.step()
        scheduler.step()
        if step == 2:
            set_peak_learning_rate(optimizer, scheduler, 4e-3)
    assert group_of[id(a)]["lr"] == pytest.approx(4e-3 * 4 / 10)


def test_a_variant_without_use_lora_is_one_error_line(tmp_path, tiny_llama_dir, lm_data_files):
    for flag in ("--use_dora", "--use_rslora", "--loraplus_lr_ratio=16"):
        message = error_of("causal_lm", [*tiny_lm_args(tiny_llama_dir, lm_data_files, tmp_path), flag])
        assert flag.split("=")[0] in message and "needs --use_lora" in message, message
    message = error_of("causal_lm", [*tiny_lm_args(tiny_llama_dir, lm_data_files, tmp_path), "--use_lora",
                                     "--loraplus_lr_ratio=0.5"])  # fmt: skip
    assert "≥ 1" in message


@pytest.mark.parametrize(
    "recipe, variant",
    [
        ("causal_lm", "--use_rslora"),
        ("instruction_tuning", "--use_dora"),
        ("preference_tuning", "--loraplus_lr_ratio=16"),
    ],
)
def test_each_variant_accumulates_exactly_and_resumes(recipe, variant, tmp_path, tiny_llama_dir, chat_lm_dir):
    """`ft-accum check`: (8 × 1) = (2 × 4) in every update's loss and gradient norm and the final
    adapter (≤ 1e-5) on 20 rows (windows of 8, 8, 4), and a bit-identical resume."""
    if recipe == "causal_lm":
        data = {"train": write_jsonl(tmp_path / "train.jsonl", make_documents(24, seed=11)),
                "validation": write_jsonl(tmp_path / "val.jsonl", make_documents(4, seed=12))}  # fmt: skip
        flags = [f for f in tiny_lm_args(tiny_llama_dir, data, tmp_path) if not f.startswith("--output_dir")]
    else:
        make = make_conversations if recipe == "instruction_tuning" else make_preference_pairs
        flags = [f"--model_name_or_path={chat_lm_dir}", "--max_seq_length=96",
                 f"--train_file={write_jsonl(tmp_path / 'train.jsonl', make(24, seed=5))}",
                 f"--validation_file={write_jsonl(tmp_path / 'val.jsonl', make(4, seed=6))}"]  # fmt: skip
        flags += ["--max_new_tokens=2"] if recipe == "instruction_tuning" else []
    # fsdp=False: the end of a run under FSDP is tests/test_engines.py's, for every recipe.
    results = check(ROOT / "recipes" / f"{recipe}.py", [*flags, "--use_lora", "--lora_r=4", variant], fsdp=False)
    assert all(r.passed for r in results), format_table(results)
