"""`rapidserve serve --mode hybrid`: a real server process (embedded SmolLM2, CPU, one worker)."""

from __future__ import annotations

import json
import time

from tests.test_server import http, metric, start, stop


def test_serve_mode_hybrid_answers_a_chat_completion() -> None:
    s = start("--mode", "hybrid", "--max-num-batched-tokens", "16")  # the prompt is computed in chunks
    try:
        status, _, body = http(s.url + "/v1/chat/completions", "POST", json.dumps({
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
            "max_tokens": 24}).encode(), {"Content-Type": "application/json"})
        assert status == 200, body
        r = json.loads(body)
        assert "Paris" in r["choices"][0]["message"]["content"] and r["choices"][0]["finish_reason"] == "stop"
        assert http(s.url + "/health")[0] == 200
        deadline = time.monotonic() + 10  # stats arrive every 0.25 s
        while metric(s.url, "vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(s.url, "vllm:kv_cache_usage_perc") == 0  # the finished request's blocks are back
    finally:
        code = stop(s)
    assert code == 0  # SIGTERM: drain and exit 0
