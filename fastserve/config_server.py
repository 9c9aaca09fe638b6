"""The ``server`` section of a config: the ingress's HTTP behaviour.

``ServerArgs``: the API key (``FASTSERVE_API_KEY`` wins), request size and OpenAI field limits,
timeouts, what callers may ask for (``priority``, ``/reset_prefix_cache``), metrics sampling and
the delivery channels. The ingress reads it through ``fastserve.server.ingress_requests.ServerContext``.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field

from fastserve.config_model import Strict

#: Environment variable that supplies (or overrides) the API key.
API_KEY_ENV = "FASTSERVE_API_KEY"
#: The format a model writes tool calls in, by vLLM's ``--tool-call-parser`` names; ``auto``
#: reads it off the folder's chat template (``fastserve.server.tools.resolve_tool_call_parser``),
#: ``none`` refuses ``tool_choice: auto`` (vLLM without ``--enable-auto-tool-choice``).
ToolCallParserName = Literal["auto", "hermes", "llama3_json", "pythonic", "none"]


class ServerArgs(Strict):
    """HTTP behaviour of the ingress."""

    #: Bearer token clients must send; None = open (env FASTSERVE_API_KEY, if set, wins).
    api_key: str | None = None
    #: ``Retry-After`` seconds sent with a 429 when the admission queue is full.
    retry_after_s: int = Field(default=1, ge=0)
    #: Refuse to start without an API key (set it for every config that binds a non-loopback host).
    require_api_key: bool = False
    #: Largest request body accepted; larger ones get a 413 before being read whole.
    max_request_bytes: int = Field(default=1 << 20, ge=1024)
    #: OpenAI ``stop``: how many strings a request may send, and how long each may be.
    max_stop_strings: int = Field(default=16, ge=1)
    max_stop_string_chars: int = Field(default=256, ge=1)
    #: OpenAI ``n``: most choices one request may ask for (each is its own job).
    max_choices: int = Field(default=16, ge=1)
    #: A request still generating after this long ends with a timeout error (and its job is
    #: aborted), whatever the client asked for.
    request_timeout_s: float = Field(default=600.0, gt=0)
    #: Longest a request waits for its job's first output (admission and first iteration); past
    #: it the job is dropped and the client gets a 429 with Retry-After.
    admission_timeout_s: float = Field(default=60.0, gt=0)
    #: Honour the request ``priority`` field (it moves a job's MLFQ entry level, so any caller
    #: could jump the queue); off by default.
    allow_priority: bool = False
    #: Offer ``POST /reset_prefix_cache`` (vLLM's): every cached KV block not in use is
    #: forgotten, on every engine replica (benchmarks, or after a weight change). Off by
    #: default, and to stay off in any config that binds beyond loopback: any caller could empty
    #: the cache of every user.
    allow_reset_prefix_cache: bool = False
    #: How long ``POST /reset_prefix_cache`` waits for every engine replica to answer.
    reset_timeout_s: float = Field(default=30.0, gt=0)
    #: How long ``/health`` waits for an engine replica to answer before reporting 503.
    health_timeout_s: float = Field(default=5.0, gt=0)
    #: How often each engine replica records its state gauges and mirrored counters (Ray
    #: then exports them every ``RAY_metrics_report_interval_ms``).
    metrics_sample_interval_s: float = Field(default=0.5, gt=0)
    #: How often each engine replica logs one stats line (running, waiting, swapped, KV use,
    #: prefix-cache hit rate, prompt and generation tokens/s), as vLLM logs every 5 s; 0: never.
    stats_log_interval_s: float = Field(default=5.0, ge=0)
    #: How ``tool_choice: auto`` outputs are read for calls (``ToolCallParserName``).
    tool_call_parser: ToolCallParserName = "auto"
    #: Deliver tokens on one channel per ingress replica and engine replica, one message per
    #: step (``fastserve.engine.delivery``), instead of on each job's own stream (one message per job per step).
    delivery_channels: bool = True
    #: How long an ingress replica waits for a new delivery channel to open; one that did not is
    #: retried after as long (its jobs use their own streams meanwhile).
    channel_open_timeout_s: float = Field(default=5.0, gt=0)
    #: An engine replica ends a delivery channel that had no job on it for this long (the
    #: ingress opens another with its next job there). An open channel is a request in flight,
    #: and Serve's graceful shutdown of a replica waits for every one: this bounds how long an
    #: idle channel keeps a drained replica alive after its last stream.
    channel_idle_close_s: float = Field(default=2.0, gt=0)
    #: How long ``GET /metrics`` waits for each node's Ray metrics agent.
    metrics_agent_timeout_s: float = Field(default=5.0, gt=0)

    def resolved_api_key(self) -> str | None:
        key = os.environ.get(API_KEY_ENV) or self.api_key
        if key is None and self.require_api_key:
            raise ValueError(f"server.require_api_key is set but no API key is configured: set "
                             f"server.api_key or the {API_KEY_ENV} environment variable")
        return key
