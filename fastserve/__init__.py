"""FastServe on Ray: an OpenAI-compatible LLM server with skip-join MLFQ scheduling and proactive
KV-cache swapping.

Rooms, lowest first (imports flow downwards only): ``kernels`` (device code), ``worker`` (the data
plane: stage runner, KV store, model code, sampler, pipeline), the control plane's shared modules
beside ``scheduler`` and ``kv`` (policy and KV manager: no torch, ray or cupy), ``engine`` (engine
core, its asyncio loop, the Engine replica), ``server`` (HTTP, OpenAI wire format, ingress), and
``bench`` (workloads, load client, simulator, benchmarks). ``main`` builds the Serve application,
``cli`` is the ``fastserve`` command. Importing this package imports nothing else.
"""
