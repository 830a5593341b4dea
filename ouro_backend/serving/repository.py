"""Renders the `config.pbtxt` files of `model_repository/` from the tensor specs in protocol.py.

    python -m ouro_backend.serving.repository --check   # exit 1 if a config.pbtxt differs (CI)
    python -m ouro_backend.serving.repository --write   # regenerate them

The checked-in files are the product (users edit `parameters` there); this keeps their tensor
declarations identical to what the Python models parse.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Iterable
from pathlib import Path

from . import protocol
from .options import FrontOptions, ServingOptions, option_docs

REPO_DIR = Path(__file__).resolve().parents[2] / "model_repository"
PRE_POST_MAX_BATCH = 64
INSTANCES = 2
# Two stub processes for the `ouro` front: one Python process (one GIL) runs every execute() one after the
# other (serving/README.md, "Where served TTFT goes").
FRONT_INSTANCES = 2

# Engine options listed (empty = the default) in ouro_engine/config.pbtxt: every EngineConfig field, its default
# last in brackets where it has one (tests/test_serving_unit.py keeps both true).
ENGINE_PARAMETERS = [
    ("model", "checkpoint dir (HF layout); $OURO_MODEL_PATH overrides; empty: the demo model"),
    ("device", "auto | cpu | cuda | cuda:N"),
    ("dtype", "auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16"),
    ("attention_backend", "auto | torch | triton | flash"),
    ("eos_token_ids", "stop token ids, comma-separated (default: the checkpoint's generation_config.json)"),
    ("kv_layout", "last_exited | shared"),
    ("block_size", "KV block size in tokens (16)"),
    ("gpu_memory_utilization", "fraction of GPU memory for weights + activations + KV (0.90)"),
    ("num_blocks", "explicit KV size in blocks (default: automatic)"),
    ("kv_cache_bytes", "explicit KV size in bytes, when num_blocks is unset (default: automatic)"),
    ("cpu_kv_cache_bytes", "KV budget on CPU when num_blocks and kv_cache_bytes are unset (268435456)"),
    ("kv_watermark", "share of KV blocks admission keeps free for running requests to grow (0.01)"),
    (
        "enable_prefix_caching",
        "share full prompt blocks between requests by content; last_exited only (default: on under last_exited)",
    ),
    ("preemption_mode", "auto | recompute | swap: how requests are preempted when KV runs out (auto)"),
    ("swap_space_gib", "host memory for the KV of swapped-out requests, GiB (4)"),
    ("max_num_seqs", "max running requests (64)"),
    ("max_num_batched_tokens", "token budget of one round (2048)"),
    ("max_model_len", "context limit (default: min(max_position_embeddings, 8192))"),
    ("prefill_chunk_size", "prompt chunk (default: max_num_batched_tokens)"),
    ("exit_mode", "ouro | ouro_delayed | random_lookahead | trace | fixed"),
    ("exit_threshold", "default per-request exit threshold (default: the checkpoint's)"),
    ("cuda_graphs", "true | false"),
    ("cuda_graph_max_tokens", "largest round captured in a CUDA graph; larger ones run eagerly (2048)"),
    ("async_scheduling", "launch the next round(s) before reading the last launch back (true)"),
    ("decode_rounds_per_launch", "decode rounds one launch (one graph replay) runs when no prompt work waits (4)"),
    (
        "spec_tokens",
        "self-speculative decoding: tokens drafted per step, 0 = off (0); needs last_exited, no gate exits",
    ),
    ("spec_draft_loops", "loops that draft when spec_tokens > 0; the rest verify (1)"),
    ("spec_auto", "speculate only while the cost model says it pays (true)"),
    ("spec_max_verify_tokens", "no drafts when rows x (spec_tokens + 1) exceeds this (256)"),
    (
        "deferred_deep_interval",
        "deferred deep batching for rollouts: loops after the readout loop run every B tokens, 0 = off (0)",
    ),
    ("deferred_readout_loop", "the loop tokens are read out at between deep boundaries (2)"),
    ("deferred_deep_eager", "deferred deep batching's control: the same readout, deep loops every token (false)"),
    ("seed", "seed of unseeded sampling and random_lookahead (0)"),
    (
        "request_timeout_s",
        "a request unfinished this long after it arrived ends with a timeout error, 0 = no limit (600)",
    ),
    ("max_waiting_requests", "requests waiting beyond the max_num_seqs running ones; more are refused as busy (256)"),
]


def _tensor(name: str, dtype: str, dims: str, optional: bool = False, ragged: bool = False) -> str:
    extra = ""
    if optional:
        extra += "\n    optional: true"
    if ragged:
        extra += "\n    allow_ragged_batch: true"
    return f'  {{\n    name: "{name}"\n    data_type: TYPE_{dtype}\n    dims: [ {dims} ]{extra}\n  }}'


def _inputs(specs: Iterable[protocol.InputSpec], required: Iterable[str] = (), ragged: bool = False) -> str:
    req = set(required)
    items = [
        _tensor(
            s.name, s.triton_dtype, "-1" if s.is_list else "1", optional=s.name not in req, ragged=ragged and s.is_list
        )
        for s in specs
    ]
    return "input [\n" + ",\n".join(items) + "\n]\n"


def _outputs(outputs: dict, lists: Iterable[str]) -> str:
    lists = set(lists)
    items = [_tensor(name, dtype, "-1" if name in lists else "1") for name, dtype in outputs.items()]
    return "output [\n" + ",\n".join(items) + "\n]\n"


def _params(pairs, header: str) -> str:
    lines = [f"# {header}"]
    for key, doc in pairs:
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "" }} }}  # {doc}')
    return "\n".join(lines) + "\n"


def _header(text: str) -> str:
    return (
        "".join(f"# {line}".rstrip() + "\n" for line in text.strip().splitlines())
        + "# Generated by `python -m ouro_backend.serving.repository --write` (tensors); edit parameters freely.\n"
    )


def render() -> dict[str, str]:
    engine_lists = ("output_ids", "prefix_ids", "exit_depths", "output_log_probs")
    files: dict[str, str] = {}
    files["ouro_engine"] = (
        _header("""
ouro_engine: the decoupled model that owns the Ouro engine (ouro_backend/serving/engine_model.py).
Callable directly with token ids: input_ids [1, n] plus the optional sampling / Ouro inputs. One response
per step with new tokens when stream=true, else one response; the last carries FINAL. Control request:
abort_request_id (with empty input_ids) aborts a running request: the request_id output of a request
started without one (the model's own, unguessable ids; a chosen request_id cannot be aborted by id).
Engine options: the parameters below (empty = default), then $OURO_ENGINE_ARGS, then $OURO_MODEL_PATH.""")
        + 'name: "ouro_engine"\nbackend: "python"\nmax_batch_size: 1\n'
        + "model_transaction_policy { decoupled: true }\n"
        + _inputs(protocol.ENGINE_INPUTS.values(), required=["input_ids"])
        + _outputs({**protocol.ENGINE_OUTPUTS, **protocol.ENGINE_ID_OUTPUT}, engine_lists)
        + "instance_group [ { count: 1, kind: KIND_CPU } ]\n"
        + _params(ENGINE_PARAMETERS, "Engine options (ouro_backend/config.py EngineConfig); empty: default")
        + _params(option_docs(ServingOptions), "Serving options")
    )
    files["preprocessing"] = (
        _header(
            "preprocessing: text_input -> input_ids (ouro_backend/serving/text_models.py).\n"
            "Takes all client inputs (all optional) to validate the whole request first in the ensemble.\n"
            "The tokenizer is the engine checkpoint's ($OURO_MODEL_PATH, else `model`, else the demo model)."
        )
        + f'name: "preprocessing"\nbackend: "python"\nmax_batch_size: {PRE_POST_MAX_BATCH}\n'
        + "dynamic_batching { }\n"
        + _inputs(protocol.CLIENT_INPUTS.values(), required=[], ragged=True)
        + _outputs({"input_ids": "INT32"}, ["input_ids"])
        + f"instance_group [ {{ count: {INSTANCES}, kind: KIND_CPU }} ]\n"
        + _params([("model", "checkpoint dir with tokenizer.json; $OURO_MODEL_PATH overrides")], "Options")
    )
    files["postprocessing"] = (
        _header(
            "postprocessing: one ouro_engine response -> text_output and the client metadata tensors.\n"
            "Stateless incremental detokenization (prefix_ids give the context). preserve_ordering is\n"
            "required with several instances: without it an ensemble reorders a stream's deltas."
        )
        + f'name: "postprocessing"\nbackend: "python"\nmax_batch_size: {PRE_POST_MAX_BATCH}\n'
        + "dynamic_batching { preserve_ordering: true }\n"
        + _inputs(protocol.POST_INPUTS.values(), required=["output_ids", "prefix_ids", "trim_chars"], ragged=True)
        + _outputs(protocol.CLIENT_OUTPUTS, ["exit_depths", "output_log_probs"])
        + f"instance_group [ {{ count: {INSTANCES}, kind: KIND_CPU }} ]\n"
        + _params([("model", "checkpoint dir with tokenizer.json; $OURO_MODEL_PATH overrides")], "Options")
    )
    files["ouro"] = (
        _header("""
ouro: the client-facing model (ouro_backend/serving/front_model.py): tokenizes, streams the request to
the engine process of ouro_engine over its socket and detokenizes (the code of preprocessing and
postprocessing, in-process) and, unlike the ensemble, stops the engine and frees its KV when the client
cancels or disconnects. Tensors as TensorRT-LLM / vLLM backends:
shapes are [1, 1] (batch 1) for scalars; /v2/models/ouro/generate and /generate_stream take plain JSON.""")
        + 'name: "ouro"\nbackend: "python"\nmax_batch_size: 1\n'
        + "model_transaction_policy { decoupled: true }\n"
        + _inputs(protocol.CLIENT_INPUTS.values(), required=["text_input"])
        + _outputs(protocol.CLIENT_OUTPUTS, ["exit_depths", "output_log_probs"])
        + f"instance_group [ {{ count: {FRONT_INSTANCES}, kind: KIND_CPU }} ]\n"
        + _params(option_docs(FrontOptions), "Options (empty: default)")
    )
    files["ouro_ensemble"] = _ensemble()
    return files


def _ensemble() -> str:
    def maps(kind: str, pairs) -> str:
        return "".join(f'      {kind} {{ key: "{k}" value: "{v}" }}\n' for k, v in pairs)

    sampling = [(n, n) for n in protocol.SAMPLING_INPUTS]
    engine_out = [(n, f"_{n}") for n in protocol.ENGINE_OUTPUTS]
    post_in = engine_out  # a step after a decoupled step may only read that step's outputs
    steps = [
        ("preprocessing", [(n, n) for n in protocol.CLIENT_INPUTS], [("input_ids", "_input_ids")]),
        (
            "ouro_engine",
            [("input_ids", "_input_ids"), ("text_input", "text_input")]
            + sampling
            + [(n, n) for n in protocol.RETURN_FLAGS],
            engine_out,
        ),
        ("postprocessing", post_in, [(n, n) for n in protocol.CLIENT_OUTPUTS]),
    ]
    body = ",\n".join(
        f'    {{\n      model_name: "{m}"\n      model_version: -1\n'
        + maps("input_map", i)
        + maps("output_map", o)
        + "    }"
        for m, i, o in steps
    )
    return (
        _header("""
ouro_ensemble: the same tensors as `ouro`, as a Triton ensemble preprocessing -> ouro_engine ->
postprocessing. Streams in order (postprocessing preserves ordering). Limitation on Triton 24.10: a client
cancellation or disconnect does NOT reach the running ouro_engine step (the ensemble only cancels steps it
schedules afterwards), so the engine finishes the request (up to max_tokens) and only then frees its KV.
Use `ouro` when clients may cancel.""")
        + 'name: "ouro_ensemble"\nplatform: "ensemble"\nmax_batch_size: 1\n'
        # text_input is required, but declared optional: a required ensemble input that is missing leaves
        # preprocessing unscheduled and the ensemble answers with an empty success; optional, preprocessing
        # runs and rejects the request ("missing required input 'text_input'").
        + _inputs(protocol.CLIENT_INPUTS.values(), required=[])
        + _outputs(protocol.CLIENT_OUTPUTS, ["exit_depths", "output_log_probs"])
        + "ensemble_scheduling {\n  step [\n"
        + body
        + "\n  ]\n}\n"
    )


MODEL_PY = {
    "ouro_engine": ("engine_model", "EngineModel"),
    "ouro": ("front_model", "FrontModel"),
    "preprocessing": ("text_models", "PreprocessingModel"),
    "postprocessing": ("text_models", "PostprocessingModel"),
}


def render_model_py(model: str) -> str:
    module, cls = MODEL_PY[model]
    return f'''"""Triton Python model `{model}`: the logic is ouro_backend.serving.{module}.{cls}."""

import os
import sys

# From a source checkout, use the checkout's ouro_backend (three levels up); otherwise the installed one.
_root = os.path.abspath(os.path.join(os.path.dirname(os.path.realpath(__file__)), "..", "..", ".."))
if os.path.isfile(os.path.join(_root, "ouro_backend", "__init__.py")) and _root not in sys.path:
    sys.path.insert(0, _root)

from ouro_backend.serving.{module} import {cls}  # noqa: E402


class TritonPythonModel({cls}):
    pass
'''


def expected_files() -> dict[str, str]:
    files = {f"{m}/config.pbtxt": text for m, text in render().items()}
    files.update({f"{m}/1/model.py": render_model_py(m) for m in MODEL_PY})
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true")
    p.add_argument("--check", action="store_true")
    p.add_argument("--repo", default=str(REPO_DIR))
    args = p.parse_args(argv)
    repo = Path(args.repo)
    bad = 0
    for rel, text in expected_files().items():
        path = repo / rel
        if args.write:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
        else:
            current = path.read_text() if path.exists() else ""
            if current != text:
                bad += 1
                sys.stdout.writelines(
                    difflib.unified_diff(current.splitlines(True), text.splitlines(True), str(path), "expected")
                )
    if args.write:  # the ensemble needs an (empty) version directory
        (repo / "ouro_ensemble" / "1").mkdir(parents=True, exist_ok=True)
        (repo / "ouro_ensemble" / "1" / ".gitkeep").write_text("")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
