"""The trainer's random draws (LoRA dropout, any dropout a model keeps in training): torch's generators of the
process, seeded at start and saved in every checkpoint, so two runs of one spec draw the same and a resumed run
draws what the uninterrupted one would have.

Each trainer rank seeds its own process with `algorithm.seed + rank` and writes its generators' states to
`rng/rank_<rank>.safetensors` in the checkpoint (CPU, and every CUDA device this process has used). A resume
on as many ranks restores them; a rank with no saved state (a resume on more ranks) keeps its seed. Sampling
does not draw from them: the engines' noise is keyed by seed, sample and position (`rlspec.rollout.noise`).
"""

from __future__ import annotations

from pathlib import Path

import torch

RNG_DIR = "rng"


def seed_rank(seed: int, rank: int) -> None:
    """Seed this process's generators (CPU and CUDA) for trainer rank `rank`."""
    torch.manual_seed(seed + rank)


def save_rng_state(checkpoint: Path, rank: int) -> None:
    from safetensors.torch import save_file

    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        states.update({f"cuda_{i}": state for i, state in enumerate(torch.cuda.get_rng_state_all())})
    folder = Path(checkpoint) / RNG_DIR
    folder.mkdir(parents=True, exist_ok=True)  # a rank may get here before rank 0 has made the checkpoint's folder
    save_file(states, str(folder / f"rank_{rank:05d}.safetensors"))


def load_rng_state(checkpoint: Path, rank: int) -> bool:
    """Restore rank `rank`'s generators from `checkpoint`; False when it holds none for that rank."""
    path = Path(checkpoint) / RNG_DIR / f"rank_{rank:05d}.safetensors"
    if not path.is_file():
        return False
    from safetensors.torch import load_file

    states = load_file(str(path))
    torch.set_rng_state(states["cpu"])
    cuda = [states[f"cuda_{i}"] for i in range(torch.cuda.device_count()) if f"cuda_{i}" in states]
    if cuda and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    return True
