"""Which request fields we honour and which we refuse, for every field vLLM's and OpenAI's
completion and chat requests define (the table, with why: docs/configs.md, "Request fields refused").

Honoured fields are declared on the request models (``fastserve.server.protocol``); ``HARMLESS`` ones
change no output; a ``REFUSED`` one passes only with a value that changes nothing, and ``null`` always
does. Any other field is refused as unknown: a field we do not honour is never accepted and ignored.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

HARMLESS = frozenset({"user", "metadata", "store", "service_tier"})

_NONE: tuple[Any, ...] = ()
_FALSE: tuple[Any, ...] = (False,)

#: field → values (besides null) that change nothing and are therefore accepted.
REFUSED: dict[str, tuple[Any, ...]] = {
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": _NONE, "functions": _NONE, "function_call": _NONE,
    "echo": _FALSE,
    "suffix": ("",),
    **{name: _NONE for name in ("guided_whitespace_pattern", "structural_tag")},
    **{name: _NONE for name in ("logits_processors", "vllm_xargs",
                                "kv_transfer_params", "request_id", "prompt_embeds")},
    "use_beam_search": _FALSE,
    "length_penalty": (1.0,),
    **{name: _NONE for name in ("chat_template", "documents", "mm_processor_kwargs", "reasoning_effort",
                                "include_reasoning", "prediction", "modalities", "audio",
                                "web_search_options")},
}


def refused_field(extra: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first field of ``extra`` (the request's undeclared fields) we refuse, with the
    message; None when every one is harmless or a no-op value."""
    for name, value in extra.items():
        if name in HARMLESS or value is None:
            continue
        if name in REFUSED:
            noop = REFUSED[name]
            if any(value == ok and type(value) is type(ok) for ok in noop):
                continue
            allowed = " or ".join(json.dumps(v) for v in (None, *noop))
            return name, f"{name} is not supported by this server (only {allowed} is accepted)"
        return name, f"unknown field '{name}': this server does not support it"
    return None
