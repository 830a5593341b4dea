"""AIPerf against a REAL tritonserver: the recipe client/aiperf/run_aiperf.py (AIPerf's `template` endpoint on
Triton's HTTP `/v2/models/ouro/generate_stream`), on the demo model with the tokenizer the recipe picks by
default (the served model's), offline (HF_HUB_OFFLINE=1). AIPerf's per-request output token counts must be
that tokenizer's counts of the text the server sent, the server's num_output_tokens the requested length, and
the report must have TTFT, ITL and throughput.

AIPerf lives in its own venv (client/aiperf/README.md): $AIPERF, PATH, else the cache venv, which this test
creates when it is missing (minutes, once; scripts/setup.sh makes it ahead). It skips when that cannot be
made (no Python >= 3.11, no package index), as the perf_analyzer tests skip when the binary cannot be fetched.
"""

from __future__ import annotations

import json
import sys

import pytest

from client.aiperf import run_aiperf as recipe

REQUESTS, CONCURRENCY, INPUT_TOKENS, OUTPUT_TOKENS = 4, 2, 16, 8


@pytest.fixture(scope="module")
def aiperf():
    try:
        return recipe.aiperf_command()
    except recipe.AIPerfMissing:
        pass
    if sys.version_info < (3, 11):
        pytest.skip("AIPerf needs Python >= 3.11")
    try:
        return recipe.install_aiperf()
    except recipe.AIPerfMissing as e:
        pytest.skip(f"AIPerf cannot be installed here: {e}")


def test_missing_aiperf_fails_clearly(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("AIPERF", raising=False)
    monkeypatch.setenv("OURO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(recipe.shutil, "which", lambda name: None)
    assert recipe.main(["--url", "localhost:1"]) == 2
    assert "--install" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_aiperf_token_counts_are_the_served_models(aiperf, demo_server, tmp_path, monkeypatch):
    """AIPerf counts a request's output by tokenizing the text it received, joined (its template endpoint reads
    no usage field). That count is not the server's: EOS (which ignore_eos lets through on the demo model)
    decodes to no text, and text streamed token by token can re-tokenize into fewer, merged tokens. So AIPerf's
    count must be the served tokenizer's count of the served text, and the server's own count must be the
    requested length."""
    from tokenizers import Tokenizer

    from ouro_backend.models import DEMO_MODEL

    for name in ("OURO_MODEL_PATH", "OURO_ENGINE_ARGS", "OURO_MODEL_REPOSITORY"):
        monkeypatch.delenv(name, raising=False)
    report = recipe.run(
        url=demo_server.http_url,
        concurrency=CONCURRENCY,
        request_count=REQUESTS,
        input_tokens=INPUT_TOKENS,
        output_tokens=OUTPUT_TOKENS,
        artifact_dir=str(tmp_path),
        timeout=240,
        extra=["--workers-max", "1", "--record-processors", "1"],
    )
    shown = {k: v for k, v in report.items() if k != "log_tail"}
    assert report["ok"], f"{json.dumps(shown, indent=1)}\n{report.get('log_tail', '')}"
    assert report["tokenizer_source"] == str(DEMO_MODEL)
    assert report["endpoint"].endswith("/v2/models/ouro/generate_stream")

    # The report: every request, positive throughput, TTFT <= latency, ITL.
    assert report["request_count"] == REQUESTS
    assert report["request_throughput_per_s"] > 0 and report["output_token_throughput_per_s"] > 0
    ttft, itl, latency = (report[k] for k in ("time_to_first_token_ms", "inter_token_latency_ms", "request_latency_ms"))
    assert 0 < ttft["avg"] <= latency["avg"] and itl["avg"] > 0
    with open(report["export_csv"]) as f:
        csv = f.read()
    assert "Time to First Token" in csv and "Inter Token Latency" in csv and "Output Token Throughput" in csv

    # What the server answered, per request (AIPerf's raw export), against AIPerf's own per-request counts.
    tokenizer = Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    expected = {}
    with open(report["raw_export"]) as f:
        for line in f:
            r = json.loads(line)
            sent = json.loads(r["payload"]) if isinstance(r["payload"], str) else r["payload"]
            assert sent["max_tokens"] == OUTPUT_TOKENS and sent["stream"] is True and sent["ignore_eos"] is True
            events = [json.loads(p["value"]) for x in r["responses"] for p in x["packets"] if p["name"] == "data"]
            assert len(events) > 1, "streaming must give several responses"
            total = sum(e["num_output_tokens"] for e in events)
            assert total == OUTPUT_TOKENS  # EOS ignored, by the server's own count
            assert all(e["num_input_tokens"] == INPUT_TOKENS for e in events)  # AIPerf's prompts: the server's tokens
            text = "".join(e["text_output"] for e in events)
            expected[r["metadata"]["x_request_id"]] = len(tokenizer.encode(text, add_special_tokens=False).ids)
    counted = {}
    with open(tmp_path / "profile_export.jsonl") as f:
        for line in f:
            r = json.loads(line)
            counted[r["metadata"]["x_request_id"]] = r["metrics"]["output_sequence_length"]["value"]
    assert len(expected) == REQUESTS and counted == expected, (counted, expected)
    assert report["server_output_sequence_length"] == OUTPUT_TOKENS
    assert report["server_input_sequence_length"] == INPUT_TOKENS
