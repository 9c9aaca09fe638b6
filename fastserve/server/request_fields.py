"""Which request fields we honour and which we refuse: the decision table for every field that
vLLM's ``ChatCompletionRequest`` / ``CompletionRequest`` (and OpenAI's) define.

Honoured (declared on the request models in ``fastserve.server.protocol``): ``model``, ``prompt`` /
``messages``, ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``, ``logit_bias``, ``logprobs`` (chat: bool,
with ``top_logprobs``; completions: an int), ``n``, ``best_of`` (only 1 or n), ``stream``,
``stream_options``, ``skip_special_tokens``, ``spaces_between_special_tokens`` (only true: our
byte-level decode is the fast tokenizer's, which never inserts spaces), ``priority``,
``cache_salt``, ``return_token_ids``, ``include_stop_str_in_output``, ``truncate_prompt_tokens``,
``allowed_token_ids``, ``bad_words``, ``return_tokens_as_token_ids``,
``add_special_tokens`` (completions: default true; chat: on top of the template's, default
false); structured outputs (``response_format``, ``structured_outputs``, ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``, ``guided_decoding_backend``:
``fastserve.server.structured_request``); chat only: ``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``, ``tools``, ``tool_choice``,
``parallel_tool_calls`` (``fastserve.server.tools``; the table below still answers them on
completions, which has no tools).

Accepted because they change no output: ``HARMLESS`` (``user``, ``metadata``, ``store``,
``service_tier``).

Refused with a 400 naming the field, unless the value is the one that changes nothing
(``REFUSED``: field → the values that are no-ops):

| field | accepted as a no-op |
|---|---|
| ``tools`` (completions) | ``[]`` |
| ``tool_choice`` (completions) | ``"none"`` |
| ``parallel_tool_calls`` (completions) | — |
| ``functions``, ``function_call`` (OpenAI's deprecated forms of ``tools``) | — |
| ``echo`` (completions) | ``false`` |
| ``suffix`` (completions) | ``""`` |
| ``guided_whitespace_pattern``, ``structural_tag`` | — |
| ``prompt_logprobs`` | — |
| ``logits_processors``, ``vllm_xargs``, ``kv_transfer_params``, ``request_id``, ``prompt_embeds`` | — |
| ``use_beam_search`` | ``false`` |
| ``length_penalty`` | ``1.0`` (beam search only) |
| ``chat_template``, ``documents``, ``mm_processor_kwargs`` | — |
| ``reasoning_effort``, ``include_reasoning``, ``prediction``, ``modalities``, ``audio``, ``web_search_options`` | — |

``null`` is a no-op for every field. Any other field is refused as unknown (it might change the
output, and we would not know): a field we do not honour is never accepted and ignored.
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
    **{name: _NONE for name in ("prompt_logprobs", "logits_processors", "vllm_xargs",
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
