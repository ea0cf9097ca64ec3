"""The OpenAI-compatible routes of the rollout server: `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions` (in `rlspec serve` and, through the same app, in the agent gateway).

What the fields mean here:
- `temperature > 0` samples (with `top_p`); a choice's log-probs are the engine's, log_softmax(logits /
  temperature) of the sampled token, as the trainer computes them. `temperature: 0` is greedy: the argmax,
  with log-probs under the plain log_softmax(logits). `seed` makes a request reproducible (same seed, same
  weights -> same tokens); without one the server draws a seed. `first_sample` (completions, rlspec's own field,
  default 0) numbers the request's samples from there in the seed's noise: a trainer that splits a step over
  several servers sends each part with the index of its first sample, so each sample is what one server would draw.
- `logprobs: k` (completions) / `logprobs: true, top_logprobs: k` (chat, k <= 20): the chosen tokens' log-probs
  and the k most likely tokens of the same distribution at each step; tokens as OpenAI names them (their text,
  their bytes, completions' `text_offset`: `shapes.TokenText`).
- `max_tokens`: a prompt plus it past the model's context (or the server's `--max-model-len`) is refused with a 400
  naming both numbers. Rows longer than the pool's (`rollout.max_prompt_tokens + rollout.max_new_tokens`, rounded
  up) decode in the scheduler's long lane, beside the others (`scheduler.py`).
- `stop` (a string or a list): a choice ends at the first token after which its text contains a stop string; the
  text ends before the stop string (as OpenAI's), `token_ids` keep the token that completed it, and
  `finish_reason` is "stop" (also when the model sampled its end-of-sequence token; "length" otherwise).
- `stream: true`: server-sent events in OpenAI's chunk format, ending with `data: [DONE]`: each choice's text as
  the decode batch samples it (`live.py`; their texts join to the text the same request returns unstreamed; a
  choice's finishing chunk carries the `weight_version`); `stream_options.include_usage` adds the usage chunk.
  A request that runs alone (`scheduler.py`: a model the slot pool cannot run) streams its chunks after sampling,
  one per token; its client going away stops it at the next token, streamed or not.
- `tools` (chat): a Qwen/Hermes-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>` in the sampled text
  naming a given tool becomes a `tool_calls` entry (finish_reason "tool_calls"); other `<tool_call>` text stays
  in the content and is counted in the choice's `malformed_tool_calls` (and in `/v1/rlspec/counters`).
  Tool results come back as `role: tool` messages, rendered by the chat template. `tool_choice: "none"` keeps the
  tools in the prompt (as OpenAI shows them) and takes no call out of the text.
- `echo` (completions) puts the prompt's text before each choice's text.
- Refused with a 400 naming the field: `logit_bias`, `presence_penalty`, `frequency_penalty`, `best_of` > 1,
  `suffix`, `response_format` other than text, `tool_choice` other than auto/none, `functions`,
  `function_call`, `audio`, `modalities` other than text, `prediction`, `echo` with `logprobs`. Unknown fields
  are ignored and null is the default, as OpenAI does. Refusals come as OpenAI's error object (`shapes.py`).
- Each choice also carries `token_ids` and `prompt_token_ids`; a response carries the `weight_version` it was
  sampled with.

Every request in flight decodes in one batch (`scheduler.py`), each row with its own settings: greedy and top
log-probs included (the slot pool's `full` step); `stop` and streaming do not change how a row samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Union

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field, StrictInt, model_validator

from ..rollout.hf import prompt_token_ids
from ..rollout.noise import sample_key_list
from .pool import RowSampling
from ..rollout.sampling import SampleOptions
from ..spec import SpecError
from .chat import ChatError, TemplateError, decoder, normalize_messages, parse_tool_calls, render, token_pieces
from .live import Abort, Choice, QueueFull, Submission, live_events, until_disconnect
from .live import Planned as _Planned
from .shapes import token_text

MAX_PROMPTS = 4096
MAX_TOP_LOGPROBS = 20
MAX_STOPS = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both routes share; unknown fields are ignored, as OpenAI does, and a field given as null takes its
    default (OpenAI's clients send null for settings left unset)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    model: Optional[str] = None
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1024)
    seed: Optional[int] = Field(None, ge=0)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, List[str]]] = None
    logit_bias: Optional[Dict[str, Any]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None


class CompletionRequest(_Common):
    prompt: Union[str, List[str], List[StrictInt], List[List[StrictInt]]]
    """Text, texts, token ids, or lists of token ids (`true` is not an id)."""
    max_tokens: int = Field(16, ge=1, le=1 << 16)
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """A count of top log-probs (`true` is refused: it is chat's field)."""
    first_sample: int = Field(0, ge=0)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatRequest(_Common):
    messages: List[Dict[str, Any]]
    max_tokens: Optional[int] = Field(None, ge=1, le=1 << 16)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=1 << 16)
    """Either one; neither: the server's `rollout.max_new_tokens`."""
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    response_format: Optional[Dict[str, Any]] = None
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    modalities: Optional[List[str]] = None
    prediction: Optional[Any] = None


def bad(field_name: str, message: str, status: int = 400, **extra: Any) -> HTTPException:
    """A refusal naming a request field (the app sends it as OpenAI's error object: `shapes.py`)."""
    return HTTPException(status_code=status, detail=[{"loc": ["body", field_name], "msg": message, **extra}])


def _refuse_unsupported(req: BaseModel) -> None:
    """400 naming the first field set to something this server cannot honour."""
    values = req.model_dump()
    harmless = {"logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
                "best_of": (None, 1), "suffix": (None, ""), "response_format": (None, {"type": "text"}),
                "tool_choice": (None, "auto", "none"), "functions": (None,), "function_call": (None,),
                "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,)}
    for name, allowed in harmless.items():
        if name in values and values[name] not in allowed:
            raise bad(name, f"{name}={values[name]!r} is not supported by this server")


@contextlib.contextmanager
def _prompt_errors(field_name: str = "prompt"):
    """A prompt longer than rollout.max_prompt_tokens is bad input (naming `field_name`, chat's `messages`): the
    spec key and its fix go along (a trainer's client turns them back into the `SpecError` a colocated engine
    raises)."""
    try:
        yield
    except SpecError as err:
        raise bad(field_name, f"{field_name}: {err.problem}", spec_key=err.where, fix=err.fix) from None


def _encode(tokenizer, prompts: list, max_prompt_tokens: int, field_name: str) -> list[list[int]]:
    """Each prompt's ids; a prompt past `rollout.max_prompt_tokens` is refused naming `field_name` and its length
    (never its ids: a chat prompt is rendered ids)."""
    encoded = prompt_token_ids(tokenizer, prompts, 1 << 62)
    longest = max(len(ids) for ids in encoded)
    if longest > max_prompt_tokens:
        what = "the rendered messages are" if field_name == "messages" else "a prompt is"
        raise SpecError("rollout.max_prompt_tokens", f"{what} {longest} tokens long, past this server's "
                        f"rollout.max_prompt_tokens={max_prompt_tokens}",
                        "raise rollout.max_prompt_tokens (the server's spec) or shorten the prompt")
    return encoded


@contextlib.contextmanager
def _queue_full():
    """`QueueFull` as 429 with Retry-After."""
    try:
        yield
    except QueueFull as full:
        raise HTTPException(429, detail=[{"loc": ["server"], "msg": str(full)}],
                            headers={"Retry-After": str(full.retry_after_s)}) from None


def _choices(planned: "_Planned", sub: Submission):
    """A finished request's (version, choices); a request the engine failed (an admission or a decode run that
    raised, a failed turn of the engine thread) as a 500 naming the error, where it was a bare one."""
    try:
        return planned.submission_choices(sub)
    except (SpecError, HTTPException):
        raise
    except Exception as err:  # noqa: BLE001 - the client gets what went wrong; the server's stderr has the traceback
        raise HTTPException(500, detail=[{"loc": ["engine"], "msg": f"the engine failed on this request: "
                                                                    f"{type(err).__name__}: {err}"}]) from err


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise bad("stop", f"give 1 to {MAX_STOPS} non-empty stop strings")
    return stops


@dataclass
class Reply:
    """A served request: its choices, and the response (JSON or a stream) built from them."""

    kind: str  # "chat" or "completion"
    model: str
    choices: list[Choice]
    weight_version: int | None
    n: int
    show_logprobs: bool
    top_logprobs: int
    tokenizer: Any
    stream: bool = False
    include_usage: bool = False
    echo_texts: list[str] | None = None
    id: str = field(default_factory=lambda: secrets.token_hex(8))
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self) -> dict[str, int]:
        completion = sum(len(c.ids) for c in self.choices)
        prompt = sum(len(c.prompt_ids) for c in self.choices[::self.n])
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def response(self):
        if self.stream:
            return StreamingResponse(self._events(), media_type="text/event-stream")
        return JSONResponse(self.body())

    def body(self) -> dict[str, Any]:
        head = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        return {**head, "choices": [self._choice(i, c) for i, c in enumerate(self.choices)], "usage": self.usage(),
                "weight_version": self.weight_version}

    def _head(self, obj: str) -> dict[str, Any]:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        return {"id": f"{prefix}-{self.id}", "object": obj, "created": self.created, "model": self.model}

    def _choice(self, i: int, c: Choice) -> dict[str, Any]:
        extra = {"token_ids": c.ids, "prompt_token_ids": c.prompt_ids}
        if self.kind == "chat":
            logprobs = {"content": self._chat_logprobs(c, 0, len(c.ids))} if self.show_logprobs else None
            return {"index": i, "message": c.message, "finish_reason": c.finish_reason, "logprobs": logprobs,
                    "malformed_tool_calls": c.malformed_tool_calls, **extra}
        text = (self.echo_texts[i // self.n] if self.echo_texts else "") + c.text
        logprobs = self._completion_logprobs(c, 0, len(c.ids)) if self.show_logprobs else None
        return {"index": i, "text": text, "finish_reason": c.finish_reason, "logprobs": logprobs, **extra}

    def _chat_logprobs(self, c: Choice, start: int, end: int) -> list[dict[str, Any]]:
        tokens = token_text(self.tokenizer)

        def entry(token_id: int, logp: float) -> dict[str, Any]:
            return {"token": tokens.text(token_id), "logprob": logp, "bytes": list(tokens.bytes(token_id))}

        return [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in (c.top[k] if c.top else [])[:self.top_logprobs]]}
                for k, (t, lp) in enumerate(zip(c.ids[start:end], c.logprobs[start:end]), start=start)]

    def _completion_logprobs(self, c: Choice, start: int, end: int) -> dict[str, Any]:
        # Tokens by their text (`shapes.TokenText`: a part of a character is named by its bytes, so the keys of
        # `top_logprobs` do not collide on the replacement character).
        tokens = token_text(self.tokenizer)
        top = None
        if self.top_logprobs and c.top is not None:
            top = [{tokens.text(a): b for a, b in c.top[k][:self.top_logprobs]} for k in range(start, end)]
        return {"tokens": [tokens.text(t) for t in c.ids[start:end]], "token_logprobs": c.logprobs[start:end],
                "top_logprobs": top, "text_offset": tokens.offsets(c.ids, start, end)}

    def _events(self) -> Iterator[str]:
        chunks = self._chat_chunks() if self.kind == "chat" else self._completion_chunks()
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        if self.include_usage:
            obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
            yield f"data: {json.dumps({**self._head(obj), 'choices': [], 'usage': self.usage()})}\n\n"
        yield "data: [DONE]\n\n"

    def _chat_chunks(self) -> Iterator[dict[str, Any]]:
        decode = decoder(self.tokenizer)
        for i, c in enumerate(self.choices):
            def chunk(delta, logprobs=None, finish=None):
                return {**self._head("chat.completion.chunk"),
                        "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

            yield chunk({"role": "assistant", "content": ""})
            content, calls = c.message.get("content"), c.message.get("tool_calls")
            if calls:  # the call's text is not content: the content, then the calls, each in one chunk
                logprobs = {"content": self._chat_logprobs(c, 0, len(c.ids))} if self.show_logprobs else None
                if content:
                    yield chunk({"content": content}, logprobs)
                    logprobs = None
                yield chunk({"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}, logprobs)
            else:
                for k, piece in enumerate(token_pieces(decode, c.ids, content or "")):
                    logprobs = {"content": self._chat_logprobs(c, k, k + 1)} if self.show_logprobs else None
                    yield chunk({"content": piece}, logprobs)
            yield chunk({}, None, c.finish_reason)

    def _completion_chunks(self) -> Iterator[dict[str, Any]]:
        decode = decoder(self.tokenizer)
        for i, c in enumerate(self.choices):
            def chunk(text, logprobs=None, finish=None):
                return {**self._head("text_completion"),
                        "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

            if self.echo_texts:
                yield chunk(self.echo_texts[i // self.n])
            for k, piece in enumerate(token_pieces(decode, c.ids, c.text)):
                yield chunk(piece, self._completion_logprobs(c, k, k + 1) if self.show_logprobs else None)
            yield chunk("", None, c.finish_reason)


def generate_alone(host, prompts: list, n: int, seed: int, changes: dict, options: SampleOptions, first_sample: int,
                   abort: Abort | None = None):
    """(weight version, rollout) of a request the decode batch cannot take (`OpenAIRoutes._job`), sampled alone by
    `host`'s engine with its rollout settings `changes`; runs on the engine thread. `abort` set (its client went
    away): not started, or stopped at the next token (an in-process engine's), its rows counted as cancelled."""
    engine = host.engine
    rows = len(prompts) * n
    if abort is not None and abort.is_set():
        host.thread.stats["rows_cancelled"] += rows
        return host.weight_version, None
    extra = {"first_sample": first_sample} if first_sample else {}  # only engines that number samples take it
    if abort is not None and not host.thread.outside:
        extra["stop"] = abort.is_set
    rollout = engine.with_spec(dataclasses.replace(engine.spec, **changes)).generate(
        prompts, n, seed=seed, options=options, **extra)
    if abort is not None and abort.is_set():
        host.thread.stats["rows_cancelled"] += rows
    return host.weight_version, rollout


async def _until_done_or_gone(job: asyncio.Future, receive) -> bool:
    """Wait for `job` while listening to the request's ASGI `receive` (its body already read): True when the job
    ended, False when the client went away first."""
    gone = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait([job, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    return job.done()


def _discard(job: asyncio.Future) -> None:
    """Read a given-up job's outcome (an error of a stopped job is nobody's)."""
    if not job.cancelled():
        job.exception()


class OpenAIRoutes:
    """The routes over an `rlspec.serve.app.EngineHost`; `completion` and `chat` also serve the agent gateway."""

    def __init__(self, host) -> None:
        self.host = host
        self.malformed_tool_calls = 0
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        return self.host.engine.tokenizer

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.host.model_name:
            raise bad("model", f"this server serves {self.host.model_name!r}", status=404)

    def _job(self, prompts: list, n: int, seed: int | None, max_tokens: int, temperature: float, top_p: float,
             top_logprobs: int, stops: list[str], first_sample: int = 0, field_name: str = "prompt",
             max_tokens_given: bool = True) -> "_Planned":
        """The request as the scheduler takes it: its rows (each prompt `n` times, each row its noise key, sample
        `first_sample + i` of `seed`), or, where the decode batch cannot take it, the engine job that samples it
        alone; and how a row's tokens become a choice cut at its stop string. A prompt plus `max_tokens` past the
        server's limit is refused (`max_tokens_given` false: the default is cut to fit instead)."""
        engine = self.host.engine
        seed = seed if seed is not None else secrets.randbits(31)
        planned = _Planned(stops=stops, tokenizer=self.tokenizer)
        scheduler = self.host.thread
        with _prompt_errors(field_name):
            encoded = _encode(self.tokenizer, prompts, engine.spec.max_prompt_tokens, field_name)
        max_tokens = self._fit(encoded, max_tokens, max_tokens_given)
        if scheduler.takes(encoded, max_tokens):
            keys = sample_key_list(seed, first_sample, len(encoded) * n)
            planned.rows = [ids for ids in encoded for _ in range(n)]
            planned.samplings = [RowSampling(key, max_tokens, temperature if temperature > 0 else 1.0, top_p,
                                             temperature == 0, top_logprobs) for key in keys]
            return planned
        changes = {"max_new_tokens": max_tokens, "top_p": top_p, "temperature": temperature if temperature > 0 else 1.0}
        planned.generate = (prompts, n, seed, changes, SampleOptions(greedy=temperature == 0, top_logprobs=top_logprobs),
                            first_sample)
        return planned

    def _fit(self, encoded: list[list[int]], max_tokens: int, given: bool) -> int:
        """`max_tokens`, checked against the server's limit on a row's prompt plus its tokens
        (`RowQueue.token_limit`): 400 naming max_tokens past it; a default (not `given`) cut to fit."""
        limit, why, setting = self.host.thread.token_limit()
        longest = max(len(ids) for ids in encoded)
        if limit is None:
            return max_tokens
        if not given:
            max_tokens = max(1, min(max_tokens, limit - longest))
        if longest + max_tokens > limit:
            room = f"at most {limit - longest}" if limit > longest else "none: the prompt alone reaches it"
            extra = {}
            if setting and not setting.startswith("--"):  # a spec key (a flag is named in `why`)
                extra = {"spec_key": setting, "fix": f"raise {setting} in the server's spec, or ask for fewer tokens"}
            raise bad("max_tokens", f"max_tokens={max_tokens} and a prompt of {longest} tokens make "
                                    f"{longest + max_tokens} tokens, past {why}; max_tokens can be {room}", **extra)
        return max_tokens

    def _reply(self, planned: "_Planned", version: int | None, choices: list[Choice]) -> Reply:
        for c in choices:
            planned.finish_choice(c)
        return planned.reply(version, choices)

    def _run(self, planned: "_Planned") -> Reply:
        """A planned request (`_completion` / `_chat`) served from a worker thread (the agent gateway's)."""
        with _prompt_errors():
            if planned.generate is not None:
                with self._counted(planned):
                    return self._reply(planned, *planned.rollout_choices(*self.host.thread.run(
                        generate_alone, self.host, *planned.generate)))
            sub = self._submit(planned)
            sub.done.wait()
            return self._reply(planned, *_choices(planned, sub))

    async def _run_async(self, planned: "_Planned", request: Request | None = None, stream: bool = False):
        """A planned request served from the event loop: it joins the scheduler's queue when it arrives, holding no
        worker thread; a streamed one sends each row's tokens as they come, a client that disconnects cancels its
        rows. Returns the reply, or the live stream's response."""
        with _prompt_errors():
            if planned.generate is not None:
                with self._counted(planned):
                    abort = Abort()
                    job = asyncio.ensure_future(self.host.generate_alone(*planned.generate, abort=abort))
                    if request is not None and not await _until_done_or_gone(job, request.receive):
                        abort.set()  # nobody reads the reply: the job stops at its next token
                        job.add_done_callback(_discard)
                        raise HTTPException(499, detail=[{"loc": ["client"], "msg": "the client went away"}])
                    return self._reply(planned, *planned.rollout_choices(*(await job)))
            sub = self._submit(planned)
            if stream:
                return StreamingResponse(live_events(planned, sub), media_type="text/event-stream")
            await sub.wait_async(request.receive if request is not None else None)
            return self._reply(planned, *_choices(planned, sub))

    def _submit(self, planned: "_Planned") -> Submission:
        sub = Submission(planned.rows, planned.samplings, planned.stops, planned.decode)
        with _queue_full():
            return self.host.thread.submit_rows(sub)

    @contextlib.contextmanager
    def _counted(self, planned: "_Planned"):
        """A request that runs alone, its rows counted against the queue's bound meanwhile (429 past it)."""
        prompts, n = planned.generate[0], planned.generate[1]
        with _queue_full():
            self.host.thread._queue(len(prompts) * n)
        try:
            yield
        finally:
            self.host.thread._unqueue(len(prompts) * n)

    def completion(self, req: CompletionRequest) -> Reply:
        return self._run(self._completion(req))

    def chat(self, req: ChatRequest, sampled: dict[int, list[int]] | None = None) -> Reply:
        """Render, sample, parse tool calls; `sampled` splices ids for earlier assistant turns (`chat.render`)."""
        return self._run(self._chat(req, sampled))

    async def completion_async(self, req: CompletionRequest, request: Request | None = None) -> Reply:
        return await self._run_async(self._completion(req), request)

    async def chat_async(self, req: ChatRequest, sampled: dict[int, list[int]] | None = None,
                         request: Request | None = None) -> Reply:
        return await self._run_async(self._chat(req, sampled), request)

    def _completion(self, req: CompletionRequest):
        _refuse_unsupported(req)
        self._check_model(req.model)
        if req.echo and req.logprobs is not None:
            raise bad("echo", "echo with logprobs is not supported (the prompt's log-probs are not computed)")
        prompts = self._prompts(req.prompt)
        planned = self._job(prompts, req.n, req.seed, req.max_tokens, req.temperature, req.top_p, req.logprobs or 0,
                            _stops(req.stop), req.first_sample)
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else self.tokenizer.decode(p, skip_special_tokens=True) for p in prompts]
        planned.reply = lambda version, choices: Reply(
            "completion", self.host.model_name, choices, version, req.n, req.logprobs is not None, req.logprobs or 0,
            self.tokenizer, req.stream, bool(req.stream_options and req.stream_options.include_usage), echo)
        return planned

    def _prompts(self, prompt) -> list:
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        else:
            prompts = list(prompt)
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise bad("prompt", f"give 1 to {MAX_PROMPTS} prompts, got {len(prompts)}")
        if any(not p for p in prompts):
            raise bad("prompt", "empty prompt")
        # the model's ids, not only the tokenizer's: a turn sent back as ids holds what the model sampled
        vocab = max(len(self.tokenizer), self.host.thread.vocab or 0)
        if any(not isinstance(p, str) and not all(0 <= t < vocab for t in p) for p in prompts):
            raise bad("prompt", f"token ids must be in [0, {vocab})")
        return prompts

    def _chat(self, req: ChatRequest, sampled: dict[int, list[int]] | None = None):
        _refuse_unsupported(req)
        self._check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        tools = req.tools
        parse_tools = bool(tools) and req.tool_choice != "none"  # "none": the tools stay visible, none is called
        try:
            prompt_ids = render(self.tokenizer, normalize_messages(req.messages), tools, sampled)
        except ChatError as err:
            refusal = bad(err.field, str(err))
            refusal.detail[0]["template_dropped_turn"] = isinstance(err, TemplateError)
            raise refusal from None
        asked = req.max_completion_tokens or req.max_tokens
        planned = self._job([prompt_ids], req.n, req.seed, asked or self.host.engine.spec.max_new_tokens,
                            req.temperature, req.top_p, req.top_logprobs or 0, _stops(req.stop),
                            field_name="messages", max_tokens_given=asked is not None)
        names = {(t.get("function") or t).get("name") for t in tools or []}
        planned.tools = parse_tools

        def finish_choice(c: Choice) -> None:
            content, calls, c.malformed_tool_calls = parse_tool_calls(c.text, names) if parse_tools else (c.text, [], 0)
            c.message = {"role": "assistant", "content": content}
            if calls:
                c.message["tool_calls"] = calls
                c.finish_reason = "tool_calls"
            with self._lock:
                self.malformed_tool_calls += c.malformed_tool_calls

        planned.finish_choice = finish_choice
        planned.reply = lambda version, choices: Reply(
            "chat", self.host.model_name, choices, version, req.n, req.logprobs, req.top_logprobs or 0,
            self.tokenizer, req.stream, bool(req.stream_options and req.stream_options.include_usage))
        return planned

    def router(self) -> APIRouter:
        router = APIRouter()

        @router.get("/v1/models")
        def models() -> dict:
            return {"object": "list", "data": [{"id": self.host.model_name, "object": "model", "owned_by": "rlspec"}]}

        async def respond(planned: _Planned, request: Request):
            out = await self._run_async(planned, request, stream=planned.reply(None, []).stream)
            return out if isinstance(out, StreamingResponse) else out.response()

        @router.post("/v1/completions")
        async def completions(req: CompletionRequest, request: Request):
            return await respond(self._completion(req), request)

        @router.post("/v1/chat/completions")
        async def chat(req: ChatRequest, request: Request):
            return await respond(self._chat(req), request)

        @router.get("/v1/rlspec/counters")
        def counters() -> dict:
            return {"malformed_tool_calls": self.malformed_tool_calls}

        return router
