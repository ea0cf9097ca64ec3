"""`rlspec serve`: a rollout engine as its own process behind HTTP, and the client that drives it.

- `app.py`: the FastAPI app (`/health`, the weight version, and the bridge endpoint that runs a `sync`
  transport's engine half), with the OpenAI routes of `openai_api.py` (`/v1/completions`,
  `/v1/chat/completions`, with token ids and log-probs) and their text plumbing in `chat.py` (chat
  templates, stop strings, tool calls).
- `scheduler.py`: the engine thread: every request in flight joins one decode batch in `pool.py` (the CUDA-graph
  engine's slot pool with per-row sampling settings; `kv/`: the prompts' prefills and prefix reuse it admits rows
  from), bridge
  jobs run between decode steps once the rows in flight have drained, a bounded queue (429 past it); `live.py`: a
  request's plan and its live stream.
- `ops.py`: the bridge's named operations and its wire format (JSON + safetensors; no code travels).
- `client.py`: `ServerClient` (HTTP calls, errors named) and `ServedEngine`, a `RolloutEngine` over it.
- `process.py`: building the engine from a plan, `rlspec serve`'s main, and `ServerProcess`, which starts
  the server as a child process, waits for it to be healthy and never leaves it behind.
"""

TOKEN_ENV = "RLSPEC_SERVE_TOKEN"
"""The shared secret the bridge endpoints require (a bridge call writes the engine's weights). Never printed."""
TOKEN_FILE_ENV = "RLSPEC_SERVE_TOKEN_FILE"
"""A trainer that joins a server reads the token from this file when `RLSPEC_SERVE_TOKEN` is unset (the file a
server without `RLSPEC_SERVE_TOKEN` writes and names)."""
