"""The Ray engine proxy splits a step over its engines without changing what is sampled."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rlspec.models.base import byte_tokenizer
from rlspec.models.factory import load_model
from rlspec.rollout.hf import HFEngine
from rlspec.rollout.remote import RemoteEngines
from rlspec.spec import ModelSpec, RolloutSpec


def _actor(engine: HFEngine, calls: list | None = None):
    """An in-process stand-in for an `EngineWorker` actor: `generate.remote` puts the local result in Ray's store
    (and appends its prompts and options to `calls`)."""
    import ray

    def remote(prompts, n, seed, first_sample=0, options=None, free=True):
        if calls is not None:
            calls.append((prompts, options))
        return ray.put(engine.generate(prompts, n, seed, first_sample=first_sample, options=options))
    return SimpleNamespace(generate=SimpleNamespace(remote=remote), free_memory=_no_op())


def _no_op():
    import ray

    return SimpleNamespace(remote=lambda *args: ray.put(None))


def test_two_engines_sample_what_one_engine_samples(ray_session):
    """Engine i gets its share of the prompts numbered from its first sample of the step (the keyed noise), so
    splitting the step over 1, 2 or 3 engines gives the same completions (not `seed + i` per engine)."""
    model = load_model(ModelSpec(eos_hazard=0.12), seed=0).eval()
    engine = HFEngine(model, byte_tokenizer(), RolloutSpec(max_new_tokens=12), "cpu")
    prompts = ["a=", "bcd=", "hello=", "xy=", "q="]
    want = engine.generate(prompts, 2, 5)
    for count in (2, 3):
        got = RemoteEngines([_actor(engine)] * count, engine.tokenizer).generate(prompts, 2, 5)
        assert got.completion_ids == want.completion_ids, count


class _Slow:
    """An engine stand-in held on its first call until the other engine has finished `wait_for` calls: a slowed
    engine, without timing."""

    def __init__(self, engine: HFEngine, done: list, wait_for: int) -> None:
        import threading

        self.engine, self.done, self.wait_for, self.event = engine, done, wait_for, threading.Event()

    def remote(self, *args):
        import ray

        self.event.wait(timeout=30)
        return ray.put(self.engine.generate(*args[:3], first_sample=args[3]))


def test_queued_chunks_sample_what_the_split_does_and_a_slowed_engine_takes_fewer(ray_session):
    """`queue` cuts the step into chunks that free engines take: the same
    completions as the fixed split and as one engine, whichever engine took a chunk; an engine held back takes fewer
    prompts than the free one (with a fixed split each takes half)."""
    import ray

    model = load_model(ModelSpec(eos_hazard=0.12), seed=0).eval()
    engine = HFEngine(model, byte_tokenizer(), RolloutSpec(max_new_tokens=12), "cpu")
    prompts = ["a=", "bcd=", "hello=", "xy=", "q=", "zz="]
    want = engine.generate(prompts, 2, 5)
    split = RemoteEngines([_actor(engine)] * 2, engine.tokenizer, dispatch="split")
    assert split.generate(prompts, 2, 5).completion_ids == want.completion_ids
    assert split.last_dispatch == [3, 3]
    done: list = []
    slow = _Slow(engine, done, 3)

    def fast(*args):
        out = ray.put(engine.generate(*args[:3], first_sample=args[3]))
        done.append(args[3])
        if len(done) >= slow.wait_for:
            slow.event.set()
        return out

    queued = RemoteEngines([SimpleNamespace(generate=SimpleNamespace(remote=fast), free_memory=_no_op()),
                            SimpleNamespace(generate=slow, free_memory=_no_op())], engine.tokenizer, dispatch="queue",
                           chunk_prompts=1)
    got = queued.generate(prompts, 2, 5)
    assert got.completion_ids == want.completion_ids and got.texts == want.texts
    assert sum(queued.last_dispatch) == len(prompts) and queued.last_dispatch[1] < queued.last_dispatch[0]
    assert queued.metrics() == {"rollout/prompts_engine_0": float(queued.last_dispatch[0]),
                                "rollout/prompts_engine_1": float(queued.last_dispatch[1]),
                                "timing_s/gen_engine_0": 0.0, "timing_s/gen_engine_1": 0.0}  # stand-ins time nothing


def test_dispatch_raises_the_first_failure_after_the_running_chunks_end():
    from rlspec.cluster.dispatch import chunk_groups, dispatch

    assert chunk_groups(5, 1) == [range(i, i + 1) for i in range(5)]
    assert chunk_groups(14, 4) == [range(0, 4), range(4, 8), range(8, 12), range(12, 14)]
    ran = []

    def run(worker, part):
        ran.append(part.start)
        if part.start == 1:
            raise ValueError("engine lost")
        return part.start

    try:
        dispatch(chunk_groups(8, 1), 1, run)
    except ValueError as err:
        assert str(err) == "engine lost"
    else:
        raise AssertionError("no failure raised")
    assert ran == [0, 1], "no chunk is taken after a failure"
    results, workers = dispatch(chunk_groups(8, 2), 2, lambda w, p: p.start)
    assert results == [0, 2, 4, 6] and set(workers) <= {0, 1}  # in chunk order, whoever ran them
    assert dispatch(chunk_groups(4, 2), 2, lambda w, p: (w, p.start), queue=False)[0] == \
        [(0, 0), (1, 2)]  # split: worker i runs part i


class _InProcess:
    """An `EngineWorker` run in this process behind actor-like handles (`handle.method.remote(...)` calls it)."""

    def __init__(self, engine: HFEngine) -> None:
        from rlspec.rollout.remote import EngineWorker

        self.worker = EngineWorker.__new__(EngineWorker)
        self.worker.engine = engine

    def __getattr__(self, method: str):
        import ray

        return SimpleNamespace(remote=lambda *args: ray.put(getattr(self.worker, method)(*args)))


def test_queued_chunks_keep_the_engine_until_the_last_then_free_it_once(ray_session):
    """With `rollout.free_during_train=kv_cache_and_weights` an engine frees its weights after a rollout: a step
    cut into chunks must not free them after its first chunk (the next chunk would find no weights)."""
    model = load_model(ModelSpec(eos_hazard=0.12), seed=0).eval()
    engine = HFEngine(model, byte_tokenizer(), RolloutSpec(max_new_tokens=8), "cpu",
                      free_during_train="kv_cache_and_weights", own_process=True)
    prompts = ["a=", "bcd=", "hello=", "xy="]
    remote = RemoteEngines([_InProcess(engine)], engine.tokenizer, dispatch="queue", chunk_prompts=1)
    got = remote.generate(prompts, 2, 5)
    assert len(got.completion_ids) == 8 and remote.last_dispatch == [4]
    assert remote.last_engine_s[0] > 0 and got.engine_s is None  # the worker's own seconds, summed over its chunks
    assert engine._freed is not None, "the step's rollout ends with the engine's memory given back"
    engine.restore_weights()
    with torch.no_grad():
        for p, q in zip(engine.model.parameters(), load_model(ModelSpec(eos_hazard=0.12), seed=0).parameters()):
            p.copy_(q)
    want = HFEngine(load_model(ModelSpec(eos_hazard=0.12), seed=0).eval(), byte_tokenizer(),
                    RolloutSpec(max_new_tokens=8), "cpu").generate(prompts, 2, 5)
    assert got.completion_ids == want.completion_ids


def test_an_eval_is_sampled_by_every_engine_each_a_share(ray_session):
    """An eval's `SampleOptions` (greedy, weights kept) reach every engine, each sampling its share of the eval's
    prompts: the completions are one engine's."""
    from rlspec.evaluation.runner import generate

    model = load_model(ModelSpec(eos_hazard=0.12), seed=0).eval()
    engine = HFEngine(model, byte_tokenizer(), RolloutSpec(max_new_tokens=12), "cpu")
    prompts = ["a=", "bcd=", "hello=", "xy=", "q="]
    calls: list = []
    got = generate(RemoteEngines([_actor(engine, calls)] * 2, engine.tokenizer), prompts, 2, 7, greedy=True)
    assert got.completion_ids == generate(engine, prompts, 2, 7, greedy=True).completion_ids
    assert [c[0] for c in calls] == [prompts[:3], prompts[3:]]
    assert all(options.greedy and options.keep_weights for _, options in calls)
