"""Bad input is refused naming the value: a request by ``fastserve.errors.validate_request`` (with the
code the HTTP layer answers by), a malformed plan by the executor, which stays usable."""

from __future__ import annotations

import pytest

from fastserve.errors import ErrorCode, InvalidRequest, validate_request
from fastserve.worker.executor import InProcessExecutor
from fastserve.worker.messages import BatchEntry, BatchPlan, SamplingParams
from fastserve.worker.model.config import OPTConfig
from fastserve.worker.spec import ModelSpec

TINY = OPTConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 ffn_dim=64, max_position_embeddings=64, name="tiny")
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def executor() -> InProcessExecutor:
    return InProcessExecutor(ModelSpec(TINY, num_device_blocks=16, num_host_blocks=4, block_size=4))


@pytest.mark.parametrize("prompt, sampling, message, code", [
    ([], GREEDY, "prompt is empty", ErrorCode.INVALID_REQUEST),
    (list(range(2, 63)), GREEDY, "prompt of 61 tokens \\+ max_tokens 4 exceeds the model's context of 64",
     ErrorCode.CONTEXT_LENGTH_EXCEEDED),
    ([2, 5, 100], GREEDY, "token id 100 is outside the vocabulary \\[0, 100\\)", ErrorCode.INVALID_REQUEST),
    ([2, -1], GREEDY, "token id -1 is outside", ErrorCode.INVALID_REQUEST),
    ([2, 5], SamplingParams(max_tokens=0), "max_tokens must be >= 1, got 0", ErrorCode.INVALID_REQUEST),
])
def test_bad_requests_are_rejected_by_name(prompt: list[int], sampling: SamplingParams, message: str,
                                           code: ErrorCode) -> None:
    with pytest.raises(InvalidRequest, match=message) as exc:
        validate_request(prompt, sampling, TINY.vocab_size, TINY.max_position_embeddings)
    assert exc.value.code is code


@pytest.mark.parametrize("entry, message", [
    (BatchEntry("x", (), 0, (0,), True, GREEDY), "job x: entry has no tokens"),
    (BatchEntry("x", (2, 3), -1, (0, 1), True, GREEDY), "start_pos must be >= 0, got -1"),
    (BatchEntry("x", (2, 3), 4, (0, 1), False, GREEDY), "a decode step feeds one token, got 2"),
    (BatchEntry("x", tuple(range(2, 11)), 0, (0, 1), True, GREEDY), "2 blocks cannot hold 9 tokens"),
])
def test_malformed_plans_are_rejected(executor: InProcessExecutor, entry: BatchEntry, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        executor.execute(BatchPlan(0, (entry,)))
    _still_usable(executor)


def _still_usable(executor: InProcessExecutor) -> None:
    out = executor.execute(BatchPlan(1, (BatchEntry("ok", (2, 7, 9), 0, (3,), True, GREEDY),)))
    assert set(out.tokens) == {"ok"} and 0 <= out.tokens["ok"] < TINY.vocab_size
