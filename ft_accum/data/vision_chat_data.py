"""Vision-language chat data: TRL's vision format, assistant-only labels, micro-batches that split by rows.

A row is a conversation in TRL's vision format: a `messages` list of turns whose `content` is a
string or a list of `{"type": "image"}` / `{"type": "text", "text": ...}` parts, and an `images`
list (image files relative to the data file, `datasets` Image values, or PIL images), one per
image part, in order. Rows with no image are allowed; an image in an assistant turn is not (the
answer is text).

Labels. The model's processor renders a conversation with its chat template and expands each image
part into the image's tokens (SmolVLM: `<fake_token_around_image><global-img><image>×64…`; Qwen2-VL:
`<|vision_start|><|image_pad|>×n<|vision_end|>`, n from the image's size). The loss covers the
assistant's text only: assistant turn i's tokens are those between the rendering of
`turns[:i]` with the generation prompt and the rendering of `turns[:i+1]` (checked to be
prefixes of the whole, row by row, as `chat_data.assistant_mask`), so image tokens, padding,
system and user turns are never targets, and never counted.

Truncation never cuts through an image: a row longer than `max_length` is cut after its last
image's tokens (counted), dropped when the cut would fall inside or before them (counted), and an
image whose tokens alone exceed `max_length` stops the run in one line.

Collation re-runs the processor on the micro-batch's texts and images, so each architecture gets
its own pixel layout: per row (Idefics3: `pixel_values` of shape rows × images × C × H × W), per
image (LLaVA, Gemma 3) or per patch (Qwen2-VL's `pixel_values` flattened over all images of the
batch, `image_grid_thw` per image). `row_of` records, for each tensor not laid out by rows, which
row each of its entries belongs to, so `training/windows.py`'s row splitting (Accelerate's
repeated rows, `--auto_micro_batch`) takes whole images with their rows and never cuts one apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ft_accum.core.errors import ConfigError

ROLES = ("system", "user", "assistant")
TEXT_KEYS = ("input_ids", "attention_mask")


def image_parts(content) -> int:
    """How many `{"type": "image"}` parts a turn's content holds (a string holds none)."""
    if isinstance(content, str):
        return 0
    return sum(isinstance(part, dict) and part.get("type") == "image" for part in content)


def check_vision_messages(messages, num_images: int, where: str) -> None:
    """Turns of known roles whose content is a string or a list of image/text parts, an assistant
    turn, no image in an assistant turn, and as many image parts as images."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: messages must be a non-empty list of turns, got {str(messages)[:60]!r}")
    for turn in messages:
        content = turn.get("content") if isinstance(turn, dict) else None
        parts_ok = isinstance(content, list) and all(
            isinstance(p, dict)
            and (p.get("type") == "image" or (p.get("type") == "text" and isinstance(p.get("text"), str)))
            for p in content
        )
        if not isinstance(turn, dict) or turn.get("role") not in ROLES:
            raise ConfigError(f"{where}: every turn needs a role in {', '.join(ROLES)}, got {str(turn)[:80]!r}")
        if not (isinstance(content, str) or parts_ok):
            raise ConfigError(
                f"{where}: a turn's content must be a string or a list of {{'type': 'image'}} and "
                f"{{'type': 'text', 'text': ...}} parts, got {str(content)[:80]!r}"
            )
        if turn["role"] == "assistant" and image_parts(content):
            raise ConfigError(
                f"{where}: an assistant turn holds an image; answers are text, move the image to a user turn"
            )
    if not any(turn["role"] == "assistant" for turn in messages):
        raise ConfigError(
            f"{where}: the conversation has no assistant turn, so nothing to learn; drop the row or add the answer"
        )
    placeholders = sum(image_parts(turn["content"]) for turn in messages)
    if placeholders != num_images:
        raise ConfigError(
            f"{where}: {placeholders} image part(s) in the messages but {num_images} image(s) in the images column; "
            "each {'type': 'image'} part takes the next image, so the two must match"
        )


def load_image(source, base_dir: Path | None, where: str):
    """An RGB PIL image from a path (relative to the data file's folder), a `datasets` Image value
    ({"bytes", "path"}) or a PIL image; a missing or undecodable file is one line naming the row."""
    import io

    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    try:
        if isinstance(source, dict) and source.get("bytes"):
            image = Image.open(io.BytesIO(source["bytes"]))
        else:
            path = Path(source["path"] if isinstance(source, dict) else source)
            path = path if path.is_absolute() or base_dir is None else base_dir / path
            image = Image.open(path)
        image.load()
    except FileNotFoundError as exc:
        raise ConfigError(
            f"{where}: image file {exc.filename} not found; image paths are relative to the data file"
        ) from None
    except (UnidentifiedImageError, OSError) as exc:
        raise ConfigError(f"{where}: an image does not decode ({exc}); fix or drop the file") from None
    return image.convert("RGB")


def blank_image(size: int = 32):
    """A black RGB image: the stand-in a batch without an image runs through the vision tower (each
    processor resizes it to its own size). Black, not zero after normalisation, so that Idefics3 does
    not drop it as padding."""
    from PIL import Image

    return Image.new("RGB", (size, size))


def vision_conversations_of(raw, messages_column: str, images_column: str, base_dirs: dict) -> dict[str, list]:
    """{split: [(messages, [image source, ...]), ...]}, every row checked (`check_vision_messages`) and
    its images decoded once (a bad file stops the run here, not mid-training)."""
    conversations = {}
    for split, rows in raw.items():
        if messages_column not in rows.column_names:
            raise ConfigError(
                f"the {split} data has no {messages_column!r} column (it has {', '.join(rows.column_names)}); "
                "name yours with --messages_column"
            )
        has_images = images_column in rows.column_names
        if has_images:
            rows = rows.cast_column(images_column, _undecoded(rows.features[images_column]))
        conversations[split] = []
        for i, row in enumerate(rows):
            where = f"{split} row {i + 1}"
            sources = (row[images_column] or []) if has_images else []
            sources = sources if isinstance(sources, list) else [sources]
            check_vision_messages(row[messages_column], len(sources), where)
            for source in sources:
                load_image(source, base_dirs.get(split), where)
            conversations[split].append((row[messages_column], sources, base_dirs.get(split)))
    return conversations


def _undecoded(feature):
    """The column's feature with `datasets.Image` values kept as {bytes, path} (decoded when used)."""
    import datasets

    if isinstance(feature, datasets.Image):
        return datasets.Image(decode=False)
    if isinstance(feature, (datasets.Sequence, list)):
        inner = feature.feature if isinstance(feature, datasets.Sequence) else feature[0]
        return datasets.Sequence(_undecoded(inner)) if isinstance(feature, datasets.Sequence) else [_undecoded(inner)]
    if hasattr(datasets, "List") and isinstance(feature, datasets.List):
        return datasets.List(_undecoded(feature.feature))
    return feature


def encode(processor, texts: list[str], images: list[list]):
    """The processor's tensors for `texts` with their rows' images (nested per row; none: text only)."""
    if not any(images):
        return processor(text=texts, return_tensors="pt", padding=True)
    return processor(text=texts, images=images, return_tensors="pt", padding=True)


def image_token_ids(processor, config=None) -> set[int]:
    """The ids that stand for an image in a rendered row: the image placeholder and the special
    tokens around it (Idefics3's `<fake_token_around_image>`, `<global-img>`; Qwen2-VL's
    `<|vision_start|>`, `<|vision_end|>`; Gemma 3's `<start_of_image>`, `<end_of_image>`), named by
    the processor, its tokenizer or the model's config."""
    tokenizer = processor.tokenizer
    from_config = {getattr(config, a) for a in dir(config) if a.endswith(("_token_id", "_token_index"))
                   and any(w in a for w in ("image", "vision", "boi", "eoi"))} if config is not None else set()  # fmt: skip
    attributes = [
        a
        for a in dir(processor)
        if a.endswith(("_token", "_tag")) and ("im" in a or "vision" in a or a in ("boi_token", "eoi_token"))
    ]
    names = [getattr(processor, a, None) for a in attributes]
    names += [getattr(tokenizer, a, None) for a in ("image_token", "boi_token", "eoi_token", "vision_start_token",
                                                   "vision_end_token")]  # fmt: skip
    ids = {tokenizer.convert_tokens_to_ids(n) for n in names if isinstance(n, str) and n in tokenizer.get_vocab()}
    if isinstance(getattr(processor, "image_token_id", None), int):
        ids.add(processor.image_token_id)
    ids |= {i for i in from_config if isinstance(i, int)}
    return ids - {tokenizer.unk_token_id, tokenizer.pad_token_id, None}


def assistant_labels(processor, messages: list, images: list, where: str) -> tuple[list[int], list[int]]:
    """(token ids of the whole rendered conversation, labels: the ids of assistant text, -100 elsewhere)."""
    render = processor.apply_chat_template
    ids = encode(processor, [render(messages, tokenize=False)], [images])["input_ids"][0].tolist()
    labels = [-100] * len(ids)
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        seen = sum(image_parts(t["content"]) for t in messages[:i])
        prompt = encode(processor, [render(messages[:i], tokenize=False, add_generation_prompt=True)], [images[:seen]])
        upto = encode(processor, [render(messages[: i + 1], tokenize=False)], [images[:seen]])["input_ids"][0].tolist()
        prompt, start = prompt["input_ids"][0].tolist(), prompt["input_ids"].shape[1]
        if ids[: len(upto)] != upto or ids[:start] != prompt or start > len(upto):
            raise ConfigError(
                f"{where}: the processor's chat template renders a conversation's prefix differently from the "
                "whole conversation, so the assistant's tokens cannot be found; give the processor a template "
                "whose turns render independently"
            )
        labels[start : len(upto)] = ids[start : len(upto)]
    return ids, labels


@dataclass
class VisionChats:
    rows: list[dict]  # text, images, base_dir, input_ids, labels
    truncated: int  # rows cut after their last image at max_length
    dropped: int  # rows whose cut would fall inside an image, or that keep no answer token
    images: int  # images in the kept rows
    image_tokens: int  # their tokens, markers included


def tokenize_vision_chats(
    processor, conversations: list, max_length: int, image_ids: set[int], split: str = "train"
) -> VisionChats:
    """Token ids and assistant-only labels per conversation; cut at `max_length` only after the last
    image's tokens (`image_ids`: `image_token_ids`)."""
    rows, truncated, dropped, num_images, image_tokens = [], 0, 0, 0, 0
    for i, (messages, sources, base_dir) in enumerate(conversations):
        where = f"{split} row {i + 1}"
        images = [load_image(s, base_dir, where) for s in sources]
        ids, labels = assistant_labels(processor, messages, images, where)
        positions = [p for p, token in enumerate(ids) if token in image_ids]
        if images and len(ids) > max_length:
            per_image = len(positions) // len(images)
            if per_image > max_length:
                raise ConfigError(
                    f"{where}: an image takes {per_image} tokens, more than --max_seq_length {max_length}; "
                    "raise --max_seq_length or make the processor's images smaller"
                )
            if positions[-1] >= max_length:  # the cut would fall inside or before an image's tokens
                dropped += 1
                continue
        if len(ids) > max_length:
            truncated += 1
            ids, labels = ids[:max_length], labels[:max_length]
        labels[0] = -100
        if all(label == -100 for label in labels[1:]):
            dropped += 1
            continue
        num_images, image_tokens = num_images + len(images), image_tokens + len(positions)
        text = processor.apply_chat_template(messages, tokenize=False)
        rows.append({"text": text, "images": sources, "base_dir": base_dir, "input_ids": ids, "labels": labels})
    return VisionChats(rows, truncated, dropped, num_images, image_tokens)


def tokenize_splits(
    processor, conversations: dict[str, list], max_length: int, image_ids: set[int]
) -> dict[str, VisionChats]:
    """`tokenize_vision_chats` of each split; a split left with no answer token stops in one line."""
    tokenized = {
        s: tokenize_vision_chats(processor, chats, max_length, image_ids, s) for s, chats in conversations.items()
    }
    for split, chats in tokenized.items():
        if not chats.rows:
            raise ConfigError(f"no {split} conversation keeps an answer token within --max_seq_length; raise it")
    return tokenized


def rows_of_images(batch, rows: list[dict]) -> dict:
    """{key: the row of each leading entry} for the image tensors that are not laid out one entry per
    row: per image (LLaVA, Gemma 3, Qwen2-VL's `image_grid_thw`) or per patch (Qwen2-VL's
    `pixel_values`, `image_grid_thw`'s t·h·w patches per image)."""
    import torch

    per_image = torch.tensor([r for r, row in enumerate(rows) for _ in row["images"]], dtype=torch.long)
    per_patch = None
    if "image_grid_thw" in batch:
        per_patch = per_image.repeat_interleave(batch["image_grid_thw"].prod(-1))
    owners = {}
    for key, value in batch.items():
        if key in TEXT_KEYS or not isinstance(value, torch.Tensor) or not value.dim():
            continue
        if value.dim() >= 2 and value.shape[:2] == batch["input_ids"].shape:
            continue  # one entry per token of each row (token_type_ids, mm_token_type_ids)
        if _is_per_row(key, batch, rows):
            continue
        if len(value) == len(per_image):
            owners[key] = per_image
        elif per_patch is not None and len(value) == len(per_patch):
            owners[key] = per_patch
        else:
            raise ConfigError(f"the processor's {key!r} has {len(value)} entries for {len(rows)} rows and "
                              f"{len(per_image)} images: a layout this recipe cannot split by rows")  # fmt: skip
    return owners


def _is_per_row(key: str, batch, rows: list[dict]) -> bool:
    """Idefics3's layout: rows × (the most images in a row) × …, padded with all-zero images."""
    pixel_values = batch.get("pixel_values")
    most = max(len(r["images"]) for r in rows)
    return (
        key in ("pixel_values", "pixel_attention_mask")
        and pixel_values is not None
        and pixel_values.dim() == 5
        and "image_grid_thw" not in batch
        and tuple(pixel_values.shape[:2]) == (len(rows), most)
    )


def collate_vision_chats(processor, pad_token_id: int):
    """A micro-batch: the processor's tensors for the rows' texts and images (right-padded, cut to
    each row's kept length), their labels, `num_images` per row and `row_of` (`rows_of_images`)."""
    import torch

    def collate(rows: list[dict]) -> dict:
        images = [[load_image(s, r["base_dir"], "a training row") for s in r["images"]] for r in rows]
        encoded = encode(processor, [r["text"] for r in rows], images)
        length = max(len(r["input_ids"]) for r in rows)
        input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        labels = torch.full((len(rows), length), -100, dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            if encoded["input_ids"][i, :n].tolist() != row["input_ids"]:
                raise ConfigError("the processor rendered a row differently in a batch than alone (its padding side?)")
            input_ids[i, :n], attention_mask[i, :n], labels[i, :n] = (
                encoded["input_ids"][i, :n],
                1,
                torch.tensor(row["labels"]),
            )
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}  # input_ids first: find_batch_size reads it
        batch |= {k: v for k, v in encoded.items() if k not in TEXT_KEYS and not _is_per_token(v, encoded)}
        batch |= {k: v[:, :length] for k, v in encoded.items() if k not in TEXT_KEYS and _is_per_token(v, encoded)}
        row_of = rows_of_images(batch, rows)
        batch |= {"labels": labels, "num_images": torch.tensor([len(r["images"]) for r in rows]), "row_of": row_of}
        return batch

    return collate


def _is_per_token(value, encoded) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == encoded["input_ids"].shape


def model_image_keys(batch: dict) -> list[str]:
    """The tensors of a collated batch the model takes besides the text: pixel values and their layout;
    none when its rows have no image (rows cut from a batch with images keep Idefics3's all-padding
    `pixel_values`, which its vision tower cannot take)."""
    keys = [k for k in batch if k not in (*TEXT_KEYS, "labels", "num_images", "row_of")]
    return keys if batch["num_images"].sum() else [k for k in keys if _is_per_token(batch[k], batch)]
