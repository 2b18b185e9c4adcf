"""An Ollama Modelfile for an exported GGUF: FROM, a TEMPLATE that renders conversations to the same
text as the tokenizer's chat template, a `PARAMETER stop` per end-of-turn token, and the system prompt.

Ollama does not run Jinja: its TEMPLATE is a Go text/template over `.Messages` (role, content), and a
wrong one is the usual reason a model "talks nonsense" in Ollama. The template is not translated
from the Jinja source. It is read off the tokenizer's own renderings: a conversation of known
turns is rendered with `apply_chat_template`, and the text around each turn gives that role's
prefix and suffix, the default system block (SmolLM2 adds one when there is no system turn) and the
generation prompt. The Go template built from them is then rendered here (`render_go_template`, the
subset of text/template it uses) on other conversations and compared with `apply_chat_template`.
A chat template that does not fit that shape (Llama 2 folds the system prompt into the first user
turn, for one) is reported, and the Modelfile goes without a TEMPLATE, saying so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

MARK = "\u2063ftaccum{}\u2063"  # an invisible separator around a number: no template produces it


@dataclass(frozen=True)
class ChatTemplateParts:
    prefix: str  # before the first turn (a BOS the tokenizer does not add itself)
    default_system: str  # rendered before the first turn when it is not a system turn
    heads: dict[str, str]  # role → text before the content
    tails: dict[str, str]  # role → text after the content
    generation_prompt: str


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _split(text: str, count: int) -> list[str]:
    """The text around the marked contents 0..count-1, or a ValueError if they are not there in order."""
    pieces, rest = [], text
    for index in range(count):
        before, found, rest = rest.partition(MARK.format(index))
        if not found:
            raise ValueError("the template does not render each message's content once, in order")
        pieces.append(before)
    return [*pieces, rest]


def _strip_suffix(text: str, suffix: str, what: str) -> str:
    if not text.endswith(suffix):
        raise ValueError(f"the text before {what} depends on the turn before it")
    return text[: len(text) - len(suffix)]


def read_template_parts(tokenizer, strip_bos: bool) -> ChatTemplateParts:
    """The chat template's pieces, read off its renderings (module docstring). `strip_bos`: the tokenizer
    adds BOS itself (llama.cpp's add_bos_token), so a BOS the template writes first is not text."""
    system, user1, assistant1, user2 = (
        {"role": role, "content": MARK.format(i)} for i, role in enumerate(("system", "user", "assistant", "user"))
    )
    full = _render(tokenizer, [system, user1, assistant1, user2], False)
    lead, system_to_user, user_to_assistant, assistant_to_user, user_tail = _split(full, 4)
    assistant_tail = _split(_render(tokenizer, [system, user1, assistant1], False), 3)[-1]
    with_prompt = _render(tokenizer, [system, user1, assistant1, user2], True)
    if not with_prompt.startswith(full):
        raise ValueError("the generation prompt changes the turns before it")
    if not user_to_assistant.startswith(user_tail) or not assistant_to_user.startswith(assistant_tail):
        raise ValueError("a turn's ending depends on the turn after it")
    user_head = assistant_to_user[len(assistant_tail) :]
    bos = tokenizer.bos_token or ""
    prefix = ""
    # A BOS written once before the turns (Llama 3's {{ bos_token }}), not one that opens every turn
    # (SmolLM2's BOS is <|im_start|>, the start of each ChatML turn).
    if bos and lead.startswith(bos) and not user_head.startswith(bos):
        prefix, lead = bos, lead[len(bos) :]
    no_system = _split(_render(tokenizer, [{"role": "user", "content": MARK.format(0)}], False), 1)[0]
    no_system = no_system[len(prefix) :] if prefix and no_system.startswith(prefix) else no_system
    return ChatTemplateParts(
        prefix="" if strip_bos else prefix,
        default_system=_strip_suffix(no_system, user_head, "a first user turn"),
        heads={"system": lead, "user": user_head, "assistant": user_to_assistant[len(user_tail) :]},
        tails={
            "system": _strip_suffix(system_to_user, user_head, "the user turn after a system turn"),
            "user": user_tail,
            "assistant": assistant_tail,
        },
        generation_prompt=with_prompt[len(full) :],
    )


def go_template(parts: ChatTemplateParts) -> str:
    """Ollama's TEMPLATE for `parts`: one line of actions, so that no trim marker eats a newline of the
    chat format; the literal text is exactly the tokenizer's."""
    for text in (
        parts.prefix,
        parts.default_system,
        parts.generation_prompt,
        *parts.heads.values(),
        *parts.tails.values(),
    ):
        if "{{" in text or "}}" in text or '"""' in text:
            raise ValueError(
                'the chat format\'s own text contains {{, }} or """, which a Modelfile TEMPLATE cannot hold'
            )
    roles = "".join(
        f'{{{{ {"if" if i == 0 else "else if"} eq .Role "{role}" }}}}{parts.heads[role]}{{{{ .Content }}}}{parts.tails[role]}'
        for i, role in enumerate(("system", "user", "assistant"))
    )
    default = (
        f'{{{{ if and (eq $i 0) (ne .Role "system") }}}}{parts.default_system}{{{{ end }}}}'
        if parts.default_system
        else ""
    )
    return f"{parts.prefix}{{{{ range $i, $_ := .Messages }}}}{default}{roles}{{{{ end }}}}{{{{ end }}}}{parts.generation_prompt}"


# ---- the subset of Go's text/template that go_template writes (and Ollama's own templates mostly use) ----

_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)
_TOKEN = re.compile(r'\s*(\(|\)|"(?:[^"\\]|\\.)*"|[^\s()]+)')


def _tokens(expression: str) -> list[str]:
    return _TOKEN.findall(expression)


def _evaluate(tokens: list[str], position: int, scope: dict, dot):
    """One operand or parenthesised call from `tokens[position:]`: (value, next position)."""
    token = tokens[position]
    if token == "(":
        value, position = _call(tokens, position + 1, scope, dot, closing=")")
        return value, position + 1
    if token.startswith('"'):
        return bytes(token[1:-1], "utf-8").decode("unicode_escape"), position + 1
    if re.fullmatch(r"-?\d+", token):
        return int(token), position + 1
    if token.startswith("$"):
        name, _, path = token.partition(".")
        value = scope[name]
        for part in filter(None, path.split(".")):
            value = value[part.lower()] if isinstance(value, dict) else getattr(value, part)
        return value, position + 1
    if token.startswith("."):
        value = dot
        for part in filter(None, token.split(".")):
            value = value.get(part.lower()) if isinstance(value, dict) else getattr(value, part, None)
        return value, position + 1
    raise ValueError(f"unsupported operand {token!r}")


_FUNCTIONS = {
    "eq": lambda a, *b: any(a == x for x in b),
    "ne": lambda a, b: a != b,
    "and": lambda *xs: next((x for x in xs if not x), xs[-1]),
    "or": lambda *xs: next((x for x in xs if x), xs[-1]),
    "not": lambda x: not x,
    "len": len,
}


def _call(tokens: list[str], position: int, scope: dict, dot, closing: str | None = None):
    if tokens[position] in _FUNCTIONS:
        function, position, arguments = _FUNCTIONS[tokens[position]], position + 1, []
        while position < len(tokens) and tokens[position] != closing:
            value, position = _evaluate(tokens, position, scope, dot)
            arguments.append(value)
        return function(*arguments), position
    return _evaluate(tokens, position, scope, dot)


def _parse(template: str) -> list:
    """The template as a tree: text, ("out", expr), ("if", [(cond, body)...], else_body), ("range", vars, expr, body)."""
    items: list = []
    position = 0
    for match in _ACTION.finditer(template):
        text = template[position : match.start()]
        if match.group(1):
            text = text.rstrip()
        items.append(("text", text))
        items.append(("action", match.group(2), bool(match.group(3))))
        position = match.end()
    items.append(("text", template[position:]))
    # apply right-trim markers to the text that follows
    for index, item in enumerate(items):
        if item[0] == "action" and item[2] and index + 1 < len(items):
            items[index + 1] = ("text", items[index + 1][1].lstrip())
    tree, _ = _block(items, 0)
    return tree


def _block(items: list, index: int) -> tuple[list, int]:
    body: list = []
    while index < len(items):
        kind, value = items[index][0], items[index][1]
        if kind == "text":
            body.append(("text", value))
            index += 1
            continue
        word = value.split()[0] if value else ""
        if word in ("end", "else"):
            return body, index
        if word == "if":
            branches, otherwise = [], []
            condition = value[2:].strip()
            while True:
                inner, index = _block(items, index + 1)
                branches.append((condition, inner))
                action = items[index][1]
                if action.startswith("else if"):
                    condition = action[len("else if") :].strip()
                    continue
                if action == "else":
                    otherwise, index = _block(items, index + 1)
                break
            body.append(("if", branches, otherwise))
            index += 1
        elif word == "range":
            header = value[len("range") :].strip()
            names, _, expression = header.rpartition(":=")
            inner, index = _block(items, index + 1)
            body.append(("range", [n.strip() for n in names.split(",") if n.strip()], expression.strip(), inner))
            index += 1
        else:
            body.append(("out", value))
            index += 1
    return body, index


def _run(tree: list, scope: dict, dot) -> str:
    out = []
    for node in tree:
        if node[0] == "text":
            out.append(node[1])
        elif node[0] == "out":
            value, _ = _call(_tokens(node[1]), 0, scope, dot)
            out.append("" if value is None else str(value))
        elif node[0] == "if":
            for condition, body in node[1]:
                if _call(_tokens(condition), 0, scope, dot)[0]:
                    out.append(_run(body, scope, dot))
                    break
            else:
                out.append(_run(node[2], scope, dot))
        elif node[0] == "range":
            values, _ = _call(_tokens(node[2]), 0, scope, dot)
            for index, item in enumerate(values or []):
                names = node[1]
                inner = dict(scope)
                if len(names) == 2:
                    inner[names[0]], inner[names[1]] = index, item
                elif len(names) == 1:
                    inner[names[0]] = item
                out.append(_run(node[3], inner, item))
    return "".join(out)


def render_go_template(template: str, messages: list[dict], system: str | None = None) -> str:
    """Render `template` as Ollama does for a chat: a Modelfile SYSTEM goes first as a system message when
    the conversation does not start with one, consecutive turns of one role are joined, `.Messages` and
    `.System` (every system turn) are set; the subset of text/template that `go_template` writes."""
    if system and (not messages or messages[0]["role"] != "system"):
        messages = [{"role": "system", "content": system}, *messages]
    collated: list[dict] = []  # Ollama's template.collate: consecutive turns of one role become one
    for message in messages:
        if collated and collated[-1]["role"] == message["role"] and message["role"] != "tool":
            collated[-1] = {**collated[-1], "content": collated[-1]["content"] + "\n\n" + message["content"]}
        else:
            collated.append(dict(message))
    systems = [m["content"] for m in messages if m["role"] == "system"]
    data = {"messages": collated, "system": "\n\n".join(systems)}
    return _run(_parse(template), {"$": data}, data)


PROBE_CONVERSATIONS = (
    [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Hello.\nHow can I help?"},
     {"role": "user", "content": "Name a colour."}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky colour?"},
     {"role": "assistant", "content": "Blue"}, {"role": "user", "content": "And grass?"}],
)  # fmt: skip


def ollama_template(tokenizer, strip_bos: bool) -> tuple[str | None, str, ChatTemplateParts | None]:
    """(Go TEMPLATE, "", its parts) when one renders every probe conversation as the tokenizer does, else
    (None, why, None)."""
    if not tokenizer.chat_template:
        return None, "the tokenizer has no chat template", None
    try:
        parts = read_template_parts(tokenizer, strip_bos)
        template = go_template(parts)
    except Exception as exc:  # a Jinja template that raises on our probe turns counts as not expressible
        return None, str(exc), None
    for conversation in PROBE_CONVERSATIONS:
        expected = _render(tokenizer, conversation, True)
        if strip_bos and tokenizer.bos_token and expected.startswith(tokenizer.bos_token):
            expected = expected[len(tokenizer.bos_token) :]
        if render_go_template(template, conversation) != expected:
            return None, "the template built from its renderings does not render every test conversation alike", None
    return template, "", parts


def stop_tokens(tokenizer, parts_tail: str | None, eos_token_ids: list[int]) -> list[str]:
    """Every end-of-turn text: the EOS token(s) of the tokenizer and generation config, and the special
    token that ends an assistant turn in the chat format (<|im_end|>, <|eot_id|>)."""
    stops = [tokenizer.convert_ids_to_tokens(i) for i in eos_token_ids if i is not None]
    if tokenizer.eos_token:
        stops.append(tokenizer.eos_token)
    specials = set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values()}
    if parts_tail:
        stops += [token for token in specials if token in parts_tail]
    return list(dict.fromkeys(s for s in stops if s))


def modelfile_text(
    gguf_name: str, template: str | None, why_not: str, stops: list[str], system_prompt: str | None
) -> str:
    lines = [
        f"# Written by ft-accum export. Create the model with: ollama create <name> -f {Path('Modelfile')}",
        f"FROM ./{gguf_name}",
    ]
    if template is not None:
        lines.append(f'TEMPLATE """{template}"""')
    else:
        lines.append(
            f"# No TEMPLATE: this model's chat template could not be written in Ollama's template language ({why_not}). "
            "Ollama then uses the GGUF's tokenizer.chat_template only if it recognises it; check `ollama show <name> "
            "--template` and write a TEMPLATE by hand if it shows none."
        )
    lines += [f"PARAMETER stop {json.dumps(stop, ensure_ascii=False)}" for stop in stops]
    if system_prompt:
        lines.append(f'SYSTEM """{system_prompt}"""')
    return "\n".join(lines) + "\n"
