"""The Ray engine proxy splits a step over its engines without changing what is sampled."""

from __future__ import annotations

from types import SimpleNamespace

from rlspec.models.base import byte_tokenizer
from rlspec.models.factory import load_model
from rlspec.rollout.hf import HFEngine
from rlspec.rollout.remote import RemoteEngines
from rlspec.spec import ModelSpec, RolloutSpec


def _actor(engine: HFEngine, calls: list | None = None):
    """An in-process stand-in for an `EngineWorker` actor: `generate.remote` puts the local result in Ray's store
    (and appends its prompts and options to `calls`)."""
    import ray

    def remote(prompts, n, seed, first_sample=0, options=None):
        if calls is not None:
            calls.append((prompts, options))
        return ray.put(engine.generate(prompts, n, seed, first_sample=first_sample, options=options))
    return SimpleNamespace(generate=SimpleNamespace(remote=remote))


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
