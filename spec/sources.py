"""What a rollout samples from: the task (with its optional LLM judge), an environment, an agent. Sections of
`rollout` (`spec.schema.RolloutSpec`); like every section they validate themselves and name the exact key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .errors import one_of, require
from .section import Section, finite, non_negative, positive

TASK_NAMES = ("copy_char", "gsm8k", "dataset")
TASK_REWARDS = ("task", "llm_judge")
ENV_NAMES = ("minigrid",)
ENV_REWARDS = ("success", "minigrid")


DEFAULT_JUDGE_PROMPT = (
    "You grade an answer. Task:\n{prompt}\n\nAnswer:\n{completion}\n\n"
    "Rate how well the answer solves the task, from 0 (wrong) to 1 (fully correct). "
    "Reply with one line: SCORE: <number>"
)


@dataclass
class JudgeSpec(Section):
    """A hosted LLM that scores completions (`rollout.task.reward: llm_judge`), over an OpenAI-compatible API."""

    base_url: Optional[str] = None
    """API root, e.g. https://api.openai.com/v1; requests go to {base_url}/chat/completions."""
    models: List[str] = field(default_factory=list)
    """Model fallback chain: the first is asked; the next when a model is not found or keeps failing."""
    api_key_env: Optional[str] = "OPENAI_API_KEY"
    """Environment variable holding the API key (sent as a bearer token; never logged or saved); null sends none."""
    prompt_template: str = DEFAULT_JUDGE_PROMPT
    """Judge prompt; {prompt}, {completion} and the task prompt's metadata fields (e.g. {answer}) are filled in."""
    score_regex: str = r"SCORE:\s*([-+]?\d*\.?\d+)"
    """Regular expression whose first group is the score in the judge's reply (the last match counts)."""
    max_tokens: int = 64
    """Reply length budget of the judge (sampled at temperature 0)."""
    timeout_s: float = 30.0
    """Per-request timeout (connect and read)."""
    max_retries: int = 3
    """Retries per model after a transient failure (5xx, 429, timeout, connection error, malformed reply)."""
    backoff_s: float = 0.5
    """Delay before the first retry; it doubles with each retry, up to backoff_max_s."""
    backoff_max_s: float = 8.0
    """Largest delay between retries."""
    jitter: float = 0.5
    """Each delay is multiplied by a uniform draw from [1 - jitter, 1] (1.0 is full jitter), so clients spread out."""
    max_concurrency: int = 8
    """Requests in flight at once while a batch is scored."""

    def __post_init__(self) -> None:
        p = "rollout.task.judge"
        if self.base_url is not None:
            require(self.base_url.startswith(("http://", "https://")), f"{p}.base_url",
                    f"{self.base_url!r} is not an http(s) URL", "e.g. https://api.openai.com/v1")
        require(all(isinstance(m, str) and m for m in self.models), f"{p}.models", "holds an empty model name",
                "list model names, e.g. [gpt-4o-mini, gpt-4.1-mini]")
        if self.api_key_env is not None:
            require(bool(self.api_key_env), f"{p}.api_key_env", "is empty", "name an environment variable, or null for no key")
        positive(self.max_tokens, f"{p}.max_tokens")
        positive(self.timeout_s, f"{p}.timeout_s")
        non_negative(self.max_retries, f"{p}.max_retries")
        non_negative(self.backoff_s, f"{p}.backoff_s")
        require(self.backoff_max_s >= self.backoff_s, f"{p}.backoff_max_s",
                f"{self.backoff_max_s} is below judge.backoff_s={self.backoff_s}", "set it to at least backoff_s")
        require(0 <= self.jitter <= 1, f"{p}.jitter", f"must be in [0, 1], got {self.jitter}", "0.5 is a common value")
        positive(self.max_concurrency, f"{p}.max_concurrency")


@dataclass
class RewardSpec(Section):
    """One of several weighted reward functions (`rollout.task.rewards`)."""

    function: str = ""
    """The function: module:function or path/to/file.py:function (`docs/data_and_rewards.md` gives its signature)."""
    weight: float = 1.0
    """Its weight in the reward (the weighted sum of every function's value)."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to it, checked against its signature."""
    name: Optional[str] = None
    """Its metric name (`reward/<name>/mean`); null: the function's own name."""

    def __post_init__(self) -> None:
        check_function(self.function, "rollout.task.rewards[].function")
        finite(self.weight, "rollout.task.rewards[].weight")
        if self.name is not None:
            require(bool(self.name) and "/" not in self.name, "rollout.task.rewards[].name",
                    f"{self.name!r} is not a metric name", "use a short name without '/', e.g. correct")


@dataclass
class TaskSpec(Section):
    """Prompts (a built-in task, or a local dataset with a column mapping) and the reward that scores completions."""

    name: str = "copy_char"
    """copy_char (synthetic, no data) | gsm8k (a GSM8K-format file) | dataset (any local file, mapped by the columns below)."""
    data_path: Optional[str] = None
    """Local data: a .jsonl or .parquet file, or a directory saved by `datasets` (`save_to_disk`); gsm8k and dataset."""
    split: str = "train"
    """The split of a directory saved from a `DatasetDict`; a file or a saved `Dataset` is one split, `train`."""
    prompt_column: str = "prompt"
    """The column holding the prompt: text, or chat messages ([{role, content}, ...]) rendered with the tokenizer's chat template."""
    prompt_template: Optional[str] = None
    """Text with {column} fields filled from each record, used as the prompt instead of prompt_column (gsm8k: its own)."""
    answer_column: Optional[str] = None
    """The column handed to the reward as `answer` (the reference; a.b for field b of a struct column, as verl's
    reward_model.ground_truth); every column also arrives under its own name."""
    shuffle: bool = True
    """Records are drawn pass after pass over the data, each pass in a new order (`shuffle_seed`'s); false: file order."""
    shuffle_seed: Optional[int] = None
    """Seed of the record order; null: algorithm.seed (so a sweep over seeds varies the data), a number fixes the
    order across seeds."""
    num_records: int = 0
    """Use only the first N records of the data (file order, before shuffling); 0 uses all."""
    reward: str = "task"
    """task (the task's own function; dataset has none) | llm_judge (a remote judge, see `judge`) | a function:
    module:function or path/to/file.py:function."""
    reward_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the reward function, checked against its signature."""
    rewards: List[RewardSpec] = field(default_factory=list)
    """Several reward functions instead of `reward`: the reward is their weighted sum, each logged as reward/<name>/mean."""
    dataset_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the synthetic task's prompt source (copy_char's alphabet and repeat)."""
    judge: JudgeSpec = field(default_factory=JudgeSpec)
    """The remote judge (only read when reward is llm_judge)."""
    max_reward_error_rate: float = 0.0
    """Fraction of a step's samples whose reward may fail (raise, or not a finite number) before the run fails; failed samples are dropped."""

    def __post_init__(self) -> None:
        p = "rollout.task"
        one_of(self.name, TASK_NAMES, f"{p}.name")
        if self.reward not in TASK_REWARDS:
            check_function(self.reward, f"{p}.reward", "examples/rewards/letters.py:copies or mypackage.rewards:copies, "
                           f"or one of: {', '.join(TASK_REWARDS)}")
        require(self.reward == "task" or not self.rewards, f"{p}.rewards",
                f"rollout.task.reward={self.reward} and rollout.task.rewards are both set",
                "set one: reward for one function, rewards for several weighted ones")
        require(not (self.rewards and self.reward_kwargs), f"{p}.reward_kwargs",
                "are for rollout.task.reward; each of rollout.task.rewards takes its own kwargs", "move them there")
        require(self.reward != "task" or self.rewards or self.name != "dataset", f"{p}.reward",
                "the dataset task has no reward of its own", "name a function: rollout.task.reward=path/to/file.py:function")
        non_negative(self.num_records, f"{p}.num_records")
        if self.shuffle_seed is not None:
            non_negative(self.shuffle_seed, f"{p}.shuffle_seed")
            require(self.shuffle, f"{p}.shuffle_seed", f"is {self.shuffle_seed}, but rollout.task.shuffle=false keeps "
                    "the file's order", "unset rollout.task.shuffle_seed, or set rollout.task.shuffle=true")
        require(bool(self.split), f"{p}.split", "is empty", "name a split, e.g. train")
        require(bool(self.prompt_column), f"{p}.prompt_column", "is empty", "name the column holding the prompts")
        require(self.name != "copy_char" or self.data_path is None, f"{p}.data_path",
                "copy_char makes its own prompts and reads no data", "unset it, or set rollout.task.name=dataset")
        if self.name != "copy_char":
            require(self.data_path is not None, f"{p}.data_path", f"the {self.name} task needs local data",
                    "set it to a .jsonl or .parquet file or a save_to_disk directory (e.g. examples/data/letters.parquet)")
        require(0 <= self.max_reward_error_rate <= 1, f"{p}.max_reward_error_rate",
                f"must be in [0, 1], got {self.max_reward_error_rate}", "e.g. 0.05 to tolerate a few failed judge calls")
        if self.reward == "llm_judge":
            require(self.judge.base_url is not None, f"{p}.judge.base_url", "is not set but rollout.task.reward=llm_judge",
                    "set it to the judge's OpenAI-compatible API root, e.g. https://api.openai.com/v1")
            require(len(self.judge.models) > 0, f"{p}.judge.models", "is empty but rollout.task.reward=llm_judge",
                    "list at least one model; later ones are fallbacks")
            require(not self.reward_kwargs, f"{p}.reward_kwargs", "are for the task's own reward, but rollout.task.reward=llm_judge",
                    "configure the judge under rollout.task.judge and remove them (on the command line: "
                    + " ".join(f"~{p}.reward_kwargs.{k}" for k in self.reward_kwargs) + ")")


def check_function(target: str, where: str,
                   example: str = "examples/rewards/letters.py:copies or mypackage.rewards:copies") -> None:
    """Refuse a function reference that is not `module:function` or `path/to/file.py:function`."""
    module, _, name = target.rpartition(":")
    require(bool(module) and name.isidentifier(), where,
            f"{target!r} is not of the form module:function or path/to/file.py:function", f"e.g. {example}")


@dataclass
class EnvSpec(Section):
    """An environment the policy acts in (`model.kind: vla`); unset (`name: null`) for text tasks."""

    name: Optional[str] = None
    """Registered environment: minigrid (MiniGrid and BabyAI levels); null means text prompts from `rollout.task`."""
    level: str = "BabyAI-GoToRedBallNoDists-v0"
    """The gymnasium id of the level (any registered MiniGrid-* or BabyAI-* id)."""
    max_steps: int = 0
    """Steps before an episode is truncated (counted as `env/truncated`, reward 0); 0 keeps the level's own limit."""
    reward: str = "success"
    """success: 1 on success else 0 | minigrid: the level's 1 - 0.9 * steps / max_steps on success else 0."""
    num_actions: int = 0
    """Use only the level's first N actions (3: MiniGrid's left, right, forward, all a navigation level needs); 0 keeps all."""
    tile_size: int = 8
    """Pixels per grid cell of the egocentric 7x7-cell RGB view (8 gives 56x56 images)."""
    prompt_template: str = "{image}{instruction}\n"
    """Prompt text per step: `{image}` becomes the processor's image token, `{instruction}` the mission."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for `gymnasium.make` of the level."""

    def __post_init__(self) -> None:
        p = "rollout.env"
        if self.name is not None:
            one_of(self.name, ENV_NAMES, f"{p}.name")
        require(bool(self.level), f"{p}.level", "is empty", "name a level, e.g. BabyAI-GoToRedBallNoDists-v0")
        non_negative(self.max_steps, f"{p}.max_steps")
        one_of(self.reward, ENV_REWARDS, f"{p}.reward")
        non_negative(self.num_actions, f"{p}.num_actions")
        positive(self.tile_size, f"{p}.tile_size")
        for key in ("{image}", "{instruction}"):
            require(key in self.prompt_template, f"{p}.prompt_template", f"has no {key}",
                    "write a template such as '{image}{instruction}\\n'")


@dataclass
class AgentSpec(Section):
    """A black-box agent that talks to the policy over HTTP (OpenAI `/v1/completions`) through rlspec's gateway.

    Unset (`function` and `command` both null): plain single-turn sampling. The agent gets each prompt and a
    base URL; the gateway records every completion it asks for and assembles the trajectory.
    """

    function: Optional[str] = None
    """Python agent `module:function` or `path/to/file.py:function`, called as fn(prompt, base_url) -> final answer
    (str); an `async def` runs as a task on one agent event loop (no thread each), a plain function in a thread."""
    command: Optional[List[str]] = None
    """Command agent argv: reads {"prompt", "base_url"} JSON on stdin, prints {"answer": str} JSON as its last stdout line."""
    timeout_s: float = 120.0
    """An agent still running after this long is a failed trajectory (a command is killed, an async function cancelled, a
    plain function's thread abandoned)."""
    max_turns: int = 8
    """Completion requests one trajectory may make; the gateway refuses more and the trajectory fails."""
    concurrency: int = 8
    """Trajectories whose agents run at the same time; one that ends lets the next start (their requests join the
    engine's decode batch together; e.g. 64 to 1024 with async agents, docs/agents.md)."""
    max_failure_rate: float = 0.25
    """A step whose share of failed trajectories (raised, timed out, invalid) exceeds this fails the run."""
    processes: int = 0
    """Agent processes: 0 runs the agents and the gateway's routes in the run's process, beside the engine thread
    (one interpreter lock for all); N runs them in N processes of their own, each a whole gateway front at its own
    address, joined to the run's engine by a pipe (their rows join the one decode batch). For many agents whose
    Python (an OpenAI client, chat templates) would hold the engine back: docs/agents.md."""

    @property
    def enabled(self) -> bool:
        return self.function is not None or self.command is not None

    def __post_init__(self) -> None:
        p = "rollout.agent"
        require(self.function is None or self.command is None, f"{p}.function",
                "both rollout.agent.function and rollout.agent.command are set", "set only one of them")
        if self.function is not None:
            check_function(self.function, f"{p}.function", "examples/agents/gsm8k_calc.py:solve or mypackage.agents:solve")
        if self.command is not None:
            require(len(self.command) > 0 and all(isinstance(a, str) and a for a in self.command), f"{p}.command",
                    "must be a non-empty list of non-empty strings", "e.g. [python, examples/agents/gsm8k_calc.py]")
        positive(self.timeout_s, f"{p}.timeout_s")
        positive(self.max_turns, f"{p}.max_turns")
        positive(self.concurrency, f"{p}.concurrency")
        non_negative(self.processes, f"{p}.processes")
        require(0 <= self.max_failure_rate <= 1, f"{p}.max_failure_rate", f"must be in [0, 1], got {self.max_failure_rate}",
                "e.g. 0.25; 0 fails the run on the first failed trajectory")
