#!/usr/bin/env python3
"""Run NVIDIA AIPerf (genai-perf's successor) against the Ouro deployment and print its token-level numbers.

    python client/aiperf/run_aiperf.py --install          # once: AIPerf 0.13.0 in its own cached venv, then exit
    python client/aiperf/run_aiperf.py                    # http://localhost:8000, c=4, 32 requests
    python client/aiperf/run_aiperf.py -- --warmup-request-count 4      # more `aiperf profile` arguments

AIPerf 0.13 has no KServe / Triton endpoint type (its endpoint plugins are OpenAI chat / completions /
responses, TGI, embeddings, rankings, ..., `raw` and `template`). Its `template` endpoint sends a Jinja2
payload to any path and reads each SSE event's text with a JMESPath field, so the recipe points it at
Triton's HTTP generate extension, `/v2/models/MODEL/generate_stream`, with the TensorRT-LLM-style fields
`ouro` takes (`text_input`, `max_tokens`, `stream`, `exclude_input_in_output`, extra inputs such as
`ignore_eos`, `temperature`) and `response_field: text_output`. No OpenAI front is needed.

* AIPerf needs Python >= 3.11 and would downgrade pandas, huggingface_hub, rich, pyzmq, orjson, pillow and
  plotly in the project's venv, so it lives in a venv of its own: $AIPERF (an `aiperf` executable), else
  `aiperf` on PATH, else the cache venv ($OURO_CACHE_DIR or ~/.cache/ouro-triton)/aiperf/venv-0.13.0, which
  `--install` (or install_aiperf()) creates with `pip install aiperf==0.13.0`.
* Tokenizer: the served checkpoint's, found as client/genai_perf/run_genai_perf.py finds it (--tokenizer to
  override). AIPerf 0.13 cannot load a local tokenizer directory with HF_HUB_OFFLINE=1 (it resolves every
  name through snapshot_download), so the tokenizer.json is laid out as a Hugging Face cache entry
  `ouro-triton/served-tokenizer` under ARTIFACT_DIR/hf-cache and AIPerf runs with HF_HUB_CACHE there and
  HF_HUB_OFFLINE=1: no network.
* AIPerf counts output tokens by re-tokenizing the streamed text; the server's own counts
  (return_num_input_tokens / return_num_output_tokens) are asked for and read back from AIPerf's raw export.

Output: AIPerf's artifacts in --artifact-dir (profile_export_aiperf.json / .csv, profile_export.jsonl,
profile_export_raw.jsonl, inputs.json, aiperf.log), a summary table on stderr, a JSON summary on stdout. Exit 1
if the run failed, 2 if AIPerf is missing or the served checkpoint cannot be found.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from client.genai_perf.run_genai_perf import (  # noqa: E402
    TokenizerUnavailable,
    log_tail,
    metric_stats,
    run_logged,
    served_checkpoint,
)

AIPERF_VERSION = "0.13.0"
EXPORT = "profile_export_aiperf.json"
TOKENIZER_NAME = "ouro-triton/served-tokenizer"
SNAPSHOT = "0" * 40
TEMPLATE = (
    '{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens|tojson }}, "stream": {{ stream|tojson }}, '
    '"exclude_input_in_output": true}\n'
)


class AIPerfMissing(RuntimeError):
    pass


def venv_dir() -> Path:
    root = os.environ.get("OURO_CACHE_DIR") or os.path.join("~", ".cache", "ouro-triton")
    return Path(root).expanduser() / "aiperf" / f"venv-{AIPERF_VERSION}"


def aiperf_command() -> str:
    """The `aiperf` executable: $AIPERF, PATH, else the cache venv's."""
    explicit = os.environ.get("AIPERF")
    if explicit:
        return explicit
    on_path = shutil.which("aiperf")
    if on_path:
        return on_path
    cached = venv_dir() / "bin" / "aiperf"
    if cached.is_file():
        return str(cached)
    raise AIPerfMissing(
        f"aiperf not found ($AIPERF, PATH, {cached}): `python client/aiperf/run_aiperf.py --install` makes "
        f"that venv (pip install aiperf=={AIPERF_VERSION}; Python >= 3.11)"
    )


def install_aiperf(python: str = sys.executable) -> str:
    """Create the cache venv with aiperf==AIPERF_VERSION (about 1.2 GB, minutes) and return its `aiperf`."""
    target = venv_dir()
    aiperf = target / "bin" / "aiperf"
    if aiperf.is_file():
        return str(aiperf)
    shutil.rmtree(target, ignore_errors=True)  # a half-made venv from an interrupted install
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run([python, "-m", "venv", str(target)], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        raise AIPerfMissing(f"cannot create a venv with {python}: {e.stderr[-400:]}") from None
    pip = [str(target / "bin" / "python"), "-m", "pip", "install", "-q", f"aiperf=={AIPERF_VERSION}"]
    r = subprocess.run(pip, capture_output=True, text=True)
    if r.returncode != 0 or not aiperf.is_file():
        shutil.rmtree(target, ignore_errors=True)
        raise AIPerfMissing(f"pip install aiperf=={AIPERF_VERSION} failed: {(r.stderr or r.stdout)[-800:]}")
    return str(aiperf)


def prepare_tokenizer(src: str, out_dir: str) -> tuple[str, dict[str, str]]:
    """(the --tokenizer name, environment) for a checkpoint directory with tokenizer.json: a Hugging Face
    cache entry under out_dir/hf-cache, loaded offline. Anything else (a Hub name) is passed as it is."""
    tok_json = os.path.join(src, "tokenizer.json")
    if not os.path.isfile(tok_json):
        return src, {}
    cache = Path(out_dir) / "hf-cache"
    entry = cache / ("models--" + TOKENIZER_NAME.replace("/", "--"))
    snap = entry / "snapshots" / SNAPSHOT
    snap.mkdir(parents=True, exist_ok=True)
    (entry / "refs").mkdir(exist_ok=True)
    (entry / "refs" / "main").write_text(SNAPSHOT)
    shutil.copyfile(tok_json, snap / "tokenizer.json")
    (snap / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return TOKENIZER_NAME, {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def server_token_counts(raw_export: str) -> list[tuple[int, int]]:
    """(num_input_tokens, num_output_tokens) per request, from AIPerf's raw export (each SSE event carries
    the tokens it adds)."""
    counts = []
    with open(raw_export) as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            events = []
            for resp in record.get("responses") or []:
                for packet in resp.get("packets") or []:
                    if packet.get("name") == "data":
                        try:
                            events.append(json.loads(packet.get("value") or ""))
                        except ValueError:
                            pass
            events = [e for e in events if isinstance(e, dict) and "num_output_tokens" in e]
            if events:
                isl = max(int(e.get("num_input_tokens") or 0) for e in events)
                counts.append((isl, sum(int(e["num_output_tokens"]) for e in events)))
    return counts


def summarize(export: dict) -> dict[str, Any]:
    def avg(key):
        return (export.get(key) or {}).get("avg")

    return {
        "request_count": avg("request_count"),
        "request_throughput_per_s": avg("request_throughput"),
        "output_token_throughput_per_s": avg("output_token_throughput"),
        "time_to_first_token_ms": metric_stats(export, "time_to_first_token"),
        "inter_token_latency_ms": metric_stats(export, "inter_token_latency"),
        "request_latency_ms": metric_stats(export, "request_latency"),
        "output_sequence_length": metric_stats(export, "output_sequence_length"),
        "total_output_tokens": avg("total_output_tokens"),
    }


def run(
    url: str = "localhost:8000",
    model: str = "ouro",
    concurrency: int = 4,
    request_count: int = 32,
    input_tokens: int = 128,
    output_tokens: int = 64,
    tokenizer: str | None = None,
    artifact_dir: str | None = None,
    temperature: float | None = 0.0,
    exit_threshold: float | None = None,
    ignore_eos: bool = True,
    extra: list[str] | None = None,
    timeout: float = 600.0,
    model_repository: str | None = None,
) -> dict[str, Any]:
    """Run `aiperf profile` once against http://URL/v2/models/MODEL/generate_stream."""
    command = aiperf_command()
    artifact_dir = os.path.abspath(artifact_dir or tempfile.mkdtemp(prefix="ouro-aiperf-"))
    os.makedirs(artifact_dir, exist_ok=True)
    tok_source = tokenizer or served_checkpoint(model_repository)
    tok, tok_env = prepare_tokenizer(tok_source, artifact_dir)
    env = dict(os.environ, **tok_env)
    template = os.path.join(artifact_dir, "triton_generate.jinja")
    with open(template, "w") as f:
        f.write(TEMPLATE)
    base = url if "://" in url else f"http://{url}"
    inputs = {"payload_template": template, "response_field": "text_output"}
    if ignore_eos:
        inputs["ignore_eos"] = "true"
    if temperature is not None:
        inputs["temperature"] = repr(float(temperature))
    if exit_threshold is not None:
        inputs["exit_threshold"] = repr(float(exit_threshold))
    inputs["return_num_input_tokens"] = inputs["return_num_output_tokens"] = "true"
    cmd = [command, "profile", "-m", model, "--endpoint-type", "template", "--url", base]
    cmd += ["--custom-endpoint", f"/v2/models/{model}/generate_stream", "--streaming"]
    for k, v in inputs.items():
        cmd += ["--extra-inputs", f"{k}:{v}"]
    cmd += ["--concurrency", str(concurrency), "--request-count", str(request_count)]
    cmd += ["--synthetic-input-tokens-mean", str(input_tokens), "--synthetic-input-tokens-stddev", "0"]
    cmd += ["--output-tokens-mean", str(output_tokens), "--output-tokens-stddev", "0"]
    cmd += ["--tokenizer", tok, "--artifact-dir", artifact_dir, "--export-level", "raw"]
    cmd += ["--ui", "none", "--no-server-metrics", "--no-gpu-telemetry"]
    cmd += list(extra or [])
    log_path = os.path.join(artifact_dir, "aiperf.log")
    started = time.time()
    code = run_logged(cmd, log_path, env, artifact_dir, timeout)
    export_json = os.path.join(artifact_dir, EXPORT)
    if not os.path.isfile(export_json) or os.path.getmtime(export_json) < started - 1:
        export_json = ""
    report: dict[str, Any] = {
        "aiperf": command,
        "aiperf_version": AIPERF_VERSION,
        "endpoint": f"{base}/v2/models/{model}/generate_stream",
        "tokenizer": tok,
        "tokenizer_source": tok_source,
        "model": model,
        "concurrency": concurrency,
        "exit_code": code,
        "seconds": round(time.time() - started, 2),
        "artifact_dir": artifact_dir,
        "log": log_path,
        "export_json": export_json or None,
        "export_csv": export_json[: -len(".json")] + ".csv" if export_json else None,
        "raw_export": os.path.join(artifact_dir, "profile_export_raw.jsonl"),
    }
    if export_json:
        with open(export_json) as f:
            report.update(summarize(json.load(f)))
        try:
            counts = server_token_counts(report["raw_export"])
        except (OSError, ValueError):
            counts = []
        if counts:
            report["server_input_sequence_length"] = sum(c[0] for c in counts) / len(counts)
            report["server_output_sequence_length"] = sum(c[1] for c in counts) / len(counts)
    report["ok"] = code == 0 and bool(export_json) and (report.get("request_count") or 0) > 0
    if not report["ok"]:
        report["log_tail"] = log_tail(log_path)
    return report


def format_table(r: dict[str, Any]) -> str:
    def ms(stat, key):
        v = (stat or {}).get(key)
        return "        -" if v is None else f"{v:9.1f}"

    osl = (r.get("output_sequence_length") or {}).get("avg")
    lines = [
        f"{r['model']} (AIPerf {r['aiperf_version']}, {r['endpoint']}), concurrency {r['concurrency']}: "
        f"{'ok' if r['ok'] else 'FAILED'}, {r.get('request_count') or 0:.0f} requests, "
        f"{r.get('request_throughput_per_s') or 0:.2f} req/s, {r.get('output_token_throughput_per_s') or 0:.1f} "
        f"output tok/s, output length {osl or 0:.1f} tokens (re-tokenized; the server's: "
        f"{r.get('server_output_sequence_length', '-')})",
        f"{'metric (ms)':<16}{'avg':>9} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9}",
    ]
    for key, name in (("time_to_first_token_ms", "TTFT"), ("inter_token_latency_ms", "ITL"),
                      ("request_latency_ms", "request latency")):  # fmt: skip
        s = r.get(key)
        lines.append(f"{name:<16}{ms(s, 'avg')} {ms(s, 'p50')} {ms(s, 'p90')} {ms(s, 'p99')} {ms(s, 'max')}")
    lines.append(f"artifacts: {r['artifact_dir']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--install", action="store_true", help=f"make the cache venv (aiperf=={AIPERF_VERSION}), exit")
    p.add_argument("--url", default="localhost:8000", help="the server's HTTP endpoint (default localhost:8000)")
    p.add_argument("--model", default="ouro")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--request-count", type=int, default=32)
    p.add_argument("--input-tokens", type=int, default=128, help="synthetic prompt length in tokens")
    p.add_argument("--output-tokens", type=int, default=64, help="max_tokens of each request (EOS ignored)")
    p.add_argument("--tokenizer", default=None, help="checkpoint directory (default: the served checkpoint's)")
    p.add_argument("--model-repository", default=None, help="where the served checkpoint is looked up")
    p.add_argument("--artifact-dir", default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--exit-threshold", type=float, default=None)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    try:
        if args.install:
            print(install_aiperf())
            return 0
        report = run(args.url, args.model, args.concurrency, args.request_count, args.input_tokens,
                     args.output_tokens, args.tokenizer, args.artifact_dir, args.temperature, args.exit_threshold,
                     args.ignore_eos, extra, args.timeout, args.model_repository)  # fmt: skip
    except (AIPerfMissing, TokenizerUnavailable) as e:
        print(f"run_aiperf: {e}", file=sys.stderr)
        return 2
    print(format_table(report), file=sys.stderr)
    if not report["ok"]:
        print(f"aiperf failed (exit {report['exit_code']}); log {report['log']}:\n{report.get('log_tail', '')}",
              file=sys.stderr)  # fmt: skip
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
