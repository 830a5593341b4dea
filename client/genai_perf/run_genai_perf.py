#!/usr/bin/env python3
"""Run NVIDIA genai-perf against the Ouro deployment (`ouro`, gRPC streaming) and print its token-level numbers.

    python client/genai_perf/run_genai_perf.py                                   # localhost:8001, c=4, 32 requests
    python client/genai_perf/run_genai_perf.py --concurrency 16 --request-count 128 --input-tokens 512 \\
        --output-tokens 128 --tokenizer /path/to/Ouro-1.4B --artifact-dir gp_out
    python client/genai_perf/run_genai_perf.py -- --measurement-interval 10000    # more genai-perf arguments

It runs `genai-perf profile -m MODEL --endpoint-type kserve --backend tensorrtllm --streaming -u URL
--concurrency C --request-count N --synthetic-input-tokens-mean I --synthetic-input-tokens-stddev 0
--output-tokens-mean O --extra-inputs ignore_eos:true --extra-inputs temperature:0.0 --tokenizer DIR
--artifact-dir DIR`: perf_analyzer sends `text_input`, `max_tokens`, `stream`, `exclude_input_in_output` and the
extra inputs as the TensorRT-LLM backend's tensors, which `ouro` takes. EOS is ignored, so every request
generates exactly --output-tokens tokens, greedily (--temperature changes that).

* perf_analyzer comes from client/perf_analyzer/locate.py ($PERF_ANALYZER, PATH, its cache, else the
  tritonclient 2.50.0 wheel): genai-perf runs the `perf_analyzer` on PATH, so a directory with a link to it
  goes first on genai-perf's PATH, with the LD_LIBRARY_PATH locate.py gives.
* genai-perf counts tokens with a Hugging Face tokenizer (transformers AutoTokenizer), which must be the
  served model's. --tokenizer takes a checkpoint directory with tokenizer.json (default: the checkpoint the
  server serves, by the server's rule: $OURO_MODEL_PATH, else `model` in $OURO_ENGINE_ARGS, else the `model`
  parameter of ouro_engine in --model-repository, else the demo model that `ouro-serve` serves without
  --model); its tokenizer.json is copied into ARTIFACT_DIR/tokenizer next to a minimal tokenizer_config.json
  (the checkpoint is not modified); genai-perf then runs with HF_HUB_OFFLINE=1 and downloads nothing. A
  directory without tokenizer.json, or a Hub name, is passed through as it is. The server's own counts are
  requested too (return_num_input_tokens / return_num_output_tokens) and reported next to genai-perf's, with
  a warning when the prompt lengths disagree (not the served model's tokenizer).
* genai-perf is run from this Python when it is installed here (`pip install -e '.[test]'` installs it),
  else `genai-perf` on PATH; if neither exists the script exits 2 and says how to install it.

Output: genai-perf's own table and the artifacts in --artifact-dir (profile_export_genai_perf.json / .csv,
perf_analyzer's profile_export.json, inputs.json, genai_perf.log); a summary table on stderr and a JSON summary
(request count, request and output token throughput, TTFT, ITL, request latency) on stdout. Exit 1 if the
run failed or measured no requests.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from client.perf_analyzer.locate import PerfAnalyzerUnavailable, check, locate  # noqa: E402

EXPORT = "profile_export_genai_perf.json"


class GenAIPerfMissing(RuntimeError):
    pass


def genai_perf_command() -> list[str]:
    """How to start genai-perf: this interpreter's package, else `genai-perf` on PATH."""
    if importlib.util.find_spec("genai_perf") is not None:
        return [sys.executable, "-m", "genai_perf.main"]
    on_path = shutil.which("genai-perf")
    if on_path:
        return [on_path]
    raise GenAIPerfMissing(
        f"genai-perf is not installed for {sys.executable} nor on PATH: "
        f"`pip install genai-perf` (or `pip install -e '.[test]'` in this repository)"
    )


ENGINE_MODEL = "ouro_engine"  # the repository's model that loads the checkpoint (its tokenizer is the server's)


class TokenizerUnavailable(RuntimeError):
    pass


def served_checkpoint(model_repository: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The checkpoint a server started from here serves, found by the server's own rule
    (ouro_backend.serving.options): $OURO_MODEL_PATH (what `ouro-serve --model` sets), else `model` in
    $OURO_ENGINE_ARGS, else the `model` parameter of MODEL_REPOSITORY/ouro_engine/config.pbtxt (default
    repository: $OURO_MODEL_REPOSITORY, else the checkout's model_repository/), else the demo model, which
    `ouro-serve` serves without --model."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from ouro_backend.config import ConfigError
    from ouro_backend.entrypoints.tritonserver import default_repository
    from ouro_backend.serving.options import engine_options, resolve_model_path

    model_dir = os.path.join(str(model_repository or default_repository()), ENGINE_MODEL)
    config_file = os.path.join(model_dir, "config.pbtxt")
    parameters: dict[str, dict[str, str]] = {}
    if os.path.isfile(config_file):
        config = model_config_pb2.ModelConfig()
        with open(config_file) as f:
            text_format.Parse(f.read(), config)
        parameters = {k: {"string_value": v.string_value} for k, v in config.parameters.items()}
    try:
        options, _ = engine_options({"parameters": parameters}, model_dir, environ)
        return resolve_model_path({"model": options.get("model", "")})["model"]
    except (ConfigError, FileNotFoundError) as e:
        raise TokenizerUnavailable(f"cannot tell which checkpoint the server serves: {e}; pass --tokenizer") from None


def prepare_tokenizer(spec: str | None, out_dir: str, model_repository: str | None = None) -> tuple[str, bool]:
    """(what to pass to genai-perf --tokenizer, whether it is local). spec None: the served checkpoint's
    (served_checkpoint). A directory with tokenizer.json gets a copy of it under out_dir/tokenizer with a
    minimal tokenizer_config.json, which AutoTokenizer loads without config.json (a checkpoint's config.json
    has model_type "ouro", unknown to most transformers)."""
    src = spec or served_checkpoint(model_repository)
    if not os.path.isdir(src):
        return src, False  # a Hugging Face Hub name: genai-perf downloads it
    tok_json = os.path.join(src, "tokenizer.json")
    if not os.path.isfile(tok_json):
        return src, True
    dest = os.path.join(out_dir, "tokenizer")
    os.makedirs(dest, exist_ok=True)
    shutil.copyfile(tok_json, os.path.join(dest, "tokenizer.json"))
    with open(os.path.join(dest, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return dest, True


def server_token_counts(profile_export: str) -> list[tuple[int, int]]:
    """(num_input_tokens, num_output_tokens) per request, as the server counted them, from perf_analyzer's
    profile export of a run with return_num_input_tokens / return_num_output_tokens (each response carries
    the tokens it adds; the input count comes with the first). Requests without the counts are left out."""
    with open(profile_export) as f:
        export = json.load(f)
    counts = []
    for experiment in export.get("experiments") or []:
        for r in experiment.get("requests") or []:
            outs = [o for o in r.get("response_outputs") or [] if isinstance(o, dict)]
            if not any("num_output_tokens" in o for o in outs):
                continue
            counts.append(
                (
                    max((int(o.get("num_input_tokens") or 0) for o in outs), default=0),
                    sum(int(o.get("num_output_tokens") or 0) for o in outs),
                )
            )
    return counts


def _number(x: float) -> str:
    """A float as genai-perf's --extra-inputs parses it: digits and one dot (no exponent: "1e-05" stays a
    string; a negative number does too, and perf_analyzer rejects it for an FP32 input)."""
    s = f"{float(x):.10f}".rstrip("0")
    return s + "0" if s.endswith(".") else s


def metric_stats(export: dict, key: str, scale: float = 1.0) -> dict[str, float] | None:
    """One metric of a genai-perf / AIPerf JSON export: its avg, percentiles, min and max (x scale)."""
    m = export.get(key)
    if not isinstance(m, dict):
        return None
    return {k: m[k] * scale for k in ("avg", "p50", "p90", "p99", "min", "max") if isinstance(m.get(k), (int, float))}


def run_logged(cmd: list[str], log_path: str, env: Mapping[str, str], cwd: str, timeout: float) -> int | str:
    """Run a profiler with its command line and output in `log_path`, in a session of its own, so that a
    timeout kills it and whatever it started (perf_analyzer, AIPerf's workers). Its exit code, or
    "timeout"."""
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=dict(env), cwd=cwd,
            start_new_session=True,
        )  # fmt: skip
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout"


def log_tail(log_path: str, chars: int = 3000) -> str:
    with open(log_path, errors="replace") as f:
        return f.read()[-chars:]


def summarize(export: dict) -> dict[str, Any]:
    def avg(key):
        m = export.get(key) or {}
        return m.get("avg")

    return {
        "request_count": avg("request_count"),
        "request_throughput_per_s": avg("request_throughput"),
        "output_token_throughput_per_s": avg("output_token_throughput"),
        "time_to_first_token_ms": metric_stats(export, "time_to_first_token"),
        "inter_token_latency_ms": metric_stats(export, "inter_token_latency"),
        "request_latency_ms": metric_stats(export, "request_latency"),
        "output_sequence_length": avg("output_sequence_length"),
        "input_sequence_length": avg("input_sequence_length"),
    }


def compare_counts(report: dict[str, Any]) -> dict[str, Any]:
    """The server's token counts next to genai-perf's (which come from re-tokenizing with --tokenizer):
    server_input/output_sequence_length (averages), server_output_token_throughput_per_s, and a warning when
    the prompt lengths differ, which means genai-perf's tokenizer is not the served model's."""
    try:
        counts = server_token_counts(report["profile_export"])
    except (OSError, ValueError, TypeError):
        counts = []
    if not counts:
        return {}
    isl = sum(c[0] for c in counts) / len(counts)
    osl = sum(c[1] for c in counts) / len(counts)
    out: dict[str, Any] = {
        "server_input_sequence_length": isl,
        "server_output_sequence_length": osl,
        "server_output_token_throughput_per_s": (report.get("request_throughput_per_s") or 0) * osl or None,
    }
    gp_isl = report.get("input_sequence_length")
    if gp_isl is not None and abs(gp_isl - isl) > 1e-6:
        out["tokenizer_warning"] = (
            f"genai-perf's prompts average {gp_isl:.1f} tokens of its tokenizer ({report['tokenizer']}) but "
            f"{isl:.1f} tokens of the server's: they are not the same tokenizer, so its token counts are wrong; "
            f"pass --tokenizer with the served checkpoint"
        )
    return out


def run(
    url: str = "localhost:8001",
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
    """Run genai-perf once; raises GenAIPerfMissing / PerfAnalyzerUnavailable when a tool is missing and
    TokenizerUnavailable when tokenizer is None and the served checkpoint cannot be found."""
    command = genai_perf_command()
    binary, env = locate()
    check(binary, env)
    artifact_dir = os.path.abspath(artifact_dir or tempfile.mkdtemp(prefix="ouro-genai-perf-"))
    os.makedirs(artifact_dir, exist_ok=True)
    tok_source = tokenizer or served_checkpoint(model_repository)
    tok, local = prepare_tokenizer(tok_source, artifact_dir)
    if local:
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
    cmd = command + [
        "profile",
        "-m",
        model,
        "--endpoint-type",
        "kserve",
        "--backend",
        "tensorrtllm",
        "--streaming",
        "-u",
        url,
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(request_count),
        "--synthetic-input-tokens-mean",
        str(input_tokens),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(output_tokens),
        "--tokenizer",
        tok,
        "--artifact-dir",
        artifact_dir,
    ]
    if ignore_eos:
        cmd += ["--extra-inputs", "ignore_eos:true"]
    if temperature is not None:
        cmd += ["--extra-inputs", f"temperature:{_number(temperature)}"]
    if exit_threshold is not None:
        cmd += ["--extra-inputs", f"exit_threshold:{_number(exit_threshold)}"]
    extra = list(extra or [])
    for flag in ("return_num_input_tokens", "return_num_output_tokens"):  # the server's own counts, to compare
        if not any(a.startswith(flag + ":") for a in extra):
            cmd += ["--extra-inputs", f"{flag}:true"]
    cmd += extra
    log_path = os.path.join(artifact_dir, "genai_perf.log")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="ouro-pa-bin-") as bin_dir:
        os.symlink(os.path.abspath(binary), os.path.join(bin_dir, "perf_analyzer"))
        env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
        code = run_logged(cmd, log_path, env, artifact_dir, timeout)
    seconds = round(time.time() - started, 2)
    exports = [
        p
        for p in glob.glob(os.path.join(artifact_dir, "**", EXPORT), recursive=True)
        if os.path.getmtime(p) >= started - 1
    ]
    export_json = max(exports, key=os.path.getmtime) if exports else None
    report: dict[str, Any] = {
        "genai_perf": command,
        "perf_analyzer": binary,
        "tokenizer": tok,
        "tokenizer_source": tok_source,
        "model": model,
        "url": url,
        "concurrency": concurrency,
        "exit_code": code,
        "seconds": seconds,
        "artifact_dir": artifact_dir,
        "log": log_path,
        "export_json": export_json,
        "export_csv": export_json[: -len(".json")] + ".csv" if export_json else None,
        "profile_export": os.path.join(os.path.dirname(export_json), "profile_export.json") if export_json else None,
    }
    if export_json:
        with open(export_json) as f:
            report.update(summarize(json.load(f)))
        report.update(compare_counts(report))
    report["ok"] = (
        code == 0
        and export_json is not None
        and (report.get("request_count") or 0) > 0
        and (report.get("output_token_throughput_per_s") or 0) > 0
    )
    if not report["ok"]:
        report["log_tail"] = log_tail(log_path)
    return report


def format_table(r: dict[str, Any]) -> str:
    def ms(stat, key):
        v = (stat or {}).get(key)
        return "        -" if v is None else f"{v:9.1f}"

    server_osl = r.get("server_output_sequence_length")
    lines = [
        f"{r['model']} (genai-perf, kserve gRPC streaming), concurrency {r['concurrency']}: "
        f"{'ok' if r['ok'] else 'FAILED'}, {r.get('request_count') or 0:.0f} requests, "
        f"{r.get('request_throughput_per_s') or 0:.2f} req/s, "
        f"{r.get('output_token_throughput_per_s') or 0:.1f} output tok/s, "
        f"output length {r.get('output_sequence_length') or 0:.1f} tokens (re-tokenized; the server's: "
        f"{'-' if server_osl is None else format(server_osl, '.1f')})",
        f"{'metric (ms)':<16}{'avg':>9} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9}",
    ]
    for key, name in (
        ("time_to_first_token_ms", "TTFT"),
        ("inter_token_latency_ms", "ITL"),
        ("request_latency_ms", "request latency"),
    ):
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
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="Arguments after `--` go to `genai-perf profile` as they are."
    )
    p.add_argument("--url", default="localhost:8001", help="the server's gRPC endpoint (default localhost:8001)")
    p.add_argument("--model", default="ouro", help="model name (default ouro)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument("--request-count", type=int, default=32, help="requests to measure (default 32)")
    p.add_argument("--input-tokens", type=int, default=128, help="synthetic prompt length in tokens (default 128)")
    p.add_argument("--output-tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="checkpoint directory with tokenizer.json, a tokenizer directory, or a Hugging Face Hub name "
        "(default: the served checkpoint's: $OURO_MODEL_PATH, else the `model` of the model repository's "
        "ouro_engine, else the demo model, as `ouro-serve` and the server decide)",
    )
    p.add_argument(
        "--model-repository",
        default=None,
        help="where to look up the served checkpoint when --tokenizer is not given (default: "
        "$OURO_MODEL_REPOSITORY, else this checkout's model_repository/)",
    )
    p.add_argument("--artifact-dir", default=None, help="where genai-perf writes (default: a new temp dir)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--exit-threshold", type=float, default=None, help="Ouro's early-exit gate for every request")
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="stop at EOS (default: generate exactly --output-tokens)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole genai-perf run")
    args = p.parse_args(argv)
    try:
        report = run(
            args.url,
            args.model,
            args.concurrency,
            args.request_count,
            args.input_tokens,
            args.output_tokens,
            args.tokenizer,
            args.artifact_dir,
            args.temperature,
            args.exit_threshold,
            args.ignore_eos,
            extra,
            args.timeout,
            args.model_repository,
        )
    except (GenAIPerfMissing, TokenizerUnavailable) as e:
        print(f"run_genai_perf: {e}", file=sys.stderr)
        return 2
    except PerfAnalyzerUnavailable as e:
        print(f"run_genai_perf: perf_analyzer unavailable: {e}", file=sys.stderr)
        return 2
    print(format_table(report), file=sys.stderr)
    if report.get("tokenizer_warning"):
        print(f"run_genai_perf: WARNING: {report['tokenizer_warning']}", file=sys.stderr)
    if not report["ok"]:
        print(
            f"genai-perf failed (exit {report['exit_code']}); log {report['log']}:\n{report.get('log_tail', '')}\n"
            f"(genai-perf hides perf_analyzer's own messages, e.g. a request's error: add `-- -v` to see them)",
            file=sys.stderr,
        )
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
