"""Our in-process bf16 decode step at batch 8, contexts 128 vs 1,024 (SmolLM2, 2 threads)."""
import torch
import loadtest.bench_engine as B
from actors.executor import InProcessExecutor, resolve_dtype
from actors.spec import ModelSpec
from actors.messages import blocks_for
torch.set_num_threads(2)
folder = B.checkpoint_folder(".cache/models/smollm2-135m-instruct", "auto")
config = B.load_bench_config(".cache/models/smollm2-135m-instruct")
for ctx in (128, 512, 1024):
    B.PROMPT_LEN = ctx
    pool = 8 * blocks_for(ctx + B.DECODE_STEPS + 1, B.BLOCK_SIZE)
    ex = InProcessExecutor(ModelSpec(config, pool, 0, B.BLOCK_SIZE, dtype="bfloat16", load_format="auto", model_path=str(folder)))
    B.prefill_s_ours(ex, 8, 1)
    s = B.decode_step_s_ours(ex, 8, 3)
    print(f"context {ctx}: batch-8 decode step {1e3*s:.1f} ms", flush=True)
