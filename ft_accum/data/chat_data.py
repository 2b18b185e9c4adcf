"""Chat data for instruction tuning: conversations, assistant-only labels, packing without cross-talk.

A row is a conversation, in one of the formats people have (`conversation_format` tells which):
a `messages` list of {"role", "content"} turns (OpenAI, TRL); ShareGPT's `conversations` of
{"from", "value"} turns (human, gpt, system); Alpaca's `instruction`, optional `input`, `output`;
or a `prompt` and a `completion` (one user turn, one assistant turn). The model's chat template
renders it (`tokenizer.apply_chat_template`). The loss covers the assistant's tokens only, in every
assistant turn: everything else in the labels is -100 (as TRL's `assistant_only_loss`).

Assistant spans come from the template's `{% generation %}` markers where it has them
(`return_assistant_tokens_mask`), and otherwise by rendering the conversation prefix by prefix:
the tokens between `template(turns[:i], add_generation_prompt=True)` and `template(turns[:i+1])`
are assistant turn i's answer, end-of-turn token included (the model must learn to stop). That
needs a template whose rendering of a prefix is a prefix of the whole; it is checked per row.

Packing puts several conversations in one row with `position_ids` restarting at 0 for each and no
attention mask: transformers (≥ 4.54) then builds a block-diagonal causal mask from the position
ids (`masking_utils.find_packed_sequence_indices`), so packed conversations cannot attend to each
other, as with `DataCollatorWithFlattening`. The first token of each conversation gets no label,
so no target crosses a boundary either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ft_accum.core.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")

# ChatML with generation markers, for models without a template of their own (--chat_template chatml).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# ShareGPT's speakers (FastChat, LLaMA-Factory) as chat-template roles.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}
CONVERSATION_FORMATS = (
    "messages ({role, content} turns)",
    "ShareGPT (conversations of {from, value} turns)",
    "Alpaca (instruction, input, output)",
    "prompt and completion",
)


def as_turns(turns) -> list:
    """{role, content} turns from a list of them, of ShareGPT's {from, value} turns, or their JSON text."""
    if isinstance(turns, str) and turns.lstrip().startswith(("[", "{")):
        turns = json.loads(turns)
    if isinstance(turns, dict):
        turns = [turns]
    if not isinstance(turns, list):
        return turns  # check_messages names what it is
    return [
        {"role": SHAREGPT_ROLES.get(t["from"], t["from"]), "content": t["value"]}
        if isinstance(t, dict) and "from" in t and "value" in t
        else t
        for t in turns
    ]


def alpaca_prompt(row: dict) -> list:
    """Alpaca's instruction and optional input as one user turn (after a `system` column if any)."""
    user = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    return [*system, {"role": "user", "content": user}]


def conversation_format(columns: list[str], messages_column: str, prompt_column: str, completion_column: str) -> str:
    """Which of CONVERSATION_FORMATS a split's columns hold: messages, sharegpt, alpaca or prompt_completion."""
    if messages_column in columns:
        return "messages"
    if "conversations" in columns:
        return "sharegpt"
    if {"instruction", "output"} <= set(columns):
        return "alpaca"
    if {prompt_column, completion_column} <= set(columns):
        return "prompt_completion"
    raise ConfigError(
        f"the columns {', '.join(columns)} are in no conversation format read here: "
        f"{'; '.join(CONVERSATION_FORMATS)}. Rename the columns, or name yours with --messages_column, or "
        "--prompt_column and --completion_column"
    )


def to_messages(row: dict, data_format: str, messages_column: str, prompt_column: str, completion_column: str) -> list:
    """The row's conversation as {role, content} turns, from its `conversation_format`."""
    if data_format == "messages":
        return as_turns(row[messages_column])
    if data_format == "sharegpt":
        return as_turns(row["conversations"])
    if data_format == "alpaca":
        return [*alpaca_prompt(row), {"role": "assistant", "content": row["output"]}]
    return [{"role": "user", "content": row[prompt_column]}, {"role": "assistant", "content": row[completion_column]}]


def check_messages(messages, where: str) -> None:
    """A list of {role, content} turns with known roles, string contents and at least one assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(
            f"{where}: messages must be a non-empty list of {{role, content}} turns, got {type(messages).__name__} "
            f"{str(messages)[:60]!r}; fix the data, or use --prompt_column/--completion_column"
        )
    for turn in messages:
        if not isinstance(turn, dict) or not isinstance(turn.get("content"), str):
            raise ConfigError(f"{where}: every turn needs a role and a string content, got {str(turn)[:80]!r}")
        if turn.get("role") not in ROLES:
            raise ConfigError(
                f"{where}: unknown role {turn.get('role')!r}; the roles are {', '.join(ROLES)} (ShareGPT's "
                f"{', '.join(SHAREGPT_ROLES)})"
            )
    if not any(turn["role"] == "assistant" for turn in messages):
        raise ConfigError(
            f"{where}: the conversation has no assistant turn, so nothing to learn; drop the row or add the answer"
        )


def resolve_chat_template(tokenizer, chat_template: str | None, name: str) -> None:
    """Give the tokenizer a template: --chat_template chatml or a .jinja file, else its own, else a clear error."""
    if chat_template == "chatml":
        tokenizer.chat_template = CHATML_TEMPLATE
    elif chat_template:
        path = Path(chat_template)
        if not path.is_file():
            raise ConfigError(f"--chat_template {chat_template}: not 'chatml' nor a readable Jinja file")
        tokenizer.chat_template = path.read_text()
    if not tokenizer.chat_template:
        raise ConfigError(
            f"the tokenizer of {name!r} has no chat template; pass --chat_template chatml (ChatML: "
            "<|im_start|>role ... <|im_end|>) or --chat_template path/to/template.jinja"
        )


def render_ids(tokenizer, messages: list, add_generation_prompt: bool = False) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True
        )["input_ids"]
    )


def assistant_mask(tokenizer, messages: list) -> tuple[list[int], list[bool]]:
    """(token ids of the whole conversation, True where the token belongs to an assistant answer)."""
    if "{% generation %}" in (tokenizer.chat_template or ""):
        encoded = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(encoded["input_ids"]), [bool(m) for m in encoded["assistant_masks"]]
    ids = render_ids(tokenizer, messages)
    mask = [False] * len(ids)
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        start = len(render_ids(tokenizer, messages[:i], add_generation_prompt=True))
        upto = render_ids(tokenizer, messages[: i + 1])
        if ids[: len(upto)] != upto or upto[:start] != ids[:start]:
            raise ConfigError(
                "this chat template renders a conversation's prefix differently from the whole conversation, so the "
                "assistant's tokens cannot be found; use a template with {% generation %} markers (--chat_template chatml)"
            )
        mask[start : len(upto)] = [True] * (len(upto) - start)
    return ids, mask


@dataclass
class TokenizedChats:
    rows: list[dict]  # input_ids, labels
    truncated: int  # conversations cut at max_length
    dropped: int  # of those, the ones left with no assistant token
    system_prompt: str | None = None  # the system turn every conversation starts with, if they share one


def shared_system_prompt(conversations: list[list]) -> str | None:
    """The system message that begins every conversation, or None: what the model was trained to expect
    (ft-accum export writes it as the Ollama Modelfile's SYSTEM)."""
    firsts = {m[0]["content"] if m and m[0]["role"] == "system" else None for m in conversations}
    return firsts.pop() if len(firsts) == 1 else None


def tokenize_chats(tokenizer, conversations: list[list], max_length: int) -> TokenizedChats:
    """Token ids and assistant-only labels per conversation, cut at `max_length` tokens (counted, never silent)."""
    rows, truncated, dropped = [], 0, 0
    for messages in conversations:
        ids, mask = assistant_mask(tokenizer, messages)
        if len(ids) > max_length:
            truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        labels = [token if is_answer else -100 for token, is_answer in zip(ids, mask)]
        labels[0] = -100  # no target crosses into this conversation from a packed predecessor
        if all(label == -100 for label in labels[1:]):
            dropped += 1
            continue
        rows.append({"input_ids": ids, "labels": labels})
    return TokenizedChats(rows, truncated, dropped, shared_system_prompt(conversations))


def conversations_of(raw, messages_column: str, prompt_column: str, completion_column: str) -> dict[str, list]:
    """{split: [conversation, ...]} from loaded splits (`datasets.Dataset`s): each split's format found
    once (`conversation_format`), every row converted and checked (`check_messages`: known roles, an
    assistant turn), so a bad row stops the run in one line that names it."""
    columns = (messages_column, prompt_column, completion_column)
    conversations = {}
    for split, rows in raw.items():
        data_format = conversation_format(rows.column_names, *columns)
        conversations[split] = [to_messages(row, data_format, *columns) for row in rows]
        for i, messages in enumerate(conversations[split]):
            check_messages(messages, f"{split} row {i + 1}")
    return conversations


def tokenize_splits(tokenizer, conversations: dict[str, list], max_length: int) -> dict[str, TokenizedChats]:
    """`tokenize_chats` of each split; a split left with no assistant token stops in one line."""
    tokenized = {split: tokenize_chats(tokenizer, chats, max_length) for split, chats in conversations.items()}
    for split, chats in tokenized.items():
        if not chats.rows:
            raise ConfigError(f"no {split} conversation keeps an assistant token within --max_seq_length; raise it")
    return tokenized


def pack_chats(rows: list[dict], max_length: int) -> list[dict]:
    """Conversations in order, several per row up to `max_length` tokens, position ids restarting at 0 for each."""
    packed, current = [], {"input_ids": [], "labels": [], "position_ids": []}
    for row in rows:
        if current["input_ids"] and len(current["input_ids"]) + len(row["input_ids"]) > max_length:
            packed.append(current)
            current = {"input_ids": [], "labels": [], "position_ids": []}
        current["input_ids"] += row["input_ids"]
        current["labels"] += row["labels"]
        current["position_ids"] += list(range(len(row["input_ids"])))
    return packed + ([current] if current["input_ids"] else [])


def collate_chats(pad_token_id: int, packed: bool):
    """Pad a micro-batch to its longest row. Packed rows get no attention mask (their position ids
    separate the conversations; the padding is a conversation of its own, with no labels)."""
    import torch

    def collate(rows: list[dict]) -> dict:
        length = max(len(r["input_ids"]) for r in rows)
        pads = [length - len(r["input_ids"]) for r in rows]
        batch = {
            "input_ids": torch.tensor([r["input_ids"] + [pad_token_id] * n for r, n in zip(rows, pads)]),
            "labels": torch.tensor([r["labels"] + [-100] * n for r, n in zip(rows, pads)]),
        }
        if packed:
            batch["position_ids"] = torch.tensor([r["position_ids"] + list(range(n)) for r, n in zip(rows, pads)])
        else:
            batch["attention_mask"] = torch.tensor([[1] * len(r["input_ids"]) + [0] * n for r, n in zip(rows, pads)])
        if "row_index" in rows[0]:  # a sequence's identity, whatever the split (training/on_policy.py)
            batch["row_index"] = torch.tensor([r["row_index"] for r in rows])
        return batch

    return collate


def to_turns(value, role: str) -> list:
    """A prompt or response as turns: a string is one `role` turn; a list of turns (TRL's
    conversational format, or ShareGPT's {from, value}), one turn, or their JSON text, as turns."""
    if isinstance(value, str) and not value.lstrip().startswith(("[{", "{")):
        return [{"role": role, "content": value}]
    return as_turns(value) if value else []


PREFERENCE_FORMATS = (
    "prompt, chosen, rejected (TRL's: strings or turns)",
    "chosen, rejected conversations with the prompt as their shared first turns (TRL's implicit prompt)",
    "ShareGPT: conversations, chosen, rejected (turns of {from, value})",
    "Alpaca: instruction, input, chosen, rejected",
)


def preference_format(columns: list[str], prompt_column: str, chosen_column: str, rejected_column: str) -> str:
    """Where a pair's prompt is: its own column (`explicit`), ShareGPT's `conversations`, Alpaca's
    `instruction` and `input`, or the turns chosen and rejected share (`implicit`, as TRL's `extract_prompt`)."""
    if missing := [f"{c!r} (--{k}_column)" for k, c in (("chosen", chosen_column), ("rejected", rejected_column))
                   if c not in columns]:  # fmt: skip
        raise ConfigError(
            f"no {' or '.join(missing)} column: the columns {', '.join(columns)} are in no preference format read "
            f"here ({'; '.join(PREFERENCE_FORMATS)}). Rename the columns, or name yours with --prompt_column, "
            "--chosen_column and --rejected_column"
        )
    if prompt_column in columns:
        return "explicit"
    return "sharegpt" if "conversations" in columns else "alpaca" if "instruction" in columns else "implicit"


def preference_conversations(row: dict, data_format: str, columns: tuple[str, str, str], where: str):
    """(prompt turns, chosen turns, rejected turns) of a preference row in `preference_format`, checked."""
    prompt_column, chosen_column, rejected_column = columns
    responses = [to_turns(row[column], "assistant") for column in (chosen_column, rejected_column)]
    if data_format == "explicit":
        prompt = to_turns(row[prompt_column], "user")
    elif data_format == "sharegpt":
        prompt = to_turns(row["conversations"], "user")
    elif data_format == "alpaca":
        prompt = alpaca_prompt(row)
    else:
        shared = 0
        while shared < min(map(len, responses)) - 1 and responses[0][shared] == responses[1][shared]:
            shared += 1
        prompt, responses = responses[0][:shared], [turns[shared:] for turns in responses]
    for column, turns in zip((chosen_column, rejected_column), responses):
        check_messages(prompt + turns, f"{where} ({column})")
        if not turns or turns[-1]["role"] != "assistant" or not turns[-1]["content"].strip():
            raise ConfigError(
                f"{where}: the {column!r} response is empty or not an assistant turn; every pair needs two "
                "non-empty answers (drop the row, or fix it)"
            )
    return prompt, *responses


@dataclass
class TokenizedPairs:
    rows: list[dict]  # chosen_input_ids, chosen_labels, rejected_input_ids, rejected_labels
    truncated: int  # pairs with a sequence cut at max_length
    dropped: int  # of those, pairs left with no response token in one of them


def response_labels(tokenizer, prompt: list, response: list) -> tuple[list[int], list[int]]:
    """(ids of prompt + response, labels that are the response's tokens and -100 elsewhere)."""
    ids, mask = assistant_mask(tokenizer, prompt + response)
    prompt_length = len(render_ids(tokenizer, prompt, add_generation_prompt=True))
    # An assistant turn inside the prompt (a multi-turn prompt) is context, not what is preferred.
    return ids, [t if is_answer and i >= prompt_length else -100 for i, (t, is_answer) in enumerate(zip(ids, mask))]


def tokenize_pairs(tokenizer, pairs: list[tuple[list, list, list]], max_length: int) -> TokenizedPairs:
    """Token ids and response-only labels of each pair's two conversations, cut at `max_length`
    tokens (counted); a pair that keeps no response token in one of them is dropped (counted)."""
    rows, truncated, dropped = [], 0, 0
    for prompt, chosen, rejected in pairs:
        row, cut = {}, False
        for name, response in (("chosen", chosen), ("rejected", rejected)):
            ids, labels = response_labels(tokenizer, prompt, response)
            cut |= len(ids) > max_length
            row[f"{name}_input_ids"], row[f"{name}_labels"] = ids[:max_length], labels[:max_length]
        truncated += cut
        if any(all(label == -100 for label in row[f"{n}_labels"][1:]) for n in ("chosen", "rejected")):
            dropped += 1
            continue
        rows.append({**row, "pair_index": len(rows)})
    return TokenizedPairs(rows, truncated, dropped)


def collate_pairs(pad_token_id: int):
    """A micro-batch of B pairs: `chosen_*` and `rejected_*` input_ids, attention_mask and labels, B
    rows each, padded to one length (the forward runs them as 2B rows). One row per pair, so the
    cut of Accelerate's repeated rows (training/windows.py, take_rows) cuts whole pairs."""
    import torch

    collate_rows = collate_chats(pad_token_id, packed=False)

    def collate(pairs: list[dict]) -> dict:
        rows = [{"input_ids": p[f"{n}_input_ids"], "labels": p[f"{n}_labels"]} for n in ("chosen", "rejected")
                for p in pairs]  # fmt: skip
        both = collate_rows(rows)
        batch = {f"{n}_{k}": v[i * len(pairs) : (i + 1) * len(pairs)] for k, v in both.items()
                 for i, n in enumerate(("chosen", "rejected"))}  # fmt: skip
        return {**batch, "pair_index": torch.tensor([p["pair_index"] for p in pairs])}

    return collate


def stacked_pairs(batch: dict) -> tuple:
    """(labels, model inputs) of a `collate_pairs` micro-batch: its chosen rows, then its rejected
    rows, so that one forward computes both."""
    import torch

    both = {
        k: torch.cat([batch[f"chosen_{k}"], batch[f"rejected_{k}"]]) for k in ("input_ids", "attention_mask", "labels")
    }
    return both["labels"], {
        "input_ids": both["input_ids"],
        "attention_mask": both["attention_mask"],
        "use_cache": False,
    }
