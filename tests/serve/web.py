"""A rollout server's app on a real HTTP port in a thread of the test process, for the tests that drive it with
many concurrent clients."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch


@contextmanager
def serving(app, **config):
    """Serve `app` on a free loopback port with one torch thread (CI's 2 cores: one for the engine, one for the web
    server and the clients); yields its URL, and stops it after."""
    import uvicorn

    from rlspec.serve.process import free_port

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    port = free_port()
    web = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                        **config))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not web.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        web.should_exit = True
        thread.join(10)
        torch.set_num_threads(threads)
