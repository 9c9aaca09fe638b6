"""The stage workers' environment: the compiled-graph channel size, and the Engine replica's
OpenMP wait policy (``parallel.omp_wait_policy``, set in the replica's ``runtime_env``) passed on,
so the processes that run the model wait the way the config says."""

from __future__ import annotations

from fastserve.worker.placement import worker_runtime_env
from fastserve.worker.spec import PipelineTimeouts


def test_the_replicas_omp_wait_policy_reaches_the_stage_workers() -> None:
    replica_env = {"OMP_WAIT_POLICY": "PASSIVE", "HOME": "/root"}
    assert worker_runtime_env(PipelineTimeouts(channel_buffer_bytes=2048), replica_env) == {
        "env_vars": {"OMP_WAIT_POLICY": "PASSIVE", "RAY_CGRAPH_buffer_size_bytes": "2048"}}


def test_without_a_policy_the_workers_keep_libgomps_default() -> None:
    assert worker_runtime_env(PipelineTimeouts(), {"HOME": "/root"}) == {
        "env_vars": {"RAY_CGRAPH_buffer_size_bytes": str(64 * 1024 * 1024)}}
