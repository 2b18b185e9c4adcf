"""Predict a training step's peak GPU memory without a GPU or weights, and plan the batch split.

Method: build the model from its config under `FakeTensorMode` (tensors with shapes and dtypes but
no storage, so an 8B model costs no RAM), run one real forward, backward and optimizer step, and
count the bytes of every storage alive at each moment with a small `TorchDispatchMode`
(`LiveBytes`). `torch.distributed._tools.mem_tracker.MemTracker` gives the same peak (checked in
the tests) with a finer breakdown, but takes ~25 s on an 8B model where this takes ~3 s. The
breakdown here: parameters and optimizer state (registered before the step, so counted exactly)
and everything else alive at the peak (activations, gradients, temporaries).

`plan` traces the candidate micro-batches that are powers of two, plus the smallest and largest,
and interpolates linearly between them (forward+backward memory is near linear in the
micro-batch; never extrapolated, since the moment of the peak can move outside the traced range).

Limits, not modelled:
- the CUDA context and cuBLAS/cuDNN workspaces (CUDA_OVERHEAD_GIB) and the caching allocator's
  fragmentation (FRAGMENTATION): both are a documented margin in `fits`;
- kernels that differ between CPU and CUDA beyond attention (the trace runs CPU kernels on fake
  tensors; attention runs a stand-in with CUDA's fused-SDPA memory profile, `fused_attention`;
  mixed precision uses CPU autocast);
- 8-bit AdamW is modelled by its state size (2 bytes per parameter plus block scales), since
  bitsandbytes does not run on fake tensors.

`torch._subclasses.fake_tensor` and `torch.utils._python_dispatch` are private PyTorch APIs;
`torch_internals()` is the only place that imports them, and it says so if they move.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from ft_accum.core.batch_arithmetic import micro_batches_for
from ft_accum.core.errors import ConfigError
from ft_accum.models.layer_selection import student_config
from ft_accum.models.loading import check_context_length, enable_gradient_checkpointing

GIB = 2**30
CUDA_OVERHEAD_GIB = 0.6  # CUDA context + cuBLAS workspace, measured as 0.4–0.6 GiB on recent drivers
FRAGMENTATION = 1.10  # the caching allocator reserves ~5–15% more than it hands out under training churn
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
OPTIMIZERS = ("adamw", "sgd", "adamw_8bit", "adamw_4bit")
# Bytes per parameter of the low-bit AdamW states (two moments each): 8-bit, block 256 with an fp32
# scale per block (bitsandbytes); 4-bit, block 128 with an fp32 scale per block (torchao).
LOW_BIT_STATE_BYTES = {"adamw_8bit": 2 * (1 + 4 / 256), "adamw_4bit": 2 * (0.5 + 4 / 128)}
# bitsandbytes keeps 32-bit states (8 bytes per parameter) for tensors under 4,096 elements.
LOW_BIT_MIN_ELEMENTS = 4096
# NF4 with double quantization (QLoRA, Dettmers et al. 2023, §3): 4 bits per weight, an 8-bit
# absmax per 64 weights, and an fp32 constant per 256 of those absmaxes.
NF4_BYTES_PER_PARAMETER = 0.5 + 1 / 64 + 4 / (64 * 256)
# The speed model's two hardware assumptions, used only to price activation offloading's copies against
# compute (`relative_throughput`); `ft-accum plan --gpu_tflops/--pcie_gbps` override them.
ASSUMED_GPU_TFLOPS = 12.0  # sustained bf16 training throughput of a 12 GB consumer card, at full utilisation
ASSUMED_PCIE_GBPS = 20.0  # pinned host↔GPU copies over PCIe 4.0 x16 (31.5 GB/s in theory)
TASKS = (
    "causal_lm",
    "text_classification",
    "token_classification",
    "seq2seq",
    "preference",
    "grpo",
    "contrastive",
    "distillation",
)
# Preference tuning's reference while it trains (recipes/preference_tuning.py): the policy with its LoRA
# adapters off, a frozen copy (full DPO), or none (SimPO, ORPO, DPO with --precompute_ref_log_probs).
PREFERENCE_LOSSES = ("dpo", "simpo", "orpo")
SHIPPED_CONFIGS = Path(__file__).parent / "model_configs"
CATEGORIES = ("parameters", "optimizer_state", "activations_gradients_temporaries")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes at the step's peak, by category; `peak` is their sum."""

    parameters: float  # and buffers
    optimizer_state: float
    activations_gradients_temporaries: float
    host_offloaded: float = 0.0  # --offload_activations: saved activations in host memory (not in `peak`)

    @property
    def peak(self) -> float:
        return sum(getattr(self, c) for c in CATEGORIES)

    def as_gib(self) -> dict[str, float]:
        return {**{k: v / GIB for k, v in asdict(self).items()}, "peak": self.peak / GIB}


def torch_internals():
    """(FakeTensorMode, TorchDispatchMode): private torch APIs, imported here only, with a clear error if they move."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError as exc:  # pragma: no cover - depends on the torch version
        raise ConfigError(
            f"this torch ({torch.__version__}) moved the private APIs the memory planner needs ({exc}); "
            "use torch 2.5–2.13, or report it at ft-accum"
        ) from exc
    return FakeTensorMode, TorchDispatchMode


def _live_bytes_mode():
    """A dispatch mode that counts the bytes of every live storage and remembers the peak."""
    import weakref

    from torch.utils._pytree import tree_flatten
    from torch.utils.weak import WeakIdKeyDictionary

    _, TorchDispatchMode = torch_internals()

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = self.peak = self.static = self.static_at_peak = 0
            self._seen = WeakIdKeyDictionary()

        def _freed(self, nbytes: int, static: bool) -> None:
            self.live -= nbytes
            self.static -= nbytes if static else 0

        def add(self, tensor: torch.Tensor, static: bool = False) -> None:
            storage = tensor.untyped_storage()
            if storage in self._seen:
                return
            nbytes = storage.nbytes()
            self._seen[storage] = nbytes
            self.live += nbytes
            self.static += nbytes if static else 0
            weakref.finalize(storage, self._freed, nbytes, static)
            if self.live > self.peak:
                self.peak, self.static_at_peak = self.live, self.static

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for value in tree_flatten(out)[0]:
                if isinstance(value, torch.Tensor):
                    self.add(value)
            return out

    return LiveBytes()


def shipped_config_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.json"))


def load_model_config(model: str | Any):
    """A `PretrainedConfig` from: a config object, a shipped name, a config.json, a local folder, or a hub name (online)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model
    path = Path(model)
    if (SHIPPED_CONFIGS / f"{model}.json").is_file():
        path = SHIPPED_CONFIGS / f"{model}.json"
    if path.is_file():
        try:
            values = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path} is not valid JSON ({exc}); pass a transformers config.json") from None
        if not isinstance(values, dict) or "model_type" not in values:
            raise ConfigError(f"{path} has no model_type; it must be a transformers config.json")
        try:
            return AutoConfig.for_model(**values)
        except (ValueError, KeyError) as exc:
            raise ConfigError(
                f"{path}: transformers does not know model_type {values['model_type']!r} ({str(exc).splitlines()[0][:120]}); "
                "check the name, or upgrade transformers"
            ) from None
    try:
        return AutoConfig.from_pretrained(str(model))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"could not load the config of {model!r} ({str(exc).strip().splitlines()[0][:160]}); offline, pass --config "
            f"path/to/config.json or a folder holding one, or a shipped name: {', '.join(shipped_config_names())}"
        ) from exc


def weight_dtype(precision: str, lora_r: int | None, load_in_4bit: bool) -> torch.dtype:
    """The dtype the recipes load the model's weights in (models.loading.cast_and_compile): bf16 under
    "bf16" and for a 4-bit base's unquantized weights; a base that LoRA freezes only runs forward, so
    under mixed precision it takes the compute dtype (peft's adapters stay fp32); else fp32."""
    if precision == "bf16" or load_in_4bit or (lora_r and precision == "bf16-mixed"):
        return torch.bfloat16
    return torch.float16 if lora_r and precision == "fp16-mixed" else torch.float32


def build_model(config, task: str, dtype: torch.dtype = torch.float32):
    """A randomly initialised model of `task` ("causal_lm", "seq2seq", "classification") from a config: what is traced."""
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForSeq2SeqLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    auto = {
        "causal_lm": AutoModelForCausalLM,
        "preference": AutoModelForCausalLM,
        "grpo": AutoModelForCausalLM,
        "distillation": AutoModelForCausalLM,
        "text_classification": AutoModelForSequenceClassification,
        "token_classification": AutoModelForTokenClassification,
        "seq2seq": AutoModelForSeq2SeqLM,
        "contrastive": AutoModel,  # a bi-encoder: the encoder's pooled hidden states, no head
    }[task]
    try:
        # Built in its final dtype: Module.to() cannot convert fake parameters (torch swaps them).
        return auto.from_config(config, dtype=dtype)
    except ValueError as exc:
        raise ConfigError(
            f"a {config.model_type} model has no {task} head; pick another --task (one of {', '.join(TASKS)})"
        ) from exc


def example_batch(
    config, task: str, micro_batch_size: int, seq_len: int, completion_length: int | None = None
) -> dict[str, torch.Tensor]:
    """A random micro-batch of `micro_batch_size` × `seq_len` tokens with the labels `task` trains on, in the
    form the task's recipe collates (GRPO: the last `completion_length` tokens are the scored completion)."""
    rows = 2 * micro_batch_size if task == "preference" else micro_batch_size  # a pair: chosen and rejected
    ids = torch.randint(0, config.vocab_size, (rows, seq_len))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if task in (
        "causal_lm",
        "preference",
    ):  # packed blocks, as the recipe passes them with --packing: no mask, so SDPA is causal
        batch = {"input_ids": ids, "labels": ids}
    elif task == "grpo":  # a completion batch (generation_round.completion_batch): prompt + completion columns
        batch["position_ids"] = torch.arange(seq_len).expand(micro_batch_size, -1)
        batch["completion_ids"] = ids[:, -(completion_length or seq_len - 1) :]
        batch["completion_mask"] = torch.ones_like(batch["completion_ids"])
        batch["advantages"] = torch.ones(micro_batch_size)  # values don't matter to memory
    elif task == "text_classification":
        batch["labels"] = torch.zeros(micro_batch_size, dtype=torch.long)
    elif task == "token_classification":
        batch["labels"] = torch.zeros_like(ids)
    elif task == "distillation":  # a chat batch whose every token is an assistant token: the most a row can count
        batch["labels"] = ids
    elif task == "contrastive":  # recipes/contrastive_embedding.py's columns: an anchor and its positive per pair
        batch = {f"{c}_{k}": v for c in ("anchor", "positive") for k, v in batch.items()}
    else:  # the decoder sees as many tokens as the encoder; the recipe's collator shifts its inputs
        batch["labels"], batch["decoder_input_ids"] = ids, ids
    return batch


def build_optimizer(name: str, parameters: list[torch.nn.Parameter]):
    """The optimizer the recipes build (run_setup.build_optimizer): fused AdamW, or SGD with momentum.

    Fused matters: foreach AdamW allocates parameter-sized temporaries in its step, fused does not."""
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=1e-5, fused=True)
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=1e-3, momentum=0.9)
    return torch.optim.SGD(parameters, lr=1e-3)  # adamw_8bit: state added analytically


ATTENTION = ("fused", "math")


def fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Stands in for CUDA's scaled_dot_product_attention in the trace, with its memory profile.

    CUDA's flash and memory-efficient kernels save q, k, v, the output and an O(T) log-sum-exp per
    head (FlashAttention-2, Dao 2023, §3.1; torch's SDPA docs), never the T × T scores; with
    dropout they save the RNG state, not a mask. PyTorch's CPU flash kernel saves exactly those
    tensors, so the trace runs it, without dropout. Grouped-query K and V stay at their own head
    count (flash reads them in place): the query heads are folded into the length, which keeps
    every saved tensor's size (this is about bytes, and fake tensors have no values).
    """
    batch, heads, length, dim = query.shape
    if key.shape[1] != heads:
        query = query.reshape(batch, key.shape[1], heads // key.shape[1] * length, dim)
    learned_bias = attn_mask is not None and attn_mask.requires_grad  # T5's relative position bias
    output, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=attn_mask.detach() if learned_bias else attn_mask, scale=scale
    )
    output = output.reshape(batch, heads, length, dim)
    if learned_bias:
        # CUDA's memory-efficient kernel returns the bias's gradient, the bias's size, in backward;
        # the CPU flash kernel has none, so a zero term routes a gradient of that size to the bias.
        output = output + attn_mask.sum() * 0
    return output


LOSS_PATHS = ("chunked", "logits", "model")


RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
# The recipe file of each task, where its name differs (an instruction-tuning run is planned as causal_lm).
RECIPE = {"preference": "preference_tuning", "contrastive": "contrastive_embedding"}


def recipe_path(task: str, recipe: str | Path | None = None) -> Path:
    """The recipe whose training step the plan traces: `recipe`, or the task's shipped one."""
    path = Path(recipe) if recipe else RECIPES_DIR / f"{RECIPE.get(task, task)}.py"
    if not path.is_file():
        raise ConfigError(f"no recipe at {path} to trace the training step of; give --recipe recipes/<name>.py")
    return path


def recipe_step(task: str, recipe: str | Path | None, loss: str):
    """`step(model, batch, reference) -> loss` for the trace: the recipe file's own `training_step`, loaded
    by path, so a change to a recipe's step (or a copy's) changes its plan.

    Sample-weighted recipes take `(model, batch)`; the language-model ones `(model, batch, output_loss)`,
    given an `OutputLoss` as the recipe builds it ("chunked", or "logits" for --no_chunked_loss); GRPO's
    `(task, accelerator, model, reference, batch)` with its parsed defaults at β = 0 (no reference, so no
    accelerator call). The preference step is still the planner's own (`preference_step`): its pairs'
    forward needs the recipe's tokenized pair format and reference handling, not yet traced from the file.
    "model" is the model's own loss, `model(**batch).loss`: what a plain PyTorch loop and the Trainer run.
    """
    if loss == "model":
        return lambda model, batch, reference: model(**batch).loss
    if task == "preference":
        return lambda model, batch, reference: preference_step(model, batch, loss, reference)
    from ft_accum.training.arguments import load_recipe_module, recipe_arguments

    module = load_recipe_module(recipe_path(task, recipe))
    if task == "contrastive":  # GradCache's replay: the micro-batch's embeddings times their cached gradients
        return lambda model, batch, reference: sum((e * torch.ones_like(e)).sum() for e in module.embed(model, batch))
    if task == "distillation":  # the recipe's step on the student and the teacher (`reference`)
        return lambda model, batch, teacher: module.training_step(
            model, teacher, batch, traced_distillation_loss(model, teacher, loss)
        )
    if task == "grpo":
        task_args = recipe_arguments(module, ["--config", "none", "--beta", "0"])[0]
        return lambda model, batch, reference: module.training_step(task_args, None, model, None, batch)[0]
    if "output_loss" not in module.training_step.__code__.co_varnames:
        return lambda model, batch, reference: module.training_step(model, batch)
    return lambda model, batch, reference: module.training_step(
        model, batch, traced_output_loss(model, loss, shift=task != "seq2seq")
    )


def embedding_cache_bytes(effective_batch_size: int, hidden_size: int, columns: int = 2) -> float:
    """The bytes GradCache (training/embedding_cache.py) holds beside one micro-batch's activations: the
    update's E × columns embeddings and their cached gradients in fp32, 2 · 4 · E · C · d, and the first
    pass's E × E·(C − 1) scores with their softmax and its gradient, 3 · 4 · E² · (C − 1). The scores live
    only while no micro-batch's activations do; counting both at once errs high, by the scores' share."""
    embeddings = 2 * 4 * effective_batch_size * columns * hidden_size
    return embeddings + 3 * 4 * effective_batch_size**2 * (columns - 1)


def traced_output_loss(model, loss: str, shift: bool = True):
    """The recipes' `OutputLoss` for the trace: chunked ("chunked") or from the full logits ("logits"). Fake
    tensors have no values: nothing to check against the logits, and no target spans to trim the per-row
    losses to (whole rows: what a row with targets to its end costs, an upper bound)."""
    from ft_accum.models.output_loss import OutputLoss

    return OutputLoss(model, shift=shift, enabled=loss == "chunked", check_logits=False, trim_to_targets=False)


def traced_distillation_loss(model, teacher, loss: str):
    """The distillation recipe's `DistillationLoss` for the trace, chunked through both output layers
    ("chunked") or from both full logits ("logits"); unchecked and untrimmed as `traced_output_loss`
    (every position of the example batch is an assistant token). ℓ is the costliest the recipe can
    run, an upper bound: the JSD (both KLs against the mixture) with cross-entropy mixed in."""
    from ft_accum.core.distillation_loss import distillation_token_losses
    from ft_accum.models.output_divergence import DistillationLoss

    token_losses = functools.partial(distillation_token_losses, beta=0.5, temperature=1.0, alpha=0.5)
    return DistillationLoss(
        model, teacher, token_losses=token_losses, enabled=loss == "chunked", check_logits=False, trim_to_targets=False
    )


def preference_step(model, batch: dict, loss: str, reference=None) -> torch.Tensor:
    """A preference micro-batch (each pair's two sequences as rows) through the recipes' `OutputLoss`;
    DPO's `reference` ("adapters_off": the same model with its LoRA adapters off, or a frozen copy) then
    runs a forward without grad while the policy's activations wait for the backward, as in
    recipes/preference_tuning.py."""
    loss_fn = traced_output_loss(model, loss)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    loss_sum, _ = loss_fn(model, batch["labels"], **inputs)
    if reference is not None:
        with torch.no_grad():
            if reference == "adapters_off":
                with model.disable_adapter():
                    loss_fn.per_row(model, batch["labels"], **inputs)
            else:
                traced_output_loss(reference, loss).per_row(reference, batch["labels"], **inputs)
    return loss_sum


def low_bit_state_bytes(numel: int, optimizer: str) -> float:
    """Bytes of a low-bit AdamW's two moments for one tensor (0 for the optimizers the trace runs)."""
    if optimizer not in LOW_BIT_STATE_BYTES:
        return 0.0
    return numel * (LOW_BIT_STATE_BYTES[optimizer] if numel >= LOW_BIT_MIN_ELEMENTS else 8.0)


def quantized_weights(model) -> list[torch.Tensor]:
    """The weights a BitsAndBytesConfig(load_in_4bit=True) quantizes: every frozen nn.Linear's (and
    GPT-2's Conv1D's, which transformers' bitsandbytes integration converts too), except the output layer's."""
    from transformers.pytorch_utils import Conv1D

    output = model.get_output_embeddings()
    # Exact types: peft's LoRA wrappers are also called Linear, and would count their base layer twice.
    return [
        m.weight
        for m in model.modules()
        if type(m) in (torch.nn.Linear, Conv1D) and m is not output and not m.weight.requires_grad
    ]


def offload_hooks(tracker):
    """saved_tensors_hooks that move every saved activation the recipes offload (`low_memory.offloads`) to
    host memory: its GPU bytes are freed when the forward drops it, counted in `tracker.host_peak`,
    and allocated again when the backward unpacks it."""
    tracker.host = tracker.host_peak = 0

    from ft_accum.models.low_memory import offloads

    def pack(tensor):
        if not offloads(tensor):  # the recipes' own rule (low_memory.offload_activations)
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        tracker.host += nbytes
        tracker.host_peak = max(tracker.host_peak, tracker.host)
        return (tensor.shape, tensor.stride(), tensor.dtype, nbytes)

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        shape, stride, dtype, nbytes = packed
        tracker.host -= nbytes
        return torch.empty_strided(shape, stride, dtype=dtype)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def trace_step(config, **settings) -> MemoryEstimate:
    """The peak of one steady-state training step: the larger of its two phases (see trace_phases)."""
    return max(trace_phases(config, **settings), key=lambda e: e.peak)


def trace_phases(config, *, micro_batch_size: int, **settings) -> tuple[MemoryEstimate, MemoryEstimate]:
    """Trace one steady-state training step; return the peaks of (forward+backward, optimizer step)."""
    return trace_micro_batches(config, [micro_batch_size], **settings)[micro_batch_size]


def trace_micro_batches(
    config,
    micro_batch_sizes: list[int],
    *,
    task: str,
    seq_len: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
    lora_r: int | None = None,
    lora_target_modules: str = "all-linear",
    gradient_checkpointing: bool = False,
    loss_path: str = "chunked",
    attention: str = "fused",
    load_in_4bit: bool = False,
    offload_activations: bool = False,
    preference_loss: str = "dpo",
    precompute_ref_log_probs: bool = False,
    completion_length: int | None = None,
    student_layers: int | None = None,
    recipe: str | Path | None = None,
    real_tensors: bool = False,
    accounting: dict | None = None,
) -> dict[int, tuple[MemoryEstimate, MemoryEstimate]]:
    """One model, one steady-state step per micro-batch size: {m: (forward+backward peak, optimizer-step peak)}.

    The optimizer state is allocated before tracing (PyTorch allocates it lazily at the first
    step). The step is the recipe's own (`recipe_step`: the `training_step` of `recipe`, by default the
    task's shipped recipe file; `loss_path` picks its loss). `attention="fused"` traces CUDA's fused
    SDPA kernels (`fused_attention`); "math" keeps the T × T scores, as SDPA's math path and eager
    attention do. `real_tensors=True` runs the same step on real CPU tensors (small models only), to
    validate the fake trace. `accounting`, if given, receives the live bytes right after backward
    and the parameter, gradient and optimizer-state bytes, for the accounting test.

    `lora_r`: peft's fp32 adapters on a frozen base built in `weight_dtype` (under mixed precision
    the compute dtype, as the recipes load a base that LoRA freezes).

    `load_in_4bit` (QLoRA, with `lora_r`): the frozen linear layers' weights are counted as NF4
    (`NF4_BYTES_PER_PARAMETER`), the embeddings and the output layer stay bf16, and the largest
    weight dequantized to bf16 (what a 4-bit matmul materialises) is added to the temporaries.
    `offload_activations`: every saved activation (not the weights) goes to host memory in the
    forward and comes back in the backward (`saved_tensors_hooks`, as torchtune's activation
    offloading and `torch.autograd.graph.save_on_cpu` do); its bytes are reported as
    `host_offloaded`, and the GPU peak counts them only while backward uses them.

    `task="preference"`: a micro-batch of m pairs is 2m sequences of `seq_len`; with
    `preference_loss="dpo"` the reference runs too (`training_step`): under LoRA the same model with
    its adapters off, else a frozen copy, counted with the parameters, unless
    `precompute_ref_log_probs` (the log-probs read from a table, no reference in memory).

    `task="grpo"`: a micro-batch of m completions of `seq_len` tokens (prompt + completion), the
    last `completion_length` of them scored (the recipe's step), at β = 0 (no reference: the recipe's default).

    `task="distillation"`: `config` is the teacher's; the student of `student_layers` of its layers (default
    half, `layer_selection.student_config`) trains, and the frozen teacher, in the compute dtype, runs its
    forward beside it (counted with the parameters); every token of a row is an assistant token.
    """
    FakeTensorMode, _ = torch_internals()
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if loss_path not in LOSS_PATHS:
        raise ConfigError(f"--loss_path must be one of {', '.join(LOSS_PATHS)}, got {loss_path!r}")
    if attention not in ATTENTION:
        raise ConfigError(f"--attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    if load_in_4bit and not lora_r:
        raise ConfigError(
            "--load_in_4bit freezes the base in 4 bits, so only LoRA adapters can train; add --lora_r 16"
        )
    step = recipe_step(task, recipe, loss_path)
    torch.manual_seed(0)
    config = copy.deepcopy(config)  # the model shares it, and checkpointing sets use_cache on it below
    with contextlib.nullcontext() if real_tensors else FakeTensorMode():
        trained_config = student_config(config, student_layers) if task == "distillation" else config
        model = build_model(trained_config, task, weight_dtype(precision, lora_r, load_in_4bit))
        if gradient_checkpointing:
            if hasattr(model.config, "use_cache"):
                model.config.use_cache = False
            enable_gradient_checkpointing(model)
        if lora_r:
            from ft_accum.models.lora import import_peft, parse_target_modules

            peft = import_peft()
            # peft moves each new adapter to its base layer's device and dtype with Module.to(), which
            # fake parameters refuse (torch swaps them, and the fake mode holds weakrefs to them).
            # The adapters are created on that same (fake) device, in fp32 as peft keeps them.
            with mock.patch.object(torch.nn.Module, "to", lambda module, *args, **kwargs: module):
                model = peft.get_peft_model(
                    model,
                    peft.LoraConfig(
                        r=lora_r, lora_alpha=2 * lora_r, target_modules=parse_target_modules(lora_target_modules)
                    ),
                )
            if gradient_checkpointing:
                model.enable_input_require_grads()
        if load_in_4bit and precision not in ("bf16", "bf16-mixed"):
            # low_memory.prepare_4bit_model: peft's fp32 cast of the frozen unquantized weights stays
            # (fp16, fp32); under bf16 everything unquantized is bf16, as the model is built here.
            quantized_ids = {id(w) for w in quantized_weights(model)}
            for parameter in model.parameters():
                if not parameter.requires_grad and id(parameter) not in quantized_ids:
                    parameter.data = parameter.data.float()
        reference, copies = None, []
        if task == "preference" and preference_loss == "dpo" and not precompute_ref_log_probs:
            if lora_r:
                reference = "adapters_off"
            else:
                reference = build_model(config, task, next(model.parameters()).dtype).requires_grad_(False).eval()
                copies = [reference]
        if task == "distillation":  # frozen in the compute dtype, as the recipe casts it (frozen_base)
            reference = build_model(config, task, weight_dtype(precision, 1, False)).requires_grad_(False).eval()
            copies = [reference]
        model.train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = build_optimizer(optimizer, trainable)
        for p in trainable:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        autocast = (
            torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16-mixed" else torch.float16)
            if precision.endswith("-mixed")
            else contextlib.nullcontext()
        )
        # Low-bit AdamW states are counted, not traced: their kernels do not run on fake tensors.
        extra_state = sum(low_bit_state_bytes(p.numel(), optimizer) for p in trainable)
        quantized = quantized_weights(model) if load_in_4bit else []
        quantization_saving = sum(w.numel() * (w.element_size() - NF4_BYTES_PER_PARAMETER) for w in quantized)
        dequantized = max((w.numel() * 2 for w in quantized), default=0)
        results = {}
        for micro_batch_size in micro_batch_sizes:
            batch = example_batch(config, task, micro_batch_size, seq_len, completion_length)
            tracker = _live_bytes_mode()
            for tensor in [p for m in (model, *copies) for p in (*m.parameters(), *m.buffers())]:
                tracker.add(tensor, static=True)
            parameter_bytes = tracker.static
            for value in (v for state in opt.state.values() for v in state.values()):
                if isinstance(value, torch.Tensor):
                    tracker.add(value, static=True)
            state_bytes = tracker.static - parameter_bytes
            kernels = (
                mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", fused_attention)
                if attention == "fused"
                else contextlib.nullcontext()
            )
            offload = offload_hooks(tracker) if offload_activations else contextlib.nullcontext()
            with tracker, kernels:  # backward too: checkpointing recomputes attention there
                with autocast, offload:
                    loss = step(model, batch, reference)
                loss.float().backward()
                del loss
                if accounting is not None:
                    accounting.update(
                        live=tracker.live,
                        parameters=parameter_bytes,
                        optimizer_state=state_bytes,
                        gradients=sum(p.grad.untyped_storage().nbytes() for p in trainable if p.grad is not None),
                    )
                backward_peak, backward_static = tracker.peak, tracker.static_at_peak
                tracker.peak = 0  # the next allocation starts the optimizer step's own peak
                opt.step()
                step_peak, step_static = (
                    (tracker.peak, tracker.static_at_peak) if tracker.peak else (tracker.live, tracker.static)
                )
                opt.zero_grad(set_to_none=True)
            results[micro_batch_size] = tuple(
                MemoryEstimate(
                    parameters=parameter_bytes - quantization_saving,
                    optimizer_state=static - parameter_bytes + extra_state,
                    activations_gradients_temporaries=peak - static + (dequantized if phase == 0 else 0),
                    host_offloaded=getattr(tracker, "host_peak", 0.0),
                )
                for phase, (peak, static) in enumerate(((backward_peak, backward_static), (step_peak, step_static)))
            )
    return results


def estimate_peak_memory(
    model: str | Any,
    *,
    task: str = "causal_lm",
    micro_batch_size: int = 1,
    seq_len: int = 512,
    precision: str = "fp32",
    optimizer: str = "adamw",
    lora_r: int | None = None,
    lora_target_modules: str = "all-linear",
    gradient_checkpointing: bool = False,
) -> MemoryEstimate:
    """The predicted peak of one training step, by category (see the module docstring for the method)."""
    return trace_step(
        load_model_config(model),
        task=task,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        precision=precision,
        optimizer=optimizer,
        lora_r=lora_r,
        lora_target_modules=lora_target_modules,
        gradient_checkpointing=gradient_checkpointing,
    )


def predict_micro_batches(config, micro_batch_sizes: list[int], **settings) -> dict[int, MemoryEstimate]:
    """The predicted peak for each micro-batch size: traced at the smallest and largest size and at
    2 and 8 where they are candidates, interpolated linearly in between (forward+backward memory
    is near linear in m; the interpolation errs high by ≤ 3% in the tests). Never extrapolated:
    outside the traced points the moment of the peak can move."""
    sizes = sorted(set(micro_batch_sizes))
    traced_sizes = sorted({m for m in sizes if m in (2, 8)} | {sizes[0], sizes[-1]})
    traced = trace_micro_batches(config, traced_sizes, **settings)
    predicted = {}
    for m in sizes:
        if m in traced:
            predicted[m] = max(traced[m], key=lambda e: e.peak)
            continue
        # Interpolate the forward+backward phase; the optimizer step's peak does not depend on m.
        low = max(t for t in traced_sizes if t < m)
        high = min(t for t in traced_sizes if t > m)
        w = (m - low) / (high - low)
        backward = MemoryEstimate(
            **{
                c: (1 - w) * getattr(traced[low][0], c) + w * getattr(traced[high][0], c)
                for c in (*CATEGORIES, "host_offloaded")
            }
        )
        predicted[m] = max(backward, traced[low][1], key=lambda e: e.peak)
    return predicted


def fits(peak_bytes: float, gpu_memory_bytes: float) -> bool:
    """peak × FRAGMENTATION + CUDA_OVERHEAD_GIB ≤ the card's memory."""
    return peak_bytes * FRAGMENTATION + CUDA_OVERHEAD_GIB * GIB <= gpu_memory_bytes


def passes_per_token(trains_base_weights: bool) -> int:
    """Forward + backward in units of one forward (2N FLOPs per token): 3 when the backward also
    computes weight gradients (4N), 2 when the base is frozen (LoRA, QLoRA: activation gradients only)."""
    return 3 if trains_base_weights else 2


def relative_throughput(
    micro_batch_size: int,
    seq_len: int,
    gradient_checkpointing: bool,
    saturation_tokens: int = 2048,
    *,
    trains_base_weights: bool = True,
    offloaded_bytes: float = 0.0,
    flops_per_token: float = 0.0,
    gpu_tflops: float = ASSUMED_GPU_TFLOPS,
    pcie_gbps: float = ASSUMED_PCIE_GBPS,
) -> float:
    """A heuristic, not a measurement: larger micro-batches keep the GPU busier, with diminishing returns.

    Tokens per second ∝ u = t / (t + saturation_tokens), with t = micro × seq_len tokens per micro-batch
    (half speed at 2048 tokens, a rough knee for 0.1–8B models on consumer GPUs); recomputation
    costs one extra forward (2N FLOPs per token): a third of a forward+backward (6N), hence × 3/4,
    or half of one when the base is frozen (LoRA: 4N, no weight gradients), hence × 2/3.

    With `offloaded_bytes` (per micro-batch, `low_memory.offload_activations`), the copies to host
    and back take 2 × bytes / PCIe bandwidth, and add to the compute time t × flops_per_token /
    (gpu_tflops × u × the checkpointing factor), since the recipes copy synchronously:
    speed × compute / (compute + copies).
    """
    tokens = micro_batch_size * seq_len
    passes = passes_per_token(trains_base_weights)
    recompute = passes / (passes + 1) if gradient_checkpointing else 1.0
    speed = tokens / (tokens + saturation_tokens) * recompute
    if not offloaded_bytes:
        return speed
    compute_seconds = tokens * flops_per_token / (gpu_tflops * 1e12 * speed)
    copy_seconds = 2 * offloaded_bytes / (pcie_gbps * 1e9)
    return speed * compute_seconds / (compute_seconds + copy_seconds)


def implied_copy_gbps(
    offloaded_bytes: float, micro_batch_size: int, samples_per_second: float, offloaded_samples_per_second: float
) -> float | None:
    """The copy bandwidth a measured offloading slowdown implies, in the terms of `relative_throughput`:
    2 × bytes / (seconds per micro-batch offloaded − without), in GB/s; None when offloading was not
    measurably slower (the copies hidden, or lost in noise). What `--pcie_gbps` should be on that machine.
    """
    extra_seconds = micro_batch_size / offloaded_samples_per_second - micro_batch_size / samples_per_second
    return 2 * offloaded_bytes / extra_seconds / 1e9 if extra_seconds > 0 else None


def training_flops_per_token(config, task: str, trains_base_weights: bool) -> float:
    """2N per token forward and 4N backward, with N the parameters used in matmuls (all but an untied
    input embedding): the 6N of Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1.
    A frozen base (LoRA, QLoRA) computes no weight gradients: 2N backward, 4N in all. Attention's
    T-dependent FLOPs are left out (small against 6N at the sequence lengths planned here)."""
    with torch.device("meta"):
        model = build_model(config, task)
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    parameters = sum(p.numel() for p in model.parameters())
    if embedding is not None and (output is None or output.weight is not embedding.weight):
        parameters -= embedding.weight.numel()
    return 2 * parameters * passes_per_token(trains_base_weights)


def candidate_micro_batches(effective_batch_size: int, num_processes: int = 1) -> list[int]:
    """Micro-batches that split the effective batch exactly (`batch_arithmetic.micro_batches_for`)."""
    return micro_batches_for(effective_batch_size, num_processes)


def plan(
    model: str | Any,
    *,
    task: str,
    seq_len: int,
    effective_batch_size: int,
    gpu_memory_gib: float,
    num_processes: int = 1,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    lora_r: int | None = None,
    lora_target_modules: str = "all-linear",
    attention: str = "fused",
    loss_path: str = "chunked",
    load_in_4bit: bool = False,
    offload_activations: bool = False,
    host_memory_gib: float | None = None,
    gpu_tflops: float = ASSUMED_GPU_TFLOPS,
    pcie_gbps: float = ASSUMED_PCIE_GBPS,
    preference_loss: str = "dpo",
    precompute_ref_log_probs: bool = False,
    completion_length: int | None = None,
    student_layers: int | None = None,
    recipe: str | Path | None = None,
) -> dict[str, Any]:
    """Every exact split of the effective batch, with and without checkpointing: predicted peak, fit, speed.
    The step traced is the `training_step` of `recipe` (default: the task's shipped recipe file).

    The recommendation is the fastest candidate that fits (ties go to the larger micro-batch).
    `offload_activations` allows offloading, and the planner decides where: it only adds copies, so
    a split is also traced with it only where the split does not fit without it, and its copies are
    priced against compute (`relative_throughput`, with `gpu_tflops` and `pcie_gbps`). An offloaded
    candidate fits only if its host bytes also stay within 80% of `host_memory_gib` (the rest is the
    OS, the data and Python).

    `task="preference"` plans recipes/preference_tuning.py: `effective_batch_size` counts pairs, each
    two sequences of `seq_len`, and DPO's reference is priced as `trace_micro_batches` says.
    `task="grpo"` plans recipes/grpo.py: `effective_batch_size` counts completions, each `seq_len`
    tokens of which the last `completion_length` (the recipe's --max_completion_length) are scored.
    `task="contrastive"` plans recipes/contrastive_embedding.py: `effective_batch_size` counts pairs (an
    anchor and a positive of `seq_len` tokens each), and every candidate holds the update's embedding
    cache (`embedding_cache_bytes`). Its speed leaves out GradCache's extra forward of each micro-batch:
    the same for every split but the one of a single micro-batch, which skips it.
    `task="distillation"` plans recipes/distillation.py: `model` is the teacher, the student its
    `student_layers` (default half); a sample is a conversation of `seq_len` tokens, all counted.
    """
    if preference_loss not in PREFERENCE_LOSSES:
        raise ConfigError(f"--loss must be one of {', '.join(PREFERENCE_LOSSES)}, got {preference_loss!r}")
    for name, value in (("--gpu_tflops", gpu_tflops), ("--pcie_gbps", pcie_gbps)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{name} must be a positive number, got {value:g}; leave it out for the default")
    config = load_model_config(model)
    # The recipes refuse a sequence longer than the model's positions; so must the plan (issue 19).
    check_context_length(config, seq_len, "--seq_len")
    micros = candidate_micro_batches(effective_batch_size, num_processes)
    task_settings = (
        {"preference_loss": preference_loss, "precompute_ref_log_probs": precompute_ref_log_probs}
        if task == "preference"
        else {"completion_length": min(completion_length or seq_len, seq_len - 1)}  # a prompt has ≥ 1 token
        if task == "grpo"
        else {"student_layers": student_layers}
        if task == "distillation"
        else {}
    )
    settings = {
        "task": task,
        "seq_len": seq_len,
        "precision": precision,
        "optimizer": optimizer,
        "lora_r": lora_r,
        "lora_target_modules": lora_target_modules,
        "attention": attention,
        "loss_path": loss_path,
        "load_in_4bit": load_in_4bit,
        "recipe": str(recipe) if recipe else None,
        **task_settings,
    }
    tokens_per_sample = seq_len * (2 if task in ("preference", "contrastive") else 1)  # a pair is two sequences
    card = gpu_memory_gib * GIB
    cache = embedding_cache_bytes(effective_batch_size, config.hidden_size) if task == "contrastive" else 0.0

    def predict(micro_batch_sizes, **features):
        estimates = predict_micro_batches(config, micro_batch_sizes, **features, **settings)
        return {
            m: replace(e, activations_gradients_temporaries=e.activations_gradients_temporaries + cache)
            for m, e in estimates.items()
        }

    # predicted[(gradient_checkpointing, offload_activations)][micro]
    predicted = {(False, False): predict(micros, gradient_checkpointing=False)}
    smallest = predicted[(False, False)][micros[0]]  # traced: the smallest candidate always is
    static = smallest.parameters + smallest.optimizer_state
    if not fits(static, card):
        options = [
            *(["--lora_r 16"] if not lora_r else []),
            *(["--optimizer adamw_8bit or sgd"] if optimizer == "adamw" else []),
            *(["--precision bf16 (weights in bf16)"] if precision != "bf16" else []),
            *(["--load_in_4bit (with --lora_r)"] if not load_in_4bit else []),
            "a smaller model",
        ]
        raise ConfigError(
            f"the weights and optimizer state alone need {static / GIB:.1f} GiB, more than a {gpu_memory_gib:g} GiB card holds "
            f"with its margin ({FRAGMENTATION}× + {CUDA_OVERHEAD_GIB} GiB); try {', '.join(options)}"
        )
    predicted[(True, False)] = predict(micros, gradient_checkpointing=True)
    if offload_activations:
        for checkpointing in (False, True):
            needed = [m for m in micros if not fits(predicted[(checkpointing, False)][m].peak, card)]
            if needed:
                predicted[(checkpointing, True)] = predict(
                    needed, gradient_checkpointing=checkpointing, offload_activations=True
                )
    if task == "distillation":  # the student trains (6N), the teacher runs its forward (2N of a frozen model's 4N)
        flops_per_token = (
            training_flops_per_token(student_config(config, student_layers), task, trains_base_weights=not lora_r)
            + training_flops_per_token(config, task, trains_base_weights=False) / 2
        )
    else:
        flops_per_token = training_flops_per_token(config, task, trains_base_weights=not lora_r)
    rows = []
    for (checkpointing, offloaded), estimates in sorted(predicted.items()):
        for micro, estimate in estimates.items():
            rows.append(
                {
                    "per_device_train_batch_size": micro,
                    "gradient_accumulation_steps": effective_batch_size // (micro * num_processes),
                    "gradient_checkpointing": checkpointing,
                    "offload_activations": offloaded,
                    "peak_gib": estimate.peak / GIB,
                    "fits": fits(estimate.peak, card)
                    and (not offloaded or estimate.host_offloaded <= 0.8 * (host_memory_gib or math.inf) * GIB),
                    "relative_throughput": relative_throughput(
                        micro,
                        tokens_per_sample,
                        checkpointing,
                        trains_base_weights=not lora_r,
                        offloaded_bytes=estimate.host_offloaded,
                        flops_per_token=flops_per_token,
                        gpu_tflops=gpu_tflops,
                        pcie_gbps=pcie_gbps,
                    ),
                    "host_gib": estimate.host_offloaded / GIB,
                    "breakdown_gib": estimate.as_gib(),
                }
            )
    rows.sort(key=lambda r: (r["gradient_checkpointing"], r["per_device_train_batch_size"], r["offload_activations"]))
    fitting = [r for r in rows if r["fits"]]
    best = (
        max(
            fitting,
            key=lambda r: (r["relative_throughput"], r["per_device_train_batch_size"], not r["offload_activations"]),
        )
        if fitting
        else None
    )
    if best and best["offload_activations"]:
        # What the copies cost, at the assumed bandwidth: the same split's speed without them.
        uncopied = relative_throughput(
            best["per_device_train_batch_size"],
            tokens_per_sample,
            best["gradient_checkpointing"],
            trains_base_weights=not lora_r,
        )
        best["offload_slowdown"] = 1 - best["relative_throughput"] / uncopied
    top = max(r["relative_throughput"] for r in rows)
    for r in rows:
        r["relative_throughput"] = r["relative_throughput"] / top
    result = {
        "model": getattr(config, "name_or_path", "") or str(model),
        "task": task,
        "seq_len": seq_len,
        "effective_batch_size": effective_batch_size,
        "num_processes": num_processes,
        "precision": precision,
        "optimizer": optimizer,
        "lora_r": lora_r,
        "attention": attention,
        "loss_path": loss_path,
        "load_in_4bit": load_in_4bit,
        "offload_activations": offload_activations,
        "recipe": str(recipe) if recipe else None,
        **task_settings,
        "gpu_tflops": gpu_tflops,
        "pcie_gbps": pcie_gbps,
        "training_flops_per_token": flops_per_token,
        "gpu_memory_gib": gpu_memory_gib,
        "margin": f"peak × {FRAGMENTATION} + {CUDA_OVERHEAD_GIB} GiB ≤ card",
        "candidates": rows,
        "recommended": best,
    }
    result["launch"] = launch_line(result)
    return result


SEQUENCE_FLAG = {
    "causal_lm": "--block_size",
    "text_classification": "--max_seq_length",
    "token_classification": "--max_seq_length",
    "seq2seq": "--max_source_length",
    "preference": "--max_seq_length",
    "grpo": "--max_completion_length",
    "contrastive": "--max_seq_length",
    "distillation": "--max_seq_length",
}


def launch_line(result: dict) -> str | None:
    """The recommended configuration as a whole `accelerate launch` command: the Accelerate config for
    the precision, and every recipe flag the plan assumed (dtype, optimizer, LoRA, 4-bit base,
    offloading, checkpointing), not only the split. None when nothing fits.

    The planner's precisions map to the recipes' dtype policy: "bf16" is bf16 mixed precision with
    bf16 weights (--model_dtype bfloat16); under LoRA the frozen base is bf16 and the adapters fp32
    anyway, which is the recipes' default under bf16 mixed precision.
    """
    best = result["recommended"]
    if best is None:
        return None
    mixed_precision = {"fp16-mixed": "fp16", "fp32": "no"}.get(result["precision"], "bf16")
    if result["num_processes"] > 1:
        accelerate_config = (
            f"multi_gpu_ddp.yaml --num_processes {result['num_processes']} --mixed_precision {mixed_precision}"
        )
    else:
        accelerate_config = {"fp16": "single_gpu_fp16.yaml", "no": "single_gpu_bf16.yaml --mixed_precision no"}.get(
            mixed_precision, "single_gpu_bf16.yaml"
        )
    flags = [
        f"--per_device_train_batch_size {best['per_device_train_batch_size']}",
        f"--effective_batch_size {result['effective_batch_size']}",
        f"{SEQUENCE_FLAG[result['task']]} {result.get('completion_length') or result['seq_len']}",
    ]
    if best["gradient_checkpointing"]:
        flags.append("--gradient_checkpointing")
    # The plan allows offloading; the recommended candidate says whether it uses it.
    settings = {**result, "offload_activations": best.get("offload_activations", False)}
    recipe = result.get("recipe") or f"recipes/{RECIPE.get(result['task'], result['task'])}.py"
    return (
        f"accelerate launch --config_file accelerate_configs/{accelerate_config} "
        f"{recipe} {' '.join(flags + recipe_flags(settings))}"
    )


def recipe_flags(settings: dict) -> list[str]:
    """The recipe's command-line words for a plan's dtype, optimizer, LoRA, 4-bit and offloading settings."""
    # The planner's "bf16" is bf16 weights in full fine-tuning; under LoRA only the frozen base is bf16.
    bf16_weights = settings.get("precision") == "bf16" and not settings.get("lora_r")
    flags = ["--model_dtype=bfloat16"] if bf16_weights else []
    flags += {
        # bf16 weights round small updates away unless rounded stochastically (docs/low_memory.md):
        # torchao's 8-bit AdamW does that, in the same bytes as bitsandbytes'.
        "adamw_8bit": ["--optim=adamw_torch_8bit" if bf16_weights else "--optim=adamw_8bit"],
        "sgd": ["--optim=sgd"],
        "adamw_4bit": ["(4-bit AdamW: torchao's, not in the recipes; see docs/low_memory.md)"],
    }.get(settings.get("optimizer", "adamw"), [])
    if settings.get("lora_r"):
        flags += ["--use_lora", f"--lora_r={settings['lora_r']}"]
    if settings.get("load_in_4bit"):
        flags.append("--load_in_4bit")
    if settings.get("offload_activations"):
        flags.append("--offload_activations")
    if settings.get("preference_loss", "dpo") != "dpo":
        flags.append(f"--loss={settings['preference_loss']}")
    if settings.get("precompute_ref_log_probs"):
        flags.append("--precompute_ref_log_probs")
    if settings.get("student_layers"):
        flags.append(f"--student_layers={settings['student_layers']}")
    return flags


def parse_memory(text: str) -> float:
    """'12GiB', '12 GB', '11.5' → GiB as a float (GB is read as GiB: cards are sold in binary units)."""
    cleaned = text.strip().lower().replace(" ", "")
    for suffix in ("gib", "gb", "g"):
        if cleaned.endswith(suffix):
            cleaned = cleaned[: -len(suffix)]
            break
    try:
        value = float(cleaned)
    except ValueError as exc:
        raise ConfigError(f"--gpu_memory {text!r} is not a size; write it like 12GiB or 11.5") from exc
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"--gpu_memory must be positive, got {text!r}")
    return value
