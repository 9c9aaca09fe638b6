"""A model folder's ``generation_config.json`` sampling values, applied where a request omits them
(vLLM's default ``--generation-config auto``), and ``model.generation_config: vllm`` turning them off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastserve.config_model import ModelArgs
from fastserve.generation_config import GENERATION_CONFIG_FILE, SamplingDefaults, sampling_defaults
from fastserve.scheduler.job import Finish, JobRequest, TokenDelta
from tests.harness.http_backends import MODEL, STATS, ScriptedBackend, post

MODEL_VALUES = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                "max_new_tokens": 7, "do_sample": True, "eos_token_id": 2}
DEFAULTS = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, max_tokens=7)


def folder_with(tmp_path: Path, values: dict[str, object]) -> Path:
    (tmp_path / GENERATION_CONFIG_FILE).write_text(json.dumps(values))
    return tmp_path


def test_the_folders_sampling_values_are_read_by_their_vllm_names(tmp_path: Path) -> None:
    assert sampling_defaults([folder_with(tmp_path, MODEL_VALUES)]) == DEFAULTS


def test_no_file_or_no_sampling_keys_means_no_defaults(tmp_path: Path) -> None:
    assert sampling_defaults([tmp_path]) == SamplingDefaults()
    assert sampling_defaults([folder_with(tmp_path, {"eos_token_id": 2})]) == SamplingDefaults()


@pytest.mark.parametrize("key,value", [("temperature", "hot"), ("top_k", 2.5), ("max_new_tokens", True)])
def test_a_mistyped_value_names_the_file_and_key(tmp_path: Path, key: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"{GENERATION_CONFIG_FILE}: {key} must be"):
        sampling_defaults([folder_with(tmp_path, {key: value})])


def test_the_vllm_switch_turns_them_off(tmp_path: Path) -> None:
    folder = folder_with(tmp_path, MODEL_VALUES)
    (folder / "config.json").write_text(json.dumps({"model_type": "opt"}))
    args = ModelArgs.model_construct(name="m", config_path=str(folder), tokenizer_path="config/tokenizers/opt",
                                     model_path=None, generation_config="auto")
    assert args.sampling_defaults() == DEFAULTS
    assert args.model_copy(update={"generation_config": "vllm"}).sampling_defaults() == SamplingDefaults()


def one_token(req: JobRequest) -> list[TokenDelta]:
    return [TokenDelta(req.job_id, (5,), Finish("length", STATS))]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
])
def test_a_request_that_omits_them_samples_with_the_models_values(path: str, body: dict[str, object]) -> None:
    backend = ScriptedBackend(one_token)
    assert post(backend, path, body, sampling_defaults=DEFAULTS).status_code == 200
    s = backend.requests[0].sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty, s.max_tokens) == (0.6, 0.9, 20, 0.05,
                                                                                                1.1, 7)


def test_a_request_that_sets_them_keeps_its_own() -> None:
    backend = ScriptedBackend(one_token)
    body = {"model": MODEL, "prompt": "hi", "temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
            "repetition_penalty": 1.0, "max_tokens": 3}
    assert post(backend, "/v1/completions", body, sampling_defaults=DEFAULTS).status_code == 200
    s = backend.requests[0].sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty, s.max_tokens) == (0.0, 1.0, 0, 0.0,
                                                                                                1.0, 3)


def test_without_model_values_openais_defaults_apply() -> None:
    backend = ScriptedBackend(one_token)
    assert post(backend, "/v1/completions", {"model": MODEL, "prompt": "hi"}).status_code == 200
    s = backend.requests[0].sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty, s.max_tokens) == (1.0, 1.0, 0, 0.0,
                                                                                                1.0, 16)
