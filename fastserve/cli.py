"""The ``fastserve`` command: one entry point for what a user runs.

``serve CONFIG.yaml`` runs a Serve config (as ``serve run``, with a local cluster when none is given);
``serve MODEL_DIR`` serves a Hugging Face folder in one command, as ``vllm serve`` does (profiled at
first start and cached, KV sized from memory); ``offline``, ``profile``, ``convert-model`` and
``plan`` hand their arguments to the modules that own them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastserve.config_folder import FolderServeArgs


#: (flags, FolderServeArgs field, type, help); None here, so the schema's default applies.
FOLDER_OPTIONS: tuple[tuple[tuple[str, ...], str, Callable[[str], Any], str], ...] = (
    (("--tp", "--tensor-parallel-size"), "tensor_parallel_size", int, "tensor-parallel ranks"),
    (("--pp", "--pipeline-parallel-size"), "pipeline_parallel_size", int, "pipeline stages"),
    (("--port",), "port", int, "HTTP port (default 8000)"),
    (("--host",), "host", str, "HTTP bind address (default 127.0.0.1)"),
    (("--served-model-name", "--name"), "name", str, "the model id clients send (default: the folder's name)"),
    (("--dtype",), "dtype", str, "auto | float32 | float16 | bfloat16 (default auto)"),
    (("--max-model-len",), "max_model_len", int, "prompt + output cap (default: the model's context)"),
    (("--kv-cache-space-gib",), "kv_cache_space_gib", float, "CPU: GiB of KV cache (default 4, as vLLM's CPU build)"),
    (("--swap-space-gib",), "swap_space_gib", float, "GiB of host KV to swap to (default 4, as vLLM)"),
    (("--gpu-memory-utilization",), "gpu_memory_utilization", float, "GPU: fraction of memory to use (default 0.9)"),
    (("--tool-call-parser",), "tool_call_parser", str,
     "auto | hermes | llama3_json | pythonic | none: how tool calls are read (default auto: from the template)"),
)
#: A local cluster's defaults: no token auth on 127.0.0.1, workers at normal priority (Ray's nice 15
#: slows the model), no tokenizer thread pool beside torch's.
LOCAL_CLUSTER_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_worker_niceness": "0", "TOKENIZERS_PARALLELISM": "false"}


def _serve(args: argparse.Namespace, extra: Sequence[str]) -> None:
    target = Path(args.target)
    if target.is_dir():
        _serve_folder(args, extra)
        return
    if not target.is_file():
        raise SystemExit(f"fastserve serve: {str(target)!r} is neither a config file nor a model folder")
    folder_only = [flags[0] for flags, field, *_ in FOLDER_OPTIONS if getattr(args, field) is not None]
    folder_only += [flag for flag, on in (("--profile", args.profile), ("--cache-dir", args.cache_dir),
                                          ("--device", args.device), ("--dry-run", args.dry_run)) if on]
    if folder_only:
        raise SystemExit(f"fastserve serve: {', '.join(folder_only)} apply to a model folder, not to a config "
                         f"file ({str(target)!r}): set them in the config")
    # Serve's CLI owns the YAML's semantics (applications, deployments: overrides, runtime_env).
    _serve_run(target, args.address, extra)


def _serve_run(config: Path, address: str, extra: Sequence[str]) -> None:
    serve_bin = shutil.which("serve", path=str(Path(sys.executable).parent)) or shutil.which("serve")
    if serve_bin is None:
        raise SystemExit("fastserve serve: Ray Serve's `serve` command is not installed (pip install 'ray[serve]')")
    os.execv(serve_bin, [serve_bin, "run", "--address", address, str(config), *extra])


def _say(line: str) -> None:
    print(f"fastserve serve: {line}", flush=True)


def _serve_folder(args: argparse.Namespace, extra: Sequence[str]) -> None:
    from pydantic import ValidationError

    from fastserve.config import AppArgs
    from fastserve.config_folder import FolderServeArgs, app_args, cache_dir, serve_config, slug

    if extra:
        raise SystemExit(f"fastserve serve: unknown options for a model folder: {' '.join(extra)}")
    given = {field: value for _, field, *_ in FOLDER_OPTIONS if (value := getattr(args, field)) is not None}
    try:
        folder = FolderServeArgs.model_validate({**given, "model_dir": Path(args.target),
                                                 "device": _device(args.device)})
        cache = Path(args.cache_dir) if args.cache_dir else cache_dir()
        gpu_memory = _gpu_memory(folder)   # before the profiler loads the model here
        profile = Path(args.profile).resolve() if args.profile else _cached_profile(folder, cache)
        app = app_args(folder, profile, _torch_threads(folder), _gpu_blocks(folder, profile, gpu_memory))
        AppArgs.model_validate(app)   # every refusal here, before a cluster starts
    except (ValidationError, ValueError) as exc:
        raise SystemExit(f"fastserve serve: {exc}") from None
    path = cache / "apps" / f"{slug(folder.served_name)}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    import yaml

    path.write_text(yaml.safe_dump(serve_config(folder, app), sort_keys=False))
    _say(f"wrote the Serve config {path} (edit it and run `fastserve serve {path}` to reuse it)")
    if args.dry_run:
        return
    if args.address == "local":
        for name, value in LOCAL_CLUSTER_ENV.items():
            os.environ.setdefault(name, value)
    _say(f"serving {folder.served_name} on http://{folder.host}:{folder.port}/v1")
    _serve_run(path, args.address, ())


def _device(requested: str | None) -> str:
    if requested not in (None, "auto"):
        return str(requested)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _torch_threads(folder: FolderServeArgs) -> int | None:
    """On a CPU every core this process may use (Ray gives a replica that reserves no CPU one thread)."""
    return len(os.sched_getaffinity(0)) if folder.device == "cpu" else None


def _cached_profile(folder: FolderServeArgs, cache: Path) -> Path:
    import json

    from fastserve.config_folder import hardware_key, profile_cache_name, profile_grid
    from fastserve.engine import profiler
    from fastserve.kernels.cpu_features import cpu_name
    from fastserve.worker.executor import resolve_dtype
    from fastserve.worker.messages import DEFAULT_BLOCK_SIZE

    dtype = resolve_dtype(folder.dtype, folder.device)
    hardware = (hardware_key(cpu_name(), _torch_threads(folder)) if folder.device == "cpu"
                else hardware_key(profiler.hardware_name(folder.device)))
    config_json = (folder.model_dir / "config.json").read_bytes()
    path = cache / "profiles" / profile_cache_name(folder.served_name, config_json, hardware, dtype,
                                                   folder.tensor_parallel_size, folder.pipeline_parallel_size)
    if path.is_file():
        _say(f"profile {path} (cached)")
        return path
    prompt_lens, batch_sizes = profile_grid(folder)
    if folder.world_size > 1:
        _say("the profiler runs the model in this process: iteration times are measured at TP 1, PP 1 "
             "(the scheduler warns that the profile's layout is not the config's)")
    _say(f"profiling {folder.model_dir.name} on {hardware} in {dtype} (first start only; cached at {path})")
    result = profiler.profile(str(folder.model_dir), dtype, folder.device, DEFAULT_BLOCK_SIZE, prompt_lens,
                              batch_sizes, folder.profile_repeats, progress=lambda line: _say(f"  {line}"))
    result["model"] = folder.served_name
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(result, indent=2) + "\n")
    partial.replace(path)   # a profile interrupted halfway is never read as cached
    return path


def _gpu_memory(folder: FolderServeArgs) -> tuple[int, int] | None:
    """(free, total) GPU bytes, read before this process loads a model: less its CUDA context, as
    the replica's will be."""
    if folder.device != "cuda":
        return None
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(free), int(total)


def _gpu_blocks(folder: FolderServeArgs, profile: Path, gpu_memory: tuple[int, int] | None) -> int | None:
    """On a GPU, the device pool sized vLLM's way (``config_folder.gpu_kv_blocks``); None on a CPU."""
    if gpu_memory is None:
        return None
    import json

    from fastserve.config_folder import app_args, gpu_kv_blocks
    from fastserve.config_model import ModelArgs
    from fastserve.worker.messages import DEFAULT_BLOCK_SIZE

    memory = json.loads(profile.read_text()).get("memory")
    if memory is None:
        raise ValueError(f"profile {profile} has no GPU memory figures (weights, activations): "
                         "measure it on this GPU (leave out --profile)")
    free, total = gpu_memory
    model = ModelArgs.model_validate(app_args(folder, profile, None)["model"])
    return gpu_kv_blocks(total, free, folder.gpu_memory_utilization, memory["weight_bytes"],
                         memory["activation_bytes"], folder.world_size, model.kv_bytes_per_block(DEFAULT_BLOCK_SIZE))


def _passthrough(main: Callable[[list[str]], None]) -> Callable[[argparse.Namespace, Sequence[str]], None]:
    return lambda _args, extra: main(list(extra))


def _offline(argv: list[str]) -> None:
    from fastserve.engine import offline
    offline.main(argv)


def _profile(argv: list[str]) -> None:
    from fastserve.engine import profiler
    profiler.main(argv)


def _convert(argv: list[str]) -> None:
    from fastserve import model_folder
    model_folder.main(argv)


def _plan(argv: list[str]) -> None:
    from fastserve import plan
    sys.exit(plan.main(argv))


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="fastserve", description=__doc__.splitlines()[0])
    commands = top.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model folder, or run a Serve config (config/*.yaml)")
    serve.add_argument("target", metavar="CONFIG.yaml|MODEL_DIR",
                       help="a Serve config file (e.g. config/demo.yaml) or a Hugging Face model folder")
    serve.add_argument("--address", default="local", help="the Ray cluster (default: start a local one)")
    for flags, field, kind, help_text in FOLDER_OPTIONS:
        serve.add_argument(*flags, dest=field, type=kind, default=None, help=help_text)
    serve.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                       help="where the model runs (default auto: the GPU if torch sees one)")
    serve.add_argument("--profile", default=None, help="use this profile JSON instead of the cached one")
    serve.add_argument("--cache-dir", default=None,
                       help="where profiles and configs are kept (default $FASTSERVE_CACHE_DIR or ~/.cache/fastserve)")
    serve.add_argument("--dry-run", action="store_true", help="profile and write the config, do not serve")
    serve.set_defaults(run=_serve)
    for name, main, help_text in (("offline", _offline, "the engine in process on a config's args"),
                                  ("profile", _profile, "measure t_init and t_dec into a profile"),
                                  ("convert-model", _convert, "convert the demo model's GGUF wheel"),
                                  ("plan", _plan, "a GPU config's memory per GPU and node, dry run")):
        sub = commands.add_parser(name, help=help_text, add_help=False)
        sub.set_defaults(run=_passthrough(main))
    return top


def main(argv: Sequence[str] | None = None) -> None:
    args, extra = parser().parse_known_args(argv)
    args.run(args, extra)


if __name__ == "__main__":
    main()
