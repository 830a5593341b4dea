"""A model stand-in for measuring the serving path alone (benchmarks/served.py --stand-in).

The engine process runs the real `LLMEngine` (scheduler, KV admission, token bookkeeping, stop rules,
outputs) and the real sockets and protocol, and the Triton side is the real front and stubs; only the
model is replaced. `StandInRunner` takes the `ModelRunner`'s place: a launch costs nothing, every decode
row emits one token per launch and a prompt's last chunk emits its first token, so the engine produces
tokens as fast as the host can take them and the serving path's own ceiling shows.

The engine process loads it through `OURO_ENGINE_RUNNER=benchmarks.stand_in_engine:StandInRunner`
(ouro_backend/serving/engine_server.py), with this checkout on its PYTHONPATH. With
`OURO_STAND_IN_ROUND_MS=T` (served.py --stand-in-round-ms) a launch lasts T ms in all, the host work it
overlaps included (longer only if that work takes longer), as a GPU round would: the engine then emits at
a fixed rate (rows / T), so what the serving path spends per token can be read off at a load it carries,
not only at its ceiling.

Tokens: ids of the checkpoint's vocabulary other than its EOS ids, in a fixed pseudo-random order per
request position, so detokenization does real work; depth = the model's loops; no EOS, so a request ends
at max_tokens (the device's `length` rule, as the real runner reports it).
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field

from ouro_backend.engine.model_runner import Emitted, Launch, LaunchTimer, RunnerStats
from ouro_backend.engine.scheduler import SchedulerOutput
from ouro_backend.engine.sequence import Sequence
from ouro_backend.outputs import FinishReason

ROUND_MS_ENV = "OURO_STAND_IN_ROUND_MS"


@dataclass
class _StandInLaunch(Launch):
    emitted: list[Emitted] = field(default_factory=list)


class StandInRunner:
    def __init__(self, engine):
        real = engine.runner
        self.num_loops = real.num_loops
        self.swap = real.swap  # the engine drops a failed request's swap copy through it
        self.stats = RunnerStats()
        self.timer = LaunchTimer(real.device)
        self.record_logits = False
        self.overlap = None  # set by the engine process: host work to do "while the GPU runs"
        self.graphs = None
        self.speculator = None
        self.last_round: dict[str, int] = {}
        eos = set(engine.eos_ids)
        self._tokens = [t for t in range(3, engine.model_config.vocab_size) if t not in eos]
        random.Random(0).shuffle(self._tokens)
        self._made: dict[int, tuple[Sequence, int]] = {}  # id(seq) -> (seq, tokens emitted for it)
        self._round_s = float(os.environ.get(ROUND_MS_ENV, "0") or 0) / 1e3

    def _emit(self, seq: Sequence) -> Emitted | None:
        entry = self._made.get(id(seq))
        n = entry[1] if entry is not None and entry[0] is seq else len(seq.output_ids)
        if n >= seq.params.max_tokens:
            return None  # its last token is out; the host has not released it yet
        n += 1
        self._made[id(seq)] = (seq, n)
        stop = FinishReason.LENGTH if n >= seq.params.max_tokens else None
        if stop is not None:
            del self._made[id(seq)]
        token = self._tokens[(n * 7919 + len(seq.prompt_ids)) % len(self._tokens)]
        return Emitted(seq, token, -1.0, self.num_loops, stop)

    def launch(self, plan: SchedulerOutput) -> Launch:
        t0 = time.perf_counter()
        owners = list(plan.owners)
        emitted = []
        for c in plan.prefill:
            if c.loop == self.num_loops and c.start + c.n == c.seq.prefill_target and not c.seq.resuming:
                emitted.append(self._emit(c.seq))
        for slot in plan.decode_slots:
            seq = owners[slot]
            assert seq is not None  # a decode slot has an owner
            emitted.append(self._emit(seq))
        if self.overlap is not None:
            self.overlap()
        if self._round_s:  # the rest of the round, as the GPU's
            time.sleep(max(0.0, self._round_s - (time.perf_counter() - t0)))
        self.stats.launches += 1
        self.stats.rounds += 1
        self.last_round = dict(
            prefill_tokens=sum(c.n for c in plan.prefill),
            decode_rows=len(plan.decode_slots),
            rounds=1,
            running=sum(s is not None for s in owners),
        )
        return _StandInLaunch(owners, emitted=[e for e in emitted if e is not None])

    def collect(self, launch: Launch) -> list[Emitted]:
        assert isinstance(launch, _StandInLaunch)
        return launch.emitted
