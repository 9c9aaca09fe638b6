"""What structured outputs cost a decode step: ``python -m fastserve.bench.bench_structured``.

The demo's model, in this process, decodes a full batch of 32 greedy chat requests free and held to a
JSON schema (``--constraint``; by default one that stays open, mostly inside strings), interleaved round
by round. Over the full-batch decode steps: tokens/s per arm and their ratio, and the constrained steps'
own mask, apply and advance times, whose share drifts with the steps on a shared machine. A table, then
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastserve.engine.core import EngineCore
from fastserve.engine.offline import load_app_args
from fastserve.engine.replica import build_grammars, build_scheduler
from fastserve.kernels.cpu_features import cpu_name
from fastserve.scheduler.job import JobRequest
from fastserve.worker import sampler as sampler_module
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import OutputConstraint, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
NOTES = {"type": "object", "required": ["notes"],
         "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 64}}}
CONSTRAINTS = {
    "json": OutputConstraint.json_schema(NOTES),
    # Letters until a marker the model never writes: free-text masks, never complete.
    "regex": OutputConstraint.regex(r"[A-Za-z ,.]+ END"),
}
TOPICS = ("volcanoes", "the Roman empire", "bread baking", "chess openings", "whales", "jazz",
          "the moon", "bicycles")


@dataclass
class Arm:
    """One arm's full-batch decode steps: seconds per phase, one entry per step, and the
    structured-output work inside them (``Timer``)."""

    name: str
    schedule_s: list[float] = field(default_factory=list)
    execute_s: list[float] = field(default_factory=list)
    update_s: list[float] = field(default_factory=list)
    grammar_s: list[float] = field(default_factory=list)
    #: The executor's own phases (``StepOutput.timings``): the forward, and sampling.
    forward_s: list[float] = field(default_factory=list)
    sample_s: list[float] = field(default_factory=list)

    @property
    def step_s(self) -> list[float]:
        return [a + b + c for a, b, c in zip(self.schedule_s, self.execute_s, self.update_s, strict=True)]


class Timer:
    """Seconds spent in the wrapped functions since the last ``take``."""

    def __init__(self) -> None:
        self.spent = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - started
        return timed

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


def time_grammar_work(core: EngineCore) -> Timer:
    """Wrap the structured-output work of a step with one timer: the masks (``with_masks``), the
    sampler's ``apply_token_masks`` and the matchers' ``advance``."""
    timer = Timer()
    grammars = core.grammars
    assert grammars is not None
    grammars.with_masks = timer.wrap(grammars.with_masks)  # type: ignore[method-assign]
    grammars.advance = timer.wrap(grammars.advance)  # type: ignore[method-assign]
    sampler_module.apply_token_masks = timer.wrap(sampler_module.apply_token_masks)
    return timer


def run_batch(core: EngineCore, executor: InProcessExecutor, prompts: list[tuple[int, ...]],
              sampling: SamplingParams, tag: str, arm: Arm | None, timer: Timer) -> None:
    """Every prompt as a job, run to its end; the full-batch decode steps recorded in ``arm``."""
    for i, prompt in enumerate(prompts):
        core.add(JobRequest(f"{tag}-{i}", prompt, sampling))
    while core.has_work():
        timer.take()
        started = time.perf_counter()
        plan = core.schedule()
        scheduled = time.perf_counter()
        if plan is None:
            continue
        output = executor.execute(plan)
        executed = time.perf_counter()
        core.update(plan, output)
        updated = time.perf_counter()
        full = len(plan.entries) == len(prompts) and not any(e.is_prefill for e in plan.entries)
        if arm is not None and full:
            arm.schedule_s.append(scheduled - started)
            arm.execute_s.append(executed - scheduled)
            arm.update_s.append(updated - executed)
            arm.grammar_s.append(timer.take())
            arm.forward_s.append(output.timings.get("forward", 0.0))
            arm.sample_s.append(output.timings.get("sample", 0.0))


def run(config: Path, batch: int, max_tokens: int, rounds: int, constraint_name: str) -> dict[str, Any]:
    args = load_app_args(config)
    tokenizer = args.model.tokenizer()
    executor = InProcessExecutor(args.engine_spec().model)
    core = EngineCore(build_scheduler(args), grammars=build_grammars(args))
    timer = time_grammar_work(core)
    prompts = [tuple(tokenizer.encode_chat([{"role": "user", "content": f"Write notes about {TOPICS[i % len(TOPICS)]}"
                                                                        f" (set {i}) as JSON."}]))
               for i in range(batch)]
    free = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    held = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          constraint=CONSTRAINTS[constraint_name])
    arms = {"free": Arm("free"), "constrained": Arm("constrained")}
    params = {"free": free, "constrained": held}
    run_batch(core, executor, prompts, free, "warm-free", None, timer)        # GEMM paths, caches
    run_batch(core, executor, prompts, held, "warm-held", None, timer)        # token index, compile
    for r in range(rounds):
        order = ["free", "constrained"] if r % 2 == 0 else ["constrained", "free"]
        for name in order:
            run_batch(core, executor, prompts, params[name], f"{name}-{r}", arms[name], timer)
    executor.close()
    out: dict[str, Any] = {"cpu": cpu_name(), "model": args.model.name, "batch": batch, "max_tokens": max_tokens,
                           "rounds": rounds, "constraint": constraint_name, "arms": {}}
    for name, arm in arms.items():
        step = statistics.median(arm.step_s)
        out["arms"][name] = {"steps": len(arm.step_s), "step_ms": 1e3 * step,
                             "schedule_ms": 1e3 * statistics.median(arm.schedule_s),
                             "execute_ms": 1e3 * statistics.median(arm.execute_s),
                             "update_ms": 1e3 * statistics.median(arm.update_s),
                             "grammar_ms": 1e3 * statistics.median(arm.grammar_s),
                             "forward_ms": 1e3 * statistics.median(arm.forward_s),
                             "sample_ms": 1e3 * statistics.median(arm.sample_s),
                             "decode_tokens_per_s": batch / step}
    free_tps = out["arms"]["free"]["decode_tokens_per_s"]
    out["throughput_ratio"] = out["arms"]["constrained"]["decode_tokens_per_s"] / free_tps
    out["cost_fraction"] = 1.0 - out["throughput_ratio"]
    held_arm = arms["constrained"]
    out["grammar_share_of_step"] = statistics.median(g / s for g, s in zip(held_arm.grammar_s, held_arm.step_s,
                                                                             strict=True))
    return out


def print_table(out: dict[str, Any]) -> None:
    print(f"{out['model']} batch {out['batch']}, greedy, {out['max_tokens']} tokens, {out['rounds']} interleaved "
          f"rounds, constraint {out['constraint']}, on {out['cpu']} (medians over full-batch decode steps)")
    print(f"{'arm':12} {'steps':>6} {'step ms':>8} {'schedule':>9} {'execute':>8} {'(forward':>9} {'sample)':>8} "
          f"{'update':>7} {'grammar':>8} {'tok/s':>8}")
    for name, arm in out["arms"].items():
        print(f"{name:12} {arm['steps']:>6} {arm['step_ms']:>8.2f} {arm['schedule_ms']:>9.2f} "
              f"{arm['execute_ms']:>8.2f} {arm['forward_ms']:>9.2f} {arm['sample_ms']:>8.2f} {arm['update_ms']:>7.2f} "
              f"{arm['grammar_ms']:>8.2f} {arm['decode_tokens_per_s']:>8.1f}")
    print(f"constrained / free decode throughput: {out['throughput_ratio']:.3f} "
          f"(cost {100 * out['cost_fraction']:.1f} %); structured-output work in the constrained steps: "
          f"{100 * out['grammar_share_of_step']:.1f} % of each (median)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "config" / "demo.yaml")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--constraint", choices=sorted(CONSTRAINTS), default="json")
    opts = parser.parse_args(argv)
    out = run(opts.config, opts.batch, opts.max_tokens, opts.rounds, opts.constraint)
    print_table(out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
