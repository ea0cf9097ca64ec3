"""The server's OpenAI routes driven by the official `openai` client (through an httpx transport into the app):
chat and completions, n, seed, stop, greedy, top log-probs against the trainer's, streaming, tool calls, and
every refused field."""

from __future__ import annotations

import json

import pytest
import torch

from rlspec.core.policy import forward_logits
from rlspec.models.factory import load_model, load_tokenizer
from rlspec.rollout.base import Rollout
from rlspec.rollout.hf import HFEngine
from rlspec.serve.app import EngineHost, build_app
from rlspec.spec import ModelSpec, RolloutSpec

openai = pytest.importorskip("openai")
MODEL = "tiny_qwen2"
USER = [{"role": "user", "content": "c="}]


def client_for(engine):
    from fastapi.testclient import TestClient

    http = TestClient(build_app(EngineHost(engine, MODEL), "t0k"))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0), http


@pytest.fixture(scope="module")
def served():
    spec = ModelSpec()
    engine = HFEngine(load_model(spec, 0), load_tokenizer(spec), RolloutSpec(max_new_tokens=8), "cpu")
    client, http = client_for(engine)
    with http:
        yield client, http, engine


def trainer_logprobs(engine, prompt_ids, ids, temperature):
    """The trainer's view of a choice: per completion token, (argmax of its logits, log-prob of the token)."""
    sequence = torch.tensor([prompt_ids + ids])
    with torch.no_grad():
        logits = forward_logits(engine.model, sequence, torch.ones_like(sequence))[0, len(prompt_ids) - 1:-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logits.argmax(-1).tolist(), logp.gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()


def test_chat_renders_the_template_and_same_seed_gives_the_same_tokens(served):
    client, _, engine = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    a, b, c = (client.chat.completions.create(model=MODEL, messages=USER, n=3, seed=seed, max_tokens=6)
               for seed in (5, 5, 6))
    assert len(a.choices) == 3 and [ch.index for ch in a.choices] == [0, 1, 2] and a.object == "chat.completion"
    ids = [ch.token_ids for ch in a.choices]
    assert ids == [ch.token_ids for ch in b.choices] and ids != [ch.token_ids for ch in c.choices]
    want_prompt = engine.tokenizer(engine.tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False),
                                   add_special_tokens=False).input_ids
    for ch in a.choices:
        assert ch.prompt_token_ids == want_prompt and 1 <= len(ch.token_ids) <= 6
        assert ch.message.role == "assistant" and ch.finish_reason in ("stop", "length")
    assert a.usage.prompt_tokens == len(want_prompt)
    assert a.usage.completion_tokens == sum(len(i) for i in ids)
    comp = client.completions.create(model=MODEL, prompt=["ab=", "c="], n=2, seed=1, max_tokens=4)
    again = client.completions.create(model=MODEL, prompt=["ab=", "c="], n=2, seed=1, max_tokens=4)
    assert len(comp.choices) == 4 and [x.token_ids for x in comp.choices] == [x.token_ids for x in again.choices]
    by_text = client.completions.create(model=MODEL, prompt="ab=", seed=1, max_tokens=4, n=2)
    by_ids = client.completions.create(model=MODEL, prompt=comp.choices[0].prompt_token_ids, seed=1, max_tokens=4, n=2)
    assert [x.token_ids for x in by_ids.choices] == [x.token_ids for x in by_text.choices]  # token-id prompts
    echo = client.completions.create(model=MODEL, prompt="ab=", seed=1, max_tokens=4, echo=True)
    assert echo.choices[0].text.startswith("ab=")


def test_temperature_zero_is_the_argmax_of_the_trainers_logits(served):
    client, _, engine = served
    first, second = (client.chat.completions.create(model=MODEL, messages=USER, temperature=0, max_tokens=8,
                                                    logprobs=True, seed=seed) for seed in (1, 2))
    assert first.choices[0].token_ids == second.choices[0].token_ids  # the seed plays no part
    choice = first.choices[0]
    argmax, logps = trainer_logprobs(engine, choice.prompt_token_ids, choice.token_ids, 1.0)
    assert choice.token_ids == argmax
    assert [e.logprob for e in choice.logprobs.content] == pytest.approx(logps, abs=1e-5)
    comp = client.completions.create(model=MODEL, prompt="ab=", temperature=0, max_tokens=6)
    assert comp.choices[0].token_ids == trainer_logprobs(engine, comp.choices[0].prompt_token_ids,
                                                         comp.choices[0].token_ids, 1.0)[0]


def test_top_logprobs_hold_the_chosen_tokens_log_prob_as_the_trainer_computes_it(served):
    client, _, engine = served
    comp = client.completions.create(model=MODEL, prompt="ab=", temperature=0.7, seed=3, max_tokens=6, logprobs=5)
    choice = comp.choices[0]
    _, logps = trainer_logprobs(engine, choice.prompt_token_ids, choice.token_ids, 0.7)
    assert choice.logprobs.token_logprobs == pytest.approx(logps, abs=1e-5)
    for top, chosen in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs):
        values = list(top.values())
        assert len(top) <= 5 and values == sorted(values, reverse=True) and values[0] >= chosen - 1e-6
    chat = client.chat.completions.create(model=MODEL, messages=USER, temperature=0.7, seed=3, max_tokens=6,
                                          logprobs=True, top_logprobs=20).choices[0]
    _, logps = trainer_logprobs(engine, chat.prompt_token_ids, chat.token_ids, 0.7)
    assert [e.logprob for e in chat.logprobs.content] == pytest.approx(logps, abs=1e-5)
    for entry in chat.logprobs.content:
        assert len(entry.top_logprobs) == 20 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6


def test_stop_ends_the_text_before_the_stop_string(served):
    client, _, _ = served
    for seed in range(20):  # a seed whose 16 tokens hold a printable character after the first few
        full = client.completions.create(model=MODEL, prompt="ab=", seed=seed, max_tokens=16).choices[0]
        stop = next((ch for ch in full.text[2:] if ch.isalnum()), None)
        if stop is not None:
            break
    cut = client.completions.create(model=MODEL, prompt="ab=", seed=seed, max_tokens=16, stop=[stop, "\x00never"]).choices[0]
    assert cut.text == full.text[:full.text.index(stop)] and cut.finish_reason == "stop"
    assert full.token_ids[:len(cut.token_ids)] == cut.token_ids and len(cut.token_ids) < len(full.token_ids)
    chat_full = client.chat.completions.create(model=MODEL, messages=USER, seed=seed, max_tokens=16).choices[0]
    stop = next(ch for ch in chat_full.message.content[1:] if ch.isprintable())
    chat_cut = client.chat.completions.create(model=MODEL, messages=USER, seed=seed, max_tokens=16, stop=stop).choices[0]
    assert chat_cut.message.content == chat_full.message.content[:chat_full.message.content.index(stop)]
    assert chat_cut.finish_reason == "stop"


def test_stream_chunks_join_to_the_unstreamed_text(served):
    client, _, _ = served
    kwargs = dict(model=MODEL, messages=USER, n=2, seed=9, max_tokens=8, logprobs=True)
    whole = client.chat.completions.create(**kwargs)
    texts, finish, logps, usage = {0: "", 1: ""}, {}, {0: [], 1: []}, None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        assert chunk.object == "chat.completion.chunk"
        usage = chunk.usage or usage
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            finish[ch.index] = ch.finish_reason or finish.get(ch.index)
            logps[ch.index] += [e.logprob for e in (ch.logprobs.content if ch.logprobs else [])]
    for ch in whole.choices:
        assert texts[ch.index] == ch.message.content and finish[ch.index] == ch.finish_reason
        assert logps[ch.index] == [e.logprob for e in ch.logprobs.content]
    assert usage.completion_tokens == whole.usage.completion_tokens
    comp = dict(model=MODEL, prompt="ab=", seed=4, max_tokens=8, stop="x")
    streamed = "".join(c.choices[0].text for c in client.completions.create(**comp, stream=True) if c.choices)
    assert streamed == client.completions.create(**comp).choices[0].text


def test_streams_equal_the_unstreamed_text_with_stops_of_multi_byte_characters(served):
    """A stop whose first character the text holds before a multi-byte character was once sent, then the whole
    text again (tests/serve/test_stops.py covers random stops and decode runs without a server)."""
    client, _, _ = served
    checked = 0
    for seed in (3, 4):  # seeds whose text holds a multi-byte character
        for route in ("completions", "chat"):
            kwargs = dict(model=MODEL, seed=seed, max_tokens=24, n=2)
            if route == "chat":
                create, kwargs["messages"] = client.chat.completions.create, USER
                text_of, delta_of = (lambda c: c.message.content), (lambda c: c.delta.content)
            else:
                create, kwargs["prompt"] = client.completions.create, "ab="
                text_of, delta_of = (lambda c: c.text), (lambda c: c.text)
            full = text_of(create(**kwargs).choices[0]) or ""
            at = next((k for k in range(1, len(full)) if ord(full[k]) > 0x7F and full[k] != "\ufffd"), None)
            if at is None:
                continue
            stop = full[at - 1:at + 1]
            whole = create(**kwargs, stop=[stop, "\u0800"]).choices
            streamed = {0: "", 1: ""}
            for chunk in create(**kwargs, stop=[stop, "\u0800"], stream=True):
                for c in chunk.choices:
                    streamed[c.index] += delta_of(c) or ""
            assert [streamed[c.index] for c in whole] == [text_of(c) or "" for c in whole], (seed, route, stop)
            checked += 1
    assert checked == 4


class ScriptedEngine:
    """An engine whose every completion is the given text (then the end token): the tool-call parser's input."""

    def __init__(self, text: str) -> None:
        self.tokenizer = load_tokenizer(ModelSpec())
        self.spec = RolloutSpec(max_new_tokens=64)
        self.text = text
        self.prompts = []

    def with_spec(self, spec):
        return self

    def generate(self, prompts, n, seed, options=None):
        self.prompts += prompts
        ids = self.tokenizer(self.text, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]
        return Rollout([list(p) for p in prompts for _ in range(n)], [ids] * len(prompts) * n,
                       [[0.0] * len(ids)] * len(prompts) * n, [self.text] * len(prompts) * n)


TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds", "parameters": {"type": "object"}}}]


def test_tool_calls_are_parsed_and_tool_results_go_back_through_the_template():
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    client, http = client_for(ScriptedEngine("let me add " + call))
    with http:
        out = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "let me add"
        (tool_call,) = choice.message.tool_calls
        assert tool_call.function.name == "add" and json.loads(tool_call.function.arguments) == {"a": 1, "b": 2}
        assert choice.malformed_tool_calls == 0
        streamed = list(client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, stream=True))
        deltas = [d.delta.tool_calls for d in (c.choices[0] for c in streamed) if d.delta.tool_calls]
        assert deltas[0][0].function.name == "add" and streamed[-1].choices[0].finish_reason == "tool_calls"
        plain = client.chat.completions.create(model=MODEL, messages=USER)  # no tools: the text is content
        assert plain.choices[0].message.content == "let me add " + call and plain.choices[0].finish_reason == "stop"
        history = [*USER, choice.message, {"role": "tool", "tool_call_id": tool_call.id, "content": "3"}]
        after = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS).choices[0]
        prompt = http.app.state.openai.tokenizer.decode(after.prompt_token_ids)
        assert prompt.endswith('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call></s>\n'
                               "<|im_start|>tool\n3</s>\n<|im_start|>assistant\n"), prompt
        assert prompt.startswith("<|im_start|>system\ntools: add</s>\n")
        # tool_choice "none": the tools stay in the prompt (as OpenAI shows them), and no call is taken out of the text
        none = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none").choices[0]
        prompt = http.app.state.openai.tokenizer.decode(none.prompt_token_ids)
        assert prompt.startswith("<|im_start|>system\ntools: add</s>\n"), prompt
        assert none.message.content == "let me add " + call and not none.message.tool_calls
        assert none.finish_reason == "stop"
    for text, malformed in (('<tool_call>{"name": "add", "arguments": </tool_call>', 1),  # bad JSON
                            ('<tool_call>{"name": "mul", "arguments": {}}</tool_call>', 1),  # no such tool
                            ('<tool_call>{"name": "add"', 1)):  # never closed
        client, http = client_for(ScriptedEngine(text))
        with http:
            choice = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS).choices[0]
            assert choice.message.content == text and not choice.message.tool_calls
            assert choice.malformed_tool_calls == malformed and choice.finish_reason == "stop"
            assert http.get("/v1/rlspec/counters").json() == {"malformed_tool_calls": malformed}


CHAT_REFUSED = [
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required", "tools": TOOLS}, "tool_choice"),
    ({"modalities": ["audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": [""]}, "stop"),
    ({"model": "another"}, "model"),
    ({"max_tokens": 600}, "max_tokens"),  # past the model's context (512)
    ({"messages": [{"role": "user", "content": "a" * 300}]}, "messages"),  # past rollout.max_prompt_tokens
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
]
COMPLETION_REFUSED = [
    ({"best_of": 2}, "best_of"),
    ({"suffix": "end"}, "suffix"),
    ({"echo": True, "logprobs": 1}, "echo"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt": [[1, 10**6]]}, "prompt"),
    ({"prompt": [True, False]}, "prompt"),
    ({"logprobs": True}, "logprobs"),
    ({"max_tokens": 600}, "max_tokens"),
]


@pytest.mark.parametrize("route,extra,field", [("chat", e, f) for e, f in CHAT_REFUSED] +
                         [("completions", e, f) for e, f in COMPLETION_REFUSED])
def test_refused_fields_get_a_4xx_naming_them_and_the_server_keeps_serving(served, route, extra, field):
    client, _, _ = served
    with pytest.raises(openai.APIStatusError) as err:
        if route == "chat":
            client.chat.completions.create(**{"model": MODEL, "messages": USER, "max_tokens": 2, **extra})
        else:
            client.completions.create(**{"model": MODEL, "prompt": "ab=", "max_tokens": 2, **extra})
    assert err.value.status_code == (404 if field == "model" else 400), err.value.body
    assert err.value.param == field and err.value.type == "invalid_request_error", err.value.body
    assert err.value.code == ("model_not_found" if field == "model" else None)
    assert client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1).choices[0].token_ids


def test_null_is_the_default_wherever_openai_allows_it(served):
    client, _, _ = served
    nulls = dict(temperature=None, top_p=None, n=None, stream=None, stop=None, stream_options=None)
    plain = client.completions.create(model=MODEL, prompt="ab=", seed=2)
    nulled = client.completions.create(model=MODEL, prompt="ab=", seed=2, max_tokens=None, echo=None, logprobs=None,
                                       **nulls)
    assert nulled.choices[0].token_ids == plain.choices[0].token_ids
    plain = client.chat.completions.create(model=MODEL, messages=USER, seed=2)
    nulled = client.chat.completions.create(model=MODEL, messages=USER, seed=2, logprobs=None, max_tokens=None,
                                            tool_choice=None, **nulls)
    assert nulled.choices[0].token_ids == plain.choices[0].token_ids and nulled.choices[0].logprobs is None


def test_logprobs_name_tokens_by_their_text_and_bytes_rebuild_the_text(served):
    """OpenAI's (and vLLM's) shapes: a token is its decoded text (not the tokenizer's symbol, 'Ġ' for a space), a
    part of a character is named by its bytes; chat's `bytes` join to the content; `text_offset` says where each
    token's text begins."""
    client, http, engine = served
    tokenizer, special = engine.tokenizer, set(engine.tokenizer.all_special_ids)
    comp = client.completions.create(model=MODEL, prompt="ab=", seed=3, max_tokens=24, logprobs=20).choices[0]
    tokens, offsets = comp.logprobs.tokens, comp.logprobs.text_offset
    assert len(tokens) == len(offsets) == len(comp.token_ids)
    for k, token_id in enumerate(comp.token_ids):
        alone = tokenizer.decode([token_id])
        assert tokens[k] == alone if "\ufffd" not in alone else tokens[k].startswith("bytes:\\x"), (k, tokens[k])
        before = tokenizer.decode(comp.token_ids[:k], skip_special_tokens=True)
        if not before.endswith("\ufffd"):
            assert offsets[k] == len(before), k
    assert offsets == sorted(offsets) and any(ord(ch) > 0x7F and ch != "\ufffd" for ch in comp.text)
    keys = {key for top in comp.logprobs.top_logprobs for key in top}
    # bytes 0-32 as themselves, not as the byte-level symbols 'Ā'...'Ġ' (U+0100-U+0120) a tokenizer writes them in
    assert any(key < " " for key in keys) and not any("\u0100" <= ch <= "\u0143" for key in keys for ch in key)
    chat = client.chat.completions.create(model=MODEL, messages=USER, seed=3, max_tokens=24, logprobs=True,
                                          top_logprobs=2).choices[0]
    joined = b"".join(bytes(e.bytes) for e, t in zip(chat.logprobs.content, chat.token_ids) if t not in special)
    assert joined.decode("utf-8", "replace") == chat.message.content
    assert any(ord(ch) > 0x7F and ch != "\ufffd" for ch in chat.message.content)
    for entry in chat.logprobs.content:
        for top in entry.top_logprobs:
            assert top.token == bytes(top.bytes).decode() if not top.token.startswith("bytes:") else top.bytes


def test_the_streams_decoder_gives_the_tokenizers_text():
    """`chat.decoder` (every stream decodes its rows after every decode run) takes the fast tokenizer's backend
    directly where that is the same text: special tokens and ids past the tokenizer dropped, as `decode` does."""
    import random

    from rlspec.models.factory import load_tokenizer
    from rlspec.serve.chat import decoder
    from rlspec.spec import ModelSpec

    tokenizer = load_tokenizer(ModelSpec())
    assert tokenizer.clean_up_tokenization_spaces is False, "the fast path is not what this test covers"
    decode, vocab, rng = decoder(tokenizer), len(tokenizer), random.Random(0)
    specials = list(tokenizer.all_special_ids)
    for _ in range(200):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(vocab + 50)
               for _ in range(rng.randint(0, 40))]
        assert decode(ids) == tokenizer.decode([t for t in ids if t < vocab], skip_special_tokens=True)


def test_encode_gives_the_tokenizers_ids_and_falls_back_where_the_backend_would_truncate():
    """`chat.encode` (a chat turn encodes its whole conversation; a completion its prompt) takes the fast tokenizer's
    backend directly: the ids the tokenizer's call gives, special tokens' text and non-ASCII included; a backend
    with truncation set goes through the tokenizer's call, which lifts it."""
    import random

    from rlspec.models.factory import load_tokenizer
    from rlspec.serve.chat import encode
    from rlspec.spec import ModelSpec

    tokenizer = load_tokenizer(ModelSpec())
    rng = random.Random(0)
    pieces = [*tokenizer.all_special_tokens, "abc", " ", "\n", "é", "日本", "<tool_call>", "{\"a\": 1}", "=", "  x"]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        assert encode(tokenizer, text) == tokenizer(text, add_special_tokens=False).input_ids, text
    long = "abcd" * 50
    tokenizer.backend_tokenizer.enable_truncation(8)
    try:
        assert encode(tokenizer, long) == tokenizer(long, add_special_tokens=False).input_ids
        assert len(encode(tokenizer, long)) > 8
    finally:
        tokenizer.backend_tokenizer.no_truncation()
    special = tokenizer.all_special_tokens[0] + "ab"  # a backend left splitting special tokens by another call
    tokenizer.backend_tokenizer.encode_special_tokens = True
    try:
        assert encode(tokenizer, special) == tokenizer(special, add_special_tokens=False).input_ids
    finally:
        tokenizer.backend_tokenizer.encode_special_tokens = False
