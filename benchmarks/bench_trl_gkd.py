"""Distillation against TRL's GKDTrainer: how far each toolkit's update is from the full-batch formula (issue 56).

    pip install trl==1.16.0          # a benchmark dependency only ([bench] extra), never a runtime one
    python benchmarks/bench_trl_gkd.py [--output benchmarks/results/trl_gkd.json]

Both toolkits distil the same teacher (a 2-layer, width-32 Llama with SmolLM2-135M-Instruct's
tokenizer and chat template, `ft_accum.testing.make_tiny_chat_lm`) into the same student (its
second layer alone, every weight moved by 0.05 · N(0, 1), so that the divergence is far from 0), on
the same 20 conversations of unequal lengths (`make_conversations`: one-word answers, 20–40-word
answers, two-turn chats), tokenized once by our chat_data with assistant-only labels: TRL's trainer
gets those very rows through its `data_collator`. Off-policy (λ = 0), the generalized JSD at β 0.5,
τ 1, fp32 on the CPU, SGD (momentum 0.9) at a constant LR, no clipping, one epoch: at 2 × 4 that is
micro-batches of 2 rows in windows of 4, 4 and 2 (the short last window).

Each toolkit's micro-batches are recorded as it trains them (which rows), and the full-batch formula
is replayed on that same partition, one unpadded sequence at a time in plain PyTorch: each update's
loss is Σ JSD over all of its assistant tokens ÷ their number, then an SGD step. The figure is
‖θ_toolkit − θ_formula‖ / ‖θ_formula − θ₀‖: how far the toolkit ends from the formula, as a fraction of
how far training moved the weights. Exact accumulation gives fp32 rounding (~1e-6).

Then the time per update, ours over TRL's, on a wider pair (teacher width 256, 2 layers; the student
its second layer) at 2 × 4: the same rows, the same SGD, each toolkit's whole train loop (train_runtime).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ft_accum.core.distillation_loss import token_divergences  # noqa: E402
from ft_accum.data import chat_data  # noqa: E402
from ft_accum.models.layer_selection import student_from_teacher  # noqa: E402
from ft_accum.testing import (  # noqa: E402
    final_weights,
    load_recipe,
    make_conversations,
    make_tiny_chat_lm,
    reset_accelerate_state,
    write_jsonl,
)
from ft_accum.training import on_policy  # noqa: E402

BETA, LEARNING_RATE, MOMENTUM, EFFECTIVE, ROWS, MAX_LENGTH, MAX_NEW_TOKENS = 0.5, 0.5, 0.9, 8, 20, 128, 16
SPLITS = [(8, 1), (2, 4), (4, 2)]


def make_pair(tmp: Path, width: int) -> tuple[Path, Path]:
    """(teacher dir, student dir): the student is the teacher's second layer, its weights moved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher_dir = make_tiny_chat_lm(tmp / f"teacher-{width}", width=width)
    student, _ = student_from_teacher(AutoModelForCausalLM.from_pretrained(teacher_dir), 1)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in student.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    student_dir = tmp / f"student-{width}"
    student.save_pretrained(student_dir)
    AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(student_dir)
    return teacher_dir, student_dir


def tokenized_rows(model_dir: Path, conversations: list[dict]) -> list[dict]:
    """The rows both toolkits train on: our chat tokenization, assistant tokens labelled."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chats = chat_data.tokenize_chats(tokenizer, [c["messages"] for c in conversations], MAX_LENGTH)
    assert len(chats.rows) == len(conversations) and not chats.truncated
    return chats.rows


# ---- the full-batch formula, replayed on a toolkit's recorded partition ----


def recorded_rows(batch: dict) -> list[tuple]:
    """A micro-batch as it was trained, row by row: (input ids, attention mask, labels), padding kept, so the
    replay sees each row at the positions it was trained at (TRL pads its on-policy prompts on the left)."""
    return [
        (batch["input_ids"][i].tolist(), batch["attention_mask"][i].tolist(), batch["labels"][i].tolist())
        for i in range(len(batch["input_ids"]))
    ]


def formula_weights(teacher_dir, student_dir, updates: list[list[tuple]]) -> dict[str, torch.Tensor]:
    """θ after SGD on each update's full-batch loss: Σ JSD(β) over its rows' assistant tokens ÷ their number."""
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    student = AutoModelForCausalLM.from_pretrained(student_dir)
    optimizer = torch.optim.SGD(student.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    for update in updates:
        optimizer.zero_grad()
        total, tokens = 0.0, 0
        for ids, mask, labels in update:
            inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.tensor([mask])}
            counted = torch.tensor(labels[1:]) != -100  # position t predicts token t + 1
            with torch.no_grad():
                teacher_logits = teacher(**inputs).logits[0, :-1][counted]
            student_logits = student(**inputs).logits[0, :-1][counted]
            total = total + token_divergences(student_logits, teacher_logits, beta=BETA).sum()
            tokens += int(counted.sum())
        (total / tokens).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in student.state_dict().items()}


def group_updates(micro_batches: list[list], accumulation: int) -> list[list]:
    """The updates from the recorded micro-batches: `accumulation` at a time, the last window short."""
    return [sum(micro_batches[i : i + accumulation], []) for i in range(0, len(micro_batches), accumulation)]


def distance(ours: dict, formula: dict, start: dict) -> float:
    keys = [k for k in formula if k in ours]
    off = sum(float((ours[k].double() - formula[k].double()).pow(2).sum()) for k in keys) ** 0.5
    moved = sum(float((formula[k].double() - start[k].double()).pow(2).sum()) for k in keys) ** 0.5
    return off / moved


# ---- the two toolkits, each recording the micro-batches it trains ----


def trl_run(teacher_dir, student_dir, rows, micro, accumulation, work, lmbda=0.0):
    """(final weights, recorded micro-batches, train seconds, updates) of TRL's GKDTrainer."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    recorded, collate = [], chat_data.collate_chats(tokenizer.pad_token_id, packed=False)

    def collator(examples):  # our tokenized rows, so both toolkits see the same tokens and labels
        batch = collate([rows[e["row"]] for e in examples])
        # GKD's on-policy step samples from `prompts`, left-padded: each row up to its last answer.
        prompts = [
            rows[e["row"]]["input_ids"][: on_policy.last_answer_start(rows[e["row"]]["labels"])] for e in examples
        ]
        width = max(map(len, prompts))
        batch["prompts"] = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
        batch["prompt_attention_mask"] = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        return batch

    config = GKDConfig(
        output_dir=str(work), per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        num_train_epochs=1, learning_rate=LEARNING_RATE, optim="sgd", optim_args=f"momentum={MOMENTUM}",
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, lmbda=lmbda, beta=BETA,
        temperature=1.0, seq_kd=False, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", seed=0,
        disable_tqdm=True, gradient_checkpointing=False, bf16=False, max_length=MAX_LENGTH, dataloader_drop_last=False,
        max_new_tokens=MAX_NEW_TOKENS,
    )  # fmt: skip
    torch.manual_seed(0)
    student = AutoModelForCausalLM.from_pretrained(student_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=config, data_collator=collator,
                         train_dataset=Dataset.from_list([{"row": i} for i in range(len(rows))]),
                         processing_class=tokenizer)  # fmt: skip
    compute_loss = trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):  # after the on-policy step replaced the answers
        recorded.append(recorded_rows(inputs))
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = recording
    seconds = trainer.train().metrics["train_runtime"]
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    reset_accelerate_state()
    return weights, recorded, seconds, trainer.state.global_step


def our_run(teacher_dir, student_dir, files, micro, accumulation, work, lmbda=0.0):
    """(final weights, recorded micro-batches, train seconds, updates) of recipes/distillation.py."""
    recipe = load_recipe("distillation")
    recorded, training_step = [], recipe.training_step

    def recording(model, teacher, batch, distill):
        recorded.append(recorded_rows(batch))
        return training_step(model, teacher, batch, distill)

    flags = {
        "teacher_name_or_path": teacher_dir, "model_name_or_path": student_dir, "train_file": files["train"],
        "validation_file": files["validation"], "beta": BETA, "alpha": 0.0, "temperature": 1.0, "lmbda": lmbda,
        "per_device_train_batch_size": micro, "effective_batch_size": EFFECTIVE, "optim": "sgd",
        "learning_rate": LEARNING_RATE, "lr_scaling": "none", "lr_scheduler_type": "constant", "num_warmup_steps": 0,
        "weight_decay": 0.0, "max_grad_norm": 0, "num_train_epochs": 1, "max_seq_length": MAX_LENGTH,
        "max_completion_length": MAX_NEW_TOKENS, "max_new_tokens": 2, "output_dir": work, "report_to": "none", "seed": 0,
    }  # fmt: skip
    recipe.training_step = recording
    try:
        recipe.main(["--config=none", *(f"--{k}={v}" for k, v in flags.items())])
    finally:
        reset_accelerate_state()
    results = json.loads((Path(work) / "all_results.json").read_text())
    return final_weights(Path(work)), recorded, results["train_runtime"], results["num_update_steps"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    parser.add_argument("--timing_repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        conversations = make_conversations(ROWS, seed=1)
        files = {"train": write_jsonl(tmp / "train.jsonl", conversations),
                 "validation": write_jsonl(tmp / "val.jsonl", make_conversations(4, seed=2))}  # fmt: skip
        teacher_dir, student_dir = make_pair(tmp, 32)
        rows = tokenized_rows(student_dir, conversations)
        counted = [sum(label != -100 for label in row["labels"][1:]) for row in rows]
        print(f"{len(rows)} conversations of {min(map(len, (r['input_ids'] for r in rows)))}–"
              f"{max(map(len, (r['input_ids'] for r in rows)))} tokens, {min(counted)}–{max(counted)} assistant tokens")  # fmt: skip
        start = AutoModelForCausalLM.from_pretrained(student_dir).state_dict()
        cases = [(lmbda, split) for lmbda in (0.0, 1.0) for split in (SPLITS if lmbda == 0 else SPLITS[1:2])]
        for toolkit in ("TRL", "ours"):
            for lmbda, (micro, accumulation) in cases:
                work = tmp / f"{toolkit}-{lmbda}-{micro}"
                run = trl_run if toolkit == "TRL" else our_run
                data = rows if toolkit == "TRL" else files
                weights, recorded, _, steps = run(teacher_dir, student_dir, data, micro, accumulation, work, lmbda)
                updates = group_updates(recorded, accumulation)
                assert len(updates) == steps == math.ceil(ROWS / EFFECTIVE), (toolkit, len(recorded), steps)
                assert sum(map(len, updates)) == ROWS, "a row was trained twice or not at all"
                error = distance(weights, formula_weights(teacher_dir, student_dir, updates), start)
                rows_out.append({"toolkit": toolkit, "lmbda": lmbda, "split": f"{micro} × {accumulation}",
                                 "off_the_formula": error, "window_rows": [len(u) for u in updates]})  # fmt: skip
                print(f"{toolkit:5s} λ {lmbda:g} {micro} × {accumulation} (windows of {[len(u) for u in updates]} "
                      f"rows): {100 * error:.4g}% of the update off the formula", flush=True)  # fmt: skip

        wide_teacher, wide_student = make_pair(tmp, 256)
        seconds = {"TRL": [], "ours": []}
        for repeat in range(args.timing_repeats):
            run = trl_run(wide_teacher, wide_student, rows, 2, 4, tmp / f"t-trl-{repeat}")
            seconds["TRL"].append(run[2] / run[3])
            run = our_run(wide_teacher, wide_student, files, 2, 4, tmp / f"t-ours-{repeat}")
            seconds["ours"].append(run[2] / run[3])
        timing = {k: statistics.median(v) for k, v in seconds.items()}
        timing["ours_over_trl"] = timing["ours"] / timing["TRL"]
        timing["all_seconds_per_update"] = seconds
        print(f"time per update at 2 × 4, width 256: ours {timing['ours']:.3f} s, TRL {timing['TRL']:.3f} s, "
              f"ours / TRL = {timing['ours_over_trl']:.2f}")  # fmt: skip

    import trl

    result = {"trl_version": trl.__version__, "torch_version": torch.__version__, "rows": rows_out,
              "time_per_update": timing}  # fmt: skip
    if args.output:
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
