"""The engine room: what runs a model copy's step loop, and the Serve replica that holds it.

``core`` (``EngineCore``: one step, schedule → execute → update, that the server, the simulator
and the tests all drive), ``async_engine`` (``AsyncEngine``: the server's asyncio loop around the
core, with delivery to each job's sink, the watchdog, step statistics, recovery, and the
executor protocols),
``replica`` (``EngineReplica``, the ``Engine`` Serve deployment: one model copy), ``delivery``
(the channel a replica sends its steps' tokens on, and the ingress's end of it), ``metrics`` and
``request_timing`` (what a replica records), ``step_stats``, and the tools that run the same
engine without Serve: ``offline`` (one config in process) and ``profiler`` (the job profile).

Imports flow ``fastserve.server → fastserve.engine → fastserve.scheduler, fastserve.kv``: nothing here imports the
server room (``tests/unit/test_import_tower.py`` checks it).
"""
