"""Diagnostics: a record of every engine step, to compare the served engine's rounds with engine-direct's.

With OURO_ENGINE_TRACE=PATH set, the engine process (ouro_backend/serving/engine_server.py) records each step
that launched work: its start, its duration, the launch's shape (ModelRunner.last_round) and the tokens
read back in that step (those of the launch before, with asynchronous scheduling). It writes
them to PATH as JSON when it stops. `summarize` reduces such a file to a few numbers;
`benchmarks/served.py --trace` prints them.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time

log = logging.getLogger(__name__)

ENV = "OURO_ENGINE_TRACE"
COLUMNS = ["start_s", "step_s", "prefill_tokens", "decode_rows", "rounds", "emitted", "running"]


class RoundTrace:
    def __init__(self, engine, path: str):
        self.engine, self.path = engine, path
        self.rows: list[tuple] = []

    @classmethod
    def from_env(cls, engine) -> RoundTrace | None:
        path = os.environ.get(ENV)
        return cls(engine, path) if path else None

    def step(self) -> list:
        """engine.step(), recorded when it ran a round (a step with only aborts runs none)."""
        runner = self.engine.runner
        launches = runner.stats.launches
        t0 = time.perf_counter()
        outputs = self.engine.step()
        if runner.stats.launches != launches:
            r = runner.last_round
            self.rows.append(
                (
                    t0,
                    time.perf_counter() - t0,
                    r["prefill_tokens"],
                    r["decode_rows"],
                    r["rounds"],
                    sum(len(o.new_token_ids) for o in outputs),
                    r["running"],
                )
            )
        return outputs

    def write(self) -> None:
        with open(self.path, "w") as f:
            json.dump(dict(columns=COLUMNS, rows=self.rows), f)
        log.info("round trace: %d steps written to %s", len(self.rows), self.path)


def summarize(path: str, since: float | None = None) -> dict:
    """A trace file in numbers: steps, busy and wall time, steps with prompt work, the median full decode
    round (the most rows seen, no prompt work) and the mean number of running requests (time-weighted).
    `since`: only the steps that started at or after this time.perf_counter() (a run's timed part; on Linux
    the clock is the system's monotonic one, so another process on the machine can give it)."""
    with open(path) as f:
        trace = json.load(f)
    col = {name: i for i, name in enumerate(trace["columns"])}
    rows = trace["rows"] if since is None else [r for r in trace["rows"] if r[col["start_s"]] >= since]
    if not rows:
        return dict(steps=0)
    step, prefill, running = col["step_s"], col["prefill_tokens"], col["running"]
    busy = sum(r[step] for r in rows)
    with_prompt = [r[step] for r in rows if r[prefill]]
    full = max(r[running] for r in rows)
    steady = [r[step] for r in rows if not r[prefill] and r[running] == full]
    return dict(
        steps=len(rows),
        busy_s=busy,
        span_s=rows[-1][col["start_s"]] + rows[-1][step] - rows[0][col["start_s"]],
        prefill_steps=len(with_prompt),
        prefill_busy_s=sum(with_prompt),
        steady_round_ms=1e3 * statistics.median(steady) if steady else None,
        mean_running=sum(r[step] * r[running] for r in rows) / busy if busy else 0.0,
    )
