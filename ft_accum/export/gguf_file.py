"""A Llama-architecture Hugging Face model as a GGUF file for llama.cpp (and Ollama, LM Studio), written
with the `gguf` package's GGUFWriter: the architecture's metadata, the tokenizer (export/vocab.py), and
the tensors under llama.cpp's names.

What llama.cpp expects that a plain copy of the weights gets wrong:
- Q and K rows permuted. Hugging Face's Llama rotates the two halves of each head
  (`rotate_half`); llama.cpp's rotates adjacent pairs. Re-ordering each head's rows from
  [first half, second half] to interleaved pairs makes the two the same rotation (the inverse of the
  permutation Hugging Face's own convert_llama_weights_to_hf.py applies to Meta's checkpoints).
- Norm weights and every other 1-D tensor in F32, whatever the output type: they are few, and
  llama.cpp's kernels read them as F32.
- A tied output layer (SmolLM2: `tie_word_embeddings`) written once: llama.cpp uses the token
  embedding when `output.weight` is absent.
- Llama 3.1's RoPE scaling as a `rope_freqs` tensor: the factor that divides each frequency, here
  taken from transformers' own RoPE functions (default frequencies / scaled ones), so that llama.cpp
  rotates exactly as the model trained.

The file is written under a temporary name in the output's folder and renamed at the end, so an
interrupted export leaves no truncated GGUF under the final name.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ft_accum.core.errors import ConfigError
from ft_accum.export.vocab import GGUFVocab, add_vocab_to_gguf

OUTTYPES = ("f16", "bf16", "q8_0", "f32")
SUPPORTED_MODEL_TYPES = ("llama",)  # LlamaForCausalLM: SmolLM/SmolLM2, TinyLlama, Llama 2, Llama 3.x
Q8_0_BLOCK = 32  # values per Q8_0 block; a row of another length stays F16, as llama.cpp's converter does


def check_supported(config) -> None:
    """Refuse, in one line, a model this exporter does not write correctly."""
    architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"GGUF export supports the Llama architecture (LlamaForCausalLM: SmolLM2, TinyLlama, Llama 2 and 3), "
            f"not {architecture} (model_type {config.model_type!r}); for other architectures run llama.cpp's "
            "convert_hf_to_gguf.py on the merged model (--merge_lora writes final_merged/)"
        )
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in ("default", "linear", "llama3"):
        raise ConfigError(
            f"GGUF export supports default, linear and llama3 RoPE, not {rope.get('rope_type')!r} "
            f"({architecture}); use llama.cpp's convert_hf_to_gguf.py for this model"
        )


def rope_parameters(config) -> dict:
    """The RoPE settings, under transformers 5's `rope_parameters` or 4's `rope_theta` + `rope_scaling`."""
    parameters = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    parameters.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return parameters


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_frequency_factors(config) -> np.ndarray | None:
    """llama.cpp's `rope_freqs`: per frequency, the factor it divides the default frequency by, or None
    for unscaled RoPE. default_inv_freq / scaled_inv_freq, both from transformers' RoPE functions."""
    rope = rope_parameters(config)
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, attention_scaling = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    if attention_scaling != 1.0:  # llama.cpp's rope_freqs cannot scale attention
        raise ConfigError(f"{kind} RoPE with attention scaling {attention_scaling} cannot be written to GGUF here")
    dim = head_dim(config)
    default = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return (default / scaled.float()).numpy().astype(np.float32)


def permute_for_rope(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Each head's rows from Hugging Face's [first half | second half] rotary order to llama.cpp's
    interleaved pairs: row (h, j, i) → (h, i, j) for half j ∈ {0, 1} and pair i. Works for biases (1-D)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def llama_tensors(state_dict: dict[str, torch.Tensor], config):
    """(GGUF name, fp32 array) for every tensor llama.cpp reads: Q/K permuted, a tied output skipped."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name, tensor in state_dict.items():
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        data = tensor.detach().to(torch.float32).cpu().numpy()
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute_for_rope(data, config.num_attention_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute_for_rope(data, config.num_key_value_heads or config.num_attention_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ConfigError(f"the tensor {name} has no llama.cpp name: is this a plain LlamaForCausalLM?")
        yield gguf_name, data
    factors = rope_frequency_factors(config)
    if factors is not None:
        yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors


def encode_tensor(data: np.ndarray, outtype: str):
    """(array to write, its GGML type): 1-D tensors (norms, rope_freqs) F32; matrices in `outtype`,
    Q8_0 through gguf's own quantizer (a row that is not a whole number of blocks stays F16)."""
    import gguf

    kinds = gguf.GGMLQuantizationType
    if data.ndim <= 1 or outtype == "f32":
        return data.astype(np.float32), kinds.F32
    if outtype == "f16" or (outtype == "q8_0" and data.shape[-1] % Q8_0_BLOCK):
        return data.astype(np.float16), kinds.F16
    kind = {"bf16": kinds.BF16, "q8_0": kinds.Q8_0}[outtype]
    return gguf.quants.quantize(data, kind), kind


def file_type(outtype: str) -> int:
    import gguf

    return {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }[outtype]


def write_gguf(
    state_dict: dict[str, torch.Tensor],
    config,
    vocab: GGUFVocab,
    output: Path,
    *,
    outtype: str,
    name: str,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Write the model as a GGUF file at `output`, whole or not at all (a temporary name, then a rename)."""
    import gguf

    check_supported(config)
    if outtype not in OUTTYPES:
        raise ConfigError(f"--outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    output = Path(output)
    if output.exists() and not overwrite:
        raise ConfigError(f"{output} already exists; pass --overwrite to replace it, or choose another --output")
    output.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_rope_dimension_count(head_dim(config))
    if head_dim(config) != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim(config))
        writer.add_value_length(head_dim(config))
    writer.add_rope_freq_base(float(rope_parameters(config)["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(file_type(outtype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocab_to_gguf(writer, vocab)
    for tensor_name, data in llama_tensors(state_dict, config):
        encoded, kind = encode_tensor(data, outtype)
        writer.add_tensor(tensor_name, encoded, raw_dtype=kind)

    remove_dead_partials(output)
    partial = output.with_name(f".{output.name}.partial-{os.getpid()}")
    try:
        writer.write_header_to_file(path=partial)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=progress)
        writer.close()
        os.replace(partial, output)
    finally:
        partial.unlink(missing_ok=True)
    return output


def remove_dead_partials(output: Path) -> None:
    """Delete the half-written files a killed export left beside `output` (their writer's PID is gone)."""
    for partial in output.parent.glob(f".{output.name}.partial-*"):
        pid = partial.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            partial.unlink(missing_ok=True)
