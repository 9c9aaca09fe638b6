"""``fastserve serve MODEL_DIR`` end to end: the console script, run on the demo's model folder with
no YAML, profiles SmolLM2 at its first start (into a fresh cache folder), writes and runs the Serve
app on a private Ray head, and answers a chat request through the ``openai`` client; the engine
replica logs its stats line.

Skips where the model folder has not been converted (``make model``). The command is stopped by
its process tree (``tests.harness.serve.stop_tree``), as is the head.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from fastserve.config_folder import CACHE_DIR_ENV
from tests.harness.serve import (
    API_KEY,
    BIN,
    REQUEST_TIMEOUT_S,
    ROOT,
    STARTUP_TIMEOUT_S,
    free_port,
    private_ray_head,
    stop_tree,
    wait_for,
)
from tests.harness.tokenizers import require_smollm2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "smollm2-135m-instruct"
#: The first start profiles the model before Serve starts: a quick grid, under a minute on 2 cores.
FIRST_START_TIMEOUT_S = 2 * STARTUP_TIMEOUT_S
#: Small pools, still one 8,192-token request each in fp32 (512 blocks of 720 KiB = 360 MiB).
KV_GIB = "0.5"
#: Twice the default stats interval (5 s) plus the metrics tick's (0.5 s): the line is due by then.
STATS_LINE_TIMEOUT_S = 15


def test_fastserve_serve_a_folder_answers_a_chat_request(tmp_path: Path) -> None:
    import openai

    folder = require_smollm2()
    port, log = free_port(), tmp_path / "fastserve.log"
    with private_ray_head(tmp_path) as head:
        env = {**head.env, CACHE_DIR_ENV: str(tmp_path / "cache")}
        proc = subprocess.Popen(
            [str(BIN / "fastserve"), "serve", str(folder), "--port", str(port), "--address", head.address,
             "--device", "cpu", "--kv-cache-space-gib", KV_GIB, "--swap-space-gib", KV_GIB],
            cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            def healthy() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(f"fastserve serve exited {proc.returncode}:\n{log.read_text()[-4000:]}")
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            wait_for("fastserve serve's /health", healthy, FIRST_START_TIMEOUT_S, log)

            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY,
                                   timeout=REQUEST_TIMEOUT_S, max_retries=0)
            resp = client.chat.completions.create(
                model=MODEL, max_tokens=32, temperature=0,
                messages=[{"role": "user", "content": "What is the capital of France?"}])
            (choice,) = resp.choices
            assert choice.finish_reason == "stop", choice
            assert "Paris" in (choice.message.content or "")

            text = log.read_text(errors="replace")
            config = tmp_path / "cache" / "apps" / f"{MODEL}.yaml"
            assert f"wrote the Serve config {config}" in text
            assert "profiling smollm2-135m-instruct" in text and "t_dec(b= 16)" in text
            (profile,) = (tmp_path / "cache" / "profiles").glob(f"{MODEL}-*.json")
            assert str(profile) in config.read_text()
            wait_for("the engine's stats line", lambda: "Avg generation throughput" in log.read_text(errors="replace"),
                     STATS_LINE_TIMEOUT_S, log)
        finally:
            stop_tree(proc, grace_s=5)
