"""Vision-language models: the offline SmolVLM assembled from parts, and the zero-weighted vision pass.

The offline default (`bundled_smolvlm_dir`). No pretrained vision-language weights can be
installed offline, so the SmolVLM-256M architecture (Idefics3: a SigLIP vision tower, a
pixel-shuffle connector, a Llama language model; Marafioti et al. 2025, "SmolVLM") is put together
here from the bundled SmolLM2-135M-Instruct (`offline_assets.bundled_smollm2_dir`) and a small
SigLIP tower initialised from a fixed seed, which the recipe trains from scratch. SmolVLM's
processor layout is kept: `<fake_token_around_image>`, `<global-img>` and `<image>` are added to
the tokenizer, and an image becomes `image_seq_len` = (image_size / patch_size)² / scale_factor²
`<image>` tokens. The assembled folder is cached like the converted SmolLM2 (written to a
temporary folder and renamed, one process at a time), keyed by the language model's config.

The vision pass (`vision_features_of`). Under DDP, FSDP and DeepSpeed every process must run the
vision tower in every micro-batch, else its parameters get no gradient on one process and the
collective waits for ever (DDP's unused parameters, TRL #6617; ZeRO-3 and FSDP hang, DeepSpeed
#7170, transformers #37186). A micro-batch without an image runs the tower on a blank image and
adds `0 · Σ features` to its loss: the tower's gradient gets exact zeros, and every other
gradient is bitwise unchanged (a separate graph, tests/test_vision_language.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
from pathlib import Path

import torch

from ft_accum.core.errors import ConfigError

IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>")

# SmolVLM's layout at a digit's scale: 32 px images in 4 px patches (64 patches), pixel-shuffled by
# 2 into 16 tokens of the language model's width. The tower is SigLIP's, 2 layers of 128.
TINY_VISION = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=32,
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
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=seq_len, chat_template=CHATML_VISION_TEMPLATE
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

    from ft_accum.data.offline_assets import CONVERTING_BUNDLED_MODEL

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

    from ft_accum.data.offline_assets import bundled_smollm2_dir

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


def check_vision_language(model, name: str) -> None:
    """A model with a vision tower (`get_image_features`), else one line naming the recipe to use."""
    if not callable(getattr(model, "get_image_features", None)):
        raise ConfigError(
            f"{name} is a {type(model).__name__}, not a vision-language model (it has no get_image_features); "
            "for a text-only model use recipes/instruction_tuning.py"
        )


def vision_features_of(model, image_inputs: dict) -> torch.Tensor:
    """Σ of the vision tower's and connector's output on `image_inputs` (pixel_values and the
    model's image keys): weighted by 0 it gives every vision parameter an exact-zero gradient."""
    outputs = model.get_image_features(**image_inputs)
    features = outputs.pooler_output if hasattr(outputs, "pooler_output") else outputs
    if isinstance(features, (list, tuple)):
        return sum(f.sum() for f in features)
    return features.sum()


# Where each family keeps its parts (Idefics3/SmolVLM; Qwen2-VL, whose projector is `visual.merger`;
# LLaVA and Gemma 3), as attribute paths under the model.
LANGUAGE_MODELS = ("language_model", "text_model")
VISION_TOWERS = ("vision_tower", "vision_model", "visual")
CONNECTORS = ("multi_modal_projector", "connector", "visual.merger")


def part_name(model, candidates: tuple[str, ...], what: str) -> str:
    """The dotted name, from the model's root, of the first of `candidates` it has."""
    names = dict(model.named_modules())
    for name in names:
        if any(name == c or name.endswith(f".{c}") for c in candidates) and name.count(".") <= 2:
            return name
    raise ConfigError(
        f"{type(model).__name__} has no {what} named {' or '.join(candidates)}; this recipe knows Idefics3 (SmolVLM), "
        "Qwen2-VL, LLaVA and Gemma 3"
    )


def lora_targets(model, target_modules: str) -> str:
    """peft's `target_modules` as one regex: the language model's linear layers (`all-linear`) or those
    named in a comma list, never the vision tower's or the connector's."""
    language = part_name(model, LANGUAGE_MODELS, "language model")
    if target_modules == "all-linear":
        leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.get_submodule(language).named_modules()
                         if isinstance(m, torch.nn.Linear)})  # fmt: skip
    else:
        leaves = [m.strip() for m in target_modules.split(",") if m.strip()]
    return rf"{re.escape(language)}\..*\.({'|'.join(map(re.escape, leaves))})"


def trained_parts(model, train_vision_tower: bool) -> list[str]:
    """What trains whole beside the language model's LoRA: the connector, and the vision tower with
    --train_vision_tower (which holds Qwen2-VL's connector)."""
    connector = part_name(model, CONNECTORS, "connector")
    if not train_vision_tower:
        return [connector]
    tower = part_name(model, VISION_TOWERS, "vision tower")
    return [tower] if connector.startswith(f"{tower}.") else [tower, connector]


def freeze_vision_tower(model) -> None:
    """A full fine-tune without --train_vision_tower: the tower is frozen, its connector trains."""
    tower, connector = part_name(model, VISION_TOWERS, "vision tower"), part_name(model, CONNECTORS, "connector")
    for name, parameter in model.named_parameters():
        if name.startswith(f"{tower}.") and not name.startswith(f"{connector}."):
            parameter.requires_grad_(False)


def check_processor(processor, name: str) -> None:
    """A processor with an image processor, a tokenizer and a chat template, else one line."""
    if not hasattr(processor, "image_processor") or not hasattr(processor, "tokenizer"):
        raise ConfigError(
            f"{name} has no image processor (AutoProcessor gave a {type(processor).__name__}): is it a vision-language "
            "model? For a text-only model use recipes/instruction_tuning.py"
        )
    if not (processor.chat_template or processor.tokenizer.chat_template):
        raise ConfigError(
            f"the processor of {name} has no chat template; save one with the processor (processor.chat_template), "
            "as every hub vision-language model has"
        )


def image_feature_keys(model) -> set[str]:
    """The inputs `model.get_image_features` takes (Idefics3: pixel_values, pixel_attention_mask;
    Qwen2-VL: pixel_values, image_grid_thw; LLaVA, Gemma 3: pixel_values)."""
    import inspect

    parameters = inspect.signature(model.get_image_features).parameters.values()
    return {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def blank_image_inputs(processor, image_keys) -> dict:
    """The processor's image tensors for one black image: a micro-batch without an image runs the tower
    on these (`vision_features_of`, weighted by 0). Black, not zero after normalisation, so that Idefics3
    does not drop it as padding."""
    from PIL import Image

    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False)
    blank = Image.new("RGB", (32, 32))  # each processor resizes it to its own size
    encoded = processor(text=[text], images=[[blank]], return_tensors="pt")
    return {k: v for k, v in encoded.items() if k in image_keys}


def zero_weight_vision_pass(accelerator, model, processor):
    """`vision_pass()` → Σ of the vision tower's output on a blank image (`blank_image_inputs`), for the
    loop to add weighted by 0 when a micro-batch holds no image. Called on the unwrapped model; under
    FSDP2 `get_image_features` is registered as a forward method of the sharded root
    (`register_fsdp_forward_method`), so that the root's own parameters are gathered for it too."""
    from accelerate.utils import DistributedType

    unwrapped = accelerator.unwrap_model(model)
    blank = blank_image_inputs(processor, image_feature_keys(unwrapped))
    blank = {k: v.to(accelerator.device) for k, v in blank.items()}
    if accelerator.distributed_type == DistributedType.FSDP:
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

        if isinstance(unwrapped, FSDPModule):
            register_fsdp_forward_method(unwrapped, "get_image_features")
    return lambda: vision_features_of(unwrapped, blank)
