"""`rollout.task.reward: llm_judge`: a hosted LLM scores each completion over an OpenAI-compatible API.

The task's prompts are kept; only the reward changes. For each completion the judge is sent
`judge.prompt_template` (filled with the prompt, the completion and the prompt's metadata) as one user
message to `{base_url}/chat/completions` at temperature 0, and the score is the last match of
`judge.score_regex` in the reply.

Failures, per model of the fallback chain `judge.models`:
  - transient (connection error, timeout, HTTP 408/409/425/429/5xx, a reply that is not the expected
    JSON or carries no score): retried up to `judge.max_retries` times with exponential backoff and
    jitter (a 429/503 `Retry-After` is honoured up to `judge.backoff_max_s`), then the next model;
  - the model is not found (HTTP 404), or the request is refused (other 4xx): the next model at once.
When every model has failed the sample's reward raises `JudgeError`: the loop counts it in
`reward/errors` and drops the sample — it is never scored 0. Requests per sample are bounded by
len(models) x (1 + max_retries).

The API key is read once from the environment variable `judge.api_key_env` and only ever sent in the
`Authorization` header: it is not part of the spec, the plan, the metrics or any error message.
Scoring runs in the driver process (not in Ray workers), so the variable only needs to be set where
`rlspec run` starts.
"""

from __future__ import annotations

import math
import os
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from ..spec import JudgeSpec, SpecError
from .base import Prompt, Task

TRANSIENT_STATUS = frozenset({408, 409, 425, 429})
"""4xx answers worth retrying (timeouts, conflicts, rate limits); 5xx are always retried."""


class JudgeError(RuntimeError):
    """No model of the chain returned a score for a sample; `counts` are its requests, retries, fallbacks."""

    def __init__(self, message: str, counts: dict[str, float]) -> None:
        super().__init__(message)
        self.counts = counts


class _Transient(Exception):
    """This attempt failed in a way another attempt at the same model may not (retry after a delay)."""

    def __init__(self, reason: str, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class _ModelFailed(Exception):
    """This model cannot answer (not found, request refused): move down the chain without retrying."""


def backoff_delay_s(retry: int, spec: JudgeSpec, rng: random.Random) -> float:
    """Delay before retry number `retry` (0-based): backoff_s * 2^retry, capped, times a draw from [1 - jitter, 1]."""
    return min(spec.backoff_max_s, spec.backoff_s * 2 ** retry) * (1 - spec.jitter * rng.random())


def render_prompt(template: str, prompt: Prompt, completion: str) -> str:
    return template.format_map({**prompt.meta, "prompt": prompt.text, "completion": completion})


class JudgeClient:
    """Scores one completion at a time; safe to call from several threads (one shared HTTP client)."""

    def __init__(self, spec: JudgeSpec, api_key: str | None, sleep: Callable[[float], None] = time.sleep,
                 seed: int = 0) -> None:
        self.spec = spec
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._pattern = re.compile(spec.score_regex)
        self._sleep = sleep
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._client = None
        self._client_lock = threading.Lock()

    def _http(self):
        import httpx

        with self._client_lock:
            if self._client is None:
                limits = httpx.Limits(max_connections=self.spec.max_concurrency)
                self._client = httpx.Client(timeout=httpx.Timeout(self.spec.timeout_s), limits=limits)
            return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def score(self, prompt: Prompt, completion: str) -> tuple[float, dict[str, float]]:
        """The judge's score and this sample's counters; raises `JudgeError` when the whole chain failed."""
        counts = {"reward/judge_requests": 0.0, "reward/retries": 0.0, "reward/fallbacks": 0.0}
        text = render_prompt(self.spec.prompt_template, prompt, completion)
        failures = []
        for index, model in enumerate(self.spec.models):
            if index:
                counts["reward/fallbacks"] += 1
            for retry in range(self.spec.max_retries + 1):
                if retry:
                    counts["reward/retries"] += 1
                counts["reward/judge_requests"] += 1
                try:
                    return self._ask(model, text), counts
                except _ModelFailed as err:
                    failures.append(f"{model}: {err}")
                    break
                except _Transient as err:
                    if retry == self.spec.max_retries:
                        failures.append(f"{model}: {err} (after {retry} retries)")
                        break
                    self._sleep(self._delay_s(retry, err.retry_after_s))
        raise JudgeError("the judge gave no score; " + "; ".join(failures), counts)

    def _delay_s(self, retry: int, retry_after_s: float | None) -> float:
        if retry_after_s is not None:
            return min(retry_after_s, self.spec.backoff_max_s)
        with self._rng_lock:
            return backoff_delay_s(retry, self.spec, self._rng)

    def _ask(self, model: str, text: str) -> float:
        import httpx

        body = {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0.0,
                "max_tokens": self.spec.max_tokens}
        try:
            response = self._http().post(self.spec.base_url.rstrip("/") + "/chat/completions", json=body,
                                         headers=self._headers)
        except httpx.TimeoutException:
            raise _Transient(f"no answer within judge.timeout_s={self.spec.timeout_s}") from None
        except httpx.TransportError as err:
            raise _Transient(f"connection failed ({type(err).__name__})") from None
        status = response.status_code
        if status == 404:
            raise _ModelFailed("not found (HTTP 404)")
        if status >= 500 or status in TRANSIENT_STATUS:
            raise _Transient(f"HTTP {status}", _retry_after_s(response.headers.get("retry-after")))
        if status != 200:
            raise _ModelFailed(f"refused (HTTP {status}: {response.text[:200]!r})")
        return self._parse(response)

    def _parse(self, response) -> float:
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise _Transient(f"malformed reply (not an OpenAI chat completion): {response.text[:120]!r}") from None
        found = self._pattern.findall(content if isinstance(content, str) else "")
        if not found:
            raise _Transient(f"no score in the reply (judge.score_regex): {str(content)[:120]!r}")
        value = float(found[-1] if isinstance(found[-1], str) else found[-1][0])
        if not math.isfinite(value):
            raise _Transient(f"score {value} is not a finite number")
        return value


def _retry_after_s(header: str | None) -> float | None:
    try:
        return max(0.0, float(header)) if header is not None else None
    except ValueError:
        return None  # an HTTP date: fall back to our own backoff


class JudgeTask:
    """A task's prompts, scored by the judge; batches are scored `judge.max_concurrency` requests at a time."""

    def __init__(self, base: Task, client: JudgeClient) -> None:
        self.name = f"{base.name}+llm_judge"
        self.base = base
        self.client = client

    def sample(self, step: int, n: int) -> list[Prompt]:
        return self.base.sample(step, n)

    def reward(self, completion: str, prompt: Prompt) -> float:
        return self.client.score(prompt, completion)[0]

    def score_batch(self, completions: list[str], prompts: list[Prompt],
                    completion_ids: list[list[int]] | None = None) -> tuple[list, dict[str, float]]:
        """Per sample the score or the `JudgeError`; counters summed over the batch (the judge reads text only)."""
        def one(pair):
            try:
                return self.client.score(pair[1], pair[0])
            except JudgeError as err:
                return err, err.counts

        with ThreadPoolExecutor(max_workers=self.client.spec.max_concurrency, thread_name_prefix="rlspec-judge") as pool:
            outcomes = list(pool.map(one, zip(completions, prompts)))
        totals = {"reward/judge_requests": 0.0, "reward/retries": 0.0, "reward/fallbacks": 0.0}
        for _, counts in outcomes:
            for key, value in counts.items():
                totals[key] += value
        return [result for result, _ in outcomes], totals


def build_judge_task(base: Task, spec: JudgeSpec, seed: int, key: str = "rollout.task.judge") -> JudgeTask:
    """Check the judge's settings against the task (template fields, regex, API key) and wrap it."""
    import importlib.util

    if importlib.util.find_spec("httpx") is None:
        raise SpecError("rollout.task.reward", "rollout.task.reward=llm_judge needs httpx, not installed in this environment",
                        "pip install 'rlspec[judge]'")
    example = base.sample(0, 1)[0]
    try:
        render_prompt(spec.prompt_template, example, "")
    except KeyError as err:
        fields = ", ".join(sorted({"prompt", "completion", *example.meta}))
        raise SpecError(f"{key}.prompt_template", f"names the field {err}, which the {base.name} task does not provide",
                        f"use only: {fields}") from None
    except (ValueError, IndexError) as err:
        raise SpecError(f"{key}.prompt_template", f"is not a valid format string ({err})",
                        "write fields as {completion}; double literal braces as {{ }}") from None
    try:
        groups = re.compile(spec.score_regex).groups
    except re.error as err:
        raise SpecError(f"{key}.score_regex", f"is not a valid regular expression ({err})", "e.g. SCORE:\\s*([-+]?\\d*\\.?\\d+)") from None
    if groups < 1:
        raise SpecError(f"{key}.score_regex", "has no capturing group for the score", "wrap the number in ( )")
    api_key = None
    if spec.api_key_env is not None:
        api_key = os.environ.get(spec.api_key_env)
        if not api_key:
            raise SpecError(f"{key}.api_key_env", f"the environment variable {spec.api_key_env} is not set",
                            f"export {spec.api_key_env} before rlspec run, or set {key}.api_key_env=null for a judge without a key")
    return JudgeTask(base, JudgeClient(spec, api_key, seed=seed))
