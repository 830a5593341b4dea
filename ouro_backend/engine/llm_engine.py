"""The step-level engine (what the Triton model drives from its thread) and the offline `LLM` API."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Sequence as Seq
from typing import cast

import torch

from ..config import ConfigError, EngineConfig, ExitMode, KVLayout
from ..model.attention import TorchBackend
from ..model.checkpoint import load_config, load_weights, read_eos_ids
from ..model.ouro import OuroModel
from ..model.tokenizer import load_tokenizer
from ..outputs import FinishReason, RequestOutput
from ..sampling_params import RequestError, SamplingParams, bad_words_token_ids
from .decode_state import MAX_TRACE
from .deferred_deep import DeferredDeepConfig
from .exit_policy import ExitPolicy
from .kv_cache import KVCache
from .model_runner import AwaitsDeep, Emitted, Launch, ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence, StopChecker
from .spec_policy import mean_accepted_length

log = logging.getLogger(__name__)
Prompt = str | list[int]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on CUDA and float32 elsewhere."""
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" else "float32"
    return _DTYPES[name]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but CUDA is not available here")
    return device


def attention_backend(name: str, device: torch.device, block_size: int = 16):
    """The attention backend: 'auto' is our Triton kernels on CUDA (the measured path), torch elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        from ..kernels.backend import TritonBackend

        return TritonBackend()
    if name == "flash":
        from ..kernels.flash import FlashBackend

        return FlashBackend(device, block_size)
    raise ValueError(f"unknown attention backend {name!r}")


class LLMEngine:
    # Per-output text deltas for in-process streaming; the Triton model leaves this off (post-processing
    # detokenizes). The final output always carries the whole text.
    want_text = False

    def __init__(self, config: EngineConfig | None = None, **kwargs):
        cfg = (config or EngineConfig(**kwargs)).validate()
        self.config = cfg
        path = cfg.resolved_model_path()
        if path is None:
            from ..models import default_model

            path = default_model()
        self.model_path = path
        self.model_config = mcfg = load_config(path)
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.max_model_len = cfg.max_model_len or min(mcfg.max_position_embeddings, 8192)
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ConfigError(
                f"max_model_len ({self.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({mcfg.max_position_embeddings})"
            )
        self.tokenizer = load_tokenizer(path)
        self.eos_ids = set(cfg.eos_token_ids if cfg.eos_token_ids is not None else read_eos_ids(path, mcfg))
        self.exit_threshold = mcfg.early_exit_threshold if cfg.exit_threshold is None else cfg.exit_threshold
        t0 = time.monotonic()
        weights = load_weights(path, mcfg, self.dtype, self.device)
        if cfg.spec_tokens and cfg.spec_draft_loops >= mcfg.num_loops:
            raise ConfigError(
                f"spec_draft_loops ({cfg.spec_draft_loops}) must be less than the model's "
                f"{mcfg.num_loops} loops: the later loops verify the drafts"
            )
        if cfg.spec_tokens and self.exit_threshold < 1.0:
            raise ConfigError(
                f"spec_tokens > 0 verifies at full depth, but the checkpoint's early_exit_threshold "
                f"is {self.exit_threshold}: set exit_threshold=1.0"
            )
        # Drafts run up to spec_tokens positions past a request's last token.
        self.model = OuroModel(
            mcfg,
            weights,
            attention_backend(cfg.attention_backend, self.device, cfg.block_size),
            self.max_model_len + cfg.spec_tokens,
        )
        del weights
        log.info("loaded %s (%s, %s) in %.1fs", path, self.dtype, self.device, time.monotonic() - t0)
        num_blocks = self._num_kv_blocks()
        self.kv = KVCache(
            mcfg.num_hidden_layers,
            num_blocks,
            cfg.block_size,
            mcfg.num_key_value_heads,
            mcfg.head_dim,
            mcfg.num_loops,
            KVLayout(cfg.kv_layout),
            self.dtype,
            self.device,
            enable_prefix_caching=cfg.prefix_caching,
        )
        log.info(
            "KV cache: %d blocks of %d tokens (%s layout, %.2f GiB)",
            num_blocks,
            cfg.block_size,
            cfg.kv_layout,
            self.kv.kv.numel() * self.kv.kv.element_size() / 2**30,
        )
        log.info("prefix caching %s", "on" if cfg.prefix_caching else "off")
        deferred = self._deferred_deep(cfg, mcfg.num_loops)
        # Deferred deep batching fixes every token's depth: no gate is computed.
        mode = ExitMode.FIXED if deferred is not None else cfg.exit_mode
        self.policy = ExitPolicy(mode, mcfg.hidden_size, cfg.seed, self.device)
        self.scheduler = Scheduler(cfg, self.kv, mcfg.num_loops)
        self._in_flight: Launch | None = None  # launched, not collected (asynchronous scheduling)
        self.runner = ModelRunner(
            self.model,
            self.kv,
            self.policy,
            cfg.max_num_seqs,
            self.max_model_len,
            sorted(self.eos_ids),
            self.exit_threshold,
            cfg.spec_tokens,
            cfg.spec_draft_loops,
            deferred,
        )
        if cfg.cuda_graphs and self.device.type == "cuda" and getattr(self.model.backend, "graph_safe", False):
            t0 = time.monotonic()
            self.runner.capture_graphs(
                cfg.max_num_seqs,
                min(cfg.cuda_graph_max_tokens, cfg.max_num_batched_tokens),
                cfg.decode_rounds_per_launch,
            )
            g = self.runner.graphs
            assert g is not None
            log.info(
                "captured CUDA graphs in %.1fs (%.0f MiB): decode launches of %s rows x %s rounds, "
                "rounds with prompt chunks of up to %s tokens beside %s decode rows, speculative steps of %s rows",
                time.monotonic() - t0,
                g.memory / 2**20,
                sorted({k[0] for k in g.decode}),
                sorted({k[1] for k in g.decode}),
                sorted({k[1] for k in g.mixed}),
                sorted({k[0] for k in g.mixed}),
                sorted({k[0] for k in g.spec}) or "none",
            )
            from .memory import RESERVE_BYTES

            if g.memory > RESERVE_BYTES and not (cfg.num_blocks or cfg.kv_cache_bytes):
                log.warning(
                    "the CUDA graphs took %.0f MiB, more than the %.0f MiB that KV sizing reserved for "
                    "them: lower gpu_memory_utilization if later launches run out of memory",
                    g.memory / 2**20,
                    RESERVE_BYTES / 2**20,
                )
        self._lock = threading.Lock()
        self._inbox: list[Sequence] = []
        self._aborts: list[str] = []
        self._ids: set[str] = set()
        self._seed_counter = itertools.count()
        self.counters = dict(num_finished=0, num_aborted=0, num_failed=0, prompt_tokens=0, generation_tokens=0, steps=0)

    # ---- sizing ----
    def _block_bytes(self) -> int:
        m = self.model_config
        return (
            m.num_hidden_layers
            * 2
            * self.config.block_size
            * m.kv_size
            * torch.tensor([], dtype=self.dtype).element_size()
        )

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_blocks:
            return cfg.num_blocks
        budget = cfg.kv_cache_bytes
        if budget is None and self.device.type == "cuda":
            from .memory import profile_kv_budget

            budget = profile_kv_budget(self)
        if budget is None:
            budget = cfg.cpu_kv_cache_bytes
        blocks = budget // self._block_bytes()
        if blocks < 1:
            raise ConfigError(f"the KV budget ({budget} bytes) holds no block of {self._block_bytes()} bytes")
        return int(blocks)

    @staticmethod
    def _deferred_deep(cfg: EngineConfig, num_loops: int) -> DeferredDeepConfig | None:
        if not cfg.deferred_deep_interval:
            return None
        r = cfg.deferred_readout_loop
        if not 1 <= r < num_loops:
            raise ConfigError(
                f"deferred_readout_loop ({r}) must be in [1, {num_loops - 1}]: the model runs {num_loops} loops "
                f"and the deep loops are r+1..{num_loops}"
            )
        return DeferredDeepConfig(cfg.deferred_deep_interval, r, cfg.deferred_deep_eager)

    # ---- requests ----
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> None:
        """Validate and queue a request; raises RequestError for bad input. Thread-safe."""
        params = params or SamplingParams()
        params.validate(
            num_loops=self.model_config.num_loops, vocab_size=self.model_config.vocab_size, max_trace=MAX_TRACE
        )
        ids = self._prompt_ids(prompt)
        if len(ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(ids)} tokens; the context limit is {self.max_model_len}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context limit of {self.max_model_len} tokens"
            )
        if self.config.spec_tokens:
            T = self.model_config.num_loops
            if (params.exit_threshold is not None and params.exit_threshold < 1.0) or (
                params.max_loops is not None and params.max_loops < T
            ):
                raise RequestError(
                    f"this engine speculates (spec_tokens={self.config.spec_tokens}) and verifies "
                    f"every token at full depth: exit_threshold < 1 and max_loops < {T} are not "
                    f"served (start the engine with spec_tokens=0 for gate exits)"
                )
        if self.config.deferred_deep_interval and (
            params.exit_threshold is not None
            or params.max_loops is not None
            or params.min_loops != 1
            or params.exit_trace is not None
        ):
            raise RequestError(
                f"this engine batches deep loops deferred (deferred_deep_interval="
                f"{self.config.deferred_deep_interval}), which fixes every token's depth: exit_threshold, "
                f"min_loops, max_loops and exit_trace are not served"
            )
        need = self.kv.blocks_needed(len(ids), self.scheduler.max_positions(len(ids), params.max_tokens))
        if need > self.kv.num_blocks:
            raise RequestError(
                f"request needs {need} KV blocks but the cache only has {self.kv.num_blocks}; "
                f"lower max_tokens or give the engine more KV memory"
            )
        seed = params.seed if params.seed is not None else hash((self.config.seed, next(self._seed_counter)))
        seq = Sequence(request_id, ids, params, seed & (2**64 - 1), StopChecker(list(params.stop)))
        if params.bad_words:
            seq.bad_word_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        with self._lock:
            if request_id in self._ids:
                raise RequestError(f"request id {request_id!r} is already in use")
            self._ids.add(request_id)
            self._inbox.append(seq)

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
            if not ids:
                raise RequestError("prompt tokenizes to no tokens")
            return ids
        if not isinstance(prompt, (list, tuple)):
            raise RequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        ids = list(prompt)
        if not ids:
            raise RequestError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        return ids

    def abort_request(self, request_id: str) -> None:
        """Abort at any time; the next step() reports it finished ('abort') with its KV freed. Thread-safe."""
        with self._lock:
            self._aborts.append(request_id)

    def get_num_unfinished_requests(self) -> int:
        """Requests added and not yet reported finished (their ids are in use). Thread-safe."""
        with self._lock:
            return len(self._ids)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            pending = bool(self._inbox)
        return pending or self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """One launch (one round, or several decode rounds). Returns an output for every request that
        produced tokens or finished.

        With async_scheduling, a launch's tokens are read back during the next step (after that step has
        launched its own work), so they come out one step later; what the device computed for a request
        after it stopped on the host (a stop string, a stop token) is dropped.

        Failures (docs/engine.md, "Failure isolation"): what raises in one request's own work (staging its
        row, appending its token, its stop checks, its output) ends that request alone, with a final output
        whose finish_reason is "error" and `error` the message; the step goes on with the others. What
        raises in the batched launch or read-back ends the requests of the launches involved; waiting and
        swapped-out requests stay. Anything else (a scheduler bug) propagates."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for new in inbox:
            self.scheduler.add(new)
        changed: dict[str, Sequence] = {}
        failed: dict[str, tuple[Sequence, str]] = {}  # request id -> (request, message): ended with an error
        for rid in aborts:
            seq = self.scheduler.find(rid)
            if seq is not None:
                self.scheduler.finish(seq, FinishReason.ABORT)
                self.counters["num_aborted"] += 1
                changed[rid] = seq
        plan = self.scheduler.schedule()
        done = None
        try:
            launched = None
            if plan.has_work:
                self.counters["steps"] += 1
                launched = self.runner.launch(plan)
                self.scheduler.launched(plan)
            if self.config.async_scheduling:
                done, self._in_flight = self._in_flight, launched
            else:
                done = launched
            emitted = self.runner.collect(done) if done is not None else []
        except Exception as exc:
            log.exception("engine step: the launch failed; ending its requests")
            message = _message(exc)
            for seq in self._requests_of(plan, done):
                self._fail(seq, message, failed)
            self._in_flight = None
            emitted = []
        else:
            for seq, err in launched.failed if launched is not None else ():
                self._fail(seq, _message(err), failed)
        if self.scheduler.spec_policy is not None:
            self.scheduler.spec_policy.observe(self.runner.stats.spec_drafted, self.runner.stats.spec_accepted)
        for e in emitted:
            if isinstance(e, AwaitsDeep):
                if not e.seq.finished:
                    self.scheduler.wait_for_deep(e.seq)
                continue
            if not e.seq.finished:  # else aborted, failed, or stopped on an earlier token, while this one was out
                try:
                    self._append(e)
                except Exception as err:
                    log.exception("request %s: appending its token failed", e.seq.request_id)
                    self._fail(e.seq, _message(err), failed)
                    continue
                changed[e.seq.request_id] = e.seq
        outputs = []
        for rid, seq in changed.items():
            if rid in failed:
                continue
            try:
                out = seq.make_output(self.tokenizer, with_text=self.want_text)
            except Exception as err:
                log.exception("request %s: building its output failed", rid)
                self._fail(seq, _message(err), failed)
                continue
            if out.new_token_ids or seq.finished:
                outputs.append(out)
        outputs += [seq.error_output(message) for seq, message in failed.values()]
        ended = [out.request_id for out in outputs if out.finished]
        if ended:
            with self._lock:
                self._ids.difference_update(ended)
        return outputs

    def _requests_of(self, plan, done) -> list[Sequence]:
        """The unfinished requests of a plan whose launch (or read-back) raised, and of the launch read back
        in the same step: every one holding a slot then, and those being swapped out."""
        seqs = {id(s): s for s in plan.owners if s is not None}
        seqs.update((id(s.seq), s.seq) for s in plan.swap_out)
        if done is not None:
            seqs.update((id(s), s) for s in done.owners if s is not None)
        return [s for s in seqs.values() if not s.finished]

    def _fail(self, seq: Sequence, message: str, failed: dict) -> None:
        """End `seq` with an error now: its slot is released by the next plan, its KV and any saved swap
        copy are freed, and the step's outputs carry its error."""
        if not seq.finished:
            self.scheduler.finish(seq, FinishReason.ERROR)
        seq.finish_reason = FinishReason.ERROR  # also when it had just finished otherwise: its output is lost
        self.runner.swap.drop(seq.request_id)
        self.counters["num_failed"] += 1
        failed[seq.request_id] = (seq, message)

    def _append(self, e: Emitted) -> None:
        seq, p = e.seq, e.seq.params
        if len(seq.output_ids) == 0:
            self.counters["prompt_tokens"] += len(seq.prompt_ids)
        seq.append_token(e.token, e.depth, e.logprob)
        if e.spec_accepted is not None:
            seq.spec_drafted += self.config.spec_tokens
            seq.spec_accepted += e.spec_accepted
        self.counters["generation_tokens"] += 1
        n = len(seq.output_ids)
        # EOS and max_tokens were decided on the device (its row went idle with this token); stop tokens and
        # stop strings are the host's. NOTE: prompt + max_tokens <= max_model_len (add_request), so
        # max_tokens is also the context limit.
        reason = e.stop
        stop_text = seq.stop.update(self.tokenizer, e.token, active=n >= p.min_tokens)
        if reason is not FinishReason.STOP and n >= p.min_tokens:
            if e.token in p.stop_token_ids:
                reason = FinishReason.STOP
            elif stop_text:
                assert seq.stop.cut is not None  # set when a stop string matched
                seq.trim_chars = len(seq.stop.text) - seq.stop.cut
                reason = FinishReason.STOP
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self.counters["num_finished"] += 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt block no running request holds (as vLLM's `reset_prefix_cache`):
        benchmarks that reuse prompts start each timed run without the previous runs' prefill."""
        self.kv.pool.clear_cache()

    def stats(self) -> dict:
        pool = self.kv.pool
        rs = self.runner.stats
        return dict(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=pool.num_blocks,
            kv_blocks_free=pool.num_available,
            prefix_cache_hit_rate=pool.hit_rate or 0.0,
            prefix_cache_blocks=pool.num_cached_blocks,
            kv_usage=pool.usage,
            **dataclasses.asdict(rs),
            **self.counters,
            num_preemptions=self.scheduler.num_preemptions,
            num_recomputes=self.scheduler.num_recomputes,
            num_swapped=len(self.scheduler.swapped),
            swap_bytes=self.scheduler.swap_used,
            spec_acceptance_rate=rs.spec_accepted / rs.spec_drafted if rs.spec_drafted else 0.0,
            spec_mean_accepted_length=mean_accepted_length(rs.spec_drafted, rs.spec_accepted, self.config.spec_tokens),
        )


def _message(e: Exception) -> str:
    return f"engine error: {type(e).__name__}: {e}"


class LLM:
    """Offline generation: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **kwargs):
        self.engine = LLMEngine(config or EngineConfig(model=model, **kwargs))
        self._counter = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [cast(Prompt, prompts)]  # one prompt: a string or token ids
        prompts = cast("Seq[Prompt]", prompts)
        # One SamplingParams (or None) for every prompt, else a list or tuple of one per prompt.
        params_list = (
            list(params)
            if isinstance(params, (list, tuple))
            else [cast(SamplingParams | None, params) or SamplingParams()] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(params_list)} SamplingParams")
        ids = [f"offline-{next(self._counter)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.engine.add_request(rid, prompt, p)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]
