"""Starting and stopping our Serve application for the real (HTTP) experiments.

Owns one ``serve run`` of a YAML derived from ``config/opt125m-dummy.yaml`` (or another base, such as
the real-model ``config/demo.yaml``): one application per policy,
each under its own route prefix (``/fcfs``, ``/skip_join_mlfq``), so a single Ray start serves every
baseline; on a free loopback port (never the demo's 8000, which other runs may hold), with a
private Ray instance (``--address local``) and Ray temp dir. The process is started in its own
session; on exit it gets SIGINT (Serve's clean shutdown), then SIGTERM and SIGKILL for its
process group if it lingers — only the processes this module started.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import yaml

from fastserve.bench.client import HEALTH_PATH
from fastserve.worker.ports import free_port

ROOT = Path(__file__).resolve().parents[3]
DEMO_YAML = ROOT / "config" / "opt125m-dummy.yaml"
SERVE_BIN = ROOT / ".venv" / "bin" / "serve"
LOOPBACK = "127.0.0.1"
READY_TIMEOUT_S = 240.0
POLL_S = 1.0
GRACE_S = 20.0
#: Ray's socket paths must stay short; the temp dir lives directly under the system temp dir.
RAY_TMP_PREFIX = "fsray-"


def multi_policy_config(policies: Sequence[str], port: int, base: Path = DEMO_YAML,
                        args_overrides: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The demo config with one application per policy, route prefix ``/<policy>``;
    ``args_overrides`` (section → settings) are merged into every application's ``args``."""
    return variant_config({p: {"scheduler": {"policy": p}} for p in policies}, port, base, args_overrides)


def variant_config(variants: Mapping[str, Mapping[str, Mapping[str, Any]]], port: int,
                   base: Path = DEMO_YAML,
                   args_overrides: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The demo config with one application per variant, route prefix ``/<name>``: every app's
    ``args`` get ``args_overrides`` (section → settings), then its own variant's."""
    raw = yaml.safe_load(base.read_text(encoding="utf-8"))
    raw.setdefault("http_options", {}).update({"host": LOOPBACK, "port": port})
    template = raw["applications"][0]
    apps = []
    for name, own in variants.items():
        app = copy.deepcopy(template)
        app["name"] = f"fastserve-{name}"
        app["route_prefix"] = f"/{name}"
        for overrides in (args_overrides or {}, own):
            for section, settings in overrides.items():
                app["args"].setdefault(section, {}).update(settings)
                if section == "kv_cache":
                    _blocks_replace_memory(app["args"]["kv_cache"], settings)
        apps.append(app)
    raw["applications"] = apps
    return raw


def _blocks_replace_memory(kv: dict[str, Any], settings: Mapping[str, Any]) -> None:
    """A block count an override sets replaces the base's memory size for that tier (the config
    refuses both)."""
    for tier in ("device", "host"):
        if settings.get(f"num_{tier}_blocks") is not None and f"{tier}_memory_gib" not in settings:
            kv.pop(f"{tier}_memory_gib", None)


def serve_env(ray_tmpdir: str) -> dict[str, str]:
    """The environment of a benchmark's ``serve run``: a cluster of its own (``RAY_TMPDIR``, no
    ``RAY_ADDRESS``), and our replicas at nice 0 as ``make serve`` runs them. Ray starts its
    workers at nice 15 (``RAY_worker_niceness``), so beside a peer and a load client at nice 0 on
    the same cores our model's threads would be the ones preempted (docs/facts.md). A caller's
    own ``RAY_worker_niceness`` wins."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": ray_tmpdir,
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.setdefault("RAY_worker_niceness", "0")
    env.pop("RAY_ADDRESS", None)
    return env


class ServeApps:
    """Context manager: ``serve run`` of one app per policy (or per named variant of the args:
    ``variants``, name → section → settings, in place of ``policies``); ``url(name)`` is its base URL."""

    def __init__(self, policies: Sequence[str], log_path: Path, ready_timeout_s: float = READY_TIMEOUT_S,
                 args_overrides: dict[str, dict[str, Any]] | None = None, base: Path = DEMO_YAML,
                 variants: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None) -> None:
        if variants is not None and policies:
            raise ValueError(f"give policies {list(policies)} or variants {list(variants)}, not both")
        self.variants = dict(variants) if variants is not None else {
            p: {"scheduler": {"policy": p}} for p in policies}
        self.policies = list(self.variants)
        self.base = base
        self.args_overrides = args_overrides
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.port = free_port(LOOPBACK)
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def url(self, policy: str) -> str:
        return f"http://{LOOPBACK}:{self.port}/{policy}"

    def __enter__(self) -> ServeApps:
        self._tmp = tempfile.TemporaryDirectory(prefix=RAY_TMP_PREFIX, ignore_cleanup_errors=True)
        config = Path(self._tmp.name) / "serve.yaml"
        raw = variant_config(self.variants, self.port, self.base, self.args_overrides)
        config.write_text(yaml.safe_dump(raw, sort_keys=False))
        env = serve_env(self._tmp.name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self._proc = subprocess.Popen([str(SERVE_BIN), "run", "--address", "local", str(config)], cwd=ROOT, env=env,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        pending = set(self.policies)
        while pending:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"serve run exited with {self._proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"apps {sorted(pending)} not healthy after {self.ready_timeout_s} s; "
                                   f"see {self.log_path}")
            for policy in list(pending):
                try:
                    if httpx.get(self.url(policy) + HEALTH_PATH, timeout=POLL_S).status_code == httpx.codes.OK:
                        pending.discard(policy)
                except httpx.HTTPError:
                    pass
            time.sleep(POLL_S)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            pgid = os.getpgid(proc.pid)
            for sig, target in ((signal.SIGINT, "leader"), (signal.SIGTERM, "group"), (signal.SIGKILL, "group")):
                try:
                    if target == "leader":
                        proc.send_signal(sig)
                    else:
                        os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=GRACE_S)
                    # The leader is gone; its group (Ray's daemons) may not be: end it too.
                    os.killpg(pgid, signal.SIGTERM)
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    pass
                break
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
