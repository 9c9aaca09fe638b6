"""LLaMA-family configs and the architecture factory: what is read from config.json, what is
refused (naming the value), how tensor parallelism splits or replicates KV heads, and that the
shipped LLaMA configs load, validate and build with dummy weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from fastserve.worker.model.config import ModelConfig, OPTConfig, load_model_config, model_config_from_dict
from fastserve.worker.model.llama_config import LlamaConfig, RopeScaling
from fastserve.worker.model.rope import inverse_frequencies

ROOT = Path(__file__).resolve().parents[2]
BASE: dict[str, Any] = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
                        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2}
SHIPPED = ["llama-3.1-8b", "llama-3.1-70b", "llama-3.2-1b", "llama-demo-150m"]


def test_factory_picks_the_architecture_from_model_type() -> None:
    assert isinstance(load_model_config(ROOT / "config/models/opt-125m"), OPTConfig)
    for model_type in ("llama", "mistral", "qwen2"):
        config = model_config_from_dict({**BASE, "model_type": model_type})
        assert isinstance(config, LlamaConfig) and config.model_type == model_type
        assert isinstance(config, ModelConfig)


def test_unknown_model_type_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="unsupported model_type 'gpt_neox'"):
        model_config_from_dict({**BASE, "model_type": "gpt_neox"})


@pytest.mark.parametrize("kind", ["dynamic", "yarn", "longrope"])
def test_unsupported_rope_scaling_is_an_error_naming_it(kind: str) -> None:
    with pytest.raises(ValueError, match=f"rope_scaling kind '{kind}' is not supported"):
        model_config_from_dict({**BASE, "rope_scaling": {"rope_type": kind, "factor": 2.0}})


def test_rope_settings_in_either_spelling() -> None:
    legacy = model_config_from_dict({**BASE, "rope_theta": 500000.0,
                                     "rope_scaling": {"type": "linear", "factor": 4.0}})
    # transformers 5 writes rope_parameters, with the theta inside.
    new = model_config_from_dict({**BASE, "rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                                              "rope_theta": 500000.0}})
    assert isinstance(legacy, LlamaConfig) and isinstance(new, LlamaConfig)
    assert legacy.rope_scaling == new.rope_scaling == RopeScaling("linear", 4.0)
    assert legacy.rope_theta == new.rope_theta == 500000.0
    plain = model_config_from_dict({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert isinstance(plain, LlamaConfig) and plain.rope_scaling is None


def test_llama3_frequencies_match_transformers() -> None:
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    hf = HFLlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                       rope_scaling=scaling.to_hf_dict())
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    torch.testing.assert_close(inverse_frequencies(128, 500000.0, scaling), expected.float())


def test_biases_by_family_and_first_eos_of_a_list() -> None:
    qwen = model_config_from_dict({**BASE, "model_type": "qwen2", "eos_token_id": [7, 8]})
    llama = model_config_from_dict({**BASE, "attention_bias": True, "mlp_bias": True})
    assert isinstance(qwen, LlamaConfig) and isinstance(llama, LlamaConfig)
    assert (qwen.qkv_bias, qwen.o_proj_bias, qwen.mlp_bias) == (True, False, False)
    assert (llama.qkv_bias, llama.o_proj_bias, llama.mlp_bias) == (True, True, True)
    assert qwen.eos_token_id == 7


def test_a_sliding_window_caps_the_context() -> None:
    mistral = model_config_from_dict({**BASE, "model_type": "mistral", "max_position_embeddings": 32768,
                                      "sliding_window": 4096})
    qwen = model_config_from_dict({**BASE, "model_type": "qwen2", "max_position_embeddings": 32768,
                                   "sliding_window": 4096, "use_sliding_window": False})
    assert mistral.max_position_embeddings == 4096
    assert qwen.max_position_embeddings == 32768


def test_kv_heads_are_split_or_replicated_across_tensor_parallel_ranks() -> None:
    config = LlamaConfig(**{k: v for k, v in BASE.items() if k != "model_type"})   # 8 query, 2 KV heads
    assert [config.kv_heads_per_rank(t) for t in (1, 2, 4, 8)] == [2, 1, 1, 1]
    assert [config.kv_head_start(r, 2) for r in range(2)] == [0, 1]
    # TP 4 > 2 KV heads: ranks 0-1 share KV head 0 (their query heads 0-3), ranks 2-3 head 1.
    assert [config.kv_head_start(r, 4) for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="num_attention_heads=8"):
        config.check_tensor_parallel(3)
    odd = LlamaConfig(**{**{k: v for k, v in BASE.items() if k != "model_type"},
                         "hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        odd.check_tensor_parallel(2)


def test_checkpoint_shape_mismatch_names_the_tensor(tmp_path: Path) -> None:
    from fastserve.worker.model.llama import LlamaStage
    from fastserve.worker.model.weights import load_weights

    config = LlamaConfig(**{k: v for k, v in BASE.items() if k != "model_type"})
    stage = LlamaStage(config)
    bad = [("model.layers.1.self_attn.k_proj.weight", torch.zeros(64, 64))]
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.k_proj.weight' has shape \(64, 64\)"):
        load_weights(stage, bad, strict=False)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_llama_configs_load(name: str) -> None:
    raw = json.loads((ROOT / "config/models" / name / "config.json").read_text())
    config = load_model_config(ROOT / "config/models" / name)
    assert isinstance(config, LlamaConfig)
    assert config.num_kv_heads == raw["num_key_value_heads"] < config.num_attention_heads
    assert config.rope_scaling is not None and config.rope_scaling.kind == "llama3"


def test_demo_model_serves_with_dummy_weights_and_fits_the_opt_tokenizer() -> None:
    from fastserve.tokenizer import Tokenizer
    from fastserve.worker.executor import InProcessExecutor
    from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams
    from fastserve.worker.spec import ModelSpec

    config = load_model_config(ROOT / "config/models/llama-demo-150m")
    assert config.vocab_size >= Tokenizer.default().vocab_size
    ex = InProcessExecutor(ModelSpec(ROOT / "config/models/llama-demo-150m", num_device_blocks=4,
                                     num_host_blocks=0, block_size=16, load_format="dummy", seed=3))
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    out = ex.execute(BatchPlan(0, (BatchEntry("a", (2, 100, 200), 0, (0,), True, greedy),)))
    assert 0 <= out.tokens["a"] < config.vocab_size
    ex.close()


@pytest.mark.parametrize("name", ["llama-demo", "llama3-8b", "llama3-70b"])
def test_llama_serve_configs_validate(name: str) -> None:
    from ray.serve.schema import ServeDeploySchema

    from fastserve.config import AppArgs

    raw = yaml.safe_load((ROOT / "config" / f"{name}.yaml").read_text())
    ServeDeploySchema.model_validate(raw)
    (app,) = raw["applications"]
    # The GPU configs' profiles are to be measured on their GPUs, and their tokenizers come with the
    # mounted model folder; the CPU demo's are shipped.
    shipped = name == "llama-demo"
    args = AppArgs.model_validate(app["args"], context={"require_profile": shipped, "require_model_files": shipped})
    assert isinstance(args.model.hf_config(), LlamaConfig)
    assert args.parallel.tensor_parallel_size * args.parallel.pipeline_parallel_size == max(
        args.parallel.num_gpus, 1)


def test_kv_projection_of_the_wrong_size_is_refused_at_tensor_parallel_2() -> None:
    from fastserve.worker.model.llama import LlamaStage
    from fastserve.worker.model.shard import StageShard
    from fastserve.worker.model.weights import load_weights

    config = LlamaConfig(**{k: v for k, v in BASE.items() if k != "model_type"})   # 2 KV heads x 8
    stage = LlamaStage(config, StageShard(0, 2, 2, tp_rank=1, tp_size=2))
    # Half the rows: rank 1's slice would be out of range, rank 0's would fit by accident.
    bad = [("model.layers.0.self_attn.v_proj.weight", torch.zeros(8, 64))]
    with pytest.raises(ValueError, match="'layers.0.self_attn.v_proj.weight' has 8 rows"):
        load_weights(stage, bad, strict=False)
