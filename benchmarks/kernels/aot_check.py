"""Compile every kernel for an NVIDIA target without a GPU (Triton's bundled ptxas), to catch code that
runs under the CPU interpreter but does not compile for the device.

    python benchmarks/kernels/aot_check.py [--arch 90] [--ptxas-v] [--ptx-hash] [--sweep candidates.json]

Signatures mimic what a real launch specialises at Ouro-1.4B shapes (bf16, H=kvh=16, hd=128, block 16):
unit strides become constants, pointers and the other strides are marked 16-divisible. ``--ptxas-v``
prints registers / spills per kernel (needs a ptxas that accepts the generated PTX version).
Must be imported WITHOUT ``TRITON_INTERPRET=1`` (the kernels have to be real JIT functions).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time


def _compile(kernel, args: dict, arch: int, **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "PDL" in kernel.arg_names:  # the variant the GPU runs: programmatic dependent launch
        args = {"PDL": True, **args}
        options = {"launch_pdl": True, **options}
    sig, const, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        v = args[name]
        if kernel.params[i].is_constexpr or not isinstance(v, str):
            sig[name] = "constexpr"
            const[name] = v
        else:
            sig[name] = v
            if v.startswith("*") or name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", arch, 32), options=options)


def _strides(prefix: str, dims: str, unit_last=True) -> dict:
    out = {f"stride_{prefix}{d}": "i32" for d in dims}
    if unit_last:
        out[f"stride_{prefix}{dims[-1]}"] = 1
    return out


def configs():
    """(label, kernel, args, launch options) for every kernel at the configs the wrappers pick."""

    from ouro_backend.kernels import activation, attention, norm, projections, rope

    H = KVH = 16
    HD, D, BS = 128, 2048, 16
    out = []

    def paged_attn(label, dt, fp32, max_q, rows, H, G, hd, splits, rope_in):
        """`_paged_attn_kernel` at `_attn_config`'s choice for these shapes, as `attention._launch` binds it."""
        c = attention._attn_config(max_q, G, hd, fp32, None, None, None, None, splits, rows=rows)
        a = dict(
            q_ptr=f"*{dt}",
            kc_ptr=f"*{dt}",
            vc_ptr=f"*{dt}",
            out_ptr=f"*{dt}",
            o_part_ptr="*fp32",
            lse_part_ptr="*fp32",
            cu_q_ptr="*i32",
            seq_lens_ptr="*i32",
            bt_ptr="*i32",
            count_ptr="*i32",
            pos_ptr="*i64",
            cs_ptr="*fp32",
            kn_ptr=f"*{dt}",
            vn_ptr=f"*{dt}",
            slot_ptr="*i64",
            qk_scale="fp32",
            num_tokens="i32",
            num_rows="i32",
            stride_bt="i32",
            stride_cs="i32",
            NUM_HEADS=H,
            QUERIES_PER_KV=G,
            HEAD_DIM=hd,
            BLOCK_SIZE=BS,
            NUM_SPLITS=splits,
            ROPE=rope_in,
            PREFETCH_KV=rope_in,  # as the engine launches it
            DOT_PREC="ieee" if fp32 else "tf32",
            INTERP=False,
            PACKED_TILES=c.packed_tiles(max_q, splits),
        )
        for p in ("q", "o", "kn", "vn"):
            a.update(_strides(p, "nhd"))
        for p in "kv":
            a.update(_strides(p, "bshd"))
        label += (
            f" BM={c.block_m} BN={c.block_n} grain={c.split_grain} first={c.first_n} w={c.num_warps} s={c.num_stages}"
        )
        args = c.launch_args()
        opts = dict(num_warps=args.pop("num_warps"), num_stages=args.pop("num_stages"))
        return label, attention._paged_attn_kernel, {**a, **args}, {**opts, "enable_fp_fusion": False}

    for dt, fp32 in (("bf16", False), ("fp32", True)):
        # (max_q, rows, splits, rope): decode as `splits_for` splits 16 kv heads on 132 SMs, then a prompt
        decode = ((1, 64, 1, False), (1, 4, 4, False), (1, 16, 1, True), (1, 8, 2, True), (1, 4, 4, True))
        for max_q, rows, splits, rope_in in (*decode, (1, 1, 8, True), (1024, 4, 1, False)):
            label = f"paged_attn {dt} max_q={max_q} rows={rows} splits={splits}{' rope' if rope_in else ''}"
            out.append(paged_attn(label, dt, fp32, max_q, rows, H, 1, HD, splits, rope_in))
    # GQA (G=3 padded to 4), head_dim 96 padded to 128, prefill tile
    out.append(paged_attn("paged_attn bf16 GQA G=3 hd=96", "bf16", False, 512, 4, 12, 3, 96, 1, False))

    dt = "bf16"
    kv_tile = dict(BLOCK_SIZE=BS, NUM_KV_HEADS=KVH, HEAD_DIM=HD, BLOCK_H=16, BLOCK_D=HD)
    a = dict(
        k_ptr=f"*{dt}",
        v_ptr=f"*{dt}",
        kc_ptr=f"*{dt}",
        vc_ptr=f"*{dt}",
        slot_ptr="*i64",
        INTERP=False,
        **kv_tile,
        **_strides("k", "nhd"),
        **_strides("v", "nhd"),
        **_strides("kc", "bshd"),
        **_strides("vc", "bshd"),
    )
    out.append(("write_kv", attention._write_kv_kernel, a, dict(num_warps=4)))
    a = dict(a, k_ptr="*fp32", v_ptr="*fp32")
    out.append(("write_kv fp32->bf16", attention._write_kv_kernel, a, dict(num_warps=4)))
    a = dict(
        kv_ptr=f"*{dt}",
        src_ptr="*i64",
        dst_ptr="*i64",
        stride_l="i64",
        stride_kv="i32",
        stride_b="i32",
        stride_s="i32",
        stride_h="i32",
        stride_d=1,
        **kv_tile,
    )
    out.append(("copy_kv_slots", attention._copy_kv_slots_kernel, a, dict(num_warps=4)))
    nopt = dict(num_warps=8, enable_fp_fusion=False)
    for ndt in ("bf16", "fp32"):
        a = dict(
            x_ptr=f"*{ndt}",
            w_ptr=f"*{ndt}",
            y_ptr=f"*{ndt}",
            stride_xn="i32",
            stride_yn="i32",
            D="i32",
            eps="fp32",
            BLOCK_D=D,
            INTERP=False,
        )
        out.append((f"rms_norm {ndt}", norm._rms_norm_kernel, a, nopt))
        a = dict(
            x_ptr=f"*{ndt}",
            res_ptr=f"*{ndt}",
            w_post_ptr=f"*{ndt}",
            w_next_ptr=f"*{ndt}",
            res_out_ptr=f"*{ndt}",
            y_ptr=f"*{ndt}",
            stride_xn="i32",
            stride_rn="i32",
            stride_ron="i32",
            stride_yn="i32",
            D="i32",
            eps="fp32",
            BLOCK_D=D,
            INTERP=False,
        )
        out.append((f"sandwich_norm {ndt}", norm._sandwich_norm_kernel, a, nopt))
    ropt = dict(num_warps=4, enable_fp_fusion=False)
    heads = dict(
        NUM_Q_HEADS=H, NUM_K_HEADS=KVH, HALF=HD // 2, BLOCK_HQ=16, BLOCK_HK=16, BLOCK_HALF=HD // 2, INTERP=False
    )
    a = dict(
        q_ptr=f"*{dt}",
        k_ptr=f"*{dt}",
        pos_ptr="*i64",
        cs_ptr="*fp32",
        stride_cs="i32",
        **heads,
        **_strides("q", "nhd"),
        **_strides("k", "nhd"),
    )
    out.append(("rope", rope._rope_kernel, a, ropt))
    a = dict(
        q_ptr=f"*{dt}",
        k_ptr=f"*{dt}",
        v_ptr=f"*{dt}",
        pos_ptr="*i64",
        cs_ptr="*fp32",
        kc_ptr=f"*{dt}",
        vc_ptr=f"*{dt}",
        slot_ptr="*i64",
        stride_cs="i32",
        BLOCK_SIZE=BS,
        **heads,
        **_strides("q", "nhd"),
        **_strides("k", "nhd"),
        **_strides("v", "nhd"),
        **_strides("kc", "bshd"),
        **_strides("vc", "bshd"),
    )
    out.append(("rope_and_write_kv", rope._rope_write_kv_kernel, a, ropt))
    a = dict(
        x_ptr=f"*{dt}",
        y_ptr=f"*{dt}",
        stride_xn="i32",
        stride_yn="i32",
        I="i32",
        BLOCK=1024,
        INTERP=False,
        LIBDEVICE=activation._HAS_LIBDEVICE,
    )
    out.append(("silu_mul", activation._silu_mul_kernel, a, dict(num_warps=4, enable_fp_fusion=False)))
    table = [(N, K, max_m, cfg) for (N, K), rows in projections.DECODE_TABLE.items() for max_m, cfg in rows]
    out += linear_configs(table)
    # o asks L2 for gate/up's two halves (`L2_AHEAD_TABLE`): its config at those rows, with the prefetch
    l2 = [
        (N, K, m, projections.config_for(N, K, m))
        for (N, K), rows in projections.L2_AHEAD_TABLE.items()
        for m, _ in rows
    ]
    out += linear_configs(l2, l2_ranges=2)
    out += coda_configs()
    return out


def coda_configs(candidates=None) -> list:
    """(label, kernel, args, options) of the fused greedy coda at 1-64 rows (hidden 2048, ouro mode), at the
    table's config for each row count or at each of `candidates` (`kernels.coda.CodaConfig`s)."""
    from ouro_backend.engine import decode_state as ds
    from ouro_backend.kernels import coda

    out = []
    rows = (1, 2, 4, 8, 16, 64)
    pairs = [(c, m) for c in candidates for m in rows] if candidates else [(coda.coda_config(m), m) for m in rows]
    for cfg, m in pairs:
        dot = cfg.dot or m > coda.MAX_FMA_M
        bm = max(16, m) if dot else m
        for dt in ("bf16", "fp32"):
            a = dict(
                h_ptr=f"*{dt}",
                w_ptr=f"*{dt}",
                tok_ptr="*i64",
                lp_ptr="*fp32",
                part_ptr="*fp32",
                count_ptr="*i32",
                idx_ptr="*i64",
                ints_ptr="*i64",
                floats_ptr="*fp64",
                rem_ptr="*fp32",
                trace_ptr="*i64",
                lam_ptr="*fp32",
                M="i32",
                V="i32",
                stride_h="i32",
                stride_w="i32",
                stride_ints="i32",
                stride_floats="i32",
                stride_trace="i32",
                K=2048,
                **{f"C_{c}": ds.COLUMNS[c] for c in ("ACTIVE", "LOOP", "NGEN", "PENDING", "MIN_LOOPS")},
                **{f"C_{c}": ds.COLUMNS[c] for c in ("MAX_LOOPS", "TRACE_LEN", "THRESHOLD")},
                MODE=0,
                BLOCK_M=bm,
                BLOCK_V=cfg.block_v,
                BLOCK_K=cfg.block_k,
                USE_DOT=dot,
                DOT_PREC="tf32" if dt == "bf16" else "ieee",
                P_CHUNK=128,
                INTERP=False,
            )
            label = f"greedy_coda {dt} M<={m} v{cfg.block_v} k{cfg.block_k} w{cfg.num_warps}{' dot' if dot else ''}"
            opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages if dot else 1)
            out.append((label, coda._greedy_coda_kernel, a, opts))
    return out


GATE_UP = (11264, 2048)  # the gate/up weight of Ouro-1.4B/2.6B (DECODE_TABLE's shape)


def linear_configs(entries, l2_ranges: int = 0) -> list:
    """(label, kernel, args, options) of the projection kernel for (N, K, M, config) entries (None: cuBLAS,
    skipped), plain, with the SiLU fused into x where the config's path can fuse it, and with the activation
    in the epilogue (GLU) for the gate/up shape; with ``l2_ranges``, only plain with that many L2 prefetch
    ranges of the next weight. A config the shape cannot take comes back with kernel None and the reason as
    its args (`compile_all` counts it as a failure)."""
    import torch

    from ouro_backend.kernels import projections

    out = []
    for N, K, max_m, cfg in entries:
        if cfg is None:
            continue
        label = f"linear {N}x{K} M<={max_m} {cfg.name}"
        glu_too = (N, K) == GATE_UP  # `kernels.mlp` runs gate/up with the activation in its epilogue
        variants = [(False, False), (True, False)] + ([(False, True)] if glu_too else [])
        for silu_x, glu in variants[:1] if l2_ranges else variants:  # on the tensor-core path SILU_X stays False
            try:
                consts = projections.launch_constants(cfg, max_m, K, torch.bfloat16, silu_x, glu, l2_ranges)
            except AssertionError as e:
                out.append((label, None, f"invalid config: {e}", {}))
                break
            if silu_x and not consts["SILU_X"]:
                continue
            a = dict(
                x_ptr="*bf16",
                w_ptr="*bf16",
                y_ptr="*bf16",
                part_ptr="*fp32",
                count_ptr="*i32",
                M="i32",
                N="i32",
                K="i32",
                stride_xm="i32",
                stride_wn="i32",
                stride_ym="i32",
                l2_ptr="*bf16",
                l2_len="i32",
                l2_stride="i32",
                INTERP=False,
                LIBDEVICE=projections._HAS_LIBDEVICE,
                **consts,
            )
            opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            name = label + (" silu_x" if silu_x else "") + (" glu" if glu else "") + (" l2" if l2_ranges else "")
            out.append((name, projections._linear_kernel, a, opts))
    return out


def sweep_configs(path: str) -> list:
    """The projection kernel at every config of a sweep JSON (what linear_bench.py writes with ``--out`` and
    loop_bench.py reads with ``--sweep``) that is not marked failed, to compile candidates before timing them
    on a GPU."""
    import json

    from ouro_backend.kernels import projections

    with open(path) as f:
        sweep = json.load(f)["sweep"]
    entries = [
        (row["N"], row["K"], row["M"], projections.LinearConfig(**c["config"]))
        for row in sweep
        for c in row["configs"]
        if c.get("ok", True)
    ]
    return linear_configs(entries)


def ptx_hash(ptx: str) -> str:
    """A hash of a kernel's PTX without its debug information (source lines, DWARF): equal before and after a
    refactor means the device runs the same code."""
    import hashlib

    code = ptx.split(".section\t.debug")[0]
    lines = (ln for ln in code.splitlines() if not ln.strip().startswith((".loc", ".file")))
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:12]


def _ptxas_info(ptx: str, arch: int) -> str:
    import triton

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        for exe in ("ptxas-blackwell", "ptxas"):
            path = os.path.join(bindir, exe)
            if not os.path.exists(path):
                continue
            r = subprocess.run(
                [path, f"--gpu-name=sm_{arch}a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                capture_output=True,
                text=True,
            )
            if r.returncode == 0:
                lines = [
                    ln.split(":", 1)[-1].strip()
                    for ln in (r.stdout + r.stderr).splitlines()
                    if "registers" in ln or "spill" in ln
                ]
                return " | ".join(lines)
    return "(ptxas unavailable)"


def compile_all(
    arch: int = 90, verbose: bool = True, ptxas_v: bool = False, sweep: str | None = None, hashes: bool = False
) -> int:
    """Compile everything (or only a sweep's projection configs); returns the number of failures."""
    failures = 0
    for label, kernel, args, opts in sweep_configs(sweep) if sweep else configs():
        t = time.time()
        if kernel is None:  # a config the shape cannot take (linear_configs)
            failures += 1
            if verbose:
                print(f"{label:62s} FAILED: {args}", flush=True)
            continue
        try:
            ck = _compile(kernel, args, arch, **opts)
            msg = f"ok  {time.time() - t:5.1f}s  smem={ck.metadata.shared}"
            if hashes:
                msg += f"  ptx={ptx_hash(ck.asm['ptx'])}"
            if ptxas_v:
                msg += "  " + _ptxas_info(ck.asm["ptx"], arch)
        except Exception as e:
            failures += 1
            msg = f"FAILED: {type(e).__name__}: {str(e)[:2000]}"
        if verbose:
            print(f"{label:62s} {msg}", flush=True)
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--ptxas-v", action="store_true")
    ap.add_argument("--sweep", help="compile only the projection configs of this sweep JSON (candidates)")
    ap.add_argument("--ptx-hash", action="store_true", help="print each kernel's PTX hash, debug info left out")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET: the kernels must be real JIT functions", file=sys.stderr)
        return 2
    n = compile_all(args.arch, ptxas_v=args.ptxas_v, sweep=args.sweep, hashes=args.ptx_hash)
    print("ALL COMPILED" if n == 0 else f"{n} FAILED")
    return 1 if n else 0


if __name__ == "__main__":
    sys.exit(main())
