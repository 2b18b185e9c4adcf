"""What fits a bigger model on a small card (issue 17): a 4-bit base (QLoRA), 8-bit AdamW states, and
activations offloaded to host memory.

The 4-bit weights and `--optim adamw_8bit` come from bitsandbytes, `--optim adamw_torch_8bit` from
torchao; both are in the `[lowmem]` extra (`pip install -e ".[lowmem]"`), never in the default
install. bitsandbytes does the 4-bit base and the 8-bit states of fp32 weights: transformers' NF4
loading needs it anyway, its kernels also run on CPU (so CI tests the real quantization, not a
mock), its state is plain tensors in an ordinary `state_dict`, and its step needs no compilation.
torchao does the 8-bit states of bf16 weights, because it rounds those weights stochastically and
bitsandbytes rounds to nearest, which lost three quarters of a fine-tune's gain in the quality
check. docs/low_memory.md has the comparison and the figures.
"""

from __future__ import annotations

import contextlib

import torch

from ft_accum.core.errors import ConfigError

LOWMEM_INSTALL = 'pip install -e ".[lowmem]" (or pip install bitsandbytes)'
# Saved tensors smaller than this stay on the GPU: copying them costs more than they hold.
MIN_OFFLOAD_ELEMENTS = 1024


def import_bitsandbytes(flag: str):
    """The bitsandbytes module, or a one-line ConfigError that names the flag and the install command."""
    try:
        import bitsandbytes
    except ImportError:
        raise ConfigError(f"{flag} needs bitsandbytes, which is not installed; {LOWMEM_INSTALL}") from None
    return bitsandbytes


def quantization_config(mixed_precision: str):
    """QLoRA's frozen base (Dettmers et al. 2023, arXiv:2305.14314, §3): NF4 weights in blocks of 64,
    double quantization of the blocks' scales, and matmuls in the run's compute dtype: bf16 under
    bf16 mixed precision (QLoRA's setting, accelerate_configs/gpu_bf16.yaml), fp16 under fp16, and
    fp32 in an fp32 run. An fp32 run's 4-bit matmuls are then as exact as its other layers: NF4
    values are exact in fp32, where bf16 would round each output to 2^-8 differently for each batch
    shape (the QLoRA accumulation test measured 2e-3 between splits with bf16 compute, 1e-6 with fp32).

    Bytes per quantized weight: 0.5 + 1/64 (an 8-bit scale per block) + 4/(64·256) (an fp32
    constant per 256 scales) = 0.516; `memory_planner.NF4_BYTES_PER_PARAMETER` counts the same.
    """
    import_bitsandbytes("--load_in_4bit")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32),
    )


def prepare_4bit_model(model, mixed_precision: str):
    """peft's k-bit preparation (every weight frozen; the unquantized ones, norms and embeddings
    included, cast to fp32), then, under bf16 mixed precision, those back to bf16; return the model.

    peft's fp32 cast is for fp16, whose range a norm can overflow; bf16 has fp32's range. Under
    bf16 it costs twice: the embeddings and output layer in fp32 hold 2 × vocabulary × hidden × 4
    bytes (4.2 GB for Llama-3.1-8B's 128k vocabulary, enough to push its QLoRA past 12 GB), and
    fp32 norm weights turn the hidden states fp32 (a Llama RMSNorm returns weight × hidden), which
    doubles the activations: the planner predicted GPT-2's QLoRA step at 9.7 GiB with them, 6.1
    without. So they stay fp32 under fp16 and in an fp32 run (where bf16 weights would meet fp32
    hidden states), and go back to bf16 under bf16. Checkpointing is left to the recipe, which
    enables it the same way for every model.
    """
    from ft_accum.models.lora import import_peft

    model = import_peft().prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    for module in model.modules():
        # On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight for inference at the first
        # eval-mode forward, for good; later training forwards then use a kernel without a backward,
        # and the gradient through the frozen layers is silently dropped (seen with 0.50.2).
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    if mixed_precision == "bf16":
        for parameter in model.parameters():
            if parameter.dtype == torch.float32:  # the 4-bit weights are uint8 and stay so
                parameter.data = parameter.data.to(torch.bfloat16)
    return model


def adamw_8bit(param_groups, learning_rate: float):
    """bitsandbytes' 8-bit AdamW (Dettmers et al. 2022, arXiv:2110.02861): each moment in 8 bits with
    an fp32 scale per block of 256, so 2 × (1 + 4/256) = 2.03 bytes per parameter instead of 8.

    Tensors under 4,096 elements (biases, norms) keep fp32 states, as bitsandbytes does by default.
    Not the paged variant: paged optimizers live in managed memory, which the GPU check avoids and
    which swaps silently instead of failing loudly (docs/low_memory.md says how to switch).
    """
    bitsandbytes = import_bitsandbytes("--optim adamw_8bit")
    return bitsandbytes.optim.AdamW8bit(param_groups, lr=learning_rate)


def adamw_8bit_stochastic_rounding(param_groups, learning_rate: float, bf16_weights: bool):
    """torchao's 8-bit AdamW, which rounds bf16 weights stochastically (`--optim adamw_torch_8bit`).

    A bf16 weight rounded to nearest keeps no update smaller than half its spacing, 2^-9 of the
    weight: at fine-tuning LRs most updates are smaller, and are lost. Rounding up or down with
    probability proportional to the distance keeps each update in expectation (Zamirai et al. 2020,
    "Revisiting BFloat16 Training", arXiv:2010.06192), at no memory cost. bitsandbytes' optimizers
    round to nearest. torchao compiles its step with torch.compile: the first updates are slow.
    """
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        raise ConfigError(
            "--optim adamw_torch_8bit needs torchao, which is not installed; pip install torchao (matching your "
            "torch), or use --optim adamw_8bit"
        ) from None
    return AdamW8bit(param_groups, lr=learning_rate, bf16_stochastic_round=bf16_weights)


def offloads(tensor: torch.Tensor) -> bool:
    """Whether activation offloading moves this saved tensor: not a weight, and not a small one."""
    return not isinstance(tensor, torch.nn.Parameter) and tensor.numel() >= MIN_OFFLOAD_ELEMENTS


def offload_activations(enabled: bool, device: torch.device):
    """A context for the forward: each tensor it saves for backward (see `offloads`) is copied to
    pinned host memory and back to `device` when backward needs it; with checkpointing, what is
    saved is each block's input (`torch.utils.checkpoint` saves it with `save_for_backward`).

    What `torch.autograd.graph.save_on_cpu(pin_memory=True)` does, except that it leaves the
    weights on the GPU: save_on_cpu would copy every weight a layer saves to the host and back in
    every micro-batch. torchtune's `OffloadActivations` skips them too. The copies are synchronous.
    The values come back bit for bit, so the gradients are unchanged (tests/test_low_memory.py).
    """
    if not enabled:
        return contextlib.nullcontext()
    if device.type != "cuda":
        raise ConfigError(
            f"--offload_activations moves activations from a GPU to host memory, and this run is on {device.type}; "
            "drop the flag (or use --gradient_checkpointing, which works everywhere)"
        )
    return offload_hooks(device, pin_memory=True)


def offload_hooks(device: torch.device, pin_memory: bool):
    """The saved-tensor hooks behind `offload_activations` (`pin_memory=False` lets a CPU test run them)."""

    def pack(tensor):
        if not offloads(tensor):
            return tensor
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin_memory)
        host.copy_(tensor)
        return host

    def unpack(saved):
        return saved if saved.device == device else saved.to(device, non_blocking=pin_memory)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
