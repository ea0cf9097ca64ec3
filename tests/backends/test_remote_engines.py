"""The Ray engine proxy splits a step over its engines without changing what is sampled."""

from __future__ import annotations

from types import SimpleNamespace

from rlspec.models.base import byte_tokenizer
from rlspec.models.factory import load_model
from rlspec.rollout.hf import HFEngine
from rlspec.rollout.remote import RemoteEngines
from rlspec.spec import ModelSpec, RolloutSpec


def _actor(engine: HFEngine):
    """An in-process stand-in for an `EngineWorker` actor: `generate.remote` puts the local result in Ray's store."""
    import ray

    def remote(*args):
        return ray.put(engine.generate(*args[:3], first_sample=args[3] if len(args) > 3 else 0))
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
