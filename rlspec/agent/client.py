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
    the app directly, on the caller's event loop: no socket, no HTTP parsing, no server thread, and for the routes
    its `call` answers, none of the app's HTTP layers either; the same routes, status codes and bodies as over the
    network."""
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


_IN_PROCESS: dict[tuple[str, int], tuple] = {}
"""(host, port) -> (the ASGI app of this process serving it, its in-process `call` or None): `serve_in_process`."""


def serve_in_process(host: str, port: int, app, call=None) -> None:
    """Let `http_client` send requests for http://host:port to `app` (an ASGI app this process also serves there)
    without the network; `app` None stops that. `call`: ``async (method, path, parsed JSON body) -> (status, body,
    headers) or None`` answers the routes it knows without the app's HTTP layers (None: the app answers), as the
    agent gateway's `call_in_process` does."""
    if app is None:
        _IN_PROCESS.pop((host, port), None)
    else:
        _IN_PROCESS[(host, port)] = (app, call)


def _in_process_call(url):
    """The in-process `call` serving httpx URL `url`'s address, or None."""
    return _IN_PROCESS.get((url.host, url.port), (None, None))[1]


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
            app, call = _IN_PROCESS.get(address, (None, None))
            if app is None:
                return await self.network.handle_async_request(request)
            if call is not None and request.headers.get("content-type", "").startswith("application/json"):
                try:
                    body = json.loads(await request.aread())
                except ValueError:
                    body = None  # the app's own 400
                answer = await call(request.method, request.url.path, body) if body is not None else None
                if answer is not None:
                    return _response(answer, request)
            transport = self.apps.get(address)
            if transport is None or transport.app is not app:
                transport = self.apps[address] = httpx.ASGITransport(app, raise_app_exceptions=False)
            return await transport.handle_async_request(request)

        async def aclose(self) -> None:
            await self.network.aclose()

    return InProcess


async def completion_async(base_url: str, body: dict, timeout_s: float = 120.0) -> dict:
    """The first choice of ``POST {base_url}/completions`` with JSON `body` (it has `token_ids` and
    `prompt_token_ids`: an agent may send the next turn as token ids); raises on an HTTP error. To an app of this
    process (`serve_in_process`), `body` goes as it is, not as JSON: a long conversation's ids are not written
    and read back as text at every turn."""
    import httpx

    url = httpx.URL(f"{base_url}/completions")
    call = _in_process_call(url)
    answer = None
    if call is not None:
        try:
            answer = await asyncio.wait_for(call("POST", url.path, body), timeout_s)
        except asyncio.TimeoutError:  # as the network's read timeout (the call is cancelled: its rows leave)
            raise httpx.ReadTimeout(f"no answer from {url} in {timeout_s} s") from None
    if answer is None:
        response = await http_client().post(url, json=body, timeout=timeout_s)
        raise_for_status(response)
        return response.json()["choices"][0]
    status, content, _ = answer
    if status >= 400:
        raise_for_status(_response(answer, httpx.Request("POST", url)))
    choice = dict(content["choices"][0])
    for key in ("token_ids", "prompt_token_ids"):  # the gateway keeps these lists: the agent gets copies, as JSON
        choice[key] = list(choice[key])
    return choice


def _response(answer: tuple, request):
    """An in-process `call`'s (status, body, headers) as the httpx response the app would have sent: a 500's text, or
    JSON written as the app writes it (Starlette's `JSONResponse`)."""
    import httpx

    status, content, headers = answer
    if isinstance(content, str):
        return httpx.Response(status, text=content, headers=headers, request=request)
    body = json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()
    return httpx.Response(status, content=body, request=request,
                          headers={**(headers or {}), "content-type": "application/json"})


def raise_for_status(response) -> None:
    """httpx's `raise_for_status`, with what the server said (a 400 names the field and the limit it broke)."""
    if response.is_error:
        import httpx

        raise httpx.HTTPStatusError(f"{response.status_code} from {response.url}: {response.text[:500]}",
                                    request=response.request, response=response)


async def complete_async(base_url: str, prompt: str | list[int], max_tokens: int, timeout_s: float = 120.0) -> str:
    """`complete` for an async agent: the text of one completion of `prompt` (text or token ids)."""
    return (await completion_async(base_url, {"prompt": prompt, "max_tokens": max_tokens}, timeout_s))["text"]
