"""A vision-language micro-batch as its processor lays it out, for the planner's trace: the image tensors of
each family, and how many placeholder tokens an image of a stated size becomes in the language model.

Image tokens per image (what the processors make of a square image of S px; P the patch size):
- Idefics3 / SmolVLM: a tile of the tower's size S is (S/P)² patches, pixel-shuffled by `scale_factor` k
  to (S/P)²/k² tokens (SmolVLM-Instruct: 384 px, P 14, k 3 → 81, its model card). Larger images are
  split into tiles plus one global tile: plan them as that many images (`images_per_sample`).
- Qwen2-VL / Qwen2.5-VL: (S/P)² patches of P px, merged `spatial_merge_size`² into one token (448 px,
  P 14, merge 2 → 256), in the flattened layout of `pixel_values` rows with `image_grid_thw`.
- LLaVA: (S/P)² patch features (the CLS feature dropped by the default feature strategy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ft_accum.core.errors import ConfigError

QWEN_VL = ("qwen2_vl", "qwen2_5_vl")
IDEFICS = ("idefics3", "smolvlm")
# Gemma 3 is left out: its forward reads a value the trace holds fake (aten._local_scalar_dense).
FAMILIES = (*IDEFICS, *QWEN_VL, "llava")
QWEN_DEFAULT_IMAGE_SIZE = 448  # Qwen's towers take any size; 448 px is 256 tokens, a common max_pixels setting


@dataclass(frozen=True)
class ImageLayout:
    """One family's image at `image_size` px: the placeholder token, how many the image becomes, and the
    tensors of `images` such images as the processor returns them."""

    model_type: str
    image_size: int
    image_token_id: int
    tokens_per_image: int

    def image_inputs(self, config, images: int) -> dict[str, torch.Tensor]:
        s, vision = self.image_size, config.vision_config
        if self.model_type in IDEFICS:
            return {"pixel_values": torch.randn(images, 1, 3, s, s)}
        if self.model_type in QWEN_VL:
            patches = (s // vision.patch_size) ** 2
            width = getattr(vision, "in_chans", 3) * vision.temporal_patch_size * vision.patch_size**2
            grid = torch.tensor([[1, s // vision.patch_size, s // vision.patch_size]] * images)
            return {"pixel_values": torch.randn(images * patches, width), "image_grid_thw": grid}
        return {"pixel_values": torch.randn(images, 3, s, s)}


def image_layout(config, image_size: int | None = None) -> ImageLayout:
    """The layout of an image of `image_size` px (default: the tower's own size; 448 for Qwen's) for
    the vision-language model `config` describes; one line for a family it does not know."""
    model_type = config.model_type
    if model_type not in FAMILIES or not hasattr(config, "vision_config"):
        raise ConfigError(
            f"the planner lays out images for {', '.join(FAMILIES)}, not {model_type!r}; pass one of their configs"
        )
    vision = config.vision_config
    size = image_size or getattr(vision, "image_size", None) or QWEN_DEFAULT_IMAGE_SIZE
    if model_type in QWEN_VL:
        unit = vision.patch_size * vision.spatial_merge_size
        if size % unit:
            raise ConfigError(
                f"--image_size must be a multiple of {unit} px for {model_type} (patch × merge), got {size}"
            )
        tokens = (size // vision.patch_size) ** 2 // vision.spatial_merge_size**2
    else:
        if size != vision.image_size:
            raise ConfigError(
                f"{model_type}'s tower takes tiles of {vision.image_size} px, got --image_size {size}; plan a larger "
                "image as the tiles its processor cuts (--images_per_sample)"
            )
        tokens = (size // vision.patch_size) ** 2 // getattr(config, "scale_factor", 1) ** 2
    return ImageLayout(model_type, size, image_token_id(config), tokens)


def image_token_id(config) -> int:
    for name in ("image_token_id", "image_token_index"):
        if getattr(config, name, None) is not None:
            return getattr(config, name)
    raise ConfigError(f"the {config.model_type} config names no image token (image_token_id); pass the model's own")


def image_prefix(config, layout: ImageLayout, images: int, seq_len: int) -> list[int]:
    """The token ids a row's `images` images take (Qwen's between vision start and end markers); one line
    where they leave no room for text in `seq_len`."""
    image_tokens = [layout.image_token_id] * layout.tokens_per_image
    if layout.model_type in QWEN_VL:
        image_tokens = [config.vision_start_token_id, *image_tokens, config.vision_end_token_id]
    prefix = image_tokens * images
    if len(prefix) >= seq_len:
        raise ConfigError(
            f"{images} image(s) of {layout.image_size} px are {len(prefix)} tokens, no room in --seq_len {seq_len}; "
            f"raise --seq_len above {len(prefix)} or lower --images_per_sample/--image_size"
        )
    return prefix


def vision_language_batch(config, layout: ImageLayout, micro_batch_size: int, seq_len: int, images: int) -> dict:
    """m rows of `seq_len` tokens, each opening with its `images` images' placeholder tokens (Qwen's between
    its vision start and end markers), the rest text, every text token a target (the most a row can
    count); the image tensors as the processor returns them, and the per-token type ids Qwen's M-RoPE reads."""
    prefix = image_prefix(config, layout, images, seq_len)
    vocab = config.get_text_config().vocab_size
    text = torch.randint(0, vocab, (micro_batch_size, seq_len - len(prefix)))
    # No text token may be one of the image's (the model would count it as an image placeholder).
    text = torch.where(torch.isin(text, torch.tensor(sorted(set(prefix)))), 0, text)
    input_ids = torch.cat([torch.tensor(prefix).expand(micro_batch_size, -1), text], dim=1)
    labels = torch.cat([torch.full((micro_batch_size, len(prefix)), -100), text], dim=1)
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "labels": labels,
        "num_images": torch.full((micro_batch_size,), images),
        **layout.image_inputs(config, micro_batch_size * images),
    }
    if layout.model_type in QWEN_VL:
        batch["mm_token_type_ids"] = (input_ids == layout.image_token_id).long()
    return batch
