"""Black-box agents (`rollout.agent`): multi-turn trajectories sampled through an OpenAI-compatible gateway.

- `runner.py`: loading a function or command agent and calling it; what counts as a failed trajectory.
- `gateway.py`: the per-trajectory endpoint in front of the run's engine (the `rlspec serve` app), and one step's
  groups of trajectories; `front.py`: its routes, the recording of every call and an agent's run, in the run's
  process or in each agent process of `processes.py` (`rollout.agent.processes`).
- `trajectory.py`: recorded calls -> one training sequence whose loss mask covers model tokens only.
- `calculator.py`: a safe arithmetic evaluator for the calculator tool of the GSM8K agent example.
"""

from .runner import AgentFailure, command_main, load_agent
from .trajectory import Call, ContextMismatch, Trajectory, assemble

__all__ = ["AgentFailure", "Call", "ContextMismatch", "Trajectory", "assemble", "command_main", "load_agent"]
