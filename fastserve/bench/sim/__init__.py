"""The simulator: paper-scale replays through the real scheduler and KV manager (no Ray, no torch).

``simulate(requests, profile, SimSetup(...))`` is the entry point; ``cost`` (profile → seconds),
``pipeline`` (stages and PCIe as timed resources), ``simulator`` (the event loop), ``configs``
(defaults from a profile's serving section), ``paper_profiles`` (the paper-scale profile JSONs).
"""

from fastserve.bench.sim.configs import CPU_PROFILE, OPT_2_7B_PROFILE, PAPER_PROFILES, SimSetup, build_configs, simulate
from fastserve.bench.sim.cost import CostModel
from fastserve.bench.sim.simulator import KVTimeline, SimOptions, SimResult, SimStalled, Simulator

__all__ = [
    "CPU_PROFILE",
    "OPT_2_7B_PROFILE",
    "PAPER_PROFILES",
    "CostModel",
    "KVTimeline",
    "SimOptions",
    "SimResult",
    "SimSetup",
    "SimStalled",
    "Simulator",
    "build_configs",
    "simulate",
]
