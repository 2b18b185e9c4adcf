"""The offline default vision-language model: SmolVLM's architecture assembled from the bundled SmolLM2.

No pretrained vision-language weights can be installed offline, so the SmolVLM-256M architecture
(Idefics3: a SigLIP vision tower, a pixel-shuffle connector, a Llama language model; Marafioti et
al. 2025, "SmolVLM") is put together here from the bundled SmolLM2-135M-Instruct
(`offline_assets.bundled_smollm2_dir`) and a small SigLIP tower initialised from a fixed seed,
which the recipe trains from scratch. SmolVLM's processor layout is kept: `<fake_token_around_image>`,
`<global-img>` and `<image>` are added to the tokenizer, and an image becomes `image_seq_len` =
(image_size / patch_size)² / scale_factor² `<image>` tokens between its markers. The assembled
folder is cached like the converted SmolLM2 (written to a temporary folder and renamed, one
process at a time), keyed by the language model's config and the tower's.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path

import torch

from ft_accum.data.offline_assets import CONVERTING_BUNDLED_MODEL, bundled_smollm2_dir

IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>")

# SmolVLM's layout at a digit's scale: 16 px images in 4 px patches (16 patches), pixel-shuffled by
# 2 into 4 tokens of the language model's width, each a quarter of the digit. The tower is SigLIP's,
# 2 layers of 128.
TINY_VISION = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=16,
    patch_size=4,
)
SCALE_FACTOR = 2
VISION_SEED = 0

# Turns whose content is a list of {"type": "image"} / {"type": "text"} parts, in SmolLM2's ChatML.
CHATML_VISION_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def image_seq_len(image_size: int, patch_size: int, scale_factor: int) -> int:
    """Tokens per image in Idefics3: (image_size / patch_size)² patches, pixel-shuffled by scale_factor²."""
    return (image_size // patch_size) ** 2 // scale_factor**2


def assembled_processor(tokenizer, image_size: int, patch_size: int, scale_factor: int):
    """SmolVLM's processor at `image_size` px, no splitting into tiles (one image, one global view)."""
    from transformers import Idefics3ImageProcessor, Idefics3Processor

    image_processor = Idefics3ImageProcessor(
        do_image_splitting=False,
        size={"longest_edge": image_size},
        max_image_size={"longest_edge": image_size},
    )
    seq_len = image_seq_len(image_size, patch_size, scale_factor)
    return Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=seq_len,
        chat_template=CHATML_VISION_TEMPLATE,
    )


def assemble_smolvlm(text_dir: Path, target: Path) -> Path:
    """An Idefics3 model whose language model is the causal LM in `text_dir` (its weights, its
    tokenizer with the image tokens added) and whose SigLIP tower and connector are new, seeded
    with VISION_SEED; saved with its processor in `target`."""
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3VisionConfig,
    )

    tokenizer = AutoTokenizer.from_pretrained(text_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    token = CONVERTING_BUNDLED_MODEL.set(True)  # the cached model stays whole under a layer cut
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's seeded RNG is not consumed
            torch.manual_seed(VISION_SEED)
            text = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
            config = Idefics3Config(
                text_config=text.config.to_dict(),
                vision_config=Idefics3VisionConfig(**TINY_VISION).to_dict(),
                scale_factor=SCALE_FACTOR,
                image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                tie_word_embeddings=text.config.tie_word_embeddings,
            )
            model = Idefics3ForConditionalGeneration(config)
            missing = model.model.text_model.load_state_dict(text.model.state_dict(), strict=True)
            assert not missing.missing_keys and not missing.unexpected_keys
            if not text.config.tie_word_embeddings:
                model.lm_head.load_state_dict(text.lm_head.state_dict())
            model.resize_token_embeddings(len(tokenizer))
    finally:
        CONVERTING_BUNDLED_MODEL.reset(token)
    processor = assembled_processor(tokenizer, TINY_VISION["image_size"], TINY_VISION["patch_size"], SCALE_FACTOR)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    if not (target / "model.safetensors").is_file():  # else another process assembled it meanwhile
        shutil.rmtree(target, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.replace(tmp, target)
    shutil.rmtree(tmp, ignore_errors=True)
    return target


def bundled_smolvlm_dir(cache_dir: str | Path | None = None) -> Path:
    """The offline default vision-language model (see the module docstring), assembled once and cached."""
    from filelock import FileLock

    text_dir = bundled_smollm2_dir(cache_dir)
    key = hashlib.sha256((text_dir / "config.json").read_bytes() + repr(TINY_VISION).encode()).hexdigest()[:12]
    cache_root = Path(cache_dir or os.environ.get("FT_ACCUM_CACHE", Path.home() / ".cache" / "ft_accum"))
    target = cache_root / f"smolvlm-assembled-{key}"
    if (target / "model.safetensors").is_file():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_root / f"{target.name}.lock")):
        if (target / "model.safetensors").is_file():
            return target
        return assemble_smolvlm(text_dir, target)
