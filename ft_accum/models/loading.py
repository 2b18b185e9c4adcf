"""Loading a pretrained model or tokenizer with errors that name the fix, shared by every recipe."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ft_accum.core.errors import ConfigError


def check_model_path(name: str) -> None:
    """A path-like --model_name_or_path must exist (a typo must not turn into a hub download attempt)."""
    if name.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(name)):
        raise ConfigError(
            f"--model_name_or_path {name} does not exist; pass a folder holding config.json, or a hub name"
        )


def lora_adapter_base(name: str) -> str | None:
    """The base model of a LoRA adapter folder (a LoRA run's final/: adapter_config.json, no config.json),
    or None for anything else."""
    folder = Path(os.path.expanduser(name))
    if not (folder / "adapter_config.json").is_file() or (folder / "config.json").is_file():
        return None
    return json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]


def load_pretrained(auto_class, name: str, trust_remote_code: bool = False, **kwargs):
    """`auto_class.from_pretrained(name, ...)`, with a one-line ConfigError instead of a deep traceback.

    ValueError is what transformers raises for a model that needs its own code while
    trust_remote_code is off; OSError covers a missing folder, file or hub name offline.
    """
    check_model_path(name)
    try:
        return auto_class.from_pretrained(name, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as exc:
        hint = (
            "pass --trust_remote_code only if you trust its code"
            if "trust_remote_code" in str(exc)
            else "pass a local folder, or go online for hub names"
        )
        raise ConfigError(f"could not load model {name!r}: {str(exc).strip().splitlines()[0]} ({hint})") from exc


def check_same_vocabulary(student_name: str, teacher_tokenizer, teacher_name: str, trust_remote_code: bool) -> None:
    """Distillation compares two models' distributions token by token: the student's tokenizer must have
    the teacher's vocabulary (the same token for the same id), or the run stops in one line."""
    from transformers import AutoTokenizer

    student_tokenizer = load_pretrained(AutoTokenizer, student_name, trust_remote_code)
    if student_tokenizer.get_vocab() != teacher_tokenizer.get_vocab():
        raise ConfigError(
            f"the student {student_name} and the teacher {teacher_name} have different vocabularies; "
            "distillation compares their distributions token by token: pick a student of the teacher's family"
        )


def cast_and_compile(
    model, model_dtype: str, torch_compile: bool = False, mixed_precision: str = "no", frozen_base: bool = False
):
    """Cast the weights to the dtype they train in, and --torch_compile the repeated blocks; return the model.

    transformers 5 loads a checkpoint in the dtype it was saved in, and most hub LLMs are saved in
    bf16: a full fine-tune would then train pure bf16, with bf16 AdamW states, and lose every
    update smaller than bf16's resolution (2^-8 relative) without a word (issue 16). So weights
    that train are `model_dtype` (--model_dtype: fp32 by default; bf16 → fp32 is exact). A base that LoRA
    will freeze only runs forward, so it takes the mixed-precision dtype (bf16 or fp16), as peft's
    and the Trainer's LoRA recipes do; peft then creates the adapters in fp32.

    --torch_compile compiles each repeated block (the model's `_no_split_modules`) in place:
    PyTorch's regional compilation, which compiles one block and reuses it for the others, keeps
    the parameter names (checkpoints unchanged) and leaves the output layer to `OutputLoss`'s hook.
    A model that names no blocks is compiled whole.

    A model loaded in 4 bits (--load_in_4bit) is not cast: it gets peft's k-bit preparation instead
    (low_memory.prepare_4bit_model).
    """
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[model_dtype]
    if frozen_base and mixed_precision in ("bf16", "fp16"):
        dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    if getattr(model, "is_loaded_in_4bit", False):  # --load_in_4bit: the weights are NF4, not castable
        from ft_accum.models.low_memory import prepare_4bit_model

        model = prepare_4bit_model(model, mixed_precision)
    else:
        model = model.to(dtype)
    if torch_compile:
        block_names = set(getattr(model, "_no_split_modules", None) or [])
        blocks = [module for module in model.modules() if type(module).__name__ in block_names]
        for block in blocks or [model]:  # a model that names no blocks is compiled whole
            block.compile()
    return model


def load_causal_lm(
    name: str,
    accelerator,
    *,
    model_dtype: str,
    torch_compile: bool,
    trust_remote_code: bool,
    frozen_base: bool,
    load_in_4bit: bool = False,
    auto_class=None,
):
    """`auto_class` (AutoModelForCausalLM by default) `name`, its base in NF4 4-bit weights with `load_in_4bit` (QLoRA; bitsandbytes
    quantizes it as it loads, on this process's device), then `cast_and_compile`. A LoRA adapter folder
    (`lora_adapter_base`) loads as its base with the adapter merged in."""
    from transformers import AutoModelForCausalLM

    auto_class = auto_class or AutoModelForCausalLM
    quantized = {}
    if load_in_4bit:
        from ft_accum.models.low_memory import quantization_config

        quantized = {"quantization_config": quantization_config(accelerator.mixed_precision)}
        quantized["device_map"] = {"": accelerator.device}
    base = lora_adapter_base(name)
    if base is None:
        model = load_pretrained(auto_class, name, trust_remote_code, **quantized)
    elif load_in_4bit:
        raise ConfigError(
            f"{name} is a LoRA adapter, which 4-bit weights cannot take merged in; merge it first (the run's "
            "--merge_lora writes final_merged/) and pass that folder"
        )
    else:  # a LoRA run's final/: its base with the adapter merged in, a plain model from here on
        from ft_accum.models.lora import import_peft

        model = load_pretrained(auto_class, base, trust_remote_code)
        # peft froze the base to train the adapter: unfrozen, it is a plain loaded model again.
        model = import_peft().PeftModel.from_pretrained(model, name).merge_and_unload().requires_grad_(True)
    return cast_and_compile(model, model_dtype, torch_compile, accelerator.mixed_precision, frozen_base=frozen_base)


def describe_dtypes(model, optimizer, mixed_precision: str) -> str:
    """The banner's dtype line: trained weights, frozen weights, compute, optimizer state."""

    def names(tensors) -> str:
        return "/".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors})) or "none"

    params = list(model.parameters())
    trained, frozen = [p for p in params if p.requires_grad], [p for p in params if not p.requires_grad]
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    compute = {"bf16": "bfloat16 (autocast)", "fp16": "float16 (autocast)"}.get(mixed_precision, names(trained))
    # AdamW allocates its state at the first step, in the dtype of the weights it updates.
    line = f"weights {names(trained)}{f', frozen {names(frozen)}' if frozen else ''}; compute {compute}; "
    low_bit = "8bit" in type(getattr(optimizer, "optimizer", optimizer)).__name__  # bitsandbytes' AdamW8bit
    line += f"optimizer state {names(state) if state else 'float32/uint8' if low_bit else names(trained)}"
    if any(p.dtype == torch.bfloat16 for p in trained):
        line += " (pure bf16: updates below 1/256 of a weight are lost)"
    return line


def check_context_length(config, length: int, flag: str) -> None:
    """Refuse sequences longer than the position embeddings of the model `config` describes (they would index past them)."""
    context = getattr(config, "max_position_embeddings", None)
    if context and length > context:
        raise ConfigError(
            f"{flag} {length} is longer than the model's {context} positions; use {flag} {context} or less"
        )


def warm_start_encoder_decoder(name: str, tokenizer):
    """An EncoderDecoderModel whose encoder and decoder both start from the encoder checkpoint `name`.

    Rothe et al. 2020 ("Leveraging Pre-trained Checkpoints for Sequence Generation Tasks",
    arXiv:1907.12461): BERT-to-BERT warm starts beat random initialisation; only the decoder's
    cross-attention (and LM head transform) start untrained. Generation starts from [CLS] and
    stops at [SEP] (BOS/EOS for tokenizers without them).
    """
    from transformers import EncoderDecoderModel

    model = EncoderDecoderModel.from_encoder_decoder_pretrained(name, name)
    start = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
    end = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    model.config.update({"decoder_start_token_id": start, "eos_token_id": end, "pad_token_id": tokenizer.pad_token_id})
    # No repeated trigrams: an undertrained warm start otherwise loops ("- 1 - 1 - 1"); the HF bert2bert recipe does the same.
    model.generation_config.update(
        decoder_start_token_id=start, eos_token_id=end, pad_token_id=tokenizer.pad_token_id, no_repeat_ngram_size=3
    )
    return freeze_encoder_pooler(model)


def freeze_encoder_pooler(model):
    """Freeze a BERT-style encoder's pooler inside an encoder-decoder; return the model.

    The decoder reads the encoder's token states, never its pooled [CLS] output, so the pooler
    gets no gradient. DDP waits for a gradient from every trainable parameter and fails at the
    second update ("Expected to have finished reduction in the prior iteration"), which is what the
    seq2seq recipe's offline default did on 2 processes (benchmarks/bench_ddp.py). It had no
    gradient anyway, so freezing it changes no update. T5 and BART have no pooler: a no-op.
    """
    pooler = getattr(getattr(model, "encoder", None), "pooler", None)
    if pooler is not None:
        pooler.requires_grad_(False)
    return model


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "special_tokens_map.json",
)


def check_tokenizer(tokenizer, model, name: str, sample_texts: list[str] | None = None) -> None:
    """Refuse a tokenizer that cannot be the model's: far fewer tokens than the embedding table, or
    one that turns most of a sample of the training text into the unknown token.

    transformers builds a 5-token tokenizer from a folder holding only config.json and the weights;
    every word then becomes [UNK], the run exits 0 and saves the broken tokenizer (issue 19).
    """
    embeddings = model.get_input_embeddings()
    rows = getattr(embeddings, "num_embeddings", None) or getattr(model.config, "vocab_size", 0)
    missing = ""
    if os.path.isdir(os.path.expanduser(name)):
        present = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(os.path.expanduser(name), f))]
        missing = f" ({name} holds {', '.join(present) or 'no tokenizer files'}; a tokenizer needs e.g. tokenizer.json, or vocab.txt with tokenizer_config.json)"
    # Real tokenizers can be a little smaller or larger than the table (padding rows, added tokens); a tenth is not.
    if rows and len(tokenizer) < rows / 10:
        raise ConfigError(
            f"the tokenizer of {name!r} has {len(tokenizer)} tokens but the model's embedding table has {rows}: "
            f"its tokenizer files are missing or wrong{missing}; copy the tokenizer files into the folder"
        )
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or not sample_texts:
        return
    ids = [i for text in sample_texts[:64] for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    if ids and sum(i == unk for i in ids) > len(ids) / 2:
        raise ConfigError(
            f"the tokenizer of {name!r} maps {sum(i == unk for i in ids) / len(ids):.0%} of a sample of the training "
            f"text to its unknown token {tokenizer.unk_token!r}{missing}; use the model's own tokenizer files"
        )


def enable_gradient_checkpointing(model) -> None:
    """Recompute each block's activations in backward instead of keeping them (non-reentrant, as
    torch.utils.checkpoint recommends). transformers 5 renamed `gradient_checkpointing_enable` to
    `activation_checkpointing_enable` and warns on every call of the old name; 4.x has only the old one."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
