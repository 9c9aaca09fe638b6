"""The ``server`` section of a config: the ingress's HTTP behaviour (``ServerArgs``)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field

from fastserve.config_model import Strict

API_KEY_ENV = "FASTSERVE_API_KEY"
#: vLLM's ``--tool-call-parser`` names; ``auto`` reads the chat template, ``none`` refuses ``auto``.
ToolCallParserName = Literal["auto", "hermes", "llama3_json", "pythonic", "none"]


class ServerArgs(Strict):
    #: Bearer token; None = open (env FASTSERVE_API_KEY, if set, wins).
    api_key: str | None = None
    #: ``Retry-After`` of a 429.
    retry_after_s: int = Field(default=1, ge=0)
    require_api_key: bool = False
    #: Larger bodies get a 413 before being read whole.
    max_request_bytes: int = Field(default=1 << 20, ge=1024)
    max_stop_strings: int = Field(default=16, ge=1)
    max_stop_string_chars: int = Field(default=256, ge=1)
    #: OpenAI ``n``; each choice is its own job.
    max_choices: int = Field(default=16, ge=1)
    #: A request still generating after this long ends with a timeout error.
    request_timeout_s: float = Field(default=600.0, gt=0)
    #: Wait for a job's first output; past it the job is dropped with a 429.
    admission_timeout_s: float = Field(default=60.0, gt=0)
    #: Honour ``priority`` (any caller could jump the MLFQ queue).
    allow_priority: bool = False
    #: Offer vLLM's ``POST /reset_prefix_cache``; off beyond loopback (any caller could empty it).
    allow_reset_prefix_cache: bool = False
    reset_timeout_s: float = Field(default=30.0, gt=0)
    health_timeout_s: float = Field(default=5.0, gt=0)
    #: Engine replicas' gauge sampling (Ray exports every ``RAY_metrics_report_interval_ms``).
    metrics_sample_interval_s: float = Field(default=0.5, gt=0)
    #: One stats line per engine replica, as vLLM's; 0: never.
    stats_log_interval_s: float = Field(default=5.0, ge=0)
    tool_call_parser: ToolCallParserName = "auto"
    #: Tokens on one channel per ingress and engine replica (``fastserve.engine.delivery``).
    delivery_channels: bool = True
    #: A channel that did not open in time is retried after as long.
    channel_open_timeout_s: float = Field(default=5.0, gt=0)
    #: An idle channel ends after this long, so it never holds a draining replica.
    channel_idle_close_s: float = Field(default=2.0, gt=0)
    metrics_agent_timeout_s: float = Field(default=5.0, gt=0)

    def resolved_api_key(self) -> str | None:
        key = os.environ.get(API_KEY_ENV) or self.api_key
        if key is None and self.require_api_key:
            raise ValueError(f"server.require_api_key is set but no API key is configured: set "
                             f"server.api_key or the {API_KEY_ENV} environment variable")
        return key
