"""``AppArgs`` (fastserve.config): the shipped configs validate; bad ones fail naming the key and value."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from fastserve.config import AppArgs, ProfileMismatchWarning
from fastserve.config_layout import ParallelArgs
from fastserve.engine.replica import build_scheduler
from fastserve.worker.spec import ParallelSpec, PipelineTimeouts
from tests.harness.app_config import demo_args, error_of

ROOT = Path(__file__).resolve().parents[2]


def test_demo_config_validates_with_the_papers_settings() -> None:
    args = AppArgs.model_validate(demo_args())
    assert args.scheduler.max_batch_size == 32   # measured on the CPU (config/opt125m-dummy.yaml says how)
    assert args.scheduler.max_num_batched_tokens == 2048
    assert args.kv_cache.block_size == 16
    assert args.model.device == "cpu" and args.model.load_format == "dummy"
    assert args.placement_group_bundles() == [{"CPU": 0.01}]
    assert args.engine_deployment_defaults() == {
        "max_ongoing_requests": 1024, "ray_actor_options": {"num_cpus": 0}, "placement_group_strategy": "PACK",
        # 1.5 × 2048 tokens × the profile's 78.5 ms decode step at batch 32, rounded up (fastserve.config_drain)
        "graceful_shutdown_timeout_s": 242.0, "placement_group_bundles": [{"CPU": 0.01}]}


EXTRA = "Extra inputs are not permitted"        # pydantic's words for a model's unknown key
UNEXPECTED = "Unexpected keyword argument"      # and for a dataclass's (parallel, pipeline)


@pytest.mark.parametrize("section,key,words", [
    (None, "modle", EXTRA), ("model", "nmae", EXTRA), ("scheduler", "max_batch", EXTRA),
    ("kv_cache", "blocksize", EXTRA), ("parallel", "replica_bundels", UNEXPECTED),
    ("pipeline", "ping_timeout", UNEXPECTED), ("server", "apikey", EXTRA),
])
def test_unknown_key_is_named(section: str | None, key: str, words: str) -> None:
    args = demo_args()
    if section is not None:
        args.setdefault(section, {})
    (args if section is None else args[section])[key] = 1
    msg = error_of(args)
    assert f"{'' if section is None else section + '.'}{key}\n  {words}" in msg


def test_bad_policy_value_is_named() -> None:
    args = demo_args()
    args["scheduler"]["policy"] = "lifo"
    msg = error_of(args)
    assert "scheduler.policy" in msg and "lifo" in msg


@pytest.mark.parametrize("policy", ["fcfs", "fixed_priority", "srpt_oracle"])
def test_request_priorities_need_a_policy_with_levels(policy: str) -> None:
    args = demo_args()
    args["scheduler"]["policy"] = policy
    args.setdefault("server", {})["allow_priority"] = True
    assert (f"server.allow_priority is on but scheduler.policy '{policy}' has one level, so a request's "
            "priority would change nothing: use one of ['naive_mlfq', 'skip_join_mlfq'] or turn "
            "allow_priority off") in error_of(args)
    args["scheduler"]["policy"] = "skip_join_mlfq"
    assert AppArgs.model_validate(args).server.allow_priority


def test_missing_profile_file_names_the_path() -> None:
    args = demo_args()
    args["profile"]["path"] = "config/profiles/nope.json"
    msg = error_of(args)
    assert "profile.path" in msg and "profile file 'config/profiles/nope.json' not found" in msg


def test_missing_profile_is_waivable_only_through_the_validation_context() -> None:
    args = demo_args()
    args["profile"]["path"] = "config/profiles/nope.json"
    assert "profile file 'config/profiles/nope.json' not found" in error_of(args)
    waived = AppArgs.model_validate(args, context={"require_profile": False})
    assert waived.profile.path == "config/profiles/nope.json"


def test_missing_model_config_names_the_path() -> None:
    args = demo_args()
    args["model"]["config_path"] = "config/models/opt-9000"
    assert "path 'config/models/opt-9000' does not exist" in error_of(args)


def test_tp_times_pp_must_equal_the_gpus_requested() -> None:
    args = demo_args()
    args["model"]["device"] = "cuda"
    args["parallel"].update(tensor_parallel_size=2, pipeline_parallel_size=2, num_gpus=3)
    msg = error_of(args)
    assert "parallel.num_gpus=3 but tensor_parallel_size=2 × pipeline_parallel_size=2 = 4" in msg


def test_gpus_on_a_cpu_model_are_rejected() -> None:
    args = demo_args()
    args["parallel"]["num_gpus"] = 1
    assert "parallel.num_gpus=1 but model.device is 'cpu'" in error_of(args)


def test_tp_must_divide_the_heads() -> None:
    args = demo_args()
    args["parallel"]["tensor_parallel_size"] = 5
    assert "tensor_parallel_size=5 does not divide the model's num_attention_heads=12" in error_of(args)


def test_block_size_must_divide_the_context() -> None:
    args = demo_args()
    args["kv_cache"]["block_size"] = 24
    assert "kv_cache.block_size=24 does not divide the context length 2048" in error_of(args)


def test_device_pool_must_hold_one_max_length_request() -> None:
    args = demo_args()
    args["kv_cache"]["num_device_blocks"] = 100
    msg = error_of(args)
    assert "kv_cache.num_device_blocks=100" in msg and "need 128 blocks of 16" in msg


def test_host_pool_must_hold_one_max_length_request_when_swapping() -> None:
    args = demo_args()
    args["kv_cache"]["num_host_blocks"] = 64
    assert "kv_cache.num_host_blocks=64 is too small" in error_of(args)
    args["kv_cache"].update(swap_mode="recompute", num_host_blocks=0)
    AppArgs.model_validate(args)


def test_token_budget_must_fit_a_max_length_prompt() -> None:
    args = demo_args()
    args["scheduler"]["max_num_batched_tokens"] = 1024
    assert "scheduler.max_num_batched_tokens=1024 is below the context length 2048" in error_of(args)


def test_max_model_len_shrinks_the_requirements() -> None:
    args = demo_args()
    args["model"]["max_model_len"] = 512
    args["kv_cache"].update(num_device_blocks=32, num_host_blocks=32)
    args["scheduler"]["max_num_batched_tokens"] = 512
    assert AppArgs.model_validate(args).model.context_len() == 512
    args["model"]["max_model_len"] = 4096
    assert "model.max_model_len=4096 exceeds the model's 2048 positions" in error_of(args)


def test_profile_layout_mismatch_warns() -> None:
    args = demo_args()
    args["kv_cache"]["block_size"] = 32
    args["kv_cache"].update(num_device_blocks=128, num_host_blocks=128)
    with pytest.warns(ProfileMismatchWarning, match="measured with block_size=16, but this config has block_size=32"):
        AppArgs.model_validate(args)


def test_profile_dtype_mismatch_warns_where_the_replica_resolves_the_dtype() -> None:
    """The opt-125m profile was measured in float32: a float32 replica builds its scheduler
    silently, a bfloat16 one is warned (``auto`` is resolved only in the replica)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileMismatchWarning)
        build_scheduler(AppArgs.model_validate(demo_args()))
    args = demo_args()
    args["model"]["dtype"] = "bfloat16"
    with pytest.warns(ProfileMismatchWarning, match="measured in float32, but this replica runs bfloat16"):
        build_scheduler(AppArgs.model_validate(args))


@pytest.mark.parametrize("section", ["ingress", "scheduler_deployment"])
def test_deployment_options_in_args_are_rejected_naming_the_section(section: str) -> None:
    args = demo_args()
    args[section] = {"num_replicas": 2}   # they belong in the YAML's `deployments:` section now
    msg = error_of(args)
    assert section in msg and "Extra inputs are not permitted" in msg


@pytest.mark.parametrize("name", ["demo", "opt13b", "opt66b", "opt175b"])
def test_shipped_deployments_sections_use_only_serve_keys(name: str) -> None:
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import DeploymentSchema, ServeDeploySchema

    raw = yaml.safe_load((ROOT / "config" / f"{name}.yaml").read_text())
    ServeDeploySchema.model_validate(raw)
    (app,) = raw["applications"]
    # Serve ignores unknown keys silently: a misspelt option would be dropped without a word.
    assert {d["name"] for d in app["deployments"]} == {"Ingress", "Engine"}
    for dep in app["deployments"]:
        assert set(dep) <= set(DeploymentSchema.model_fields), dep
        assert set(dep.get("autoscaling_config", {})) <= set(AutoscalingConfig.model_fields), dep
        scaling = dep.get("autoscaling_config")
        if scaling is not None:
            assert "num_replicas" not in dep
            assert dep["max_ongoing_requests"] >= scaling["target_ongoing_requests"]


@pytest.mark.parametrize("policy,env", [("passive", {"OMP_WAIT_POLICY": "PASSIVE"}),
                                        ("active", {"OMP_WAIT_POLICY": "ACTIVE"}), (None, None)])
def test_omp_wait_policy_reaches_the_engine_replicas_environment(policy: str | None,
                                                                 env: dict[str, str] | None) -> None:
    args = demo_args()
    args["parallel"]["omp_wait_policy"] = policy
    options = AppArgs.model_validate(args).engine_deployment_defaults()["ray_actor_options"]
    assert options.get("runtime_env") == (None if env is None else {"env_vars": env})


def test_omp_wait_policy_is_one_of_openmps() -> None:
    args = demo_args()
    args["parallel"]["omp_wait_policy"] = "spin"
    msg = error_of(args)
    assert "omp_wait_policy" in msg and "'passive' or 'active'" in msg


def test_in_process_cuda_model_gets_its_gpus_on_the_replica() -> None:
    args = demo_args()
    args["model"]["device"] = "cuda"
    args["parallel"].update(num_gpus=1)
    args["profile"]["path"] = "config/profiles/opt-125m-gpu-tp1-pp1.json"   # not measured: waived
    args["drain"] = {"tpot_s": 0.01}   # the drain's default TPOT comes from that profile
    parsed = AppArgs.model_validate(args, context={"require_profile": False})
    defaults = parsed.engine_deployment_defaults()
    assert defaults["ray_actor_options"] == {"num_cpus": 0, "num_gpus": 1}
    assert defaults["placement_group_bundles"] == [{"CPU": 0.01, "GPU": 1.0}]


def test_pipeline_bundles_reserve_each_stage_with_its_tp_gpus() -> None:
    args = demo_args()
    args["model"]["device"] = "cuda"
    args["parallel"].update(tensor_parallel_size=2, pipeline_parallel_size=2, num_gpus=4, worker_cpus=1)
    args["profile"]["path"] = "config/profiles/opt-125m-gpu-tp2-pp2.json"   # not measured: waived
    args["drain"] = {"tpot_s": 0.01}
    parsed = AppArgs.model_validate(args, context={"require_profile": False})
    assert parsed.placement_group_bundles() == [
        {"CPU": 0.01}, {"CPU": 2.0, "GPU": 2.0}, {"CPU": 2.0, "GPU": 2.0}]
    assert "num_gpus" not in parsed.engine_deployment_defaults()["ray_actor_options"]


def test_stage_resources_pin_each_stage_bundle_to_a_node() -> None:
    args = demo_args()
    args["parallel"].update(pipeline_parallel_size=2, worker_cpus=0.5,
                            stage_resources=[{"node_a": 0.001}, {"node_b": 0.001}])
    parsed = AppArgs.model_validate(args)
    assert parsed.placement_group_bundles() == [
        {"CPU": 0.01}, {"CPU": 0.5, "node_a": 0.001}, {"CPU": 0.5, "node_b": 0.001}]


@pytest.mark.parametrize("update,words", [
    ({"pipeline_parallel_size": 2, "stage_resources": [{"node_a": 1}]},
     "stage_resources has 1 entries; it needs one per pipeline stage (pipeline_parallel_size=2)"),
    ({"pipeline_parallel_size": 2, "stage_resources": [{"node_a": 1}, {"GPU": 1}]},
     "stage_resources[1] names ['GPU']"),
    ({"pipeline_parallel_size": 2, "stage_resources": [{"node_a": 1}, {"node_b": 0}]},
     "stage_resources[1]['node_b'] must be > 0, got 0"),
    ({"stage_resources": [{"node_a": 1}]}, "the model runs inside the Engine replica: pin it with replica_bundle"),
])
def test_stage_resources_it_cannot_honour_are_refused(update: dict[str, object], words: str) -> None:
    args = demo_args()
    args["parallel"].update(update)
    assert words in error_of(args)


def test_profile_tp_mismatch_is_reported_when_the_file_is_present() -> None:
    args = demo_args()
    args["parallel"].update(tensor_parallel_size=2)
    with pytest.warns(ProfileMismatchWarning, match="measured with tp=1, but this config has tp=2"):
        parsed = AppArgs.model_validate(args)
    assert parsed.parallel.uses_pipeline


def test_temperature_below_epsilon_is_greedy() -> None:
    from fastserve.server.protocol import CompletionRequest

    req = CompletionRequest(model="m", prompt="x", temperature=1e-30)
    assert req.to_sampling(16).temperature == 0.0


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


@pytest.mark.parametrize("path", sorted((ROOT / "config").glob("*.yaml")), ids=lambda p: p.name)
def test_configs_bound_beyond_loopback_require_an_api_key(path: Path) -> None:
    raw = yaml.safe_load(path.read_text())
    host = str((raw.get("http_options") or {}).get("host", "127.0.0.1"))
    for app in raw.get("applications") or []:
        server = (app.get("args") or {}).get("server") or {}
        assert _is_loopback(host) or server.get("require_api_key") is True, \
            f"{path.name} binds {host} without server.require_api_key"


def test_require_api_key_refuses_to_start_without_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastserve.config_server import API_KEY_ENV, ServerArgs

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(ValueError, match="require_api_key is set but no API key"):
        ServerArgs(require_api_key=True).resolved_api_key()
    assert ServerArgs(require_api_key=True, api_key="k").resolved_api_key() == "k"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert ServerArgs(require_api_key=True).resolved_api_key() == "from-env"


def test_one_engine_spec_is_built_from_the_args_with_the_pipeline_waits_in_config() -> None:
    parsed = AppArgs.model_validate(demo_args())
    spec = parsed.engine_spec()
    kv = parsed.kv_cache
    assert (spec.model.num_device_blocks, spec.model.num_host_blocks, spec.model.block_size) == (
        kv.num_device_blocks, kv.num_host_blocks, kv.block_size)
    assert spec.timeouts == PipelineTimeouts()   # today's values are the defaults
    args = demo_args()
    args["pipeline"] = {"tp_timeout_s": 7.5, "channel_buffer_bytes": 1 << 20}
    waits = AppArgs.model_validate(args).engine_spec().timeouts
    assert waits.tp_timeout_s == 7.5 and waits.channel_buffer_bytes == 1 << 20
    args["pipeline"] = {"tp_timout_s": 1.0}
    with pytest.raises(ValidationError, match="tp_timout_s"):
        AppArgs.model_validate(args)
    # The bounds are the dataclass's own (declared once, in fastserve.worker.spec).
    args["pipeline"] = {"tp_timeout_s": 0}
    with pytest.raises(ValidationError, match=r"pipeline\.tp_timeout_s\n  Input should be greater than 0"):
        AppArgs.model_validate(args)
    args["pipeline"] = {"channel_buffer_bytes": 512}
    with pytest.raises(ValidationError, match="greater than or equal to 1024"):
        AppArgs.model_validate(args)


def test_the_race_config_matches_the_vllm_peer_it_is_raced_against() -> None:
    """config/race-vllm.yaml: vLLM's batch limit (--max-num-seqs 16) and KV memory (4 GiB)."""
    raw = yaml.safe_load((ROOT / "config" / "race-vllm.yaml").read_text())
    args = AppArgs.model_validate(raw["applications"][0]["args"])
    hf = args.model.hf_config()
    block_bytes = 2 * hf.num_hidden_layers * args.kv_cache.block_size * hf.hidden_size * 4   # K and V, fp32
    assert args.scheduler.max_batch_size == 16
    assert 4 * 2**30 - block_bytes < args.kv_cache.num_device_blocks * block_bytes <= 4 * 2**30


def test_pools_sized_by_memory_as_vllm_sizes_its_kv_space() -> None:
    # OPT-125M in fp32: 2 (K, V) × 12 layers × 12 heads × 64 × 4 B = 73,728 B per token,
    # 1,179,648 B per 16-token block: 1 GiB buys 910 blocks, 2.5 GiB 2,275.
    args = demo_args()
    kv = args["kv_cache"]
    del kv["num_device_blocks"], kv["num_host_blocks"]
    kv["device_memory_gib"], kv["host_memory_gib"] = 1, 2.5
    parsed = AppArgs.model_validate(args)
    assert (parsed.kv_cache.num_device_blocks, parsed.kv_cache.num_host_blocks) == (910, 2275)
    assert parsed.engine_spec().model.num_device_blocks == 910
    # Replicas get the GiB, not this machine's count, and work it out again where they run.
    raw = parsed.replica_args()
    assert "num_device_blocks" not in raw["kv_cache"] and raw["kv_cache"]["device_memory_gib"] == 1
    assert AppArgs.model_validate(raw).kv_cache == parsed.kv_cache


def test_memory_sized_pool_follows_the_dtype_this_machine_resolves(monkeypatch: pytest.MonkeyPatch) -> None:
    args = demo_args()
    args["model"]["dtype"] = "auto"
    del args["kv_cache"]["num_device_blocks"]
    args["kv_cache"]["device_memory_gib"] = 1
    counts = {}
    for bf16 in (True, False):
        monkeypatch.setattr("fastserve.config_model.cpu_has_bf16", lambda bf16=bf16: bf16)
        counts[bf16] = AppArgs.model_validate(args).kv_cache.num_device_blocks
    assert counts == {True: 1820, False: 910}


def test_a_pool_sized_twice_is_refused_naming_both() -> None:
    args = demo_args()
    args["kv_cache"]["device_memory_gib"] = 1
    msg = error_of(args)
    assert "set num_device_blocks or device_memory_gib, not both" in msg and "got 256 and 1" in msg


@pytest.mark.parametrize("key,value,words", [
    ("tensor_parallel_size", 0, "Input should be greater than or equal to 1"),
    ("worker_cpus", 0, "Input should be greater than 0"),
    ("transport", "grpc", "Input should be 'compiled' or 'actor'"),
    ("max_inflight", 0, "Input should be greater than or equal to 1"),
])
def test_the_parallel_sections_bounds_are_the_data_planes_own(key: str, value: object, words: str) -> None:
    args = demo_args()
    args["parallel"][key] = value
    assert f"parallel.{key}\n  {words}" in error_of(args)


def test_the_parallel_section_is_parallel_spec_plus_the_replicas_own_knobs() -> None:
    assert ParallelArgs().spec() == ParallelSpec()      # one declaration, one set of defaults
    args = demo_args()
    args["parallel"].update(pipeline_parallel_size=2, transport="actor", worker_cpus=0.5, num_gpus=0)
    spec = AppArgs.model_validate(args).parallel.spec()
    assert spec == ParallelSpec(pipeline_parallel_size=2, transport="actor", worker_cpus=0.5)
    assert type(spec) is ParallelSpec                   # the replica's knobs stay in the replica
