"""Rollout engines as Ray actors, and the driver-side proxy that implements `RolloutEngine` over them.

`EngineWorker` holds one `HFEngine` in its own process; `RemoteEngines` fans calls out to one or more
workers through the watchdog (`rlspec.cluster.ray_utils.wait_all`), so a dead engine stops the run with its
traceback. With several engines, `generate` hands the prompts out by work or in fixed parts (`rlspec.cluster.dispatch`),
each part numbered from its first sample of the step, so the samples depend neither on the number of engines nor
on which engine took which part;
`receive` runs a transport's engine half in every engine, where each carries `engine_index`.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import Tensor

from ..cluster.dispatch import dispatch, parts
from ..core.batch import TrainBatch
from ..models.factory import load_model, load_tokenizer
from ..runtime.stall import StackReporter
from ..spec import RunPlan
from .base import Rollout


class EngineWorker(StackReporter):
    """One rollout engine in a Ray actor; starts from the same weights as the trainer (same seed).

    Made in two steps: the actor first reports its `seat` (so the layout is checked before any model is
    built, `rlspec.cluster.placement`), then `build` loads the model."""

    def __init__(self, plan: RunPlan, index: int) -> None:
        self.plan = plan
        self.index = index
        self.engine = None
        self.episodes = None

    def seat(self):
        from ..cluster.placement import this_seat

        return this_seat()

    def build(self) -> None:
        from .hf import HFEngine

        spec = self.plan.spec
        if spec.hardware.num_threads:
            torch.set_num_threads(spec.hardware.num_threads)
        device = "cuda" if self.plan.placement.device == "cuda" else "cpu"  # Ray exposes this actor's GPU as cuda:0
        model = load_model(spec.model, spec.algorithm.seed, device).to(device).eval().requires_grad_(False)
        self.engine = HFEngine(model, load_tokenizer(spec.model), spec.rollout, device, spec.algorithm.micro_batch_size,
                               free_during_train=spec.rollout.free_during_train, own_process=True)
        self.engine.engine_index = self.index
        self.engine.num_engines = spec.hardware.num_rollout_engines

    def _episode_runner(self):
        """This engine's environments (`model.kind: vla`): every `num_engines`-th group of a step, made once."""
        if self.episodes is None:
            from ..envs.rollout import EpisodeRunner

            groups = list(range(self.index, self.plan.spec.rollout.prompts_per_step, self.engine.num_engines))
            self.episodes = EpisodeRunner(self.plan, self.engine.model, self.engine.tokenizer, self.engine.device, groups)
        return self.episodes

    def run_episodes(self, step: int):
        return self._episode_runner().run(step)

    def env_info(self) -> tuple[int, int]:
        runner = self._episode_runner()
        return runner.num_actions, runner.max_steps

    def generate(self, prompts: list[str], n: int, seed: int, first_sample: int = 0, options=None,
                 free: bool = True) -> Rollout:
        import time

        start = time.perf_counter()
        out = self.engine.generate(prompts, n, seed, options=options, first_sample=first_sample, free=free)
        out.engine_s = time.perf_counter() - start
        return out

    def free_memory(self, keep_weights: bool) -> None:
        """What `rollout.free_during_train` gives back, after a step's last chunk (`generate` without `free`)."""
        self.engine.free_memory(keep_weights=keep_weights)

    def logprobs(self, batch: TrainBatch) -> Tensor:
        return self.engine.logprobs(batch)

    def load_weights(self, named_tensors: list[tuple[str, Tensor]]) -> None:
        self.engine.load_weights(named_tensors)

    def receive(self, fn, payload) -> Any:
        """A transport's engine half here; before `build` (the placement check's fan-out) with no engine yet."""
        return fn(None, payload) if self.engine is None else self.engine.receive(fn, payload)

    def named_weights(self) -> list[tuple[str, Tensor]]:
        return [(name, t.detach().cpu()) for name, t in self.engine.named_weights()]

    def pid(self) -> int:
        import os

        return os.getpid()


class RemoteEngines:
    """Driver-side `RolloutEngine` over engine actors."""

    def __init__(self, actors: Sequence[Any], tokenizer, dispatch: str = "split", chunk_prompts: int = 1) -> None:
        self.actors = list(actors)
        self.dispatch = dispatch
        """`queue` or `split` (`rlspec.cluster.dispatch`; the plan's `dispatch.method`)."""
        self.chunk_prompts = chunk_prompts
        """`queue`: prompts (groups) per chunk."""
        self.last_dispatch: list[int] = [0] * len(self.actors)
        self.last_engine_s: list[float] = [0.0] * len(self.actors)
        """Per engine, its own seconds generating in the last `generate` (`Rollout.engine_s`, summed over chunks)."""
        self.labels = [f"rollout engine {i}" for i in range(len(self.actors))]
        self.tokenizer = tokenizer
        self.num_engines = len(self.actors)

    def _all(self, method: str, *args) -> list:
        from ..cluster.ray_utils import call_all

        return call_all(self.actors, self.labels, method, *args)

    def _first(self, method: str, *args) -> Any:
        from ..cluster.ray_utils import wait_all

        return wait_all([getattr(self.actors[0], method).remote(*args)], self.labels[:1])[0]

    def generate(self, prompts: list[str], n: int, seed: int, options=None) -> Rollout:
        """`options` (`SampleOptions`, e.g. an eval's greedy decoding) go to every engine. The prompts go out as the
        plan's dispatch says (`rlspec.cluster.dispatch`); `last_dispatch` keeps how many each engine took."""
        from ..cluster.ray_utils import wait_all

        queue = self.dispatch == "queue"
        chunks = parts(self.dispatch, len(prompts), self.num_engines, self.chunk_prompts)

        def run(i: int, part: range) -> Rollout | None:
            if not part:  # a split with fewer prompts than engines
                return None
            # A part starts at sample part.start * n of the step: each sample draws the noise it would on one engine.
            # Queued chunks keep the engine's memory until the last one is done (freed below, once per engine).
            ref = self.actors[i].generate.remote(prompts[part.start:part.stop], n, seed, part.start * n, options,
                                                 not queue)
            return wait_all([ref], self.labels[i:i + 1])[0]

        outs, workers = dispatch(chunks, self.num_engines, run, queue)
        if queue:
            self._all("free_memory", bool(options is not None and options.keep_weights))
        self.last_dispatch = [0] * self.num_engines
        self.last_engine_s = [0.0] * self.num_engines
        for part, worker, out in zip(chunks, workers, outs):
            self.last_dispatch[worker] += len(part)
            self.last_engine_s[worker] += (out.engine_s or 0.0) if out is not None else 0.0
        outs = [o for o in outs if o is not None]
        return Rollout(*(sum((getattr(o, f) for o in outs), []) for f in
                         ("prompt_ids", "completion_ids", "completion_logprobs", "texts")))

    def metrics(self) -> dict[str, float]:
        """Per engine, its own seconds generating in the last `generate` (`timing_s/gen_engine_<i>`) and, with
        several, the prompts it took (`rollout/prompts_engine_<i>`)."""
        seconds = {f"timing_s/gen_engine_{i}": s for i, s in enumerate(self.last_engine_s)}
        if self.num_engines == 1:
            return seconds
        return {**{f"rollout/prompts_engine_{i}": float(n) for i, n in enumerate(self.last_dispatch)}, **seconds}

    def logprobs(self, batch: TrainBatch) -> Tensor:
        return self._first("logprobs", batch)

    def run_episodes(self, step: int):
        """Every engine runs its groups' episodes (`rlspec.envs.rollout.EpisodeRunner`) at once; merged by group.
        The engines work side by side, so each phase's time is the slowest engine's."""
        episodes, errors, seconds = {}, {}, {}
        for mine, failed, timing in self._all("run_episodes", step):
            episodes.update(mine)
            errors.update(failed)
            for name, value in timing.items():
                seconds[name] = max(seconds.get(name, 0.0), value)
        return episodes, errors, seconds

    def env_info(self) -> tuple[int, int]:
        """(number of actions, episode step limit) of the environment."""
        return self._first("env_info")

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        self._all("load_weights", [(n, t.detach().cpu()) for n, t in named_tensors])

    def receive(self, fn, payload) -> list:
        return self._all("receive", fn, payload)

    def receive_each(self, fn, payloads: Sequence[Any]) -> list:
        """Engine i runs `fn(engine, payloads[i])` (each its own sender's payload: `sync.base.push_beside`)."""
        from ..cluster.ray_utils import wait_all

        assert len(payloads) == len(self.actors), (len(payloads), len(self.actors))
        return wait_all([a.receive.remote(fn, p) for a, p in zip(self.actors, payloads)], self.labels)

    def build(self) -> None:
        """Load every engine's model (after the layout was checked); a failed constructor surfaces here."""
        self._all("build")

    def named_weights(self) -> list[tuple[str, Tensor]]:
        return self._first("named_weights")

    def pids(self) -> list[int]:
        return self._all("pid")


def create_engines(plan: RunPlan, bundles: Sequence[tuple[Any, int]], num_cpus: float, num_gpus: float) -> RemoteEngines:
    """One `EngineWorker` actor per (placement group, bundle index) in `bundles`, not yet built
    (`RemoteEngines.build`)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from ..runtime.stall import remote_class

    remote_cls = remote_class(EngineWorker)
    actors = [remote_cls.options(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=1,
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b))
              .remote(plan, i) for i, (pg, b) in enumerate(bundles)]
    return RemoteEngines(actors, load_tokenizer(plan.spec.model), plan.dispatch.method, plan.dispatch.chunk_prompts)
