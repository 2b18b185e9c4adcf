"""DS_ACCELERATOR=cpu accelerate launch --config_file accelerate_configs/deepspeed_zero2.yaml --mixed_precision no benchmarks/deepspeed_cpu_probe.py

What DeepSpeed's own loss scaling does to accumulated gradients, measured with real DeepSpeed
ZeRO-2 on 2 CPU processes (gloo). Not a recipe: Accelerate 1.15 gives a CPU-only DeepSpeed run no
process group of its own (`_prepare_backend` returns no backend without CUDA, so each process
reports one process and the recipes refuse to start), and this probe passes
`InitProcessGroupKwargs(backend="gloo")` to get one. Needs `pip install deepspeed` (0.19.8 built
with DS_BUILD_OPS=0; it also wants hjson, ninja, py-cpuinfo, msgpack, einops).

A tiny GPT-2 from a config, fp32, dropout 0; 8 padded documents of 12–62 words per update, as
2 processes × micro-batch 2 × accumulation 2. DeepSpeed steps inside `accelerator.backward` at the
window's end, so gradients cannot be rescaled afterwards; what it reports is the global gradient
norm of the window, compared here with ‖g*‖ of one full-batch backward of the token-mean loss:

- accelerate default:  `accelerator.backward(model(**batch).loss)`: DeepSpeed divides by the
                        accumulation steps itself (`scale_wrt_gas`), so each micro-batch's token
                        mean weighs the same, whatever its token count;
- ft-accum as the recipes run it: `backward(loss_sum / micro)`, then a window scale DeepSpeed
                        never sees (it has already stepped);
- window-count loss:   the window's target count T counted before its first backward (the
                        Trainer's `num_items_in_batch`; transformers PR #35808 turns off
                        DeepSpeed's own division instead): `backward(loss_sum · N · P / T)`.

Prints one JSON line from process 0: the norm ratios ‖g‖ / ‖g*‖ of each method. Measured
2026-11-29 (DeepSpeed 0.19.8, accelerate 1.15, torch 2.13 CPU; the shipped zero2 config with
mixed_precision "no" and gradient_clipping 0): accelerate default 1.0017, ft-accum as the recipes
run it 31.25 (= T / (c·N·P): the window scale never reaches DeepSpeed), window-count loss 1.0000004.
The recipes therefore refuse DeepSpeed when their loss is a mean over tokens
(`run_outputs.check_accelerator`).
"""

import json
import sys
import tempfile
from pathlib import Path

import torch

from ft_accum.testing import reset_accelerate_state

ROOT = Path(__file__).resolve().parents[1]

MICRO, ACCUMULATION = 2, 2


def main():
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling

    from ft_accum.core.loss_normalization import causal_lm_loss_sum
    from ft_accum.testing import make_documents, make_tiny_lm

    model_dir = make_tiny_lm("gpt2", Path(tempfile.mkdtemp()))  # deterministic: every process builds the same one
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    collate = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    rows = [tokenizer(d["text"]) for d in make_documents(8, seed=21, min_words=12, max_words=62)]

    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    reference(**collate(rows)).loss.backward()
    reference_norm = float(torch.cat([p.grad.flatten() for p in reference.parameters()]).norm())

    ratios = {}
    for method in ("accelerate default", "ft-accum as the recipes run it", "window-count loss"):
        accelerator = Accelerator(
            gradient_accumulation_steps=ACCUMULATION, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")]
        )
        if accelerator.num_processes != 2 or accelerator.distributed_type.value != "DEEPSPEED":
            sys.exit(
                f"error: expected DeepSpeed on 2 processes, got {accelerator.distributed_type.value} on {accelerator.num_processes}"
            )
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = (
            MICRO  # no DataLoader to read it from
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
        model, optimizer = accelerator.prepare(model, optimizer)
        rank = accelerator.process_index
        micro_batches = [collate(rows[4 * rank + 2 * m : 4 * rank + 2 * m + 2]) for m in range(ACCUMULATION)]
        window_targets = sum(int((collate(rows[i : i + 2])["labels"][:, 1:] != -100).sum()) for i in range(0, 8, 2))
        for batch in micro_batches:
            with accelerator.accumulate(model):
                if method == "accelerate default":
                    loss = model(**batch).loss
                else:
                    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                    loss_sum, _ = causal_lm_loss_sum(logits, batch["labels"])
                    loss = (
                        loss_sum / MICRO
                        if method.startswith("ft-accum")
                        else loss_sum * ACCUMULATION * accelerator.num_processes / window_targets
                    )
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        ratios[method] = float(accelerator.deepspeed_engine_wrapped.get_global_grad_norm()) / reference_norm
        accelerator.free_memory()
        reset_accelerate_state()
    if rank == 0:
        print(json.dumps({"reference_grad_norm": reference_norm, "grad_norm_ratio": ratios}))


if __name__ == "__main__":
    main()
