"""OpenAI's shapes where the server's own differ: errors as OpenAI's error object, and a token as text and bytes in
log-probs.

Errors: every refusal of the app (an `HTTPException`, a request that fails validation) goes out as
`{"error": {"message", "type", "param", "code"}}`, with 400 for bad input (never FastAPI's 422), 404 for an unknown
model, 429 past the queue's bound (with Retry-After). A refusal that a spec setting decides also carries `spec_key`
and `fix` (a trainer's client turns them back into the `SpecError` a colocated engine raises). The bridge's own
answers (`/bridge/receive`) keep their shape.

Tokens: a log-prob entry names its token by the text it decodes to (`" Yes"`, not the tokenizer's symbol `"ĠYes"`),
and `bytes` are the token's own bytes, so the bytes of a choice's tokens join to its text even where a character
spans tokens. A token that is part of a character (its bytes are not UTF-8 by themselves) is named `bytes:\\xe4\\xb8`
as OpenAI names it.
"""

from __future__ import annotations

import codecs
import re
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          410: "invalid_request_error", 429: "requests"}
_CODES = {401: "invalid_api_key", 429: "rate_limit_exceeded"}


def error_body(status: int, message: str, param: str | None, **extra: Any) -> dict[str, Any]:
    """OpenAI's error object (`extra`: rlspec's own keys beside OpenAI's, e.g. `spec_key` and `fix`)."""
    code = "model_not_found" if status == 404 and param == "model" else _CODES.get(status)
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code, **extra}}


def _param(loc) -> str | None:
    """The request field a FastAPI location names (`["body", "max_tokens", 0]` -> "max_tokens")."""
    loc = list(loc or [])
    return str(loc[1]) if len(loc) > 1 and loc[0] == "body" else None


def refusal_body(err: HTTPException) -> dict[str, Any]:
    """The body the app answers `err` with: OpenAI's error object, naming the field of its first detail."""
    detail = err.detail
    first = detail[0] if isinstance(detail, list) and detail and isinstance(detail[0], dict) else {}
    message = first.get("msg", detail if isinstance(detail, str) else str(detail))
    extra = {k: v for k, v in first.items() if k not in ("loc", "msg")}
    return error_body(err.status_code, message, _param(first.get("loc")), **extra)


def install_error_handlers(app: FastAPI) -> None:
    """The app's refusals as OpenAI's error object (see the module docstring)."""

    @app.exception_handler(HTTPException)
    async def refused(_request: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse(refusal_body(err), status_code=err.status_code, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        first = errors[0] if errors else {}
        param = _param(first.get("loc"))
        message = f"{param}: {first.get('msg', 'invalid')}" if param else first.get("msg", "invalid request body")
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more)"
        return JSONResponse(error_body(400, message, param), status_code=400)


_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character a byte-level vocabulary writes for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_TEXTS: dict[int, "TokenText"] = {}


def token_text(tokenizer) -> "TokenText":
    """The `TokenText` of `tokenizer`, made once (its bytes are cached per token)."""
    made = _TEXTS.get(id(tokenizer))
    if made is None or made.tokenizer is not tokenizer:
        made = _TEXTS[id(tokenizer)] = TokenText(tokenizer)
    return made


class TokenText:
    """A tokenizer's tokens as log-probs name them: `text(id)` (OpenAI's token string) and `bytes(id)`."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = _byte_level_table() if backend is not None and "ByteLevel" in str(backend.decoder) else None
        self._special = set(getattr(tokenizer, "all_special_ids", ()))
        """Left out of a completion's text (it is decoded with `skip_special_tokens`)."""
        self._added = self._special | set(getattr(tokenizer, "added_tokens_decoder", {}))
        self._vocab = len(tokenizer)
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._of(token_id)
        return cached

    def _of(self, token_id: int) -> bytes:
        if not 0 <= token_id < self._vocab:
            return b""
        if token_id in self._added:
            return self.tokenizer.decode([token_id]).encode()
        symbol = self.tokenizer.convert_ids_to_tokens(token_id)
        if symbol is None:
            return b""
        if self._byte_level is not None and all(ch in self._byte_level for ch in symbol):
            return bytes(self._byte_level[ch] for ch in symbol)
        byte = _BYTE.fullmatch(symbol)
        if byte:  # a sentencepiece byte-fallback token
            return bytes([int(byte.group(1), 16)])
        return symbol.replace("\u2581", " ").encode()

    def text(self, token_id: int) -> str:
        raw = self.bytes(token_id)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def offsets(self, ids: list[int], start: int, end: int) -> list[int]:
        """`text_offset` of tokens `start:end` of a completion of `ids`: where each token's text begins in the
        completion's text (a token inside a character: where that character begins). Special tokens add nothing."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        at, out = 0, []
        for k, token_id in enumerate(ids[:end]):
            if k >= start:
                out.append(at)
            if token_id not in self._special:
                at += len(decoder.decode(self.bytes(token_id)))
        return out
