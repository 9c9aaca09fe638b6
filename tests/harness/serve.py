"""Starting a real server for integration tests: a private Ray head (``ray start --head --block``,
small object store, explicit CPUs and ports) and ``serve run`` on a copy of a config that differs
only in ``http_options.port`` (a free port, so a test never collides with a server on 8000).
Teardown stops exactly the processes it started, walking their process trees: ``ray stop`` would
also kill every other Ray on the machine. ``private_ray_head`` alone is for a test that starts its own
command on the head (``fastserve serve MODEL_DIR --address ...``); ``serve_run`` alone runs an app on a
cluster the test started itself (``tests.harness.ray_nodes``).

Also the dummy-OPT config most integration tests serve (``dummy_opt_yaml``), its tokenizer and
the Engine deployment options: no test module imports another.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from fastserve.config_server import API_KEY_ENV
from fastserve.tokenizer import Tokenizer
from fastserve.worker import ports

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MODEL = "opt-125m"
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
RAY_CPUS = "8"
OBJECT_STORE_BYTES = "200000000"
STARTUP_TIMEOUT_S = 240.0
#: How often Ray's workers report metrics to their node's agent (Ray's default is 10 s).
METRICS_REPORT_MS = "500"
REQUEST_TIMEOUT_S = 180.0


# ---- the server: ray start + serve run, torn down by process tree -----------------------------

def free_port() -> int:
    """A loopback port for a test server (``fastserve.worker.ports``: not one Ray may take meanwhile)."""
    return ports.free_port("127.0.0.1")


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, start time) of every process we can see."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        table[int(entry)] = (int(fields[1]), fields[19])
    return table


def process_tree(root: int) -> dict[int, str]:
    """``root`` and all its descendants: pid -> start time (to never signal a reused pid)."""
    table = _proc_table()
    out, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        if pid in table and pid not in out:
            out[pid] = table[pid][1]
            frontier += [p for p, (ppid, _) in table.items() if ppid == pid]
    return out


def signal_all(pids: dict[int, str], sig: int) -> None:
    """Send ``sig`` to each of ``pids`` that is still the process recorded (same start time)."""
    table = _proc_table()
    for pid, started in pids.items():
        if table.get(pid, (0, ""))[1] == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def alive(pids: dict[int, str]) -> list[int]:
    """Those of ``pids`` still running (not reused, not zombies)."""
    table = _proc_table()
    running = []
    for pid, started in pids.items():
        if table.get(pid, (0, ""))[1] != started:
            continue
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z":
                running.append(pid)
        except OSError:
            pass
    return running


def stop_tree(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM a process and all its descendants, SIGKILL what outlives ``grace_s``."""
    pids = process_tree(proc.pid)
    signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    pids.update(process_tree(proc.pid))   # anything started meanwhile
    signal_all(pids, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@dataclass
class Server:
    base: str
    log: Path
    ray_address: str

    def url(self, path: str) -> str:
        return self.base + path


def greedy_completion(srv: Server, prompt: str, max_tokens: int, model: str = MODEL) -> list[int]:
    """The token ids of one greedy, fixed-length ``/v1/completions`` answer."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    resp = httpx.post(srv.url("/v1/completions"), headers=AUTH, json=body, timeout=REQUEST_TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    ids: list[int] = resp.json()["choices"][0]["token_ids"]
    return ids


def wait_for(what: str, check: Callable[[], bool], timeout: float, log: Path) -> None:
    """Poll ``check`` each second until it holds; past ``timeout`` fail with ``log``'s tail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(1.0)
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
    raise AssertionError(f"{what} not within {timeout:.0f} s; log tail:\n{tail}")


@dataclass
class RayHead:
    """A private Ray head: its address and the environment its clients run with."""

    address: str
    env: dict[str, str]


@contextlib.contextmanager
def private_ray_head(tmp: Path) -> Iterator[RayHead]:
    """``ray start --head --block`` on free ports (log in ``tmp/ray.log``), stopped afterwards by
    process tree; ``env`` points clients at it (``RAY_ADDRESS``) with the test API key."""
    gcs = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", API_KEY_ENV: API_KEY, "RAY_ADDRESS": f"127.0.0.1:{gcs}",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "RAY_metrics_report_interval_ms": METRICS_REPORT_MS}
    ray_log = tmp / "ray.log"
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
         "--num-cpus", RAY_CPUS, "--object-store-memory", OBJECT_STORE_BYTES, "--include-dashboard", "false",
         "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port())],
        cwd=ROOT, env=env, stdout=ray_log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for("ray start", lambda: "--block" in ray_log.read_text(errors="replace"), 90, ray_log)
        yield RayHead(f"127.0.0.1:{gcs}", env)
    finally:
        stop_tree(head, grace_s=10)
        # `ray start` recorded our head as this machine's current cluster; a later plain
        # `serve run` would try to join it (what `ray stop` cleans up, for our cluster only).
        current = Path("/tmp/ray/ray_current_cluster")
        with contextlib.suppress(OSError):
            if current.read_text().strip() == f"127.0.0.1:{gcs}":
                current.unlink()


@contextlib.contextmanager
def serve_app(tmp: Path, config: dict[str, Any], health_path: str = "/health", model: str = MODEL) -> Iterator[Server]:
    """A private Ray head and ``serve run`` of ``config`` (on a free port), stopped afterwards;
    ready once ``model`` answers a first completion."""
    with private_ray_head(tmp) as head, serve_run(tmp, config, head, health_path, model) as srv:
        yield srv


@contextlib.contextmanager
def serve_run(tmp: Path, config: dict[str, Any], head: RayHead, health_path: str = "/health",
              model: str = MODEL) -> Iterator[Server]:
    """``serve run`` of ``config`` (on a free port) on the running cluster ``head`` names, stopped
    afterwards by process tree; ready once ``model`` answers a first completion."""
    http = free_port()
    config = copy.deepcopy(config)
    # One fixed GEMM path in every process of the app: tests compare tokens across processes, and
    # the stage workers of a pipeline would otherwise each time the paths at once on two cores,
    # disturbing one another (the measured choice has its own tests: test_gemm_choice).
    for app in config["applications"]:
        args = app.get("args", {})
        if "model" in args:   # our AppArgs (Ray Serve LLM's apps carry theirs under llm_configs)
            args.setdefault("engine", {}).setdefault("gemm_choice", "fixed")
    config["http_options"]["port"] = http
    config_path = tmp / "config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    serve_log = tmp / "serve.log"
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = subprocess.Popen([str(BIN / "serve"), "run", str(config_path)], cwd=ROOT, env=head.env,
                                     stdout=serve_log.open("wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        srv = Server(f"http://127.0.0.1:{http}", serve_log, head.address)
        wait_for(health_path, lambda: httpx.get(srv.url(health_path), timeout=5).status_code == 200,
                 STARTUP_TIMEOUT_S, serve_log)

        def scheduler_ready() -> bool:
            resp = httpx.post(srv.url("/v1/completions"), headers=AUTH, timeout=REQUEST_TIMEOUT_S,
                              json={"model": model, "prompt": "warm up", "max_tokens": 1})
            return resp.status_code == 200
        wait_for("a first completion", scheduler_ready, STARTUP_TIMEOUT_S, serve_log)
        yield srv
    finally:
        if proc is not None:
            stop_tree(proc, grace_s=5)


#: The OPT tokenizer the dummy-OPT servers use (``config/opt125m-dummy.yaml``).
TOK = Tokenizer.default()


def dummy_opt_yaml() -> dict[str, Any]:
    """``config/opt125m-dummy.yaml`` parsed: the dummy-OPT server most integration tests run."""
    raw: dict[str, Any] = yaml.safe_load((ROOT / "config" / "opt125m-dummy.yaml").read_text())
    return raw


def engine_options(config: dict[str, Any]) -> dict[str, Any]:
    """The Engine deployment's entry in the config's Serve ``deployments:`` section."""
    (options,) = [d for d in config["applications"][0]["deployments"] if d["name"] == "Engine"]
    return options
