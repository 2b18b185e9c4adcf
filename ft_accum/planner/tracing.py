"""Trace one training step without a GPU or weights: the peak of its live bytes, by category.

Method: build the model from its config under `FakeTensorMode` (tensors with shapes and dtypes but
no storage, so an 8B model costs no RAM), run one real forward, backward and optimizer step, and
count the bytes of every storage alive at each moment with a small `TorchDispatchMode`
(`LiveBytes`). `torch.distributed._tools.mem_tracker.MemTracker` gives the same peak (checked in
the tests) with a finer breakdown, but takes ~25 s on an 8B model where this takes ~3 s. The
breakdown here: parameters and optimizer state (registered before the step, so counted exactly)
and everything else alive at the peak (activations, gradients, temporaries).

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
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import torch

from ft_accum.core.errors import ConfigError
from ft_accum.models.layer_selection import student_config
from ft_accum.models.loading import enable_gradient_checkpointing
from ft_accum.planner.task_specs import build_model, example_batch, recipe_step, task_spec

GIB = 2**30
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


def weight_dtype(precision: str, lora_r: int | None, load_in_4bit: bool) -> torch.dtype:
    """The dtype the recipes load the model's weights in (models.loading.cast_and_compile): bf16 under
    "bf16" and for a 4-bit base's unquantized weights; a base that LoRA freezes only runs forward, so
    under mixed precision it takes the compute dtype (peft's adapters stay fp32); else fp32."""
    if precision == "bf16" or load_in_4bit or (lora_r and precision == "bf16-mixed"):
        return torch.bfloat16
    return torch.float16 if lora_r and precision == "fp16-mixed" else torch.float32


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


PACKED_ATTENTION = "flash_packed_trace"  # "flash" in the name takes the towers' cu_seqlens path


def packed_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """A transformers attention function standing in for flash-attention's variable-length kernel in a
    vision tower: Qwen2-VL/2.5-VL pack every image (and window) of a micro-batch into one sequence cut by
    `cu_seqlens`, where CUDA's varlen kernel saves q, k, v, the output and an O(T) log-sum-exp for the
    whole pack: `fused_attention` over the pack, byte for byte. One call per block, where the SDPA path
    splits into a call per window (hundreds per image, each traced: minutes for a 3B model's plan).
    The towers traced here hold whole images only, so no mask is lost."""
    output = fused_attention(query, key, value, scale=scaling)
    return output.transpose(1, 2).contiguous(), None


def pack_vision_attention(model) -> None:
    """Run `model`'s vision tower through `packed_attention` (registered with transformers once)."""
    from transformers import AttentionInterface

    vision = getattr(model.config, "vision_config", None)
    if vision is not None:
        AttentionInterface.register(PACKED_ATTENTION, packed_attention)
        vision._attn_implementation = PACKED_ATTENTION


LOSS_PATHS = ("chunked", "logits", "model")


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


def fresh_deep_copies(fake_mode):
    """peft's `modules_to_save` deep-copies a module (the vision connector); a fake tensor's own deep copy
    makes it in a new FakeTensorMode, which torch refuses to mix with the trace's (and which corrupted
    the heap at exit here). While patched, a tensor's or parameter's deep copy is a new empty one of its
    shape, dtype and stride in `fake_mode`: fake tensors have no values to lose."""

    def fresh(tensor, memo):
        with fake_mode:
            copied = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
        if isinstance(tensor, torch.nn.Parameter):
            copied = torch.nn.Parameter(copied, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = copied
        return copied

    stack = contextlib.ExitStack()
    if fake_mode is not None:
        for cls in (torch.Tensor, torch.nn.Parameter):
            stack.enter_context(mock.patch.object(cls, "__deepcopy__", fresh))
    return stack


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


# Integer tensors up to this many elements are kept as constants under `layout_constants`: an image grid,
# a placeholder mask, position ids (2^22: a mask of 4M tokens, 4 MiB as bool).
LAYOUT_CONSTANT_ELEMENTS = 1 << 22


@contextlib.contextmanager
def layout_constants(fake_mode):
    """Trace a model whose layout code reads the batch's values, with that layout computed for real.

    Vision-language models pick their image rows (`nonzero` on a mask), loop over image grids
    (`.tolist()`), and build position ids from both: data-dependent shapes, which fake tensors refuse.
    Here the batch is made of real tensors held as FakeTensorMode *constants*, every integer or bool
    tensor created without tensor inputs (`arange`, `ones`, `tensor`) is computed for real and held as
    one too, and PyTorch's own constant propagation (fake_tensor.CONSTANT_NUMEL_LIMIT, raised here from 1
    element) computes every op whose inputs are all constants for real: the layout is exact, while
    anything touching a fake weight or activation stays fake. Yields `batch_of(build)`: `build()` on
    real tensors, returned as constants. With no `fake_mode` (other tasks, or real tensors) it does
    nothing: `batch_of(build)` is `build()`."""
    if fake_mode is None:
        yield lambda build: build()
        return
    from torch._subclasses import fake_tensor
    from torch.utils._pytree import tree_flatten, tree_map_only

    _, TorchDispatchMode = torch_internals()
    converter = fake_mode.fake_tensor_converter

    def constant(tensor: torch.Tensor) -> torch.Tensor:
        return converter.from_real_tensor(fake_mode, tensor, make_constant=True)

    class IndexConstants(TorchDispatchMode):
        building = False  # while `batch_of` builds the batch: every tensor real

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            made_here = not any(isinstance(a, torch.Tensor) for a in tree_flatten((args, kwargs))[0])
            if (
                made_here
                and not self.building
                and isinstance(out, torch.Tensor)
                and _is_index(out, fake_tensor.CONSTANT_NUMEL_LIMIT)
            ):
                with fake_tensor.unset_fake_temporarily():
                    return constant(func(*args, **kwargs))
            return out

    def python_scalars(data):
        """torch.tensor([t0, t1]) of 0-d tensors reads their storage, which a fake has none of: their values."""
        return tree_map_only(fake_tensor.FakeTensor, lambda t: t.item() if t.dim() == 0 else t, data)

    make_tensor = torch.tensor

    index_constants = IndexConstants()

    def batch_of(build):
        index_constants.building = True
        with fake_tensor.unset_fake_temporarily():
            batch = build()
        index_constants.building = False
        largest = max(t.numel() for t in batch.values())
        fake_tensor.CONSTANT_NUMEL_LIMIT = max(LAYOUT_CONSTANT_ELEMENTS, largest)
        return {k: constant(v) for k, v in batch.items()}

    with (
        mock.patch.object(fake_tensor, "CONSTANT_NUMEL_LIMIT", LAYOUT_CONSTANT_ELEMENTS),
        mock.patch.object(torch, "tensor", lambda data, *a, **k: make_tensor(python_scalars(data), *a, **k)),
        index_constants,
    ):
        yield batch_of


def _is_index(tensor: torch.Tensor, limit: int) -> bool:
    return not (tensor.is_floating_point() or tensor.is_complex()) and tensor.numel() <= limit


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
    image_size: int | None = None,
    images_per_sample: int = 1,
    train_vision_tower: bool = False,
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

    `task="vision_language"`: each row opens with `images_per_sample` images of `image_size` px
    (planner/vision_inputs.py), run through the model's own forward, vision tower included, with the
    batch's layout traced as constants (`layout_constants`); LoRA and freezing as the recipe sets them
    (the tower frozen unless `train_vision_tower`, the connector trained whole).
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
    spec = task_spec(task)
    step = recipe_step(task, recipe, loss_path, {"preference_loss": preference_loss})
    task_settings = dict(completion_length=completion_length, image_size=image_size,
                         images_per_sample=images_per_sample, train_vision_tower=train_vision_tower)  # fmt: skip
    torch.manual_seed(0)
    config = copy.deepcopy(config)  # the model shares it, and checkpointing sets use_cache on it below
    fake_mode = None if real_tensors else FakeTensorMode()
    with fake_mode or contextlib.nullcontext():
        trained_config = student_config(config, student_layers) if spec.frozen_teacher else config
        model = build_model(trained_config, task, weight_dtype(precision, lora_r, load_in_4bit))
        if spec.layout_constants and attention == "fused":
            pack_vision_attention(model)
        if gradient_checkpointing:
            if hasattr(model.config, "use_cache"):
                model.config.use_cache = False
            enable_gradient_checkpointing(model)
        if lora_r:
            from ft_accum.models.lora import import_peft

            peft = import_peft()
            target_modules, modules_to_save = spec.lora_modules(model, lora_target_modules, task_settings)
            # peft moves each new adapter to its base layer's device and dtype with Module.to(), which
            # fake parameters refuse (torch swaps them, and the fake mode holds weakrefs to them).
            # The adapters are created on that same (fake) device, in fp32 as peft keeps them.
            with (
                mock.patch.object(torch.nn.Module, "to", lambda module, *args, **kwargs: module),
                fresh_deep_copies(fake_mode),
            ):
                model = peft.get_peft_model(
                    model,
                    peft.LoraConfig(
                        r=lora_r, lora_alpha=2 * lora_r, target_modules=target_modules, modules_to_save=modules_to_save
                    ),
                )
            if gradient_checkpointing:
                model.enable_input_require_grads()
        else:
            spec.freeze(model, task_settings)
        if load_in_4bit and precision not in ("bf16", "bf16-mixed"):
            # low_memory.prepare_4bit_model: peft's fp32 cast of the frozen unquantized weights stays
            # (fp16, fp32); under bf16 everything unquantized is bf16, as the model is built here.
            quantized_ids = {id(w) for w in quantized_weights(model)}
            for parameter in model.parameters():
                if not parameter.requires_grad and id(parameter) not in quantized_ids:
                    parameter.data = parameter.data.float()
        reference, copies = None, []
        if spec.dpo_reference and preference_loss == "dpo" and not precompute_ref_log_probs:
            if lora_r:
                reference = "adapters_off"
            else:
                reference = build_model(config, task, next(model.parameters()).dtype).requires_grad_(False).eval()
                copies = [reference]
        if spec.frozen_teacher:  # frozen in the compute dtype, as the recipe casts it (frozen_base)
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
            # The layout's integers stay real (constants) while the step runs; a no-op for other tasks.
            with layout_constants(fake_mode if spec.layout_constants else None) as batch_of:
                batch = batch_of(
                    functools.partial(example_batch, config, task, micro_batch_size, seq_len, **task_settings)
                )
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
                    for phase, (peak, static) in enumerate(
                        ((backward_peak, backward_static), (step_peak, step_static))
                    )
                )
    return results
