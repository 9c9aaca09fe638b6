"""The server room: the OpenAI HTTP API in front of the engine replicas.

The OpenAI protocol (``protocol``, ``protocol_output``, ``request_fields``, ``choices``), the
requests' limits (``request_limits``), the OpenAI logic of a request (``ingress``,
``ingress_requests``), the FastAPI routes (``http_api``, ``tokenize_api``),
the ``Ingress`` Serve deployment (``ingress_deployment``), the ``Engine`` deployment's request
router (``routing``), the app's own ``/metrics`` (``metrics_export``) and the Ray Serve LLM
adapter (``llm_server``).

Imports flow ``fastserve.server → fastserve.engine → fastserve.scheduler, fastserve.kv``; the shared top level
(``fastserve.config*``, ``fastserve.errors``, ``fastserve.tokenizer``, ...) is open to every room.
"""
