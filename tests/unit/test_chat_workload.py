"""Real-EOS chat workloads: the cap rule, the chat body, the output-length summary, and the race in
chat mode against scripted servers that stop at their own EOS."""

from __future__ import annotations

import asyncio
import json
import zlib

import httpx
import pytest

from fastserve.bench import chat as C
from fastserve.bench import prompts as P
from fastserve.bench import race
from fastserve.bench import workloads as W
from fastserve.bench.client import HEALTH_PATH, ClientConfig, request_body, run_requests

#: The scripted model stops after this many tokens unless max_tokens comes first.
SCRIPTED_EOS_AFTER = 3


def test_cap_is_reference_clipped_to_floor_ceiling_and_context() -> None:
    cap = C.EosCap()
    assert cap.cap(100, prompt_len=50) == 100
    assert cap.cap(3, prompt_len=50) == 16                      # the floor
    assert cap.cap(3000, prompt_len=1000) == 2048 - 1000 - 64   # the room the context leaves
    assert cap.cap(100, prompt_len=2040) == 1                   # no room: still one token
    assert C.EosCap(output_scale=0.5).cap(101, prompt_len=10) == 51   # ceil(50.5)
    assert C.EosCap(max_tokens=40).cap(100, prompt_len=10) == 40
    assert C.EosCap(context_len=8192, template_margin=0).cap(3000, prompt_len=1000) == 3000
    with pytest.raises(ValueError, match="output_scale"):
        C.EosCap(output_scale=0)
    with pytest.raises(ValueError, match="below min_tokens"):
        C.EosCap(min_tokens=32, max_tokens=8)


def test_cap_requests_keeps_prompts_and_arrivals() -> None:
    reqs = P.text_requests(P.load_sharegpt_prompts(), 30, rate=2.0, seed=1)
    capped = C.cap_requests(reqs, C.EosCap())
    assert [(r.request_id, r.arrival_s, r.prompt_len, r.prompt_text) for r in capped] == \
        [(r.request_id, r.arrival_s, r.prompt_len, r.prompt_text) for r in reqs]
    assert [r.output_len for r in capped] == \
        [max(1, min(max(r.output_len, 16), 2048 - r.prompt_len - 64)) for r in reqs]


def test_chat_body_has_one_user_message_and_no_ignore_eos() -> None:
    req = W.Request("req-3", 0.0, 12, 7, "What is the capital of France?")
    body = request_body(req, "smol", ClientConfig(mode="chat"))
    assert body == {"model": "smol", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 7, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    sampled = request_body(req, "smol", ClientConfig(mode="chat", temperature=0.7, system_prompt="Be brief.", seed=4))
    assert sampled["messages"] == [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "What is the capital of France?"}]
    assert sampled["seed"] == 4 + zlib.crc32(b"req-3") and sampled["temperature"] == 0.7
    assert "ignore_eos" not in sampled
    # The paper's mode is unchanged: exact lengths through ignore_eos.
    completion = request_body(req, "smol", ClientConfig(prompt_mode="text"))
    assert completion["ignore_eos"] is True and completion["prompt"] == req.prompt_text


def test_output_lengths_summary_exact() -> None:
    records = [{"status": "ok", "output_tokens": n, "finish_reason": f}
               for n, f in ((10, "stop"), (40, "length"), (20, "stop"), (30, "stop"))]
    records.append({"status": "http_error", "output_tokens": 0, "finish_reason": None})
    summary = C.output_lengths(records)
    assert summary == C.OutputLengths(count=4, mean=25.0, p50=25.0, p90=37.0, p99=pytest.approx(39.7),
                                      max=40, stop_share=0.75, length_share=0.25)
    assert C.format_output_lengths(summary) == ("output tokens: n 4, mean 25.0, P50 25, P90 37, P99 40, max 40; "
                                                "finished by stop 75 %, by length 25 %")
    empty = C.output_lengths(records[-1:])
    assert empty.count == 0 and empty.to_dict()["mean"] is None


def scripted_chat_server(model: str, bodies: list[bytes]) -> httpx.MockTransport:
    """A chat server that stops at EOS after SCRIPTED_EOS_AFTER tokens (or at max_tokens): a
    role-only first chunk, one content chunk per token, an empty finish chunk, then usage."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == HEALTH_PATH:
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": model}]})
        assert request.url.path == C.CHAT_COMPLETIONS_PATH
        bodies.append(request.content)
        body = json.loads(request.content)
        assert body["model"] == model and "ignore_eos" not in body
        n = min(body["max_tokens"], SCRIPTED_EOS_AFTER)
        reason = "stop" if n < body["max_tokens"] else "length"
        events = [{"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
        events += [{"choices": [{"delta": {"content": "x"}, "finish_reason": None}]} for _ in range(n)]
        events.append({"choices": [{"delta": {}, "finish_reason": reason}]})
        events.append({"choices": [], "usage": {"completion_tokens": n}})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle)


def test_chat_records_keep_received_length_and_finish_reason() -> None:
    reqs = [W.Request("req-0", 0.0, 10, 2, "a"), W.Request("req-1", 0.0, 10, 20, "b")]
    config = ClientConfig(base_url="http://127.0.0.1:1", mode="chat", progress=False)
    records = asyncio.run(run_requests(reqs, config, scripted_chat_server("m", [])))
    assert [(r["output_tokens"], r["finish_reason"], r["status"]) for r in records] == \
        [(2, "length", "ok"), (SCRIPTED_EOS_AFTER, "stop", "ok")]
    # Token times are the content chunks only (the role-only first chunk is no token).
    assert [len(r["token_times"]) for r in records] == [2, SCRIPTED_EOS_AFTER]


def test_chat_race_sends_identical_bodies_and_reports_output_lengths(capsys: pytest.CaptureFixture[str]) -> None:
    args = race.parse_args(["--ours", "http://127.0.0.1:1", "--peer", "http://127.0.0.1:2", "--rates", "50,100",
                            "--num-prompts", "4", "--slo", "10", "--mode", "chat", "--eos-min-tokens", "4",
                            "--eos-max-tokens", "6", "--system-prompt", "Be brief."])
    sent: dict[str, list[bytes]] = {"ours": [], "peer": []}
    result = race.race(args, {name: scripted_chat_server(f"{name}-model", sent[name]) for name in race.SYSTEMS})
    assert len(sent["ours"]) == len(sent["peer"]) == 8 + race.DEFAULT_WARMUP
    ours = sorted(b.replace(b'"ours-model"', b'"M"') for b in sent["ours"])
    peer = sorted(b.replace(b'"peer-model"', b'"M"') for b in sent["peer"])
    assert ours == peer
    assert all(4 <= json.loads(b)["max_tokens"] <= 6 for b in sent["ours"])
    assert result["mode"] == "chat" and result["eos_cap"]["max_tokens"] == 6
    for name in race.SYSTEMS:
        for rate in ("50.0", "100.0"):
            assert result["points"][name][rate]["output_lengths"] == {
                "count": 4, "mean": 3.0, "p50": 3.0, "p90": 3.0, "p99": 3.0, "max": 3,
                "stop_share": 1.0, "length_share": 0.0}
    race.print_table(result)
    assert "output tokens received (completion_tokens)" in capsys.readouterr().out
