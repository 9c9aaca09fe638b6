"""The prefix cache at the HTTP layer: ``usage.prompt_tokens_details.cached_tokens`` and
``job_stats.cached_tokens`` from the job's stats, and ``POST /reset_prefix_cache`` only when
``server.allow_reset_prefix_cache`` is on."""

from __future__ import annotations

from dataclasses import replace

from fastserve.config_server import ServerArgs
from fastserve.scheduler.job import Finish, TokenDelta
from tests.harness.http_backends import STATS, ScriptedBackend, post, sse_events


def backend(cached: int) -> ScriptedBackend:
    stats = replace(STATS, cached_tokens=cached)
    return ScriptedBackend(lambda req: [TokenDelta(req.job_id, (5,), Finish("length", stats))])


BODY = {"model": "opt-125m", "prompt": "hello there", "max_tokens": 1}


def test_usage_reports_the_prompt_tokens_the_cache_served() -> None:
    resp = post(backend(8), "/v1/completions", BODY).json()
    assert resp["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    assert resp["job_stats"]["cached_tokens"] == 8
    events = sse_events(post(backend(8), "/v1/completions", {
        **BODY, "stream": True, "stream_options": {"include_usage": True}}).text)
    assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    # Nothing served from the cache: the field is left out (vLLM's default shape).
    assert "prompt_tokens_details" not in post(backend(0), "/v1/completions", BODY).json()["usage"]


def test_reset_prefix_cache_is_offered_only_when_allowed() -> None:
    assert ServerArgs().allow_reset_prefix_cache is False
    off = backend(0)
    assert post(off, "/reset_prefix_cache", {}).status_code == 404 and off.resets == 0
    on = backend(0)
    resp = post(on, "/reset_prefix_cache", {}, allow_reset_prefix_cache=True)
    assert resp.status_code == 200 and resp.json() == {"reset_blocks": 0} and on.resets == 1



class UnansweredReset(ScriptedBackend):
    """An engine replica did not answer the broadcast within ``server.reset_timeout_s``."""

    async def reset_prefix_cache(self) -> dict[str, object]:
        raise TimeoutError("Timed out waiting for broadcast results.")


def test_a_reset_some_replica_does_not_answer_is_a_503_naming_it() -> None:
    resp = post(UnansweredReset(lambda req: []), "/reset_prefix_cache", {}, allow_reset_prefix_cache=True)
    assert resp.status_code == 503
    assert resp.json()["error"]["message"] == "reset_prefix_cache: Timed out waiting for broadcast results."
