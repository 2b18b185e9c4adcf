"""Preference tuning against TRL: how far accumulation moves each toolkit's update (issue 28).

    pip install trl==1.16.0          # a benchmark dependency only ([bench] extra), never a runtime one
    python benchmarks/bench_trl_preference.py [--output benchmarks/results/trl_preference.json]

The same tiny Llama (SmolLM2-135M-Instruct's tokenizer and chat template, 2 layers of width 32,
from `ft_accum.testing.make_tiny_chat_lm`), the same pairs in TRL's conversational format
(responses of one word against 20–40 words), fp32 on the CPU, SGD, a constant LR, no clipping, one
epoch, the pairs in one fixed order for TRL (a sequential sampler) and one seeded order for ours.

1. At (8 × 1), full fine-tuning with a frozen reference: the first update's loss, rewards and
   gradient norm, ours against TRL's `DPOTrainer` and against DPO written out in plain PyTorch
   (full logits, one sequence at a time).
2. For DPO (full, frozen reference) and ORPO (TRL's `experimental.orpo.ORPOTrainer`), each split
   against the same toolkit's full batch of the same size: (2 × 4) and (4 × 2) on 8 pairs, (3 × 2)
   on 10 pairs (its last window holds micro-batches of 3 and 1 pairs) against (6 × 1), and
   (4 × 3) on 10 pairs (4, 4, 2) against (12 × 1). The figure is ‖θ_split − θ_full‖ / ‖θ_full − θ₀‖:
   how far the split's weights end from the full batch's, as a fraction of how far training moved
   them. Exact accumulation gives fp32 rounding (~1e-7).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ft_accum.testing import (  # noqa: E402
    make_preference_pairs,
    make_tiny_chat_lm,
    reset_accelerate_state,
    run_in_process,
    write_jsonl,
)

LEARNING_RATE = 0.5
SPLITS = [((2, 4), 8), ((4, 2), 8), ((3, 2), 10), ((4, 3), 10)]  # ((micro, accumulation), pairs)


def conversational_pairs(n: int) -> list[dict]:
    """make_preference_pairs as turns throughout (one Arrow type per column, as TRL needs)."""

    def turns(value, role):
        return value if isinstance(value, list) else [{"role": role, "content": value}]

    return [
        {"prompt": turns(r["prompt"], "user"), "chosen": turns(r["chosen"], "assistant"),
         "rejected": turns(r["rejected"], "assistant")}
        for r in make_preference_pairs(n, seed=21)
    ]  # fmt: skip


def trainable_vector(model) -> torch.Tensor:
    return torch.cat([p.detach().double().flatten() for p in model.parameters() if p.requires_grad])


def trl_run(loss: str, model_dir: Path, pairs: list[dict], micro: int, accumulation: int, work: Path):
    """(final trainable weights, the Trainer's log of the first update)."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if loss == "dpo":
        from trl import DPOConfig as Config
        from trl import DPOTrainer as Trainer
    else:
        from trl.experimental.orpo import ORPOConfig as Config
        from trl.experimental.orpo import ORPOTrainer as Trainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = Config(
        output_dir=str(work / f"trl-{loss}-{micro}x{accumulation}"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation, learning_rate=LEARNING_RATE, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=1e9, num_train_epochs=1, logging_steps=1, save_strategy="no",
        report_to=[], beta=0.1, use_cpu=True, max_length=512, seed=0, disable_tqdm=True,
        # TRL's configs default to bf16=True, which autocasts on the CPU too: like for like with ours is fp32.
        bf16=False,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=config, train_dataset=Dataset.from_list(pairs),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )  # fmt: skip
    trainer._get_train_sampler = lambda *args, **kwargs: SequentialSampler(trainer.train_dataset)
    assert trainer.accelerator.mixed_precision == "no", trainer.accelerator.mixed_precision
    try:
        trainer.train()
    finally:
        reset_accelerate_state()
    first = next(entry for entry in trainer.state.log_history if "loss" in entry)
    return trainable_vector(model), first


def our_run(loss: str, model_dir: Path, pairs_file: Path, micro: int, accumulation: int, pairs: int, work: Path):
    """(final weights, the first update's metrics.jsonl record)."""
    from safetensors.torch import load_file

    out = work / f"ours-{loss}-{micro}x{accumulation}-{pairs}"
    run_in_process(
        "preference_tuning",
        [f"--model_name_or_path={model_dir}", f"--train_file={pairs_file}", f"--validation_file={pairs_file}",
         f"--output_dir={out}", f"--loss={loss}", f"--per_device_train_batch_size={micro}",
         f"--gradient_accumulation_steps={accumulation}", f"--max_train_samples={pairs}", "--max_eval_samples=2",
         "--optim=sgd", f"--learning_rate={LEARNING_RATE}", "--lr_scheduler_type=constant", "--max_grad_norm=0",
         "--num_warmup_steps=0", "--weight_decay=0", "--lr_scaling=none", "--num_train_epochs=1",
         "--max_seq_length=512", "--seed=0", "--report_to=none", "--config=none"],
    )  # fmt: skip
    weights = load_file(str(out / "final" / "model.safetensors"))
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    return torch.cat([weights[k].double().flatten() for k in sorted(weights)]), first


def plain_pytorch_first_update(model_dir: Path, pairs: list[dict], beta: float = 0.1) -> dict:
    """DPO's loss and gradient norm over `pairs` in one full batch, written out in plain PyTorch (full
    logits, one sequence at a time, a frozen copy as the reference): what both toolkits should give."""
    import copy

    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ft_accum.data import chat_data

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    reference = copy.deepcopy(model).eval()

    def log_prob(m, prompt, response):
        ids, labels = chat_data.response_labels(tokenizer, prompt, response)
        logits = m(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        targets = torch.tensor(labels[1:])
        kept = targets != -100
        return logits.log_softmax(-1)[kept].gather(1, targets[kept].unsqueeze(1)).sum()

    losses = []
    for row in pairs:
        prompt, chosen, rejected = chat_data.preference_conversations(
            row, "explicit", ("prompt", "chosen", "rejected"), ""
        )
        policy = log_prob(model, prompt, chosen) - log_prob(model, prompt, rejected)
        with torch.no_grad():
            ref = log_prob(reference, prompt, chosen) - log_prob(reference, prompt, rejected)
        losses.append(-F.logsigmoid(beta * (policy - ref)))
    loss = torch.stack(losses).mean()
    loss.backward()
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None))
    return {"loss": float(loss), "grad_norm": float(norm)}


def fraction(split: torch.Tensor, full: torch.Tensor, start: torch.Tensor) -> float:
    return float((split - full).norm() / (full - start).norm())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "trl_preference.json")
    options = parser.parse_args(argv)
    import trl
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    work = Path(tempfile.mkdtemp(prefix="bench-trl-"))
    model_dir = make_tiny_chat_lm(work / "model")
    start_model = AutoModelForCausalLM.from_pretrained(model_dir)
    trl_start = trainable_vector(start_model)
    ours_start_state = load_file(str(next(model_dir.glob("*.safetensors"))))
    ours_start = torch.cat([ours_start_state[k].double().flatten() for k in sorted(ours_start_state)])
    results = {"trl_version": trl.__version__, "learning_rate": LEARNING_RATE, "first_update_8x1": {}, "splits": []}

    full_runs = {}
    for loss in ("dpo", "orpo"):
        for (micro, accumulation), n in SPLITS:
            pairs = conversational_pairs(n)
            pairs_file = write_jsonl(work / f"pairs-{n}.jsonl", pairs)
            full_micro = micro * accumulation
            if (loss, full_micro, n) not in full_runs:  # (2 × 4) and (4 × 2) share their (8 × 1)
                full_runs[loss, full_micro, n] = (
                    trl_run(loss, model_dir, pairs, full_micro, 1, work),
                    our_run(loss, model_dir, pairs_file, full_micro, 1, n, work),
                )
            (trl_full, trl_first), (ours_full, ours_first) = full_runs[loss, full_micro, n]
            trl_split, _ = trl_run(loss, model_dir, pairs, micro, accumulation, work)
            ours_split, _ = our_run(loss, model_dir, pairs_file, micro, accumulation, n, work)
            row = {
                "loss": loss, "split": f"{micro} × {accumulation}", "against": f"{full_micro} × 1", "pairs": n,
                "trl": fraction(trl_split, trl_full, trl_start), "ft_accum": fraction(ours_split, ours_full, ours_start),
            }  # fmt: skip
            results["splits"].append(row)
            print(f"{loss} {row['split']} on {n} pairs against {row['against']}: TRL {row['trl']:.2e}, "
                  f"ft-accum {row['ft_accum']:.2e} of the update", flush=True)  # fmt: skip
            if loss == "dpo" and (micro, accumulation) == (2, 4):
                results["first_update_8x1"] = {
                    "trl": {k: trl_first.get(k) for k in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected")},
                    "ft_accum": {k: ours_first.get(k) for k in ("loss", "grad_norm", "rewards_chosen", "rewards_rejected")},
                    "plain_pytorch": plain_pytorch_first_update(model_dir, pairs),
                }  # fmt: skip
    options.output.parent.mkdir(parents=True, exist_ok=True)
    options.output.write_text(json.dumps(results, indent=2))
    print(json.dumps(results["first_update_8x1"], indent=2))
    return results


if __name__ == "__main__":
    main()
