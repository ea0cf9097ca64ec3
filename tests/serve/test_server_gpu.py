"""The rollout server on CUDA (skipped without it): two clients at once get completions with finite log-probs from
the CUDA-graph decode, on the trainer's GPU and (with 2 GPUs) on a GPU of its own, where the engine's device is not
a worker thread's default one."""

from __future__ import annotations

import math
import threading

import pytest
import torch

pytestmark = pytest.mark.gpu


def _serve_and_complete(hardware, sync_method: str) -> None:
    from rlspec.core.backend import all_caps
    from rlspec.serve.client import ServerClient
    from rlspec.serve.process import ServerProcess
    from rlspec.spec import ModelSpec, RolloutSpec, Spec, SyncSpec, compile_plan

    spec = Spec(model=ModelSpec(dtype="bfloat16"), rollout=RolloutSpec(max_new_tokens=16),
                sync=SyncSpec(method=sync_method, timeout_s=60), hardware=hardware, backend="standalone")
    plan = compile_plan(spec, all_caps())
    server = ServerProcess(plan)
    server.start()
    try:
        ServerClient(server.url, server.token, 600, server.describe).wait_healthy(300, server.alive)
        barrier, results, errors = threading.Barrier(2), [None, None], []

        def ask(i: int) -> None:
            client = ServerClient(server.url, server.token, 600, server.describe)
            try:
                barrier.wait()
                results[i] = client.completions({"prompt": ["a=", "bcd=", "x="], "n": 4, "seed": i, "max_tokens": 16,
                                                 "logprobs": 1})
            except Exception as err:  # noqa: BLE001 - reported below
                errors.append(err)
            finally:
                client.close()

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, f"{errors[0]}{server.describe()}"
        for out in results:
            assert len(out["choices"]) == 12
            logps = [lp for c in out["choices"] for lp in c["logprobs"]["token_logprobs"]]
            assert logps and all(math.isfinite(lp) and lp <= 0 for lp in logps)
        health = ServerClient(server.url, server.token, 60).health()
        assert health["sampler"] == "cuda_graph", health
        used = ServerClient(server.url, server.token, 60).call("engine.describe", None)  # how the requests sampled
        assert used["use_graphs"] is True and used["sampler"] == "cuda_graph", used
        log = server.log_path.read_text(errors="replace")
        assert "Offset increment" not in log, log
    finally:
        server.stop()


def test_server_on_the_trainers_gpu_serves_two_clients_with_cuda_graphs():
    from rlspec.spec import HardwareSpec

    _serve_and_complete(HardwareSpec(device="cuda"), "cuda_ipc")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_server_on_its_own_gpu_serves_two_clients_with_cuda_graphs():
    from rlspec.spec import HardwareSpec

    _serve_and_complete(HardwareSpec(device="cuda", rollout="separate"), "nccl")
