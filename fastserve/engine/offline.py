"""Offline generation: the same ``AsyncEngine`` as the server, in this process, without Ray or HTTP.
Builds the engine from a Serve YAML's application ``args`` as a replica does; pipeline configs
(TP·PP > 1) run on one in-process copy: a quick look, not their hardware.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from fastserve.config import AppArgs
from fastserve.engine.async_engine import AsyncEngine
from fastserve.engine.replica import build_grammars, build_scheduler, in_process_executor
from fastserve.worker.messages import SamplingParams

DEFAULT_PROMPTS = (
    "Hello, my name is",
    "The capital of France is",
    "FastServe schedules jobs at the granularity of",
    "Once upon a time",
)
DEFAULT_MAX_TOKENS = 24


def load_app_args(config: str | Path, app_index: int = 0) -> AppArgs:
    """The ``args`` of one application of a Serve YAML, validated."""
    raw = yaml.safe_load(Path(config).read_text(encoding="utf-8"))
    apps = raw.get("applications") or []
    if not apps:
        raise ValueError(f"{config}: no 'applications' in the Serve config")
    return AppArgs.model_validate(apps[app_index].get("args") or {})


async def generate_all(args: AppArgs, prompts: Sequence[str], sampling: SamplingParams,
                       chat: bool = False) -> list[dict[str, Any]]:
    """Each prompt as a completion, or with ``chat`` as one user message in the chat template."""
    tokenizer = args.model.tokenizer()
    executor = await in_process_executor(args.engine_spec())
    engine = AsyncEngine(build_scheduler(args), executor, config=args.engine, grammars=build_grammars(args))
    await engine.start()

    async def one(i: int, prompt: str) -> dict[str, Any]:
        started = time.monotonic()
        prompt_ids = (tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat
                      else tokenizer.encode(prompt))
        stream = engine.add_request(prompt_ids, sampling, job_id=f"offline-{i}")
        ids: list[int] = []
        reason = None
        async for delta in stream:
            ids += delta.token_ids
            reason = delta.finish_reason
        return {"prompt": prompt, "text": tokenizer.decode(ids), "tokens": len(ids),
                "finish_reason": reason, "seconds": time.monotonic() - started}

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await engine.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", default="config/demo.yaml", help="a Serve YAML (config/*.yaml)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few demos")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--chat", action="store_true", help="send each prompt as a user chat message")
    opts = parser.parse_args(argv)
    args = load_app_args(opts.config)
    if args.parallel.uses_pipeline:
        print(f"note: {opts.config} asks for TP·PP = {args.parallel.world_size}; running one in-process copy")
    sampling = SamplingParams(max_tokens=opts.max_tokens, temperature=opts.temperature, seed=opts.seed)
    started = time.monotonic()
    results = asyncio.run(generate_all(args, opts.prompt or DEFAULT_PROMPTS, sampling, opts.chat))
    for r in results:
        print(f"--- {r['prompt']!r} -> {r['tokens']} tokens ({r['finish_reason']}, {r['seconds']:.2f} s)")
        print(r["text"])
    print(f"=== {len(results)} completions in {time.monotonic() - started:.2f} s "
          f"(model {args.model.name}, policy {args.scheduler.policy}, swap {args.kv_cache.swap_mode})")


if __name__ == "__main__":
    main()
