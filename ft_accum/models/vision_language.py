"""Vision-language models: which part is which, what trains, and the zero-weighted vision pass.

The parts (`part_name`): each family keeps its language model, vision tower and connector under its
own names (Idefics3/SmolVLM: `text_model`, `vision_model`, `connector`; Qwen2-VL: `language_model`,
`visual`, `visual.merger`; LLaVA and Gemma 3: `language_model`, `vision_tower`,
`multi_modal_projector`). LoRA goes on the language model's linear layers only (`lora_targets`); the
connector trains whole, and the vision tower with --train_vision_tower (`trained_parts`).

The vision pass (`BlankVisionPass`). Under DDP, FSDP and DeepSpeed every process must run the
vision tower in every micro-batch, else its parameters get no gradient on one process and the
collective waits for ever (DDP's unused parameters, TRL #6617; ZeRO-3 and FSDP hang, DeepSpeed
#7170, transformers #37186). A micro-batch without an image runs the tower on a blank image inside
the model's forward and adds `0 · Σ features` to the language model's input embeddings: the
tower's gradient gets exact zeros, and every other gradient is bitwise unchanged
(tests/test_vision_language.py).
"""

from __future__ import annotations

import re

import torch

from ft_accum.core.errors import ConfigError


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
    """The dotted name, from the model's root (a peft wrapper's included), of the outermost module named
    one of `candidates`."""
    names = [n for n, _ in model.named_modules() if any(n == c or n.endswith(f".{c}") for c in candidates)]
    if names:
        return min(names, key=lambda n: n.count("."))
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


def blank_image_inputs(processor, image_keys, blank) -> dict:
    """The processor's tensors, of those in `image_keys`, for the one image `blank`
    (`vision_chat_data.blank_image`)."""
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False)
    encoded = processor(text=[text], images=[[blank]], return_tensors="pt")
    return {k: v for k, v in encoded.items() if k in image_keys}


class BlankVisionPass:
    """The vision tower's run on a blank image, for a micro-batch without an image, inside the model's
    own forward: `arm(batch)` before each forward; while armed (the batch holds no image), a hook on
    the language model adds `0 · Σ features` of the blank image to its input embeddings.

    Inside the forward, so that every process calls the same modules in the same order: a forward
    with images runs the vision tower, then the language model, and so does an armed one (FSDP and
    ZeRO-3 gather each module's weights as it is called, so a pass of its own, before or after the
    forward, would pair one process's gathers with another's different ones). Adding +0.0 leaves the
    embeddings, and every gradient but the tower's and connector's (exact zeros), bitwise unchanged.
    `disarm()` before generate(), whose every step would otherwise run it."""

    def __init__(self, accelerator, model, processor, blank_image):
        self.model = accelerator.unwrap_model(model)
        inputs = blank_image_inputs(processor, image_feature_keys(self.model), blank_image)
        self.inputs = {k: v.to(accelerator.device) for k, v in inputs.items()}
        self.armed = False
        language = self.model.get_submodule(part_name(self.model, LANGUAGE_MODELS, "language model"))
        language.register_forward_pre_hook(self._add_zero_weighted, with_kwargs=True)

    def arm(self, batch: dict) -> None:
        self.armed = not batch["num_images"].sum()

    def disarm(self) -> None:
        self.armed = False

    def _add_zero_weighted(self, module, args, kwargs):
        if not self.armed:
            return None
        embeds = kwargs["inputs_embeds"]  # every vision-language model calls its language model with them
        features = vision_features_of(self.model, self.inputs)
        return args, {**kwargs, "inputs_embeds": embeds + 0.0 * features.to(embeds.dtype)}
