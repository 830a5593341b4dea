"""Prompt-chunk attention's launch config: `paged_attention` over one chunk's queries, timed alone, against
torch's SDPA (FlashAttention) on the same keys laid out contiguously: how far the paged prefill kernel is
from a well-kept library's, and which tile, warps and stages close it.

A case is rows of ``tokens`` new tokens each after ``ctx`` cached ones, alike (``4x512+512``) or not
(``1314+586/730+0``: `parse_case`) (the 1.4B shape: 16 heads, 16 kv heads of 128; block size 16, each row's
blocks scattered over the cache), causal. Every config runs 24 launches
(one per layer, each over its own layer's KV) captured as one CUDA graph: us a launch (median of
``--replays``) and TFLOP/s (QK^T and PV of the causal part: 2 x queries x keys seen x heads x head dim x 2). Each
output is compared with the default config's (bitwise, and the largest difference); SDPA's with the default's too
(a wrong layout would show; `tests/test_kernels.py` checks the layout against the reference on the CPU).
``--graph-rows N`` launches each case as a mixed CUDA graph does: its rows followed by empty ones up to N,
and ``max_seqlen_q`` the whole query buffer (the graph's token bucket), not one row's tokens.

    PYTHONPATH=$PWD python3 benchmarks/kernels/prefill_attn_sweep.py --cases 1x2048+0,4x512+512 --out attn.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from benchmarks.graph_timing import graph_ms
from benchmarks.kernels.bench_kernels import rel_err
from ouro_backend.kernels.attention import paged_attention

LAYERS, H, KVH, HD, BS = 24, 16, 16, 128, 16
GRID = [
    dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
    for bm, bn, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))
]


def parse_case(spec: str) -> list[tuple[int, int]]:
    """A case's rows as (tokens, ctx): ``ROWSxTOKENS+CONTEXT`` parts joined by ``/`` (``ROWSx`` may be left out):
    ``4x512+512``, or ``1314+586/730+0``, a chunk that continues a prompt after 586 cached tokens, then a new
    prompt's first 730 (how the scheduler fills a chunk: continuing chunks first)."""
    shapes: list[tuple[int, int]] = []
    for part in spec.split("/"):
        count, _, rest = part.rpartition("x")
        tokens, ctx = rest.split("+")
        shapes += [(int(tokens), int(ctx))] * int(count or 1)
    return shapes


class Case:
    def __init__(self, shapes: list[tuple[int, int]], device: str = "cuda", layers: int = LAYERS, graph_rows: int = 0):
        dev, dt = torch.device(device), torch.bfloat16
        self.layers, self.shapes = layers, shapes
        rows = len(shapes)
        per_row = [(ctx + tokens + BS - 1) // BS for tokens, ctx in shapes]
        gen = torch.Generator(device=dev).manual_seed(0)
        self.kv = torch.randn(layers, 2, sum(per_row), BS, KVH, HD, device=dev, dtype=dt, generator=gen)
        perm = torch.randperm(sum(per_row), device=dev, generator=gen).to(torch.int32)
        self.tables = torch.zeros(rows, max(per_row), device=dev, dtype=torch.int32)
        for r, first in enumerate(itertools.accumulate([0, *per_row[:-1]])):
            self.tables[r, : per_row[r]] = perm[first : first + per_row[r]]  # scattered, as a busy cache holds them
        tokens = torch.tensor([0] + [t for t, _ in shapes], device=dev)
        self.cu = tokens.cumsum(0).to(torch.int32)
        self.lens = torch.tensor([t + c for t, c in shapes], device=dev, dtype=torch.int32)
        self.max_q = max(t for t, _ in shapes)
        self.launch_tables = self.tables
        if graph_rows > rows:  # empty rows after the case's, as a mixed graph's launch has them
            pad = graph_rows - rows
            self.cu = torch.cat([self.cu, self.cu[-1:].expand(pad)])
            self.lens = torch.cat([self.lens, self.lens.new_zeros(pad)])
            self.launch_tables = torch.cat([self.tables, self.tables.new_zeros(pad, self.tables.shape[1])])
            self.max_q = int(self.cu[-1])
        self.graph_rows = graph_rows
        self.q = torch.randn(int(self.cu[-1]), H, HD, device=dev, dtype=dt, generator=gen)
        self.out = torch.empty_like(self.q)
        keys_seen = sum(t * c + t * (t + 1) // 2 for t, c in shapes)  # causal: query i sees ctx + i + 1 keys
        self.flops = keys_seen * H * HD * 2 * 2

    @property
    def label(self) -> str:
        padded = f" in {self.graph_rows}" if self.graph_rows > len(self.shapes) else ""
        runs = [(len(list(g)), shape) for shape, g in itertools.groupby(self.shapes)]
        return "/".join(f"{n}x{t}+{c}" for n, (t, c) in runs) + padded

    def call(self, layer: int, cfg: dict) -> None:
        kc, vc = self.kv[layer, 0], self.kv[layer, 1]
        paged_attention(
            self.q, kc, vc, self.cu, self.lens, self.launch_tables, HD**-0.5, self.max_q, out=self.out, **cfg
        )

    def time_us(self, cfg: dict, replays: int) -> float:
        return graph_ms(lambda: [self.call(layer, cfg) for layer in range(self.layers)], replays) * 1e3 / self.layers

    def sdpa(self):
        """torch SDPA (its FlashAttention backend on a GPU) on contiguous [rows, heads, seq, hd] copies of the
        keys, one call per run of rows of the same shape: (a function that runs it over every layer, a function
        that returns layer 0's output in the paged kernel's layout). The queries sit at the end of each row
        (bottom-right causal alignment, as a chunk after cached tokens)."""
        groups = []  # (queries [n, H, tokens, HD], keys and values of each layer, mask or None)
        r = 0
        for (tokens, ctx), g in itertools.groupby(self.shapes):
            n, seq = len(list(g)), ctx + tokens
            blocks = self.tables[r : r + n, : (seq + BS - 1) // BS].long()

            def contiguous(cache: torch.Tensor, blocks=blocks, n=n, seq=seq) -> torch.Tensor:
                return cache[blocks].reshape(n, -1, KVH, HD)[:, :seq].transpose(1, 2).contiguous()

            q0 = int(self.cu[r])
            q = self.q[q0 : q0 + n * tokens].view(n, tokens, H, HD).transpose(1, 2).contiguous()
            mask = None
            if ctx:  # bottom-right causal: query i sees keys < ctx + i + 1
                i = torch.arange(tokens, device=q.device)[:, None]
                mask = torch.arange(seq, device=q.device)[None, :] <= ctx + i
            kvs = [(contiguous(self.kv[layer, 0]), contiguous(self.kv[layer, 1])) for layer in range(self.layers)]
            groups.append((q, kvs, mask))
            r += n
        outs: list[list[torch.Tensor]] = []

        def run() -> None:
            outs.clear()
            for q, kvs, mask in groups:
                outs.append(
                    [F.scaled_dot_product_attention(q, k, v, is_causal=mask is None, attn_mask=mask) for k, v in kvs]
                )

        def layer0() -> torch.Tensor:
            return torch.cat([o[0].transpose(1, 2).reshape(-1, H, HD) for o in outs])

        return run, layer0


def name(cfg: dict) -> str:
    return f"m{cfg['block_m']}_n{cfg['block_n']}_w{cfg['num_warps']}_st{cfg['num_stages']}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--cases", default="1x2048+0,4x512+512", help="ROWSxTOKENS+CONTEXT[/...] (`parse_case`), comma-separated"
    )
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--graph-rows", type=int, default=0, help="pad each case with empty rows to N (a mixed graph's)")
    ap.add_argument("--bf16-tflops", type=float, default=990.0)
    ap.add_argument("--grid", help="only these configs (names as printed, e.g. m128_n64_w8_st2)")
    ap.add_argument("--out", help="JSON, rewritten after every case")
    ap.add_argument(
        "--save-outputs", help="torch.save the default config's output of every case here (to compare builds bitwise)"
    )
    args = ap.parse_args()
    grid = GRID if not args.grid else [c for c in GRID if name(c) in args.grid.split(",")]
    report: dict = {"device": torch.cuda.get_device_name(), "bf16_tflops": args.bf16_tflops, "cases": {}}
    saved: dict[str, torch.Tensor] = {}
    for spec in args.cases.split(","):
        case = Case(parse_case(spec), graph_rows=args.graph_rows)
        case.call(0, {})
        ref = case.out.float().clone()
        saved[case.label] = case.out.cpu().clone()
        res: dict = {"flops": case.flops, "configs": {}}

        def record(label: str, us: float, out: torch.Tensor, res=res, case=case, ref=ref) -> None:
            tf = case.flops / (us * 1e-6) / 1e12
            err, same = rel_err(out, ref), torch.equal(out.float(), ref)
            res["configs"][label] = dict(us=round(us, 2), tflops=round(tf, 1), max_rel_diff=err, bitwise_equal=same)
            pct = 100 * tf / args.bf16_tflops
            diff = "bitwise equal" if same else f"max rel. diff {err:.1e}"
            print(f"{case.label:20s} {label:20s} {us:9.2f} us {tf:7.1f} TFLOP/s {pct:5.1f}%  {diff}", flush=True)

        record("default", case.time_us({}, args.replays), ref)
        try:
            run, out = case.sdpa()
            record("torch_sdpa", graph_ms(run, args.replays) * 1e3 / case.layers, out())
        except Exception as e:  # no flash backend for this shape: recorded, not fatal
            print(f"{case.label:20s} torch_sdpa: {type(e).__name__}: {str(e)[:160]}", flush=True)
        for cfg in grid:
            try:
                us = case.time_us(cfg, args.replays)
            except Exception as e:  # a config the kernel cannot take (shared memory, registers): not fatal
                print(f"{case.label:20s} {name(cfg)}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            case.call(0, cfg)
            record(name(cfg), us, case.out)
        best = min(res["configs"].items(), key=lambda kv: kv[1]["us"])
        print(f"{case.label:20s} fastest: {best[0]} {best[1]}", flush=True)
        report["cases"][case.label] = res
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        if args.save_outputs:
            torch.save(saved, args.save_outputs)


if __name__ == "__main__":
    main()
