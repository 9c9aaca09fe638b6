"""Shared set-up for the request-field tests: a tiny random model behind the real scheduler and
in-process executor, driven step by step (no Ray, no asyncio). The HTTP layer's scripted
backends are ``tests.harness.http_backends``.

``run_jobs`` returns each job's deltas; ``recording(executor)`` keeps every logits tensor the
model produced (the reference the logprobs are checked against); ``boost(executor, token)``
makes ``token`` the argmax of every row (a model that always wants to stop).
"""

from __future__ import annotations

import torch

from fastserve.scheduler.config import KVCacheConfig, SchedulerConfig
from fastserve.scheduler.job import JobRequest, TokenDelta
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.scheduler import Scheduler
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import SamplingParams
from fastserve.worker.model.config import OPTConfig
from fastserve.worker.spec import ModelSpec
from tests.harness.engine_driver import CoreDriver

TINY = OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 ffn_dim=64, max_position_embeddings=256, name="tiny")
BLOCK = 4
PROFILE = Profile.from_dict({
    "t_init": {"prompt_lens": [1, 64], "seconds": [0.01, 0.1]},
    "t_dec": {"batch_sizes": [1, 4], "seconds": [0.01, 0.015]},
    "swap": {"bytes_per_block": 1, "seconds_per_block": 0.001},
})
PROMPT = (2, 11, 23, 35, 47)


def tiny_executor(seed: int = 3) -> InProcessExecutor:
    return InProcessExecutor(ModelSpec(TINY, num_device_blocks=64, num_host_blocks=16,
                                       block_size=BLOCK, seed=seed))


def run_jobs(ex: InProcessExecutor, jobs: dict[str, SamplingParams],
             prompt: tuple[int, ...] = PROMPT, max_steps: int = 200) -> dict[str, list[TokenDelta]]:
    """Every job to its finish through the real scheduler; each job's deltas in order."""
    s = Scheduler(SchedulerConfig(), KVCacheConfig(block_size=BLOCK, num_device_blocks=64,
                                                   num_host_blocks=16), PROFILE, frozenset({TINY.eos_token_id}))
    driver = CoreDriver(s, ex)
    for job_id, sampling in jobs.items():
        driver.add(JobRequest(job_id, prompt, sampling))
    driver.run(max_steps=max_steps)
    return {j: driver.deltas.get(j, []) for j in jobs}


def recording(ex: InProcessExecutor) -> list[torch.Tensor]:
    """Every logits tensor the model returns from now on, in order."""
    seen: list[torch.Tensor] = []
    real = ex.runner.model.logits

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        out = real(hidden)
        seen.append(out.clone())
        return out

    ex.runner.model.logits = logits  # type: ignore[method-assign]
    return seen


def boost(ex: InProcessExecutor, token: int, by: float = 100.0) -> None:
    real = ex.runner.model.logits

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        out = real(hidden).clone()
        out[:, token] += by
        return out

    ex.runner.model.logits = logits  # type: ignore[method-assign]
