"""NEFTune (Jain et al. 2023, arXiv:2310.05914), the same update at any split of the batch.

NEFTune adds uniform noise to the input embeddings while training: U(−1, 1) · α / √(L·d), with d
the embedding width and L the sequence's length. transformers' `neftune_post_forward_hook` takes L
from the padded (or packed) micro-batch and puts noise on the padding too, and draws it from the
global RNG: the noise a row gets then depends on which rows share its micro-batch and on the
micro-batch's place in the window, so (8 × 1) and (2 × 4) are different updates (transformers
#34659). Here each row gets noise on its real tokens only (the attention mask's), scaled with its
own length Lᵢ (as the paper's code does), from a generator seeded by (seed, update, the row's
tokens): the same noise whatever the micro-batch, the process or a resume.

The noise is added only where gradients are being built (a training forward), never in an
evaluation or generation, which run without them.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable

import torch


def row_seed(seed: int, update: int, token_ids: torch.Tensor) -> int:
    """A 63-bit seed for one row's noise from (seed, update, its real tokens), independent of its neighbours."""
    digest = hashlib.blake2b(token_ids.to("cpu", torch.int64).numpy().tobytes(), digest_size=8)
    digest.update(f"{seed}:{update}".encode())
    return int.from_bytes(digest.digest(), "little") >> 1


def noisy_embeddings(
    embeddings: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    alpha: float,
    seed: int,
    update: int,
) -> torch.Tensor:
    """`embeddings` (B, T, d) plus each row's NEFTune noise on its real tokens: U(−1, 1) · α / √(Lᵢ·d)."""
    real = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
    noise = torch.zeros_like(embeddings)
    width = embeddings.shape[-1]
    for row in range(len(input_ids)):
        positions = real[row].nonzero().squeeze(-1)
        if len(positions) == 0:
            continue
        generator = torch.Generator(device=embeddings.device)
        generator.manual_seed(row_seed(seed, update, input_ids[row, positions]))
        draw = torch.rand(len(positions), width, generator=generator, device=embeddings.device, dtype=torch.float32)
        scale = alpha / math.sqrt(len(positions) * width)
        noise[row, positions] = ((draw * 2 - 1) * scale).to(embeddings.dtype)
    return embeddings + noise


def add_neftune_noise(model: torch.nn.Module, alpha: float, seed: int, current_update: Callable[[], int]) -> list:
    """Hooks on `model` (unwrapped): the forward's attention mask is kept, and its input embeddings get
    `noisy_embeddings` at update `current_update()` in every forward that builds gradients. Returns the
    hook handles."""
    seen: dict[str, torch.Tensor | None] = {"attention_mask": None}

    def keep_mask(module, args, kwargs):
        seen["attention_mask"] = kwargs.get("attention_mask")

    def add_noise(module, args, output):
        if not torch.is_grad_enabled():
            return output
        input_ids = args[0] if args else None
        mask = seen["attention_mask"]
        if input_ids is None or (mask is not None and mask.shape != input_ids.shape):
            mask = None  # a call of the embedding outside the model's own forward: every token is real
        return noisy_embeddings(output, input_ids, mask, alpha, seed, current_update())

    return [
        model.register_forward_pre_hook(keep_mask, with_kwargs=True),
        model.get_input_embeddings().register_forward_hook(add_noise),
    ]
