"""A Ray cluster of two nodes on this one machine, for tests that need more than one node.

``two_node_cluster`` starts a head (``ray start --head --block``) and a second raylet (``ray start
--address ... --block``), each advertising its own custom resource (``HEAD_RESOURCE``,
``WORKER_RESOURCE``) so a config can pin work to one of them, each with its own temp dir, free
ports, a small object store and explicit logical CPUs. ``TwoNodeCluster.kill_worker_node`` kills
the second node's raylet by its PID (and then whatever else that node's ``ray start`` had
started), as a crashed machine would lose it; ``start_worker_node`` starts it again (a new node
to Ray, with the same resource).

The GCS is told to health-check raylets every second and to give up after three misses, so a
killed node is declared dead within seconds rather than Ray's default ~15 s (a cluster-wide
setting of this test cluster only). Everything is stopped by process tree
(``tests.harness.serve.stop_tree``): a plain ``ray stop`` would stop every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fastserve.config_server import API_KEY_ENV
from tests.harness.serve import (
    API_KEY,
    BIN,
    METRICS_REPORT_MS,
    ROOT,
    RayHead,
    alive,
    free_port,
    process_tree,
    signal_all,
    stop_tree,
    wait_for,
)

HEAD_RESOURCE = "node_a"
WORKER_RESOURCE = "node_b"
#: Logical CPUs per node: actors reserve logical CPUs, not cores (replicas and workers a sliver).
NODE_CPUS = "4"
#: Ray's smallest object store is 75 MiB; what the tests send is small.
NODE_OBJECT_STORE_BYTES = "100000000"
#: The GCS's raylet health check: every second, three misses and the node is dead. A killed node's
#: port refuses at once, so the timeout only decides how slow a live raylet may answer: at 1 s a busy
#: 2-core box declared the restarted node dead, and Ray's head raylet then crashed on its channel.
HEALTH_CHECK_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "10000",
                    "RAY_health_check_failure_threshold": "3"}
START_TIMEOUT_S = 90.0
#: How long a killed node's ``ray start --block`` may take to notice and stop its other processes.
KILL_GRACE_S = 10.0
RAYLET_BINARY = "raylet/raylet"


@dataclass
class RayNode:
    """One ``ray start --block`` process and the node it runs."""

    resource: str
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class TwoNodeCluster:
    head: RayHead
    #: The nodes' temp dirs go here (short paths); their ``ray start`` logs under ``logs``.
    tmp: Path
    logs: Path
    nodes: list[RayNode] = field(default_factory=list)
    #: Worker nodes started so far (each gets its own temp dir and log).
    starts: int = 0

    @property
    def worker(self) -> RayNode:
        (node,) = [n for n in self.nodes if n.resource == WORKER_RESOURCE]
        return node

    def start_worker_node(self) -> RayNode:
        """``ray start --address`` with ``WORKER_RESOURCE``; returns once its ``ray start`` blocks
        (the caller waits for the GCS to list it: ``ray.nodes()``)."""
        self.starts += 1
        node = _start(self.tmp / f"b{self.starts}", self.logs / f"ray-b{self.starts}.log", WORKER_RESOURCE,
                      self.head.env, ["--address", self.head.address])
        self.nodes.append(node)
        return node

    def kill_worker_node(self) -> int:
        """SIGKILL the worker node's raylet (by PID), then whatever else its ``ray start`` started
        that outlives ``KILL_GRACE_S``; returns the raylet's PID."""
        node = self.worker
        pids = process_tree(node.proc.pid)   # before the kill: its children are reparented after
        (raylet,) = [pid for pid in pids if _is_raylet(pid)]
        os.kill(raylet, signal.SIGKILL)
        deadline = time.monotonic() + KILL_GRACE_S
        while alive(pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        signal_all(pids, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.proc.wait(timeout=KILL_GRACE_S)
        self.nodes.remove(node)
        return raylet


@contextlib.contextmanager
def two_node_cluster(logs: Path) -> Iterator[TwoNodeCluster]:
    """A head with ``HEAD_RESOURCE`` and a worker node with ``WORKER_RESOURCE`` (``ray start``
    logs in ``logs``), stopped afterwards by process tree, their temp dirs removed. Those are
    short paths of their own: Ray's socket paths must fit 107 bytes."""
    tmp = Path(tempfile.mkdtemp(prefix="fs2n-"))
    gcs = free_port()
    env = {**os.environ, **HEALTH_CHECK_ENV, "RAY_AUTH_MODE": "disabled", API_KEY_ENV: API_KEY,
           "RAY_ADDRESS": f"127.0.0.1:{gcs}", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "RAY_metrics_report_interval_ms": METRICS_REPORT_MS}
    cluster = TwoNodeCluster(RayHead(f"127.0.0.1:{gcs}", env), tmp, logs)
    failed = False
    try:
        cluster.nodes.append(_start(tmp / "a", logs / "ray-a.log", HEAD_RESOURCE, env, [
            "--head", "--port", str(gcs), "--include-dashboard", "false",
            "--ray-client-server-port", str(free_port())]))
        cluster.start_worker_node()
        yield cluster
    except BaseException:
        failed = True
        raise
    finally:
        for node in reversed(cluster.nodes):
            stop_tree(node.proc, grace_s=10)
        if failed:   # Ray's own logs (raylets, workers) stay for the post-mortem
            print(f"two-node cluster failed; Ray's logs under {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _start(temp_dir: Path, log: Path, resource: str, env: dict[str, str], role: list[str]) -> RayNode:
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--block", *role, "--node-ip-address", "127.0.0.1", "--num-cpus", NODE_CPUS,
         "--resources", json.dumps({resource: 1}), "--object-store-memory", NODE_OBJECT_STORE_BYTES,
         "--temp-dir", str(temp_dir), *_agent_ports(), "--disable-usage-stats"],
        cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    node = RayNode(resource, proc, log)
    try:
        wait_for(f"ray start ({resource})", lambda: _blocking(node), START_TIMEOUT_S, log)
    except BaseException:
        stop_tree(proc, grace_s=10)
        raise
    return node


def _agent_ports() -> list[str]:
    """Every port of the node's agents, given: one left to the agent makes the raylet wait for
    the agent's port file and abort past a fixed bound (seen once on this box under load:
    "Timed out waiting for file .../metrics_agent_port_..."), and two nodes on one machine must
    not share one anyway."""
    flags = ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
             "--runtime-env-agent-port")
    ports: list[int] = []
    while len(ports) < len(flags):   # distinct: free_port draws at random, and nothing is bound yet
        port = free_port()
        if port not in ports:
            ports.append(port)
    return [arg for flag, port in zip(flags, ports, strict=True) for arg in (flag, str(port))]


def _blocking(node: RayNode) -> bool:
    if node.proc.poll() is not None:
        raise AssertionError(f"ray start ({node.resource}) exited {node.proc.returncode}:\n"
                             f"{node.log.read_text(errors='replace')[-4000:]}")
    return "--block" in node.log.read_text(errors="replace")


def _is_raylet(pid: int) -> bool:
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return False
    return argv0.endswith(RAYLET_BINARY)
