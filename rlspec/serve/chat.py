"""Text and token plumbing of the OpenAI routes: chat messages rendered with the tokenizer's chat template,
the cut at a stop string, Qwen/Hermes-style tool calls read out of sampled text, and a completion's text split
at token boundaries for streaming.

Rendering can splice token ids in place of assistant messages (`render(..., sampled={index: ids})`): the
agent gateway puts a trajectory's earlier turns back exactly as the model sampled them, never re-tokenised.
The template renders a marker in place of each such message's content (and no `tool_calls`: the sampled
ids already hold the call's text); the text around the markers is tokenised, the ids go in between. A
template that drops or repeats a marker (it cannot show that turn as sampled) raises `TemplateError`.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Callable

ROLES = ("system", "developer", "user", "assistant", "tool")
MARKER = "[[rlspec-sampled-turn-{}]]"
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


class ChatError(ValueError):
    """A request the routes refuse; `field` is the request field it names."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class TemplateError(ChatError):
    """The chat template did not render a spliced assistant turn exactly once."""


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Plain message dicts a chat template reads: text content (parts joined), `developer` as `system`, tool-call
    arguments as objects (the transformers convention) where they parse as JSON."""
    if not messages:
        raise ChatError("messages", "give at least one message")
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise ChatError("messages", f"messages[{i}].role is {role!r}; give one of {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise ChatError("messages", f"messages[{i}].content: only text parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        elif content is not None and not isinstance(content, str):
            raise ChatError("messages", f"messages[{i}].content must be a string or a list of text parts")
        clean: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if role == "assistant" and message.get("tool_calls"):
            clean["tool_calls"] = [_call_for_template(i, call) for call in message["tool_calls"]]
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                clean[key] = message[key]
        out.append(clean)
    return out


def _call_for_template(i: int, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatError("messages", f"messages[{i}].tool_calls: each needs function.name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def render(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
           sampled: dict[int, list[int]] | None = None) -> list[int]:
    """The prompt ids of `messages` (normalized) with the generation prompt; `sampled` maps a message index to
    the ids spliced in place of that assistant message (see the module docstring)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatError("messages", "this model's tokenizer has no chat template; use /v1/completions")
    sampled = sampled or {}
    shown = [({"role": "assistant", "content": MARKER.format(i)} if i in sampled else m) for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(shown, tools=tools or None, add_generation_prompt=True, tokenize=False)
    except Exception as err:  # noqa: BLE001 - a template's own error (e.g. an unsupported role order) is bad input
        raise ChatError("messages", f"the chat template refused these messages: {type(err).__name__}: {err}") from None
    ids: list[int] = []
    for index in sorted(sampled):
        marker = MARKER.format(index)
        if text.count(marker) != 1:
            raise TemplateError("messages", f"the chat template rendered assistant message {index} {text.count(marker)} "
                                            "times (not once): it cannot show that turn as the model sampled it")
        before, text = text.split(marker)
        ids += encode(tokenizer, before) + list(sampled[index])
    return ids + encode(tokenizer, text)


def encode(tokenizer, text: str) -> list[int]:
    """`tokenizer(text, add_special_tokens=False).input_ids`. A fast tokenizer with no truncation or padding set,
    whose backend splits special tokens' text as the tokenizer's call would, encodes in its Rust backend directly:
    the same ids, without transformers' per-call conversions (~40% of a short text's encoding; a chat turn encodes
    its whole conversation)."""
    if not text:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    splits = bool(getattr(tokenizer, "split_special_tokens", False))
    if (backend is not None and backend.truncation is None and backend.padding is None
            and getattr(backend, "encode_special_tokens", False) == splits):
        return backend.encode(text, add_special_tokens=False).ids
    return tokenizer(text, add_special_tokens=False).input_ids


def decoder(tokenizer) -> Callable[[list[int]], str]:
    """Ids -> text as the engine decodes a completion (special tokens dropped). A fast tokenizer that cleans up no
    spaces decodes in its Rust backend directly: the same text, without transformers' per-call conversions (a
    server's streams decode every row after every decode run)."""
    vocab = len(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", None) is False:
        return lambda ids: backend.decode([t for t in ids if t < vocab], skip_special_tokens=True)
    return lambda ids: tokenizer.decode([t for t in ids if t < vocab], skip_special_tokens=True)


def cut_at_stop(decode: Callable[[list[int]], str], ids: list[int], stops: list[str]) -> tuple[int, str] | None:
    """(tokens kept, text before the stop string) at the first token after which the text contains one of
    `stops`, as if sampling had stopped there; None if it never does."""
    def first_stop(text: str) -> int | None:
        found = [text.find(s) for s in stops if s in text]
        return min(found) if found else None

    if not stops or first_stop(decode(ids)) is None:
        return None
    low, high = 1, len(ids)  # the smallest prefix whose text holds a stop (a longer prefix's text extends it)
    while low < high:
        mid = (low + high) // 2
        if first_stop(decode(ids[:mid])) is None:
            low = mid + 1
        else:
            high = mid
    text = decode(ids[:low])
    return low, text[:first_stop(text)]


def parse_tool_calls(text: str, tool_names: set[str]) -> tuple[str | None, list[dict[str, Any]], int]:
    """(content, tool_calls, malformed) from sampled text: each `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
    naming a given tool becomes an OpenAI tool call and leaves the content; any other `<tool_call>` text (bad
    JSON, an unknown tool, no closing tag) stays in the content and is counted as malformed."""
    calls, kept, last = [], [], 0
    for match in TOOL_CALL.finditer(text):
        call = _tool_call(match.group(1), tool_names)
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last:match.start()])
        last = match.end()
    kept.append(text[last:])
    malformed = text.count("<tool_call>") - len(calls)  # bad calls, and openings never closed
    if not calls:
        return text, [], malformed
    return "".join(kept).strip() or None, calls, malformed


def _tool_call(body: str, tool_names: set[str]) -> dict[str, Any] | None:
    try:
        parsed = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(parsed, dict) or parsed.get("name") not in tool_names:
        return None
    arguments = parsed.get("arguments", {})
    if not isinstance(arguments, (dict, str)):
        return None
    return {"id": f"call_{secrets.token_hex(8)}", "type": "function",
            "function": {"name": parsed["name"], "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def token_pieces(decode: Callable[[list[int]], str], ids: list[int], text: str) -> list[str]:
    """`text` (the final text of a completion of `ids`) split into one piece per token: what that token adds,
    empty while a multi-byte character is incomplete; the last piece takes any rest. Joined, they are `text`."""
    pieces, done = [], 0
    for m in range(1, len(ids) + 1):
        prefix = decode(ids[:m])
        common = done if prefix[:done] == text[:done] else 0
        limit = min(len(prefix), len(text))
        while common < limit and prefix[common] == text[common]:
            common += 1
        upto = max(done, common)
        pieces.append(text[done:upto])
        done = upto
    if not pieces:
        return [text] if text else []
    pieces[-1] += text[done:]
    return pieces
