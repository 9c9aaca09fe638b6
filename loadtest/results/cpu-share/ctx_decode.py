"""Our in-process bf16 decode step at batch 8, contexts 128 / 512 / 1,024 (SmolLM2, 2 threads)."""

import torch

import loadtest.bench_engine as bench
from actors.executor import InProcessExecutor
from actors.messages import blocks_for
from actors.spec import ModelSpec

MODEL = ".cache/models/smollm2-135m-instruct"
BATCH = 8

torch.set_num_threads(2)
folder = bench.checkpoint_folder(MODEL, "auto")
config = bench.load_bench_config(MODEL)
for context in (128, 512, 1024):
    bench.PROMPT_LEN = context
    pool = BATCH * blocks_for(context + bench.DECODE_STEPS + 1, bench.BLOCK_SIZE)
    ex = InProcessExecutor(ModelSpec(config, pool, 0, bench.BLOCK_SIZE, dtype="bfloat16", load_format="auto",
                                     model_path=str(folder)))
    bench.prefill_s_ours(ex, BATCH, 1)
    step_s = bench.decode_step_s_ours(ex, BATCH, 3)
    print(f"context {context}: batch-{BATCH} decode step {1e3 * step_s:.1f} ms", flush=True)
