"""genai-perf against a REAL tritonserver: the recipe client/genai_perf/run_genai_perf.py, run as users run it
(`genai-perf profile -m ouro --endpoint-type kserve --backend tensorrtllm --streaming`), on free ports with no
network (HF_HUB_OFFLINE=1): against the toy checkpoint with its tokenizer given (--tokenizer), and against
the demo model, the default model, with the tokenizer the recipe picks by default (the served model's), where
genai-perf's token counts must be the server's.

genai-perf comes from the `test` extra; a missing genai-perf fails these tests. They skip only when
perf_analyzer cannot be located or fetched (client/perf_analyzer/locate.py, the rule of tests/test_server_metrics.py's
perf_analyzer test) or when there is no tritonserver (as every real-server test does).
"""

from __future__ import annotations

import json
import os

import pytest

from client.genai_perf import run_genai_perf as recipe
from client.perf_analyzer.locate import PerfAnalyzerUnavailable

REQUESTS, CONCURRENCY, INPUT_TOKENS, OUTPUT_TOKENS = 6, 2, 16, 8


def run_or_skip(**kwargs) -> dict:
    try:
        return recipe.run(**kwargs)
    except PerfAnalyzerUnavailable as e:
        pytest.skip(f"perf_analyzer cannot run here: {e}")


@pytest.mark.timeout(480)  # server start (shared by the module) + genai-perf's start (transformers) + the run
def test_genai_perf_recipe_against_server(server, toy_path, tmp_path):
    try:
        report = recipe.run(
            server.grpc_url,
            "ouro",
            concurrency=CONCURRENCY,
            request_count=REQUESTS,
            input_tokens=INPUT_TOKENS,
            output_tokens=OUTPUT_TOKENS,
            tokenizer=toy_path,
            artifact_dir=str(tmp_path),
            timeout=300,
            extra=["--extra-inputs", "return_num_output_tokens:true", "--extra-inputs", "return_num_input_tokens:true"],
        )
    except PerfAnalyzerUnavailable as e:
        pytest.skip(f"perf_analyzer cannot run here: {e}")
    shown = {k: v for k, v in report.items() if k != "log_tail"}
    assert report["ok"], f"{json.dumps(shown, indent=1)}\n{report.get('log_tail', '')}"
    assert report["exit_code"] == 0

    # genai-perf's export: every request measured, positive throughput and token latencies.
    assert report["request_count"] == REQUESTS
    assert report["request_throughput_per_s"] > 0 and report["output_token_throughput_per_s"] > 0
    ttft, itl, latency = (report[k] for k in ("time_to_first_token_ms", "inter_token_latency_ms", "request_latency_ms"))
    assert 0 < ttft["avg"] <= latency["avg"] and itl["avg"] > 0
    assert ttft["max"] <= latency["max"]
    assert report["output_sequence_length"] > 0  # re-tokenized text: not exactly OUTPUT_TOKENS on the toy
    with open(report["export_json"]) as f:
        export = json.load(f)
    assert export["request_count"]["avg"] == REQUESTS and export["time_to_first_token"]["unit"] == "ms"
    assert os.path.isfile(report["export_csv"])
    with open(report["export_csv"]) as f:
        csv = f.read()
    assert "Time To First Token (ms)" in csv and "Output Token Throughput (tokens/sec)" in csv

    # perf_analyzer's raw export: what was sent, and what the server answered to each request.
    with open(report["profile_export"]) as f:
        raw = json.load(f)
    requests = raw["experiments"][0]["requests"]
    assert len(requests) == REQUESTS
    for r in requests:
        sent = r["request_inputs"]
        assert sent["max_tokens"] == OUTPUT_TOKENS and sent["stream"] is True and sent["ignore_eos"] is True
        assert sent["temperature"] == 0.0 and sent["exclude_input_in_output"] is True
        outs = r["response_outputs"]
        assert len(outs) > 1, "streaming must give several responses"
        assert len(r["response_timestamps"]) == len(outs)
        # EOS ignored: every request made exactly max_tokens tokens, by the server's own count.
        assert sum(o["num_output_tokens"] for o in outs) == OUTPUT_TOKENS
    # genai-perf's input lengths come from the tokenizer it was given: the server's, so they agree.
    server_isl = [r["response_outputs"][0]["num_input_tokens"] for r in requests]
    assert report["input_sequence_length"] == pytest.approx(sum(server_isl) / len(server_isl))

    # The tokenizer genai-perf used: a copy of the checkpoint's tokenizer.json; the checkpoint is untouched.
    tok_dir = tmp_path / "tokenizer"
    assert report["tokenizer"] == str(tok_dir)
    with open(os.path.join(toy_path, "tokenizer.json"), "rb") as f:
        assert (tok_dir / "tokenizer.json").read_bytes() == f.read()
    assert not os.path.exists(os.path.join(toy_path, "tokenizer_config.json"))


def test_missing_genai_perf_fails_clearly(monkeypatch, capsys):
    monkeypatch.setattr(recipe.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(recipe.shutil, "which", lambda name: None)
    assert recipe.main(["--url", "localhost:1"]) == 2
    err = capsys.readouterr().err
    assert "genai-perf is not installed" in err and "pip install" in err


def test_prepared_tokenizer_matches_the_servers(toy_path, tmp_path):
    """transformers' AutoTokenizer (what genai-perf loads) on the prepared dir gives the server's ids."""
    from transformers import AutoTokenizer

    from ouro_backend.model.tokenizer import load_tokenizer

    path, local = recipe.prepare_tokenizer(toy_path, str(tmp_path))
    assert local and os.path.isdir(path)
    hf = AutoTokenizer.from_pretrained(path)
    ours = load_tokenizer(toy_path)
    for text in ["Once upon a time", " leading space and  two spaces", "héllo wörld: naïve café 🙂 你好"]:
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text, add_special_tokens=False).ids
        assert hf.decode(hf.encode(text, add_special_tokens=False)) == text
    # A Hub name is passed through as it is (genai-perf would download it); nothing is prepared.
    assert recipe.prepare_tokenizer("gpt2", str(tmp_path / "x")) == ("gpt2", False)
    assert not (tmp_path / "x").exists()


@pytest.mark.timeout(480)
def test_genai_perf_token_counts_are_the_served_models(demo_server, tmp_path, monkeypatch):
    """`ouro-serve` serves the demo model (vocab 4,096) without --model; the recipe without --tokenizer must
    count with its tokenizer. With the toy's (vocab 621), which it used to pick, genai-perf reported 113
    output tokens for max_tokens 64. Now its counts are the server's num_output_tokens, but for one thing
    re-tokenizing text cannot see: EOS, which the demo model emits between its texts and which ignore_eos
    lets through, decodes to no text. So the expected count of a request is the server's minus its special
    tokens, found by the offline engine's greedy run of the same prompt (whose text is the served text)."""
    from server_common import ENGINE_ARGS

    from ouro_backend import LLM, SamplingParams
    from ouro_backend.model.tokenizer import load_tokenizer
    from ouro_backend.models import DEMO_MODEL

    for name in ("OURO_MODEL_PATH", "OURO_ENGINE_ARGS", "OURO_MODEL_REPOSITORY"):
        monkeypatch.delenv(name, raising=False)
    requests, output_tokens = 6, 16  # on the demo model two of these six requests emit an EOS
    report = run_or_skip(
        url=demo_server.grpc_url,
        concurrency=CONCURRENCY,
        request_count=requests,
        input_tokens=INPUT_TOKENS,
        output_tokens=output_tokens,
        artifact_dir=str(tmp_path),
        timeout=300,
        # The recipe asks for these itself; given here too, so that the counts below are there in any case.
        extra=["--extra-inputs", "return_num_output_tokens:true", "--extra-inputs", "return_num_input_tokens:true"],
    )
    shown = {k: v for k, v in report.items() if k != "log_tail"}
    assert report["ok"], f"{json.dumps(shown, indent=1)}\n{report.get('log_tail', '')}"

    with open(report["profile_export"]) as f:
        served = json.load(f)["experiments"][0]["requests"]
    assert len(served) == requests
    tok = load_tokenizer(str(DEMO_MODEL))
    special = {tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    llm = LLM(**ENGINE_ARGS)  # the default model, on the server's device and dtype
    greedy = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    refs = llm.generate([r["request_inputs"]["text_input"] for r in served], greedy)
    expected_osl, expected_isl = [], []
    for r, ref in zip(served, refs):
        outs = r["response_outputs"]
        server_count = sum(o["num_output_tokens"] for o in outs)
        assert server_count == output_tokens  # EOS ignored, by the server's own count
        text = "".join(o["text_output"] for o in outs)
        assert ref.text == text and len(ref.token_ids) == server_count
        expected_osl.append(server_count - sum(t in special for t in ref.token_ids))
        expected_isl.append(outs[0]["num_input_tokens"])
    assert any(n == output_tokens for n in expected_osl), expected_osl  # requests without EOS: exactly the server's

    # genai-perf's own numbers, from its export: per-request output lengths (avg / min / max) and prompt lengths.
    with open(report["export_json"]) as f:
        export = json.load(f)
    osl, isl = export["output_sequence_length"], export["input_sequence_length"]
    assert (osl["min"], osl["max"]) == (min(expected_osl), max(expected_osl)), (osl, expected_osl)
    assert osl["avg"] == pytest.approx(sum(expected_osl) / requests), (osl, expected_osl)
    assert isl["min"] == isl["max"] == INPUT_TOKENS and expected_isl == [INPUT_TOKENS] * requests

    # The recipe's report: which tokenizer, and the server's counts next to genai-perf's.
    assert report["tokenizer_source"] == str(DEMO_MODEL)
    assert (tmp_path / "tokenizer" / "tokenizer.json").read_bytes() == (DEMO_MODEL / "tokenizer.json").read_bytes()
    assert "tokenizer_warning" not in report
    assert report["server_output_sequence_length"] == output_tokens
    assert report["server_input_sequence_length"] == INPUT_TOKENS
