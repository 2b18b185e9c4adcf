"""A smaller student built from its teacher's own layers: K of N decoder layers, evenly spaced (issue 56).

DistilBERT (Sanh et al. 2019, arXiv:1910.01108, §3) initialises its student from every other layer of
BERT; NVIDIA's Minitron (Muralidharan et al. 2024, arXiv:2407.14679) prunes depth the same way before
distilling. Keeping layers i_k = round(k (N − 1) / (K − 1)) for k = 0..K−1 keeps the first and the last
(the ones nearest the embeddings and the output layer) and spreads the rest evenly; the embeddings,
final norm and output layer are the teacher's. No second checkpoint is downloaded.
"""

from __future__ import annotations

import copy

import torch

from ft_accum.core.errors import ConfigError


def evenly_spaced_layers(num_layers: int, keep: int | None) -> list[int]:
    """The indices of `keep` of `num_layers` layers: i_k = round(k (N − 1) / (K − 1)), first and last included;
    `keep` None: half of them (DistilBERT's share), the distillation recipe's default."""
    keep = max(1, num_layers // 2) if keep is None else keep
    if not 1 <= keep <= num_layers:
        raise ConfigError(
            f"--student_layers must be between 1 and the teacher's {num_layers} layers, got {keep}; "
            "or give the student with --model_name_or_path"
        )
    if keep == 1:
        return [num_layers - 1]
    return [round(k * (num_layers - 1) / (keep - 1)) for k in range(keep)]


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder layers (Llama, Qwen, Mistral, Gemma: `model.model.layers`; GPT-2: `transformer.h`)."""
    base = getattr(model, model.base_model_prefix, model)
    for name in ("layers", "h", "blocks"):
        if isinstance(getattr(base, name, None), torch.nn.ModuleList):
            return getattr(base, name)
    raise ConfigError(
        f"cannot find the decoder layers of a {type(model).__name__}; give the student with --model_name_or_path"
    )


def student_from_teacher(teacher: torch.nn.Module, keep: int | None) -> tuple[torch.nn.Module, list[int]]:
    """(a copy of `teacher` with only the layers `evenly_spaced_layers` picks, their indices). The copy's
    config says its new depth, and each kept attention layer its new position (for the KV cache)."""
    layers = decoder_layers(teacher)
    kept = evenly_spaced_layers(len(layers), keep)
    student = copy.deepcopy(teacher)
    student_layers = decoder_layers(student)
    new_layers = torch.nn.ModuleList([student_layers[i] for i in kept])
    base = getattr(student, student.base_model_prefix, student)
    setattr(base, next(n for n in ("layers", "h", "blocks") if getattr(base, n, None) is student_layers), new_layers)
    for position, layer in enumerate(new_layers):
        attention = getattr(layer, "self_attn", None) or getattr(layer, "attn", None)
        if attention is not None and hasattr(attention, "layer_idx"):
            attention.layer_idx = position
    keep_layers_in_config(student.config, kept)
    return student, kept


def keep_layers_in_config(config, kept: list[int]) -> None:
    """Make `config` (in place) describe only the `kept` layers: its depth, and each kept layer's attention kind."""
    for name in ("num_hidden_layers", "n_layer"):
        if hasattr(config, name):
            setattr(config, name, len(kept))
    if getattr(config, "layer_types", None) is not None:  # per-layer attention kinds (sliding or full)
        config.layer_types = [config.layer_types[i] for i in kept]


def student_config(teacher_config, keep: int | None):
    """The config of `student_from_teacher(teacher, keep)`'s student, without building either model (the
    planner's trace); `keep` None: half the teacher's layers, as the distillation recipe's default."""
    layers = getattr(teacher_config, "num_hidden_layers", None) or teacher_config.n_layer
    config = copy.deepcopy(teacher_config)
    keep_layers_in_config(config, evenly_spaced_layers(layers, keep))
    return config
