"""GPU check 3: every cell of the README's 12 GB table that the planner says fits runs 2 updates under the cap."""

from collections.abc import Iterator
from pathlib import Path

import torch

from ft_accum.testing.gpu_checks.common import CAP_GIB, DRY_RUN_VOCAB, lm_args, random_model_dir, recipe_run


def dry_run_cells(models: Path) -> list[dict]:
    """Tiny stand-ins for plan_12gb.json's cells, one per branch of check_12gb_table (each recipe, and
    the low-memory modes of the causal LM), to test it on CPU."""
    from ft_accum.planner.configs import load_model_config

    cells = []
    for name, task, seq_len, shrink in (
        ("bert-base-uncased", "text_classification", 32, {"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128}),
        ("t5-base", "seq2seq", 32, {"num_layers": 1, "num_decoder_layers": 1, "d_model": 64, "d_ff": 128, "num_heads": 2, "d_kv": 32}),
    ):  # fmt: skip
        config = load_model_config(name)
        config.update({**shrink, "vocab_size": DRY_RUN_VOCAB})
        path = models / f"tiny-{name}.json"
        path.write_text(config.to_json_string())
        cells.append(
            {
                "cell": f"tiny-{name} {task} {seq_len} full", "model": str(path), "task": task, "seq_len": seq_len,
                "lora_r": None, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                "gradient_checkpointing": False, "predicted_gib": 0.0,
            }
        )  # fmt: skip
    # The low-memory modes (bitsandbytes runs on CPU too): a tiny Llama, 64 wide (one 4-bit block).
    config = load_model_config("llama-3.1-8b")
    config.update({"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 2,
                   "num_key_value_heads": 2, "head_dim": 32, "vocab_size": DRY_RUN_VOCAB})  # fmt: skip
    path = models / "tiny-llama-3.1-8b.json"
    path.write_text(config.to_json_string())
    # Full fine-tuning with 8-bit AdamW on fp32 weights: bitsandbytes' optimizer. The table's bf16
    # weights take torchao's, whose step compiles for ~20 s on a cold CPU cache; tests/test_low_memory.py
    # runs that path, and the cell's code here is the same either way.
    for key, settings in (("full-8bit", {"precision": "no", "optimizer": "adamw_8bit"}),
                          ("qlora", {"precision": "bf16", "lora_r": 4, "load_in_4bit": True})):  # fmt: skip
        cells.append(
            {
                "cell": f"tiny-llama-3.1-8b causal_lm 64 {key}", "model": str(path), "task": "causal_lm", "seq_len": 64,
                **settings, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                "gradient_checkpointing": True, "predicted_gib": 0.0,
            }
        )  # fmt: skip
    return cells


def check_12gb_table(models: Path, cells: list[dict]) -> Iterator[dict]:
    from ft_accum.planner.configs import load_model_config
    from ft_accum.planner.launch_line import recipe_flags

    cuda = torch.cuda.is_available()
    total = torch.cuda.get_device_properties(0).total_memory if cuda else None
    for cell in cells:
        if cell.get("lora_r") and cell["task"] != "causal_lm":
            continue  # only the causal-LM recipe has LoRA
        model_dir = models / Path(cell["model"]).stem
        if not model_dir.exists():
            random_model_dir(load_model_config(cell["model"]), cell["task"], model_dir)
        micro, accumulation = cell["per_device_train_batch_size"], cell["gradient_accumulation_steps"]
        common = [
            f"--per_device_train_batch_size={micro}",
            f"--gradient_accumulation_steps={accumulation}",
            f"--gradient_checkpointing={cell['gradient_checkpointing']}",
        ]
        if cell["task"] == "causal_lm":
            args = lm_args(model_dir, cell["seq_len"], micro, accumulation, 2, cell["gradient_checkpointing"])
        elif cell["task"] == "text_classification":
            args = [f"--model_name_or_path={model_dir}", f"--max_seq_length={cell['seq_len']}", *common]
        else:
            args = [f"--model_name_or_path={model_dir}", f"--max_source_length={cell['seq_len']}", *common]
        # LoRA, bf16 weights, 8-bit AdamW, a 4-bit base, offloading: the flags `ft-accum plan` prints.
        args += recipe_flags(cell)
        if cell["task"] != "causal_lm":
            args += [
                "--max_train_steps=2",
                f"--max_train_samples={max(200, 2 * micro * accumulation)}",
                "--max_eval_samples=4",
            ]
        if cuda:
            torch.cuda.set_per_process_memory_fraction(CAP_GIB * 2**30 / total)
        try:
            _, measured, _ = recipe_run(cell["task"], args, "bf16")
            error = None
        except torch.OutOfMemoryError as exc:
            measured, error = float("nan"), str(exc).splitlines()[0][:160]
        finally:
            if cuda:
                torch.cuda.set_per_process_memory_fraction(1.0)
        yield {
            "check": f"12 GB table: {cell['cell']}, {micro} × {accumulation}, under {CAP_GIB} GiB",
            "cell": cell["cell"],
            "predicted_gib": cell["predicted_gib"],
            "measured_gib": measured,
            "measured": error or f"peak {measured:.2f} GiB (predicted {cell['predicted_gib']:.2f})",
            "bound": f"no OOM under {CAP_GIB} GiB",
            "pass": error is None,
        }
