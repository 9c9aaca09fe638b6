"""Everything a worker makes on a GPU names its device: ``cuda:{index}``, never the bare ``cuda``.

A bare ``cuda`` means whichever device is current on the calling thread, and CUDA's current device
is per thread: Ray runs compiled-graph steps on a thread of its own, where nothing set it, and a
process that sees every GPU would then put the step's tensors on device 0. Checked on this CPU:

- no worker or kernel module spells a device-less CUDA call (a scan of their source);
- ``build_runner`` hands the model, the KV store and the device it makes current ``cuda:{index}``
  (constructed with a fake index, CUDA's calls recorded instead of made);
- a step makes its worker's device current on whichever thread runs it;
- a bare ``cuda`` given to a KV store or staging buffers is pinned to the device current then.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from fastserve.worker import executor
from fastserve.worker.graphs import GraphSettings
from fastserve.worker.messages import BatchPlan
from fastserve.worker.model.shard import StageShard
from fastserve.worker.parallel import device_name, explicit_device
from fastserve.worker.spec import ModelSpec
from fastserve.worker.stage import StageRunner
from tests.harness.tiny_jobs import TINY

ROOT = Path(__file__).resolve().parents[2]
#: Where the data plane makes tensors, streams and pools.
SCANNED = [ROOT / "fastserve" / "worker", ROOT / "fastserve" / "kernels"]
#: Calls that land on the current device when they name none.
DEVICELESS = {
    "torch.device('cuda')": re.compile(r"""torch\.device\(\s*["']cuda["']\s*\)"""),
    "device='cuda'": re.compile(r"""device\s*=\s*["']cuda["']"""),
    ".cuda()": re.compile(r"\.cuda\(\s*\)"),
    ".to('cuda')": re.compile(r"""\.to\(\s*["']cuda["']"""),
    "a stream, sync or pool of the current device": re.compile(
        r"torch\.cuda\.(Stream|current_stream|default_stream|synchronize|graph_pool_handle)\(\s*\)"),
    "a graph captured on torch's default capture stream": re.compile(r"torch\.cuda\.graph\((?![^)]*stream=)"),
}


def test_no_worker_module_makes_anything_on_a_device_less_cuda() -> None:
    found = []
    for folder in SCANNED:
        for path in sorted(folder.rglob("*.py")):
            text = path.read_text()
            for what, pattern in DEVICELESS.items():
                for match in pattern.finditer(text):
                    line = text.count("\n", 0, match.start()) + 1
                    found.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert found == []


def test_the_scan_sees_each_spelling() -> None:
    samples = ["torch.device('cuda')", 'x = torch.zeros(3, device="cuda")', "t.cuda()", 't.to("cuda")',
               "torch.cuda.current_stream()", "torch.cuda.graph(g, pool=p)"]
    for sample, pattern in zip(samples, DEVICELESS.values(), strict=True):
        assert pattern.search(sample), sample
    assert not any(p.search('torch.device("cuda", 3); torch.cuda.graph(g, stream=s)') for p in DEVICELESS.values())


def test_a_device_name_carries_its_index() -> None:
    assert device_name("cuda", 3) == "cuda:3"
    assert device_name("cpu", 0) == "cpu"
    with pytest.raises(ValueError, match="device must be one of"):
        device_name("tpu", 0)
    with pytest.raises(ValueError, match="device index must be >= 0, got -1"):
        device_name("cuda", -1)


def test_a_bare_cuda_is_pinned_to_the_device_current_then(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert explicit_device("cuda") == torch.device("cuda", 5)
    assert explicit_device("cuda:2") == torch.device("cuda", 2)
    assert explicit_device("cpu") == torch.device("cpu")


def test_build_runner_makes_everything_on_cuda_index(monkeypatch: pytest.MonkeyPatch) -> None:
    made: dict[str, Any] = {}

    class Model:
        num_local_kv_heads = TINY.num_attention_heads

    def build_stage(config: Any, shard: Any, dtype: str, device: str, *args: Any, **kw: Any) -> Model:
        made["model"] = device
        return Model()

    monkeypatch.setattr(executor, "build_stage", build_stage)
    monkeypatch.setattr(executor, "KVStore", lambda *args: made.setdefault("kv", args[-1]))
    monkeypatch.setattr(executor, "StageRunner", lambda model, kv, *args: (model, kv))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: made.setdefault("current", d))
    spec = ModelSpec(TINY, 8, 8, block_size=4, device="cuda")
    executor.build_runner(spec, TINY, StageShard.whole(TINY), device_index=3)
    assert made == {"current": "cuda:3", "model": "cuda:3", "kv": "cuda:3"}


class _CudaKV:
    """The KV store's face a swap-less step sees, claiming a CUDA device."""

    device = torch.device("cuda", 2)
    block_size = 4
    device_pool = torch.zeros(0)
    settles_lazily = False

    def wait_all(self) -> float:
        return 0.0

    def device_wait_s(self) -> float:
        return 0.0


def test_a_step_makes_its_device_current_on_the_thread_that_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("fastserve.worker.stage.StepBuffers", lambda device: None)
    runner = StageRunner(None, _CudaKV(), graphs=GraphSettings(enabled=False))  # type: ignore[arg-type]
    current: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append((threading.current_thread().name, d)))

    def step() -> None:
        runner.run(BatchPlan(0, (), (), ()), None, sample=False)

    thread = threading.Thread(target=step, name="ray-graph-thread")
    thread.start()
    thread.join()
    assert current == [("ray-graph-thread", torch.device("cuda", 2))]
