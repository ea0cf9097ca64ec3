"""`rlspec serve`'s bridge token and address: never printed; a 0600 file when not given; a non-loopback address only
with `--allow-remote`."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import time

import pytest

from rlspec.serve.process import is_loopback
from tests.conftest import REPO, rlspec_cmd

SPEC = ("examples/tiny.yaml", "hardware.num_threads=1")


def test_loopback_addresses():
    assert all(is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "[::1]", "127.3.2.1"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "example.org", ""))


def test_a_non_loopback_host_without_allow_remote_exits_2_naming_the_flag():
    env = {k: v for k, v in os.environ.items() if k != "RLSPEC_SERVE_TOKEN"}
    proc = subprocess.run(rlspec_cmd("serve", *SPEC, "--host", "0.0.0.0", "--port", "1"), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--allow-remote" in proc.stderr and "'0.0.0.0'" in proc.stderr, proc.stderr


@pytest.mark.parametrize("interval", ["fast", "0"])
def test_a_bad_switch_interval_exits_2_naming_the_variable(interval):
    from rlspec.serve.process import SWITCH_INTERVAL_ENV

    env = {k: v for k, v in os.environ.items() if k != "RLSPEC_SERVE_TOKEN"} | {SWITCH_INTERVAL_ENV: interval}
    proc = subprocess.run(rlspec_cmd("serve", *SPEC, "--port", "1"), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert SWITCH_INTERVAL_ENV in proc.stderr and repr(interval) in proc.stderr, proc.stderr
    assert "rlspec serve:" not in proc.stderr  # refused before the server announced anything


@pytest.mark.distributed
def test_a_server_without_a_token_writes_it_to_a_private_file_and_never_prints_it(tmp_path):
    import httpx

    from rlspec.serve.client import ServerClient
    from rlspec.serve.process import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RLSPEC_SERVE_TOKEN", "RLSPEC_SERVE_TOKEN_FILE")}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(rlspec_cmd("serve", *SPEC, "--host", "0.0.0.0", "--allow-remote", "--port", str(port)),
                                  cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "on http://" not in log.read_text():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        text = log.read_text()
        assert "WARNING: binding 0.0.0.0 (--allow-remote)" in text, text
        path = re.search(r"bridge token written to (\S+) \(mode 0600\)", text).group(1)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        token = open(path).read().strip()
        assert len(token) == 32
        url = f"http://127.0.0.1:{port}"
        client = ServerClient(url, token, 30)
        client.wait_healthy(60)
        assert client.call("engine.describe", None)["thread"] == "rlspec-engine"  # the token in the file works
        os.environ["RLSPEC_SERVE_TOKEN_FILE"] = path
        try:
            assert ServerClient(url, timeout_s=30).token == token  # a joining trainer reads the file
        finally:
            del os.environ["RLSPEC_SERVE_TOKEN_FILE"]
        assert httpx.post(f"{url}/bridge/weight_version", json={"version": 1}).status_code == 401
        server.send_signal(signal.SIGTERM)
        server.wait(30)
        assert token not in log.read_text()
        assert not os.path.exists(path), "the token file outlived the server"
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_a_taken_port_exits_2_naming_port_before_anything_is_announced():
    """Another process listens on the port: exit 2 with one line naming `--port` and a free one to use, before the
    server builds its engine, writes a token file or says that it serves (it once announced the port, then exited 3)."""
    import socket

    env = {k: v for k, v in os.environ.items() if k not in ("RLSPEC_SERVE_TOKEN", "RLSPEC_SERVE_TOKEN_FILE")}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        proc = subprocess.run(rlspec_cmd("serve", *SPEC, "--port", str(port)), cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=120)
    print(f"\ntaken port: exit {proc.returncode} after {time.monotonic() - started:.1f} s: {proc.stderr.strip()}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("rlspec: error: --port:") and proc.stderr.count("\n") == 1, proc.stderr
    assert f"port {port} is already in use" in proc.stderr and "choose a free port, e.g. --port " in proc.stderr
    assert "rlspec serve:" not in proc.stderr and proc.stdout == ""  # nothing announced, no token file named
