"""Generated data with fixed seeds: topic-labelled rows, tagged rows, text and sentence pairs, documents, conversations, preference pairs, and a reward that varies."""

from __future__ import annotations

import json
import random
from pathlib import Path

TOPICS = {
    "sport": "match goal team coach league score player season win cup".split(),
    "money": "bank market shares profit price trade economy rate growth fund".split(),
    "tech": "software phone chip computer network data code internet device screen".split(),
}


COMMON = "the a of and to in on said new year people last first".split()


def make_rows(n: int, seed: int) -> list[dict]:
    """Sentences of 4 to 30 words, so micro-batches pad to different lengths."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = list(TOPICS)[i % len(TOPICS)]
        words = [rng.choice(TOPICS[label] if rng.random() < 0.5 else COMMON) for _ in range(rng.randint(4, 30))]
        rows.append({"text": " ".join(words), "label": label})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_tagged_rows(n: int, seed: int) -> list[dict]:
    """Sentences of 3 to 30 words, about half tagged B-SPORT or B-MONEY, some plural (two sub-tokens)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words, tags = [], []
        for _ in range(rng.randint(3, 30)):
            topic = rng.choice(["sport", "money", None, None])
            word = rng.choice(TOPICS[topic] if topic else COMMON)
            words.append(word + ("s" if rng.random() < 0.3 else ""))
            tags.append(f"B-{topic.upper()}" if topic else "O")
        rows.append({"tokens": words, "ner_tags": tags})
    return rows


def make_text_pairs(n: int, seed: int) -> list[dict]:
    """Seq2seq rows: a source of 5 to 30 words, a target of 1 to 12 of them, sorted."""
    rng = random.Random(seed)
    words = sorted({w for ws in TOPICS.values() for w in ws} | set(COMMON))
    rows = []
    for _ in range(n):
        source = [rng.choice(words) for _ in range(rng.randint(5, 30))]
        rows.append({"source": " ".join(source), "target": " ".join(sorted(source)[: rng.randint(1, 12)])})
    return rows


def make_sentence_pairs(n: int, seed: int) -> list[dict]:
    """Pairs of 4 to 20 words: the same topic scores 5, different topics 0."""
    rng = random.Random(seed)
    topics, rows = list(TOPICS), []
    for i in range(n):
        a, b = topics[i % len(topics)], rng.choice(topics)

        def sentence(topic):
            return " ".join(
                rng.choice(TOPICS[topic] if rng.random() < 0.6 else COMMON) for _ in range(rng.randint(4, 20))
            )

        rows.append({"sentence1": sentence(a), "sentence2": sentence(b), "score": 5.0 if a == b else 0.0})
    return rows


def make_retrieval_pairs(n: int, seed: int, negatives: bool = False) -> list[dict]:
    """(anchor, positive[, negative]) rows of 4 to 20 words: the positive shares the anchor's topic, the
    hard negative (another topic's sentence) does not; lengths differ, so micro-batches pad differently."""
    rng = random.Random(seed)
    topics = list(TOPICS)

    def sentence(topic):
        return " ".join(rng.choice(TOPICS[topic] if rng.random() < 0.6 else COMMON) for _ in range(rng.randint(4, 20)))

    rows = []
    for i in range(n):
        topic = topics[i % len(topics)]
        row = {"anchor": sentence(topic), "positive": sentence(topic)}
        if negatives:
            row["negative"] = sentence(rng.choice([t for t in topics if t != topic]))
        rows.append(row)
    return rows


def make_documents(n: int, seed: int, min_words: int = 4, max_words: int = 40) -> list[dict]:
    """Documents of very different lengths, so padded micro-batches hold different token counts."""
    rng = random.Random(seed)
    words = COMMON + [w for ws in TOPICS.values() for w in ws]
    return [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(min_words, max_words)))} for _ in range(n)]


def make_conversations(n: int, seed: int) -> list[dict]:
    """Chats whose answers differ 10× and more in length: one-word answers, 20–40-word answers, and
    some two-round conversations (two assistant turns), as `messages` rows."""
    rng = random.Random(seed)
    words = COMMON + [w for ws in TOPICS.values() for w in ws]

    def say(low, high):
        return " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))

    rows = []
    for i in range(n):
        answer = rng.choice(list(TOPICS)) if i % 2 == 0 else say(20, 40)
        messages = [{"role": "user", "content": say(3, 12)}, {"role": "assistant", "content": answer}]
        if i % 3 == 0:
            messages += [{"role": "user", "content": say(2, 6)}, {"role": "assistant", "content": say(1, 3)}]
        rows.append({"messages": messages})
    return rows


def write_vision_conversations(
    folder: Path, n: int, seed: int, image_counts: tuple[int, ...] = (2, 0, 1, 0, 1, 2)
) -> Path:
    """`n` conversations in TRL's vision format in `folder`/data.jsonl, their images as 8 px PNG files
    in `folder`/images/ (paths relative to the data file): row i has image_counts[i % len] images (the
    default mixes rows of 2, 1 and 0), one-word answers beside 10–25-word ones."""
    import numpy as np
    from PIL import Image

    rng, pixels = random.Random(seed), np.random.default_rng(seed)
    words = COMMON + [w for ws in TOPICS.values() for w in ws]
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        images = []
        for k in range(image_counts[i % len(image_counts)]):
            path = f"images/{seed}-{i}-{k}.png"
            Image.fromarray(pixels.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(folder / path)
            images.append(path)
        question = " ".join(rng.choice(words) for _ in range(rng.randint(2, 6)))
        answer = rng.choice(list(TOPICS)) if i % 2 else " ".join(rng.choice(words) for _ in range(rng.randint(10, 25)))
        parts = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
        rows.append({"messages": [{"role": "user", "content": parts},
                                  {"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                     "images": images})  # fmt: skip
    return write_jsonl(folder / "data.jsonl", rows)


def make_preference_pairs(n: int, seed: int) -> list[dict]:
    """(prompt, chosen, rejected) rows in TRL's format whose responses differ 5× and more in length:
    a one-word answer against 20–40 words, in both orders, some prompts as two-turn conversations."""
    rng = random.Random(seed)
    words = COMMON + [w for ws in TOPICS.values() for w in ws]

    def say(low, high):
        return " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))

    rows = []
    for i in range(n):
        short, long = rng.choice(list(TOPICS)), say(20, 40)
        chosen, rejected = (short, long) if i % 2 == 0 else (long, short)
        prompt = say(3, 12)
        if i % 3 == 0:  # TRL's conversational format: lists of turns
            prompt = [{"role": "user", "content": prompt}, {"role": "assistant", "content": say(1, 3)},
                      {"role": "user", "content": say(2, 6)}]  # fmt: skip
            chosen, rejected = [{"role": "assistant", "content": chosen}], [{"role": "assistant", "content": rejected}]
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def varied_reward(prompts, completions, **columns) -> list[float]:
    """A reward for the GRPO tests that differs between completions of one prompt: a function of the
    completion's text only (its length and letters), so equal completions score equally."""
    texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
    return [(len(t) % 7) / 6 + 0.5 * sum(ch in "aeiou" for ch in t) / max(len(t), 1) for t in texts]


def make_token_pairs(n: int, negatives: bool = False, vocab_size: int = 50, seed: int = 1) -> dict:
    """n (anchor, positive[, negative]) texts as token ids of 3–12 tokens, each column padded to its
    longest: `{column}_input_ids`, `{column}_attention_mask`, as recipes/contrastive_embedding.py collates them."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    pairs = {}
    for column in ("anchor", "positive", "negative") if negatives else ("anchor", "positive"):
        lengths = torch.randint(3, 13, (n,), generator=generator)
        ids = torch.randint(1, vocab_size, (n, int(lengths.max())), generator=generator)
        mask = (torch.arange(ids.shape[1]) < lengths.unsqueeze(1)).long()
        pairs[f"{column}_input_ids"], pairs[f"{column}_attention_mask"] = ids * mask, mask
    return pairs
