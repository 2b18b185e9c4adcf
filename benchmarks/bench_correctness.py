"""python benchmarks/bench_correctness.py

Relative gradient error ‖g − g*‖ / ‖g*‖ of each accumulation method against one full-batch
backward of the same loss, fp32, dropout 0, 4 micro-batches:

- padded LM: a tiny GPT-2 and a tiny Llama from configs, 16 documents of 12–62 words padded per
  micro-batch (4 × 4); the full-batch loss is the mean over all target tokens.
- classification, fixed length: a tiny BERT classifier, every input exactly 16 tokens, either
  16 samples as 4 × 4, or 14 samples as 4 + 4 + 4 + 2 (the short last window of an epoch); the
  full-batch loss is the mean over samples.

Methods: naive `loss / N`; Accelerate's default `accumulate()` + `backward()`; Accelerate's
`gradient_accumulation_for_autoregressive_models.py` (targets counted before the causal shift; LM
only); the Transformers Trainer (`gradient_accumulation_steps=4`, its gradient captured before the
optimizer step); and ft-accum's library functions as the recipes call them. Each method starts
from the same saved weights. Takes ~20 s on 2 CPU cores.
"""

import argparse
import json
import tempfile
from pathlib import Path

import torch

from ft_accum.testing import reset_accelerate_state

ROOT = Path(__file__).resolve().parents[1]

MICRO, ACCUMULATION = 4, 4


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in model.parameters()])


def accelerate_accumulate(model, micro_batches):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=len(micro_batches))
    model = accelerator.prepare(model)
    for batch in micro_batches:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
    reset_accelerate_state()


def trainer_gradient(model, rows, collate):
    """The gradient the Trainer hands to its optimizer for one update over all rows (LR 0, no clipping)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.grad = flat_grad(model).clone()

    capture = Capture()
    with tempfile.TemporaryDirectory() as out:
        # One update over all rows: the gradient is a sum over micro-batches, so the Trainer's shuffle only
        # changes which rows share a micro-batch, which matters exactly when a method weights micro-batches wrongly.
        args = TrainingArguments(
            out,
            per_device_train_batch_size=MICRO,
            gradient_accumulation_steps=ACCUMULATION,
            max_steps=1,
            learning_rate=0.0,
            max_grad_norm=0.0,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            seed=0,
        )
        Trainer(model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=[capture]).train()
    reset_accelerate_state()
    for p, g in zip(model.parameters(), torch.split(capture.grad, [p.numel() for p in model.parameters()])):
        p.grad = g.view_as(p).clone()


def errors_of(model_loader, reference_fn, methods) -> dict[str, dict[str, float]]:
    """Per method: the relative error, and ‖g‖ / ‖g*‖ (N = 4 means the loss was never divided by N)."""

    def grad_of(fn):
        model = model_loader()
        fn(model)
        return flat_grad(model)

    reference = grad_of(reference_fn)
    grads = {name: grad_of(fn) for name, fn in methods.items()}
    return {
        name: {
            "relative_error": float((g - reference).norm() / reference.norm()),
            "norm_ratio": float(g.norm() / reference.norm()),
        }
        for name, g in grads.items()
    }


def lm_errors(arch: str) -> dict[str, dict[str, float]]:
    """Padded variable-length LM: 16 documents, 4 micro-batches of 4."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling

    from ft_accum.core.loss_normalization import causal_lm_loss_sum
    from ft_accum.testing import make_documents, make_tiny_lm

    model_dir = make_tiny_lm(arch, Path(tempfile.mkdtemp()))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    collate = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    rows = [tokenizer(d["text"]) for d in make_documents(16, seed=21, min_words=12, max_words=62)]
    micro_batches = [collate(rows[i : i + MICRO]) for i in range(0, len(rows), MICRO)]

    def logits_of(model, batch):
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    def naive(model):
        for batch in micro_batches:
            (model(**batch).loss / len(micro_batches)).backward()

    def count_before_shift(
        model,
    ):  # Accelerate's examples/by_feature/gradient_accumulation_for_autoregressive_models.py
        count = sum(int((b["labels"] != -100).sum()) for b in micro_batches)
        for batch in micro_batches:
            (causal_lm_loss_sum(logits_of(model, batch), batch["labels"])[0] / count).backward()

    def ours(model):  # recipes/causal_lm.py: targets counted after the shift first, then loss sums × the window scale
        from ft_accum.core.loss_normalization import window_loss_scale

        targets = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro_batches)
        scale = window_loss_scale(targets, len(micro_batches), 1)
        for batch in micro_batches:
            loss_sum, _ = causal_lm_loss_sum(logits_of(model, batch), batch["labels"])
            (loss_sum * scale / len(micro_batches)).backward()  # ÷N: what accelerator.backward divides by

    methods = {
        "naive `loss / N`": naive,
        "Accelerate `accumulate()` + `backward()`": lambda m: accelerate_accumulate(m, micro_batches),
        "Accelerate autoregressive example (count before the shift)": count_before_shift,
        "Transformers Trainer": lambda m: trainer_gradient(m, rows, collate),
        "ft-accum": ours,
    }
    return errors_of(
        lambda: AutoModelForCausalLM.from_pretrained(model_dir), lambda m: m(**collate(rows)).loss.backward(), methods
    )


def classification_errors(num_samples: int) -> dict[str, dict[str, float]]:
    """Fixed-length classification: every input is 16 tokens, so padding plays no part."""
    from transformers import BertConfig, BertForSequenceClassification, default_data_collator

    from ft_accum.core.loss_normalization import window_loss_scale

    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(5, 100, (num_samples, 16), generator=generator)
    labels = torch.randint(0, 4, (num_samples,), generator=generator)
    rows = [
        {"input_ids": i, "attention_mask": torch.ones(16, dtype=torch.long), "labels": y} for i, y in zip(ids, labels)
    ]
    micro_batches = [default_data_collator(rows[i : i + MICRO]) for i in range(0, num_samples, MICRO)]
    path = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    BertForSequenceClassification(
        BertConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=4,
        )
    ).save_pretrained(path)

    def naive(model):
        for batch in micro_batches:
            (model(**batch).loss / len(micro_batches)).backward()

    def ours(model):  # recipes/text_classification.py: the window's samples counted first, summed loss × scale
        scale = window_loss_scale(num_samples, len(micro_batches), 1)
        for batch in micro_batches:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss_sum = torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="sum")
            (loss_sum * scale / len(micro_batches)).backward()  # ÷N: what accelerator.backward divides by

    methods = {
        "naive `loss / N`": naive,
        "Accelerate `accumulate()` + `backward()`": lambda m: accelerate_accumulate(m, micro_batches),
        "Transformers Trainer": lambda m: trainer_gradient(m, rows, default_data_collator),
        "ft-accum": ours,
    }
    return errors_of(
        lambda: BertForSequenceClassification.from_pretrained(path),
        lambda m: m(**default_data_collator(rows)).loss.backward(),
        methods,
    )


def measure(quick: bool = False) -> dict:
    """All columns of the correctness table (quick changes nothing: the models are already tiny)."""
    return {
        "setup": {
            "precision": "fp32",
            "micro_batch": MICRO,
            "gradient_accumulation_steps": ACCUMULATION,
            "dropout": 0.0,
        },
        "columns": {
            "LM, padded, GPT-2": lm_errors("gpt2"),
            "LM, padded, Llama": lm_errors("llama"),
            "classification, fixed length, 4 × 4": classification_errors(16),
            "classification, fixed length, 4+4+4+2": classification_errors(14),
        },
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "correctness.json")
    args = parser.parse_args()
    results = measure()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    for column, errors in results["columns"].items():
        print(column, {k: f"{v['relative_error']:.1e} (norm × {v['norm_ratio']:.2f})" for k, v in errors.items()})


if __name__ == "__main__":
    main()
