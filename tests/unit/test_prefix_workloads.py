"""The prefix-sharing workloads (``fastserve.bench.prefix_workloads``) and their use by ``fastserve.bench.race``:
conversations send turns in order with the whole history (the server's own answers included), a
shared system prompt leads every request, and the hit rate comes from the server's usage."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from fastserve.bench import prefix_workloads as PW
from fastserve.bench import prompts as P
from fastserve.bench import race
from fastserve.bench.client import HEALTH_PATH, ClientConfig


def chat_server(model: str, seen: list[list[dict[str, str]]]) -> httpx.MockTransport:
    """Answers every chat request with the words "a<k> b<k>" (k = requests so far) and usage
    that reports the messages it saw before as cached (one token a word, to keep counts exact)."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == HEALTH_PATH:
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": model}]})
        body = json.loads(request.content)
        assert body["model"] == model and body["stream"]
        messages = body["messages"]
        words = sum(len(m["content"].split()) for m in messages)
        cached = sum(len(m["content"].split()) for m in messages[:-1])
        k = len(seen)
        seen.append(messages)
        events: list[dict[str, Any]] = [{"choices": [{"delta": {"content": f"a{k} "}}]},
                                        {"choices": [{"delta": {"content": f"b{k}"}}]},
                                        {"choices": [{"delta": {}, "finish_reason": "stop"}]},
                                        {"choices": [], "usage": {
                                            "prompt_tokens": words, "completion_tokens": 2,
                                            "prompt_tokens_details": {"cached_tokens": cached}}}]
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle)


def test_a_conversation_sends_each_turn_after_the_answer_with_its_whole_history() -> None:
    samples = P.load_sharegpt_prompts()
    convs = PW.conversations(samples, 2, 3, rate=1000.0, seed=0, max_tokens=8)
    assert [len(c.user_turns) for c in convs] == [3, 3]
    assert len({t for c in convs for t in c.user_turns}) == 6      # no prompt used twice
    assert convs == PW.conversations(samples, 2, 3, rate=1000.0, seed=0, max_tokens=8)
    seen: list[list[dict[str, str]]] = []
    config = ClientConfig(base_url="http://127.0.0.1:1", mode="chat", progress=False,
                          system_prompt="be brief")
    records = asyncio.run(PW.run_conversations(convs, config, chat_server("m", seen)))
    assert [(r["conversation"], r["turn"]) for r in records] == [
        ("conv0", 0), ("conv0", 1), ("conv0", 2), ("conv1", 0), ("conv1", 1), ("conv1", 2)]
    assert all(r["status"] == "ok" and r["output_tokens"] == 2 for r in records)
    for conv in convs:
        mine = [m for m in seen if m[1]["content"] == conv.user_turns[0]]
        assert [len(m) for m in mine] == [2, 4, 6]                  # system, then 2 per turn
        last = mine[-1]
        assert last[0] == {"role": "system", "content": "be brief"}
        assert [m["content"] for m in last[1::2]] == list(conv.user_turns)
        assert last[2]["role"] == "assistant" and last[2]["content"].startswith("a")
        assert mine[1][:3] == mine[2][:3]                           # turn 3 repeats turn 2's
    rate = PW.hit_rate(records)
    assert rate == sum(r["cached_tokens"] for r in records) / sum(r["prompt_tokens"] for r in records)
    assert 0 < rate < 1


def test_shared_system_prompt_is_long_and_deterministic() -> None:
    samples = P.load_sharegpt_prompts()
    text = PW.shared_system_prompt(samples, words=300, seed=1)
    assert text == PW.shared_system_prompt(samples, words=300, seed=1)
    assert len(text.split()) == 300 + 8     # the 8-word preamble
    with pytest.raises(ValueError, match="need 6000 prompts"):
        PW.conversations(samples, 3000, 2, 1.0, 0, 8)


@pytest.mark.parametrize("workload", ["multi-turn", "shared-system"])
def test_race_runs_the_prefix_workloads(workload: str) -> None:
    args = race.parse_args(["--ours", "http://127.0.0.1:1", "--peer", "http://127.0.0.1:2",
                            "--rates", "100", "--num-prompts", "4", "--mode", "chat",
                            "--workload", workload, "--turns", "2", "--slo", "10"])
    seen: dict[str, list[list[dict[str, str]]]] = {"ours": [], "peer": []}
    result = race.race(args, {name: chat_server(f"{name}-m", seen[name]) for name in seen})
    assert result["workload"] == workload
    for name in race.SYSTEMS:
        point = result["points"][name]["100.0"]
        assert point["completed"] == 4 and point["failed"] == 0
        assert point["prefix_hit_rate"] is not None and point["prefix_hit_rate"] > 0
    if workload == "shared-system":
        assert all(m[0]["role"] == "system" and len(m[0]["content"].split()) > 400
                   for m in seen["ours"])
    else:
        # Two one-message warm-up requests, then two conversations of two turns.
        assert sorted(len(m) for m in seen["ours"]) == [1, 1, 1, 1, 3, 3]
