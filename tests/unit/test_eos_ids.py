"""EOS ids as a set: read from generation_config.json (int or list), else config.json, else the
tokenizer; every id stops a job through the real Scheduler; chat template refusals are 400s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastserve.engine.offline import load_app_args
from fastserve.generation_config import eos_token_ids
from fastserve.scheduler.config import KVCacheConfig, SchedulerConfig
from fastserve.scheduler.job import JobRequest
from fastserve.scheduler.profile import Profile
from fastserve.scheduler.scheduler import Scheduler
from fastserve.server.ingress import OpenAIServer
from fastserve.server.ingress_requests import ServerContext
from fastserve.server.protocol import APIError
from fastserve.tokenizer import Tokenizer
from fastserve.worker.messages import SamplingParams, StepOutput
from tests.harness.tokenizers import LLAMA3_END_OF_TEXT, LLAMA3_EOT, LLAMA3_STYLE, require_smollm2

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_EOS = frozenset({LLAMA3_END_OF_TEXT, LLAMA3_EOT})
ORDINARY = 42          # a token id that is no EOS
PROMPT = (10, 11, 12)
MAX_TOKENS = 8
PROFILE = Profile.from_dict({
    "t_init": {"prompt_lens": [8, 64], "seconds": [0.5, 1.0]},
    "t_dec": {"batch_sizes": [1, 16], "seconds": [1.0, 2.0]},
})


def _write(folder: Path, name: str, body: dict[str, object]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(body))


def test_the_fixture_generation_config_names_two_eos_ids() -> None:
    tok = Tokenizer.from_dir(LLAMA3_STYLE)
    assert tok.eos_token_id == LLAMA3_EOT
    assert eos_token_ids([LLAMA3_STYLE], None, tok.eos_token_id) == FIXTURE_EOS


def test_fallbacks_config_json_then_the_tokenizer(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    _write(tmp_path, "config.json", {"eos_token_id": [5, 6]})
    assert eos_token_ids([tmp_path], config, 9) == frozenset({5, 6})
    _write(tmp_path, "generation_config.json", {"eos_token_id": 7})
    assert eos_token_ids([tmp_path], config, 9) == frozenset({7})
    _write(tmp_path, "generation_config.json", {"eos_token_id": None})
    _write(tmp_path, "config.json", {})
    assert eos_token_ids([tmp_path], config, 9) == frozenset({9})
    with pytest.raises(ValueError, match="no eos_token_id in generation_config.json of"):
        eos_token_ids([tmp_path], config, None)


def test_a_bad_eos_value_is_named(tmp_path: Path) -> None:
    _write(tmp_path, "generation_config.json", {"eos_token_id": ["</s>"]})
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id must be a token id or "
                                         r"a list of them, got \['</s>'\]"):
        eos_token_ids([tmp_path], None, None)


def test_demo_and_opt_configs_resolve_their_eos_sets() -> None:
    require_smollm2()
    assert load_app_args(ROOT / "config" / "demo.yaml").model.eos_token_ids() == frozenset({2})
    assert load_app_args(ROOT / "config" / "opt125m-dummy.yaml").model.eos_token_ids() == frozenset({2})


def test_finish_reason_stops_on_every_eos_id_unless_ignore_eos() -> None:
    p = SamplingParams(max_tokens=MAX_TOKENS)
    assert [p.finish_reason(t, 1, FIXTURE_EOS) for t in (LLAMA3_END_OF_TEXT, LLAMA3_EOT, ORDINARY)] == \
        ["stop", "stop", None]
    ignoring = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [ignoring.finish_reason(t, 1, FIXTURE_EOS) for t in (LLAMA3_END_OF_TEXT, LLAMA3_EOT)] == [None, None]


def test_every_eos_id_stops_a_job_through_the_scheduler() -> None:
    tok = Tokenizer.from_dir(LLAMA3_STYLE)
    eos = eos_token_ids([LLAMA3_STYLE], None, tok.eos_token_id)
    s = Scheduler(SchedulerConfig(), KVCacheConfig(block_size=4, num_device_blocks=64, num_host_blocks=64),
                  PROFILE, eos_token_ids=eos)
    tokens = {"end-of-text": LLAMA3_END_OF_TEXT, "eot": LLAMA3_EOT, "ordinary": ORDINARY,
              "ignores-eos": LLAMA3_EOT}
    for job_id in tokens:
        sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=job_id == "ignores-eos")
        s.add(JobRequest(job_id, PROMPT, sampling), now=0.0)
    plan = s.schedule(0.0)
    assert plan is not None and sorted(e.job_id for e in plan.entries) == sorted(tokens)
    deltas = s.update(plan, StepOutput(plan.step_id, dict(tokens), {"total": 1.0}), 1.0)
    finished = {d.job_id: d.finish_reason for d in deltas if d.finished}
    assert finished == {"end-of-text": "stop", "eot": "stop"}
    assert sorted(s.state.jobs) == ["ignores-eos", "ordinary"]


def test_a_template_refusal_is_a_400_naming_the_reason() -> None:
    tok = Tokenizer.from_dir(LLAMA3_STYLE)
    server = OpenAIServer(ServerContext("m", tok, tok.vocab_size, 256), backend=None)  # type: ignore[arg-type]
    body = {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    with pytest.raises(APIError) as refused:
        server.preparer.prepare_chat(json.dumps(body).encode())
    assert (refused.value.status, refused.value.param) == (400, "messages")
    assert refused.value.message == ("the model's chat template refused these messages: TemplateError: "
                                     "Conversation roles must alternate, but messages 0 and 1 are both user")

