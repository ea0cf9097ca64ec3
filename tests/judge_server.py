"""A scripted OpenAI-compatible judge on 127.0.0.1 that fails on purpose (for the llm_judge tests).

Each model has a script of actions, consumed one per request (`default` once it runs out):
  ok:<score>       200 with "SCORE: <score>"
  500 | 503 | 401  that HTTP status (with an OpenAI-style error body)
  404              the model does not exist
  429:<s>          429 with `Retry-After: <s>`
  timeout          answers only after `slow_s` (past the client's timeout)
  malformed        200 with a body that is not JSON
  noscore          200, a well-formed completion without a score
  every:<n>:<a>    the n-th, 2n-th, ... request of this model gets action <a>, the others `ok:0.5`
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScriptedJudge:
    def __init__(self, scripts: dict[str, list[str]] | None = None, default: str = "ok:0.5", slow_s: float = 1.0) -> None:
        self.scripts = {model: list(actions) for model, actions in (scripts or {}).items()}
        self.default = default
        self.slow_s = slow_s
        self.requests: list[tuple[str, str]] = []
        """(model, action) per request received, in arrival order."""
        self.auth_headers: list[str | None] = []
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def count(self, model: str) -> int:
        return sum(1 for m, _ in self.requests if m == model)

    def __enter__(self) -> "ScriptedJudge":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _next_action(self, model: str) -> str:
        with self._lock:
            self._counts[model] = n = self._counts.get(model, 0) + 1
            script = self.scripts.get(model)
            action = script.pop(0) if script else self.default
            if action.startswith("every:"):
                _, every, inner = action.split(":", 2)
                action = inner if n % int(every) == 0 else "ok:0.5"
            self.requests.append((model, action))
            return action

    def _handler(self):
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet test output
                pass

            def _send(self, status: int, body: bytes, headers: dict | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                    pass

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                judge.auth_headers.append(self.headers.get("Authorization"))
                if self.path != "/v1/chat/completions":
                    self._send(400, b'{"error": {"message": "wrong path"}}')
                    return
                action = judge._next_action(request["model"])
                if action == "timeout":
                    time.sleep(judge.slow_s)
                    action = "ok:0.5"
                if action.startswith("ok:"):
                    reply = {"choices": [{"index": 0, "message": {"role": "assistant",
                                                                  "content": f"Fine work. SCORE: {action[3:]}"}}]}
                    self._send(200, json.dumps(reply).encode())
                elif action == "malformed":
                    self._send(200, b'{"choices": [{"message": ')
                elif action == "noscore":
                    self._send(200, json.dumps({"choices": [{"message": {"content": "I cannot grade this."}}]}).encode())
                elif action == "404":
                    self._send(404, json.dumps({"error": {"code": "model_not_found",
                                                          "message": f"The model {request['model']} does not exist"}}).encode())
                elif action.startswith("429:"):
                    self._send(429, b'{"error": {"message": "slow down"}}', {"Retry-After": action[4:]})
                else:
                    self._send(int(action), json.dumps({"error": {"message": f"status {action}"}}).encode())

        return Handler
