"""`rlspec serve`: a rollout engine as its own process behind HTTP, and the client that drives it.

- `app.py`: the FastAPI app (`/health`, the weight version, and the bridge endpoint that runs a `sync`
  transport's engine half), with the OpenAI routes of `openai_api.py` (`/v1/completions`,
  `/v1/chat/completions`, with token ids and log-probs) and their text plumbing in `chat.py` (chat
  templates, stop strings, tool calls).
- `client.py`: `ServerClient` (HTTP calls, errors named) and `ServedEngine`, a `RolloutEngine` over it.
- `process.py`: building the engine from a plan, `rlspec serve`'s main, and `ServerProcess`, which starts
  the server as a child process, waits for it to be healthy and never leaves it behind.
"""

TOKEN_ENV = "RLSPEC_SERVE_TOKEN"
"""The shared secret the bridge endpoint requires (it runs code sent by the trainer)."""
