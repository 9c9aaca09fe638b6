"""``fastserve serve MODEL_DIR`` without a cluster (``fastserve.config_folder``, ``fastserve.cli``):
the AppArgs it builds for a folder, its KV sizing (CPU by memory, GPU by vLLM's rule), the profile
grid and cache key, and the command line's choice between a config file and a model folder."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from fastserve import cli
from fastserve.config import GIB, AppArgs
from fastserve.config_folder import (
    CACHE_DIR_ENV,
    FolderServeArgs,
    app_args,
    cache_dir,
    gpu_kv_blocks,
    hardware_key,
    profile_cache_name,
    profile_grid,
    serve_config,
)
from fastserve.config_model import REQUIRE_PROFILE_CONTEXT
from fastserve.config_server import API_KEY_ENV
from fastserve.scheduler.config import ChunkedPrefillConfig, KVCacheConfig, SchedulerConfig
from tests.harness.tokenizers import require_smollm2

MIB = 1 << 20
NO_PROFILE = {REQUIRE_PROFILE_CONTEXT: False}


def folder_args(**kw: object) -> FolderServeArgs:
    return FolderServeArgs.model_validate({"model_dir": require_smollm2(), **kw})


def test_a_folder_becomes_the_app_args_of_that_folder_with_the_schemas_defaults(tmp_path: Path) -> None:
    folder = folder_args()
    app = AppArgs.model_validate(app_args(folder, tmp_path / "p.json", torch_threads=2), context=NO_PROFILE)
    m = app.model
    assert (m.name, m.config_path, m.tokenizer_path, m.model_path) == (
        "smollm2-135m-instruct", str(folder.model_dir), str(folder.model_dir), str(folder.model_dir))
    assert (m.load_format, m.dtype, m.device, m.max_model_len) == ("auto", "auto", "cpu", None)
    assert app.profile.path == str(tmp_path / "p.json")
    assert (app.parallel.tensor_parallel_size, app.parallel.pipeline_parallel_size,
            app.parallel.num_gpus, app.parallel.torch_threads) == (1, 1, 0, 2)
    # The scheduler is the schema's, but for chunked prefill (vLLM V1's default), which is also what
    # lets SmolLM2's 8,192-token context run with the default 2,048-token budget.
    assert app.scheduler == SchedulerConfig(chunked_prefill=ChunkedPrefillConfig(enabled=True))
    assert app.scheduler.max_num_batched_tokens < m.context_len() == 8192


def test_cpu_pools_are_vllms_4_gib_each_in_the_dtype_this_machine_runs() -> None:
    app = AppArgs.model_validate(app_args(folder_args(), Path("p.json"), None), context=NO_PROFILE)
    # SmolLM2: 30 layers x K and V x 3 KV heads x 64 dims per token, 16 tokens a block.
    block = 16 * 2 * 30 * 3 * 64 * app.model.dtype_bytes()
    assert app.model.kv_bytes_per_block(16) == block
    assert app.kv_cache.num_device_blocks == 4 * GIB // block   # 11,650 in bf16, 5,825 in fp32
    assert app.kv_cache.num_host_blocks == 4 * GIB // block
    assert (app.kv_cache.device_memory_gib, app.kv_cache.host_memory_gib) == (4.0, 4.0)
    # The replica gets the GiB, not this machine's count: it sizes the pools in its own dtype.
    raw = app.replica_args()["kv_cache"]
    assert "num_device_blocks" not in raw and "num_host_blocks" not in raw


def test_options_reach_the_app_and_the_serve_config() -> None:
    folder = folder_args(name="smol", port=8123, max_model_len=2048, kv_cache_space_gib=0.5, swap_space_gib=0.25,
                         dtype="float32")
    app = AppArgs.model_validate(app_args(folder, Path("p.json"), None), context=NO_PROFILE)
    block = 16 * 2 * 30 * 3 * 64 * 4
    assert (app.model.name, app.model.max_model_len, app.model.dtype) == ("smol", 2048, "float32")
    assert (app.kv_cache.num_device_blocks, app.kv_cache.num_host_blocks) == (GIB // 2 // block, GIB // 4 // block)
    served = serve_config(folder, app_args(folder, Path("p.json"), None))
    assert served["http_options"] == {"host": "127.0.0.1", "port": 8123}
    (entry,) = served["applications"]
    assert (entry["import_path"], entry["route_prefix"]) == ("fastserve.main:build_app", "/")


def test_a_gpu_folder_asks_for_one_gpu_per_rank_and_takes_the_sized_pool() -> None:
    folder = folder_args(device="cuda", tensor_parallel_size=3, pipeline_parallel_size=2)
    app = app_args(folder, Path("p.json"), None, num_device_blocks=5000)
    assert app["parallel"] == {"tensor_parallel_size": 3, "pipeline_parallel_size": 2, "num_gpus": 6}
    assert app["kv_cache"] == {"host_memory_gib": 4.0, "num_device_blocks": 5000}


def test_a_folder_without_config_json_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"{tmp_path}.*config.json"):
        FolderServeArgs(model_dir=tmp_path)


def test_gpu_pool_is_utilization_times_total_less_others_weights_and_activations() -> None:
    # One 80 GiB GPU, 1 GiB used by another process, 16 GiB of weights, 2 GiB of activations:
    # 0.9 x 80 - 1 - 16 - 2 = 53 GiB of 2 MiB blocks.
    assert gpu_kv_blocks(80 * GIB, 79 * GIB, 0.9, 16 * GIB, 2 * GIB, 1, 2 * MIB) == 53 * GIB // (2 * MIB)
    # Two ranks each hold half the weights and half of every block: 2 x (72 - 1 - 8 - 2) GiB.
    assert gpu_kv_blocks(80 * GIB, 79 * GIB, 0.9, 16 * GIB, 2 * GIB, 2, 2 * MIB) == 122 * GIB // (2 * MIB)
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        gpu_kv_blocks(80 * GIB, 10 * GIB, 0.9, 16 * GIB, 2 * GIB, 1, 2 * MIB)
    with pytest.raises(ValueError, match="block_bytes must be > 0, got 0"):
        gpu_kv_blocks(80 * GIB, 80 * GIB, 0.9, 0, 0, 1, 0)


def test_the_quick_grid_stops_at_what_the_server_runs() -> None:
    sched, chunk = SchedulerConfig(), SchedulerConfig(chunked_prefill=ChunkedPrefillConfig(enabled=True)).chunk_limit()
    assert chunk is not None
    prompts, batches = profile_grid(folder_args())
    assert prompts == [p for p in FolderServeArgs.model_fields["profile_prompt_lens"].default if p < chunk] + [chunk]
    assert batches == [b for b in FolderServeArgs.model_fields["profile_batch_sizes"].default
                       if b < sched.max_batch_size] + [sched.max_batch_size]
    # A GPU sizes its pool from the profile's peak: the grid runs the whole token budget.
    assert profile_grid(folder_args(device="cuda"))[0][-1] == sched.max_num_batched_tokens
    # Without chunks a first iteration is the whole budget.
    assert profile_grid(folder_args(chunked_prefill=False))[0][-1] == sched.max_num_batched_tokens


def test_the_profile_cache_key_changes_with_each_thing_timings_depend_on() -> None:
    block_size = KVCacheConfig.model_fields["block_size"].default
    base: dict[str, Any] = {"name": "smol", "config_json": b'{"hidden_size": 576}', "hardware": "cpu-x-2t",
                            "dtype": "bfloat16", "tp": 1, "pp": 1, "block_size": block_size}
    name = profile_cache_name(**base)
    assert name == profile_cache_name(**base)
    assert name.startswith("smol-") and name.endswith("-cpu-x-2t-bfloat16-tp1-pp1-bs16.json")
    changes = {"config_json": b'{"hidden_size": 577}', "hardware": "h100", "dtype": "float32", "tp": 2, "pp": 2,
               "block_size": 32}
    others = {profile_cache_name(**{**base, key: value}) for key, value in changes.items()}
    assert len(others) == len(changes) and name not in others
    assert hardware_key("Intel(R) Xeon(R) Processor (avx512_bf16)", 2) == "intel-r-xeon-r-processor-avx512-bf16-2t"
    assert "/" not in profile_cache_name("org/model", b"{}", "h100", "bfloat16", 1, 1)


def test_the_cache_folder_follows_the_environment(tmp_path: Path) -> None:
    assert cache_dir({CACHE_DIR_ENV: str(tmp_path)}) == tmp_path
    assert cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "fastserve"
    assert cache_dir({}) == Path.home() / ".cache" / "fastserve"


def parse(*argv: str) -> argparse.Namespace:
    args, _ = cli.parser().parse_known_args(list(argv))
    return args


def test_the_command_line_maps_vllm_style_flags_onto_the_schema() -> None:
    args = parse("serve", "m", "--tp", "2", "--pp", "3", "--port", "9000", "--kv-cache-space-gib", "1.5")
    assert (args.target, args.tensor_parallel_size, args.pipeline_parallel_size, args.port) == ("m", 2, 3, 9000)
    assert (args.kv_cache_space_gib, args.gpu_memory_utilization, args.address) == (1.5, None, "local")


def test_a_config_file_refuses_folder_options_and_a_missing_target_is_named(tmp_path: Path) -> None:
    config = tmp_path / "app.yaml"
    config.write_text("applications: []\n")
    with pytest.raises(SystemExit, match="--tp, --port apply to a model folder"):
        cli.main(["serve", str(config), "--tp", "2", "--port", "9000"])
    with pytest.raises(SystemExit, match="'nowhere' is neither a config file nor a model folder"):
        cli.main(["serve", "nowhere"])
    with pytest.raises(SystemExit, match="unknown options for a model folder: --bogus"):
        cli.main(["serve", str(require_smollm2()), "--bogus"])


def test_a_bad_value_is_refused_naming_it_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="gpu_memory_utilization"):
        cli.main(["serve", str(require_smollm2()), "--device", "cpu", "--gpu-memory-utilization", "1.5",
                  "--cache-dir", str(tmp_path), "--dry-run"])
    assert not (tmp_path / "apps").exists()


def test_dry_run_with_a_given_profile_writes_the_serve_config(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    profile = Path(__file__).resolve().parents[2] / "config/profiles/smollm2-135m-instruct-cpu-tp1-pp1.json"
    cli.main(["serve", str(require_smollm2()), "--device", "cpu", "--port", "8123", "--profile", str(profile),
              "--kv-cache-space-gib", "0.5", "--swap-space-gib", "0.5", "--cache-dir", str(tmp_path), "--dry-run"])
    written = tmp_path / "apps" / "smollm2-135m-instruct.yaml"
    assert f"wrote the Serve config {written}" in capsys.readouterr().out
    (entry,) = yaml.safe_load(written.read_text())["applications"]
    app = AppArgs.model_validate(entry["args"])
    assert (app.profile.path, app.kv_cache.device_memory_gib) == (str(profile), 0.5)
    assert not (tmp_path / "profiles").exists()   # a given profile is used as is


def test_the_command_sizes_a_gpu_pool_from_the_memory_read_first_and_the_profiles_figures(tmp_path: Path) -> None:
    folder = folder_args(device="cuda", tensor_parallel_size=2)
    profile = tmp_path / "p.json"
    profile.write_text('{"memory": {"weight_bytes": 268435456, "activation_bytes": 1073741824}}')
    block = 16 * 2 * 30 * 3 * 64 * 2   # SmolLM2 in bf16, as ``auto`` resolves on a GPU
    # 2 x (0.9 x 80 GiB - 1 GiB used by others - 128 MiB of weights per rank - 1 GiB) of 360 KiB blocks.
    want = int(2 * (0.9 * 80 * GIB - GIB - 128 * MIB - GIB) // block)
    assert cli._gpu_blocks(folder, profile, (79 * GIB, 80 * GIB)) == want
    assert cli._gpu_blocks(folder_args(), profile, None) is None
    profile.write_text('{"t_init": {}}')
    with pytest.raises(ValueError, match="has no GPU memory figures"):
        cli._gpu_blocks(folder, profile, (79 * GIB, 80 * GIB))


def test_a_server_bound_beyond_loopback_requires_an_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    for host, required in (("127.0.0.1", False), ("localhost", False), ("::1", False), ("0.0.0.0", True),
                           ("10.1.2.3", True), ("myhost", True)):
        app = app_args(folder_args(host=host), Path("p.json"), None)
        assert ("server" in app) == required, host
    app = app_args(folder_args(host="0.0.0.0"), Path("p.json"), None)
    with pytest.raises(ValueError, match="require_api_key is set but no API key"):
        AppArgs.model_validate(app, context=NO_PROFILE).server.resolved_api_key()


def test_the_tool_call_parser_option_reaches_the_server_section() -> None:
    assert "server" not in app_args(folder_args(), Path("p.json"), None)
    app = app_args(folder_args(tool_call_parser="pythonic"), Path("p.json"), None)
    assert AppArgs.model_validate(app, context=NO_PROFILE).server.tool_call_parser == "pythonic"
    args = cli.parser().parse_args(["serve", str(require_smollm2()), "--tool-call-parser", "llama3_json"])
    assert args.tool_call_parser == "llama3_json"
