"""The engine room: ``core`` (``EngineCore``, the one step every driver runs), ``async_engine`` (the
server's loop around it), ``replica`` (the ``Engine`` Serve deployment), ``delivery`` (the token
channel), what a replica records (``metrics``, ``request_timing``, ``step_stats``, ``stats_log``),
and the Serve-less tools ``offline`` and ``profiler``. Nothing here imports ``fastserve.server``.
"""
