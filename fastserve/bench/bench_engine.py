"""Engine throughput vs transformers, side by side in one run: ``python -m fastserve.bench.bench_engine``.

Prefill and decode tokens/s at batch 1/8/32 of our in-process executor (paged KV, sampling
included) against ``transformers``' forward on the same weights (logits only, at prefill the last
position's, as ours); ``--model`` takes a folder, config.json or Serve YAML, real weights where the
folder has them (``--weights dummy`` forces seeded ones). A table, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from fastserve.kernels.cpu_features import cpu_name
from fastserve.worker.executor import InProcessExecutor, resolve_dtype, torch_dtype
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams, blocks_for
from fastserve.worker.model.config import ModelConfig, OPTConfig, as_model_config
from fastserve.worker.model.llama_config import LlamaConfig
from fastserve.worker.model.weights import checkpoint_files, dummy_weights
from fastserve.worker.spec import ModelSpec

ROOT = Path(__file__).resolve().parents[2]
PROMPT_LEN = 128
BATCH_SIZES = (1, 8, 32)
BLOCK_SIZE = 16
DECODE_STEPS = 8
GREEDY = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0.0, ignore_eos=True)


def timed_runs(run: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``run``, after one warm-up run."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def _median(run: Callable[[], object], repeats: int) -> float:
    return statistics.median(timed_runs(run, repeats))


#: transformers' (config, model) classes of each LLaMA-family ``model_type``.
HF_LLAMA_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}


def _hf_twin(ex: InProcessExecutor, config: ModelConfig, seed: int) -> transformers.PreTrainedModel:
    ours = dict(dummy_weights(ex.model, seed))
    if isinstance(config, OPTConfig):
        hf = transformers.OPTForCausalLM(transformers.OPTConfig(**config.to_hf_dict()))
        state = {f"model.decoder.{n}": t for n, t in ours.items()}
    elif isinstance(config, LlamaConfig):
        config_cls, model_cls = HF_LLAMA_CLASSES[config.model_type]
        hf = model_cls(config_cls(**config.to_hf_dict()))
        state = {(n if n == "lm_head.weight" else f"model.{n}"): t for n, t in ours.items()}
    else:
        raise TypeError(f"no transformers twin for {type(config).__name__}")
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weights do not map onto transformers' names: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    hf.tie_weights()
    return hf.eval()


def _hf_pretrained(config: ModelConfig, folder: Path,
                   dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    if isinstance(config, OPTConfig):
        model_cls: type[transformers.PreTrainedModel] = transformers.OPTForCausalLM
    elif isinstance(config, LlamaConfig):
        model_cls = HF_LLAMA_CLASSES[config.model_type][1]
    else:
        raise TypeError(f"no transformers twin for {type(config).__name__}")
    return model_cls.from_pretrained(str(folder), dtype=dtype).eval()


def _model_folder(model: str) -> Path:
    path = Path(model)
    if path.suffix in (".yaml", ".yml"):
        import yaml

        (app,) = yaml.safe_load(path.read_text())["applications"]
        path = Path(app["args"]["model"]["config_path"])
        path = path if path.is_absolute() else ROOT / path
    return path.parent if path.is_file() else path


def load_bench_config(model: str) -> ModelConfig:
    """A model folder or config.json as is; a Serve YAML through its ``model.config_path``."""
    return as_model_config(_model_folder(model))


def checkpoint_folder(model: str, weights: str) -> Path | None:
    if weights == "dummy":
        return None
    folder = _model_folder(model)
    try:
        checkpoint_files(folder)
    except FileNotFoundError:
        if weights == "real":
            raise
        return None
    return folder


def _block_tables(b: int) -> list[tuple[int, ...]]:
    per_seq = blocks_for(PROMPT_LEN + DECODE_STEPS + 1, BLOCK_SIZE)
    return [tuple(range(j * per_seq, (j + 1) * per_seq)) for j in range(b)]


def prefill_s_ours(ex: InProcessExecutor, b: int, repeats: int) -> float:
    """Median seconds; it leaves the KV in the pool for ``decode_step_s_ours``."""
    tables = _block_tables(b)
    prompt = tuple(2 + i for i in range(PROMPT_LEN))
    prefill = BatchPlan(0, tuple(BatchEntry(str(j), prompt, 0, tables[j], True, GREEDY) for j in range(b)))
    return _median(lambda: ex.execute(prefill), repeats)


def decode_step_s_ours(ex: InProcessExecutor, b: int, repeats: int) -> float:
    """Per step, the median over ``repeats`` runs of ``DECODE_STEPS`` steps, sampling included."""
    tables = _block_tables(b)

    def decode_steps() -> None:
        for k in range(DECODE_STEPS):
            ex.execute(BatchPlan(1, tuple(BatchEntry(str(j), (7,), PROMPT_LEN + k, tables[j], False,
                                                     GREEDY, k + 1) for j in range(b))))

    return _median(decode_steps, repeats) / DECODE_STEPS


def bench_ours(ex: InProcessExecutor, b: int, repeats: int) -> tuple[float, float]:
    t_prefill = prefill_s_ours(ex, b, repeats)
    return b * PROMPT_LEN / t_prefill, b / decode_step_s_ours(ex, b, repeats)


@torch.inference_mode()
def decode_step_s_hf(hf: transformers.PreTrainedModel, b: int, repeats: int) -> float:
    """The same contexts as ``decode_step_s_ours``."""
    ids = torch.arange(2, 2 + PROMPT_LEN).repeat(b, 1)

    def decode_steps() -> None:
        cache = hf(ids, use_cache=True).past_key_values
        start = time.perf_counter()
        for _ in range(DECODE_STEPS):
            cache = hf(torch.full((b, 1), 7), past_key_values=cache, use_cache=True).past_key_values
        decode_steps.elapsed = time.perf_counter() - start  # type: ignore[attr-defined]

    samples = []
    for _ in range(repeats + 1):
        decode_steps()
        samples.append(decode_steps.elapsed)  # type: ignore[attr-defined]
    return statistics.median(samples[1:]) / DECODE_STEPS


@torch.inference_mode()
def bench_hf(hf: transformers.PreTrainedModel, b: int, repeats: int) -> tuple[float, float]:
    ids = torch.arange(2, 2 + PROMPT_LEN).repeat(b, 1)
    # Only the last position's logits, as ours: else the ratio measures HF's LM head over the prompt.
    t_prefill = _median(lambda: hf(ids, use_cache=False, logits_to_keep=1), repeats)
    return b * PROMPT_LEN / t_prefill, b / decode_step_s_hf(hf, b, repeats)


def build_pair(model: str, weights: str, batch_sizes: list[int], dtype: str, seed: int = 0,
               gemm_choice: str = "cached") -> tuple[InProcessExecutor, transformers.PreTrainedModel, str]:
    """Our executor (GEMM paths chosen as a server's) and transformers' model on the same weights."""
    config = load_bench_config(model)
    folder = checkpoint_folder(model, weights)
    pool = max(batch_sizes) * blocks_for(PROMPT_LEN + DECODE_STEPS + 1, BLOCK_SIZE)
    dtype = resolve_dtype(dtype, "cpu")
    if folder is None:
        ex = InProcessExecutor(ModelSpec(config, pool, 0, BLOCK_SIZE, dtype=dtype, seed=seed, gemm_choice=gemm_choice))
        hf = _hf_twin(ex, config, seed)
        torch.nn.Module.to(hf, torch_dtype(dtype))   # in place; transformers' typed `to` hides Module's
    else:
        ex = InProcessExecutor(ModelSpec(config, pool, 0, BLOCK_SIZE, dtype=dtype, load_format="auto",
                                         model_path=str(folder), gemm_choice=gemm_choice))
        hf = _hf_pretrained(config, folder, torch_dtype(dtype))
    label = "dummy" if folder is None else str(folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder)
    return ex, hf, label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "config/models/opt-125m"),
                        help="model folder / config.json (OPT or LLaMA family), or a Serve YAML")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES),
                        help="batch sizes to measure (a busy machine may only afford the small ones)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights", choices=("auto", "real", "dummy"), default="auto",
                        help="auto: the folder's checkpoint if it has one, else seeded dummy weights")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), default="float32",
                        help="both sides' weights and activations (ours: and KV); auto = bfloat16 "
                             "where the CPU has native bf16, else float32")
    args = parser.parse_args()
    config = load_bench_config(args.model)
    dtype = resolve_dtype(args.dtype, "cpu")
    ex, hf, weights = build_pair(args.model, args.weights, args.batch_sizes, dtype, args.seed)
    rows = {}
    print(f"{config.name} ({weights} weights, {dtype}), prompt {PROMPT_LEN} tokens, "
          f"{torch.get_num_threads()} torch threads, {cpu_name()}")
    print(f"{'batch':>5} | {'prefill tok/s ours':>18} {'hf':>10} {'ratio':>6} | "
          f"{'decode tok/s ours':>17} {'hf':>10} {'ratio':>6}")
    for b in args.batch_sizes:
        op, od = bench_ours(ex, b, args.repeats)
        hp, hd = bench_hf(hf, b, args.repeats)
        rows[str(b)] = {"prefill_tok_s": round(op, 1), "prefill_tok_s_hf": round(hp, 1),
                        "prefill_ratio": round(op / hp, 3), "decode_tok_s": round(od, 1),
                        "decode_tok_s_hf": round(hd, 1), "decode_ratio": round(od / hd, 3)}
        print(f"{b:>5} | {op:>18.1f} {hp:>10.1f} {op / hp:>6.2f} | {od:>17.1f} {hd:>10.1f} {od / hd:>6.2f}")
    ex.close()
    print(json.dumps({"model": config.name, "weights": weights, "dtype": dtype, "cpu": cpu_name(),
                      "prompt_len": PROMPT_LEN, "torch_threads": torch.get_num_threads(), "batches": rows}))


if __name__ == "__main__":
    main()
