"""The server room: the OpenAI HTTP API in front of the engine replicas, the ``Ingress`` deployment,
the Engine's router, ``/metrics`` and the Ray Serve LLM adapter. Imports flow server → engine."""
