"""Integration fixtures: a private local Ray instance per test module, always shut down hard.

Sized for a 2-core CI box: 8 logical CPUs (actors reserve logical CPUs, not cores), a 200 MB
object store instead of Ray's 7.5 GB default, no dashboard, token auth off. ``address="local"``
starts a fresh instance even when another engineer's ``ray start`` cluster runs on the machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

RAY_LOGICAL_CPUS = 8
RAY_OBJECT_STORE_BYTES = 200 * 1024 * 1024


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if ray.is_initialized():  # a previous module's instance that was not shut down
        ray.shutdown()
    ray.init(address="local", num_cpus=RAY_LOGICAL_CPUS, object_store_memory=RAY_OBJECT_STORE_BYTES,
             include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        # Stops this driver's raylet, GCS and every worker it started: no actor outlives the module.
        ray.shutdown()
