"""The decode attention kernel's sm90 PTX over a bf16 and an fp8 KV cache, compiled without a GPU: lines,
shared-memory loads, mma instructions and conversions (the README's counts).

Run from the repository root of a checkout of branch fp8-kv (main's kernel does not compile over an fp8
cache): `b9b4125` gave 2,957 lines / 243 conversions over fp8, `58d3062` (fp16 dots) 2,339 / 139;
over bf16 1,751 / 32 and 1,749 / 32.

    python benchmarks/results/2026-12-03-h200-fp8-kv/ptx_counts.py
"""

import re
import sys

sys.path.insert(0, ".")
from benchmarks.kernels.aot_check import _compile, configs

LABEL = "paged_attn bf16 max_q=1 splits=1 BM=16 BN=64 w=4 s=3"  # the decode config of 17-64 rows


def count(lines: list[str], pattern: str) -> int:
    return sum(bool(re.search(pattern, x)) for x in lines)


for label, kernel, args, options in configs():
    if label != LABEL:
        continue
    for cache in ("bf16", "fp8e4nv"):
        ptx = _compile(kernel, dict(args, kc_ptr=f"*{cache}", vc_ptr=f"*{cache}"), 90, **options).asm["ptx"]
        lines = ptx.splitlines()
        shared, ldm = count(lines, r"ld\.shared|ldmatrix"), count(lines, "ldmatrix")
        mma, cvt = count(lines, r"\bmma\.|wgmma"), count(lines, r"cvt\.")
        print(f"{cache}: {len(lines)} lines, {shared} shared loads ({ldm} ldmatrix), {mma} mma, {cvt} cvt")
