"""Overload is answered, not absorbed: 3× the measured capacity for 30 s against a live ``serve
run`` of the demo app (with a small admission queue, so the test's burst fills it) gets 429s with
Retry-After and no 5xx; every accepted request completes; and the latency of admitted requests is
back to its light-load level within 30 s of the burst (``fastserve.bench.overload`` does the driving)."""

from __future__ import annotations

import statistics
from collections.abc import Iterator

import pytest

from fastserve.bench import overload
from tests.harness.serve import API_KEY, Server, dummy_opt_yaml, serve_app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ADMISSION_QUEUE_LIMIT = 8
ADMISSION_TIMEOUT_S = 20
#: Latency in each recovery window after the first may exceed the light-load level by this much:
#: a 10 s window at 0.3x capacity holds 3-7 Poisson arrivals, and a cluster of them alone has
#: measured 1.6x on a quiet machine. Still overloaded, p50 stays at 5-6x.
RECOVERED_WITHIN = 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = dummy_opt_yaml()
    args = config["applications"][0]["args"]
    args["scheduler"]["admission_queue_limit"] = ADMISSION_QUEUE_LIMIT
    args["server"]["admission_timeout_s"] = ADMISSION_TIMEOUT_S
    with serve_app(tmp_path_factory.mktemp("overload"), config) as srv:
        yield srv


def test_three_times_capacity_gets_429s_and_recovers(server: Server) -> None:
    # Outputs capped at 32 tokens: ShareGPT's long tail would keep the batch full for minutes
    # after any burst, which is the workload's recovery time, not the server's.
    # The capacity burst is a full batch of the served config: a saturated server, not half of one.
    probe = dummy_opt_yaml()["applications"][0]["args"]["scheduler"]["max_batch_size"]
    common = ["--base-url", server.base, "--api-key", API_KEY, "--output-scale", "0.25", "--window", "10",
              "--max-output-tokens", "32"]
    light = overload.run(overload.parse_args([*common, "--factor", "0.3", "--duration", "30", "--recovery", "0",
                                              "--probe", str(probe)]))
    baseline = statistics.median(w["per_token_p50_s"] for w in light["windows"] if w["per_token_p50_s"])
    result = overload.run(overload.parse_args([*common, "--capacity", str(light["capacity_req_s"]),
                                               "--factor", "3", "--duration", "30", "--recovery", "30"]))
    overload.print_table(light)
    overload.print_table(result)
    assert result["errors_5xx"] == 0 and result["errors_other"] == 0
    assert result["rejected_429"] > 0
    burst = [w for w in result["windows"] if w["phase"] == "overload"]
    assert sum(w["retry_after_on_429"] for w in burst) == sum(w["rejected_429"] for w in burst)
    assert result["accepted"] + result["rejected_429"] == result["offered"]   # every accepted one completed
    # The first recovery window still drains the burst's backlog; from the second on, none.
    settled = [w for w in result["windows"] if w["phase"] == "recovery"][1:]
    p50s = [w["per_token_p50_s"] for w in settled if w["per_token_p50_s"] is not None]  # a window may get no arrival
    print(f"light-load p50 {baseline:.3f} s/token; settled recovery windows' p50 {[round(x, 3) for x in p50s]}")
    assert settled and p50s
    assert settled[-1]["rejected_429"] == 0
    assert max(p50s) <= RECOVERED_WITHIN * baseline, (p50s, baseline)
