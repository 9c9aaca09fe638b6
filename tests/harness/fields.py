"""Shared set-up for the request-field tests: a tiny random model behind the real scheduler and
in-process executor, driven step by step (no Ray, no asyncio), and a scripted HTTP backend.

``run_jobs`` returns each job's deltas; ``recording(executor)`` keeps every logits tensor the
model produced (the reference the logprobs are checked against); ``boost(executor, token)``
makes ``token`` the argmax of every row (a model that always wants to stop).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from actors.executor import InProcessExecutor
from actors.messages import SamplingParams
from actors.model.config import OPTConfig
from actors.spec import ModelSpec
from app.scheduler.config import KVCacheConfig, SchedulerConfig
from app.scheduler.job import JobRequest, JobStats, TokenDelta
from app.scheduler.profile import Profile
from app.scheduler.scheduler import Scheduler

TINY = OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 ffn_dim=64, max_position_embeddings=256, name="tiny")
BLOCK = 4
PROFILE = Profile.from_dict({
    "t_init": {"prompt_lens": [1, 64], "seconds": [0.01, 0.1]},
    "t_dec": {"batch_sizes": [1, 4], "seconds": [0.01, 0.015]},
    "swap": {"bytes_per_block": 1, "seconds_per_block": 0.001},
})
PROMPT = (2, 11, 23, 35, 47)
STATS = JobStats("j", arrival=0.0, prompt_len=2)


def tiny_executor(seed: int = 3) -> InProcessExecutor:
    return InProcessExecutor(ModelSpec(TINY, num_device_blocks=64, num_host_blocks=16,
                                       block_size=BLOCK, seed=seed))


def run_jobs(ex: InProcessExecutor, jobs: dict[str, SamplingParams],
             prompt: tuple[int, ...] = PROMPT, max_steps: int = 200) -> dict[str, list[TokenDelta]]:
    """Every job to its finish through the real scheduler; each job's deltas in order."""
    s = Scheduler(SchedulerConfig(), KVCacheConfig(block_size=BLOCK, num_device_blocks=64,
                                                   num_host_blocks=16), PROFILE, frozenset({TINY.eos_token_id}))
    now = 0.0
    for job_id, sampling in jobs.items():
        s.add(JobRequest(job_id, prompt, sampling), now)
    out: dict[str, list[TokenDelta]] = {j: [] for j in jobs}
    for _ in range(max_steps):
        if not s.has_work():
            return out
        plan = s.schedule(now)
        now += 0.01
        if plan is None:
            continue
        for d in s.update(plan, ex.execute(plan), now):
            out[d.job_id].append(d)
    raise AssertionError(f"jobs not finished after {max_steps} steps")


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


class FakeStream:
    """A backend stream of scripted deltas; it yields to the loop before each item, as a real
    stream does, and ends once cancelled."""

    def __init__(self, items: list[TokenDelta]) -> None:
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[TokenDelta]:
        return self

    async def __anext__(self) -> TokenDelta:
        await asyncio.sleep(0)
        if self.cancelled or not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedBackend:
    """Each job's stream from ``script(request)``: its deltas after the accepted event."""

    def __init__(self, script: Callable[[JobRequest], list[TokenDelta]]) -> None:
        self.script = script
        self.requests: list[JobRequest] = []
        self.resets = 0

    def generate(self, req: JobRequest) -> FakeStream:
        self.requests.append(req)
        return FakeStream([TokenDelta(req.job_id)] + self.script(req))

    async def metrics_text(self) -> str:
        return ""

    async def engine_stats(self) -> dict[str, Any]:
        return {}

    async def health(self) -> dict[str, Any]:
        return {"healthy": True}

    async def reset_prefix_cache(self) -> dict[str, Any]:
        self.resets += 1
        return {"reset_blocks": 0}


MODEL = "opt-125m"
VOCAB = 50272
CONTEXT = 2048


def post(backend: ScriptedBackend, path: str, body: Any, **context: Any) -> Any:
    """POST ``body`` to an ``OpenAIServer`` over ``backend``; the httpx response. ``context``:
    ``ServerContext`` fields beyond the model's."""
    import asyncio
    import json

    import httpx

    from app.http_api import make_api
    from app.ingress import OpenAIServer
    from app.ingress_requests import ServerContext
    from app.tokenizer import Tokenizer

    async def run() -> httpx.Response:
        ctx = ServerContext(MODEL, Tokenizer.default(), VOCAB, CONTEXT, **context)
        app = make_api(OpenAIServer(ctx, backend))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.post(path, content=json.dumps(body).encode())
    return asyncio.run(run())


def sse_events(text: str) -> list[Any]:
    import json
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
