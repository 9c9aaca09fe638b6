"""The offline runner (fastserve.engine.offline): a Serve YAML's ``args`` read and refused as the server would,
and the demo's real model answering through the same engine in this process (no Ray, no HTTP).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from fastserve.engine.offline import load_app_args, main

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "config/demo.yaml"
FRANCE = "What is the capital of France?"
ANSWER = "The capital of France is Paris."


def test_a_yaml_without_applications_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("proxy_location: EveryNode\n")
    with pytest.raises(ValueError) as err:
        load_app_args(path)
    assert str(err.value) == f"{path}: no 'applications' in the Serve config"


def test_args_are_validated_as_the_server_validates_them(tmp_path: Path) -> None:
    raw = yaml.safe_load(DEMO.read_text())
    raw["applications"][0]["args"]["kv_cache"]["num_devce_blocks"] = 3
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValidationError, match=r"kv_cache\.num_devce_blocks\n  Extra inputs are not permitted"):
        load_app_args(path)
    assert load_app_args(DEMO).model.name == "smollm2-135m-instruct"


def test_the_demo_answers_the_france_question_and_stops_at_eos(smollm2_folder: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    main(["--config", str(DEMO), "--chat", "--prompt", FRANCE, "--max-tokens", "32"])
    lines = capsys.readouterr().out.splitlines()
    tokens = len(load_app_args(DEMO).model.tokenizer().encode(ANSWER, add_special_tokens=False)) + 1   # + EOS
    assert re.fullmatch(rf"--- '{re.escape(FRANCE)}' -> {tokens} tokens \(stop, \d+\.\d\d s\)", lines[0]), lines[0]
    assert lines[1] == ANSWER
    assert re.fullmatch(r"=== 1 completions in \d+\.\d\d s \(model smollm2-135m-instruct, "
                        r"policy skip_join_mlfq, swap proactive\)", lines[2]), lines[2]
    assert len(lines) == 3
