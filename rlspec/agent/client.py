"""A minimal OpenAI completions call for agents (stdlib only: an agent process need not import httpx)."""

from __future__ import annotations

import json
import urllib.request

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the gateway is local: never a proxy


def complete(base_url: str, prompt: str, max_tokens: int, timeout_s: float = 120.0) -> str:
    """The text of one completion of `prompt` from ``POST {base_url}/completions``; raises on an HTTP error."""
    request = urllib.request.Request(f"{base_url}/completions", method="POST",
                                     data=json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode(),
                                     headers={"content-type": "application/json"})
    with _OPENER.open(request, timeout=timeout_s) as response:
        return json.loads(response.read())["choices"][0]["text"]
