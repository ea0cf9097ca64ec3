"""What a new user sees: the README's first command prints rlspec's own lines and nothing else — no deprecation
warning from a library (transformers' `past_key_values` FutureWarning, printed twice by the `hf` engine's decode loop
before it took its KV cache by the current keyword), no library log line (DeepSpeed's "Setting accelerator to CPU",
printed when transformers' `save_pretrained` imported it).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess

from tests.conftest import REPO, rlspec_cmd


def readme_first_run() -> list[str]:
    """The `rlspec run ...` part of the README's first command (after `pip install ... &&`), as arguments."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    first = block.strip().splitlines()[0]
    run = first.split("&&")[-1].strip()
    assert run.startswith("rlspec run "), first
    return shlex.split(run)[1:]


def test_the_readmes_first_command_prints_no_warning(tmp_path):
    """The README's command with its `--out` moved to a temporary directory and a few steps (every phase of a step
    runs, and the checkpoint at the end: the steps after those print nothing new)."""
    args = readme_first_run()
    args[args.index("--out") + 1] = str(tmp_path / "tiny")
    # A user's environment: without what the test session sets to keep other tests quiet.
    quiet = ("TOKENIZERS_PARALLELISM", "RAY_AUTH_MODE", "PYTHONWARNINGS")
    env = {k: v for k, v in os.environ.items() if k not in quiet}
    proc = subprocess.run(rlspec_cmd(*args, "algorithm.steps=2", "checkpoint.every_n_steps=1"), cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    assert lines == [f"rlspec: run finished; outputs in {tmp_path / 'tiny'}"], "\n".join(lines)
    assert (tmp_path / "tiny" / "checkpoints" / "step_000001" / "model.safetensors").is_file()
