"""Minimal OpenAI completions calls for agents: `complete` (stdlib only: a command agent need not import httpx)
and, for async agents, `complete_async` / `completion_async` over one shared HTTP client (`http_client`); their HTTP
errors carry what the server said."""

from __future__ import annotations

import asyncio
import functools
import json
import urllib.request

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the gateway is local: never a proxy
_CLIENTS: dict = {}


def complete(base_url: str, prompt: str, max_tokens: int, timeout_s: float = 120.0) -> str:
    """The text of one completion of `prompt` from ``POST {base_url}/completions``; raises on an HTTP error."""
    request = urllib.request.Request(f"{base_url}/completions", method="POST",
                                     data=json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode(),
                                     headers={"content-type": "application/json"})
    with _OPENER.open(request, timeout=timeout_s) as response:
        return json.loads(response.read())["choices"][0]["text"]


def http_client():
    """One `httpx.AsyncClient` per event loop, shared by every agent on it (the gateway runs all agents on one loop):
    one connection pool, no limit on connections (hundreds of agents wait on the engine at once; a pool of 100
    would queue the rest and time them out), never a proxy (the gateway is local). Pass it to an OpenAI client as
    ``AsyncOpenAI(base_url=..., http_client=http_client())``: building a client per agent costs ~20 ms of CPU each.

    A request to an address that an app of this process serves (`serve_in_process`: the agent gateway's) goes to
    the app directly, on the caller's event loop: no socket, no HTTP parsing, no server thread; the same routes,
    status codes and bodies as over the network."""
    import httpx

    loop = asyncio.get_running_loop()
    client = _CLIENTS.get(loop)
    if client is None:
        # Idle connections dropped after 1 s, well before the server closes them (5 s): none is reused as it closes.
        network = httpx.AsyncHTTPTransport(trust_env=False, limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=None, keepalive_expiry=1.0))
        client = httpx.AsyncClient(timeout=httpx.Timeout(None), trust_env=False,
                                   transport=_in_process_transport()(network))
        _CLIENTS[loop] = client
    return client


_IN_PROCESS: dict[tuple[str, int], object] = {}
"""(host, port) -> the ASGI app of this process serving it (`serve_in_process`)."""


def serve_in_process(host: str, port: int, app) -> None:
    """Let `http_client` send requests for http://host:port to `app` (an ASGI app this process also serves there)
    without the network; `app` None stops that."""
    if app is None:
        _IN_PROCESS.pop((host, port), None)
    else:
        _IN_PROCESS[(host, port)] = app


@functools.cache
def _in_process_transport():
    """`http_client`'s transport class (made on first use: httpx is imported only by the agents that use it)."""
    import httpx

    class InProcess(httpx.AsyncBaseTransport):
        """`http_client`'s transport: the app of `serve_in_process` for its address, else the network. A 500 of the
        app is a 500 response, as over the network, not an exception."""

        def __init__(self, network) -> None:
            self.network = network
            self.apps: dict[tuple[str, int], httpx.ASGITransport] = {}

        async def handle_async_request(self, request):
            address = (request.url.host, request.url.port)
            app = _IN_PROCESS.get(address)
            if app is None:
                return await self.network.handle_async_request(request)
            transport = self.apps.get(address)
            if transport is None or transport.app is not app:
                transport = self.apps[address] = httpx.ASGITransport(app, raise_app_exceptions=False)
            return await transport.handle_async_request(request)

        async def aclose(self) -> None:
            await self.network.aclose()

    return InProcess


async def completion_async(base_url: str, body: dict, timeout_s: float = 120.0) -> dict:
    """The first choice of ``POST {base_url}/completions`` with JSON `body` (it has `token_ids` and
    `prompt_token_ids`: an agent may send the next turn as token ids); raises on an HTTP error."""
    response = await http_client().post(f"{base_url}/completions", json=body, timeout=timeout_s)
    raise_for_status(response)
    return response.json()["choices"][0]


def raise_for_status(response) -> None:
    """httpx's `raise_for_status`, with what the server said (a 400 names the field and the limit it broke)."""
    if response.is_error:
        import httpx

        raise httpx.HTTPStatusError(f"{response.status_code} from {response.url}: {response.text[:500]}",
                                    request=response.request, response=response)


async def complete_async(base_url: str, prompt: str | list[int], max_tokens: int, timeout_s: float = 120.0) -> str:
    """`complete` for an async agent: the text of one completion of `prompt` (text or token ids)."""
    return (await completion_async(base_url, {"prompt": prompt, "max_tokens": max_tokens}, timeout_s))["text"]
