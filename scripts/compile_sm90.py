"""Compile Triton kernels for sm_90 on a machine without a GPU, to catch compiler failures before a GPU call.

Triton lowers a kernel to PTX and runs ptxas without a device, so a pass that asserts on a kernel (as
Triton 3.6's thread-locality pass did on the tiled indexer KL forward) fails here as it would on the
H100. Use the GPU image's Triton, installed beside the project's without touching it:

    pip install --no-deps --target /tmp/tri36 triton==3.6.0
    PYTHONPATH=/tmp/tri36 python scripts/compile_sm90.py tiled_kl

Each preset names kernels, their pointer types and the constexpr values the host code launches them
with; integer arguments not named are i32. Prints one line per compile: ok with its warps, shared
memory, and the registers and spills Triton's bundled ptxas reports (which set how many programs fit
on an SM), or FAIL with the compiler's last line. Exit status 1 if any failed. ``--loops`` also prints
the instructions of each loop's iteration in the sm_90 SASS and what each forward branch inside a loop
skips (``sass_loops``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hyscale_hf.kernels.indexer_kl import tiled  # noqa: E402
from hyscale_hf.kernels.sparse_attn import tile_head_probs  # noqa: E402
from hyscale_hf.kernels.topk import triton_kernels as topk_kernels  # noqa: E402


def compile_for_sm90(fn, pointers: dict[str, str], constexprs: dict, options: dict):
    """The compiled kernel of ``fn`` for sm_90: ``pointers`` maps argument names to Triton types ("*bf16",
    "tensordesc<bf16[1,64,64]>"), ``constexprs`` gives every constexpr argument; other arguments are
    i32. ``options``: the launch's compile options (num_warps, num_stages, maxnreg)."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    src = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_usage(ptx: str) -> str:
    """Registers a thread and spill bytes of ``ptx`` as the ptxas Triton itself assembles sm_90 with
    reports them (the bundled one that reads this Triton's PTX version)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        err = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=False).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", err)
    spills = re.search(r"(\d+) bytes spill stores", err)
    return f"{regs.group(1) if regs else '?'} registers, {spills.group(1) if spills else '?'} B spilled"


def tiled_kl_cases():
    """The tiled indexer KL kernels at the tile shapes SmolLM2's indexers launch (42-query tiles)."""
    import torch

    pointers = dict(IQ="*bf16", IK="*bf16", IW="*fp32", IDX="*i32", UNION="*i32", NUM="*i32", BITS="*i32",
                    P="*fp32", KL="*fp32", Z="*fp32", LSEI="*fp32", GKL="*fp32", DQ="*fp32", DW="*fp32", DK="*fp32")
    cuda = torch.device("cuda")
    for tqp, hp, bd in [(64, 2, 64), (64, 4, 64), (32, 4, 64), (64, 4, 32)]:
        consts = dict(RELU=True, TQP=tqp, HP=hp, BLOCK_D=bd, BLOCK_N=tiled.BLOCK_N, PRECISION="tf32")
        for fn, backward, extra in [(tiled.indexer_kl_fwd_tiled_kernel, False, {}),
                                    (tiled.indexer_kl_bwd_tiled_kernel, True, {"ONE_PASS": False}),
                                    (tiled.indexer_kl_bwd_tiled_kernel, True, {"ONE_PASS": True})]:
            options = tiled._launch(tqp, hp, bd, cuda, backward)
            label = f"{fn.fn.__name__}{' ONE_PASS' if extra.get('ONE_PASS') else ''} TQP={tqp} HP={hp} BLOCK_D={bd}"
            yield label, fn, pointers, {**consts, **extra}, options


def sass_loops(cubin: bytes) -> list[tuple[int, list[int]]]:
    """Each loop of a kernel's sm_90 SASS, in address order, as (instructions in its body, instructions
    each forward branch inside it skips), disassembled by the ``cuobjdump`` Triton bundles (``loops_in_sass``).
    Per-iteration counts of an ALU-bound kernel's loops say where its instructions go before any GPU run;
    the skips say what a path through an iteration leaves out (a branch over a block taken on some tiles)."""
    from triton.backends.nvidia.compiler import get_ptxas

    cuobjdump = Path(get_ptxas(90).path).with_name("cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return loops_in_sass(sass)


def loops_in_sass(sass: str) -> list[tuple[int, list[int]]]:
    """``sass_loops`` on disassembled text. A loop is a branch back to an earlier address; its body, the
    instructions from the target to the branch. A forward branch inside the body, to a target inside
    it, skips the instructions between the two."""
    instrs = []  # (address, branch target or None)
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            bra = re.search(r"BRA (0x[0-9a-f]+)", m.group(2))
            instrs.append((int(m.group(1), 16), int(bra.group(1), 16) if bra else None))
    loops = []
    for addr, target in instrs:
        if target is not None and target < addr:
            body = [(a, t) for a, t in instrs if target <= a <= addr]
            skips = [sum(1 for b, _ in body if a < b < t) for a, t in body if t is not None and a < t <= addr]
            loops.append((len(body), skips))
    return loops


def hytopk_scan_small_cases():
    """HyTopK's Triton scan for small indexers (2 x 64, 4 x 64) at the rows per program, warps and
    stages ``bench_hytopk.py``'s small-indexer sweep times (keys through TMA, a 16K-key buffer), as the
    one-launch scan after the pre-pass runs it (its first pass, and the second chance at the default tiles)."""
    pointers = dict(q_ptr="*bf16", k_ptr="*bf16", k_desc="tensordesc<bf16[1,64,64]>", w_ptr="*fp32",
                    start_ptr="*i32", buf_ptr="*i64", cnt_ptr="*i32", th_ptr="*i32", nan_ptr="*i32", dbg_ptr="*fp32",
                    redo_ptr="*i32", list_ptr="*i32", n_list_ptr="*i32")
    for hp in (2, 4):
        for bq, warps, stages, stop in [(8, 4, 2, 1), (8, 4, 2, 2), (8, 8, 2, 1), (16, 4, 2, 1), (16, 8, 2, 1), (32, 8, 2, 1)]:
            consts = dict(H=hp, HP=hp, D=64, DP=64, BQ=bq, BN=64, SC=256, SEG=1 << 30, RELU=True, CHECK_NAN=False,
                          IEEE=False, UPCAST=False, SCORE_ONLY=False, TMA=True, ASM_STORE=True, STOP_FULL=stop)
            label = f"hytopk_scan_kernel H={hp} D=64 BQ={bq} stages={stages} STOP_FULL={stop}"
            yield label, topk_kernels.hytopk_scan_kernel, pointers, consts, {"num_warps": warps, "num_stages": stages}


def hytopk_rescue_cases():
    """HyTopK's threshold pre-pass kernels: the refine that sets each row's estimate (and the usual
    refine beside it), the one-launch scan's flagged-row list and second chance, the short-row check
    and the rescue of rows whose estimate missed (``hytopk_rescue_kernel``), at a small indexer's shape
    and at the DSA indexer's (32 x 128)."""
    sel = dict(NS=64, SC=256, OB=16, LOG_NB=7, ASM_STORE=True)  # OB = CH // BN, as the host launches it
    refine_ptrs = dict(buf_ptr="*i64", cnt_ptr="*i32", th_ptr="*i32", refine_ptr="*i32")
    for presample in (True, False):
        yield (f"hytopk_refine_kernel PRESAMPLE={presample}", topk_kernels.hytopk_refine_kernel, refine_ptrs,
               dict(sel, PRESAMPLE=presample), {"num_warps": 4})  # fmt: skip
    yield ("hytopk_redo_kernel", topk_kernels.hytopk_redo_kernel,
           dict(buf_ptr="*i64", cnt_ptr="*i32", th_ptr="*i32", list_ptr="*i32", n_list_ptr="*i32"),
           dict(NS=64, SC=256, OB=16, LOG_NB=7), {"num_warps": 4})  # fmt: skip
    yield ("hytopk_short_rows_kernel", topk_kernels.hytopk_short_rows_kernel,
           dict(cnt_ptr="*i32", start_ptr="*i32", rows_ptr="*i32", n_ptr="*i32", stat_ptr="*i64"),
           dict(NS=64, BR=128), {"num_warps": 4})  # fmt: skip
    yield ("hytopk_flagged_rows_kernel", topk_kernels.hytopk_flagged_rows_kernel,
           dict(redo_ptr="*i32", rows_ptr="*i32", n_ptr="*i32"), dict(BR=1024), {"num_warps": 4})  # fmt: skip
    pointers = dict(q_ptr="*bf16", k_ptr="*bf16", w_ptr="*fp32", start_ptr="*i32", buf_ptr="*i64", cnt_ptr="*i32",
                    th_ptr="*i32", rows_ptr="*i32", n_ptr="*i32")
    for h, d in [(4, 64), (32, 128)]:
        consts = dict(H=h, HR=max(16, h), D=d, DP=d, NS=64, SC=256, BK=64, LOG_NB=7, RELU=True, IEEE=False,
                      UPCAST=False, ASM_STORE=True)
        yield f"hytopk_rescue_kernel H={h} D={d}", topk_kernels.hytopk_rescue_kernel, pointers, consts, {"num_warps": 4}


def tile_head_probs_cases():
    """The query tiles' head sums (``tile_head_probs``, q through TMA) at SmolLM2's shape (9 / 3 heads,
    42-query tiles, D 64) and a 16 x 64 model past ``host.TILE_PROBS_MAX_WIDTH``, at the key blocks and
    warps ``bench_head_probs.py`` compares. Unit strides are constexprs, as Triton specialises them."""
    for hkv, group in [(3, 3), (4, 4)]:
        for block_n, warps in [(64, 8), (64, 4), (128, 8)]:
            pointers = dict(Q="*bf16", Q_DESC="tensordesc<bf16[1,64,1,64]>", K="*bf16", IDX="*i32", NUM="*i32",
                            BITS="*i32", LSE="*fp32", PSUM="*fp32")
            consts = dict(HKV=hkv, GROUP=group, D1=64, D2=0, BLOCK_M=64, BLOCK_N=block_n, DOT_PREC="tf32", TMA=True,
                          stride_qd=1, stride_kd=1, stride_ik=1, stride_pk=1)
            label = f"tile_head_probs_kernel {hkv * group} x 64 BLOCK_N={block_n}"
            yield label, tile_head_probs.tile_head_probs_kernel, pointers, consts, {"num_warps": warps, "num_stages": 2}


def hytopk_finalize_cases():
    """HyTopK's final selection (``hytopk_finalize_kernel``) as a training step calls it (indices + lse)
    and with scores, at the default radix digit, the small indexers' 4 finalize warps and the default register
    cap (``HyTopKConfig.finalize_maxnreg``)."""
    pointers = dict(buf_ptr="*i64", cnt_ptr="*i32", th_ptr="*i32", bm_ptr="*i32", rw_ptr="*i64", idx_ptr="*i32",
                    score_ptr="*fp32", lse_ptr="*fp32")
    for scores, lse in [(False, True), (True, False)]:
        consts = dict(NS=64, SC=256, OB=16, LOG_NB=7, BLOCK_W=1024, WRITE_SCORES=scores, WRITE_LSE=lse, ASM_STORE=True,
                      L1_BUF=True)
        yield (f"hytopk_finalize_kernel scores={scores} lse={lse}", topk_kernels.hytopk_finalize_kernel, pointers,
               consts, {"num_warps": 4, "maxnreg": 128})  # fmt: skip


PRESETS = {"tiled_kl": tiled_kl_cases, "hytopk_scan_small": hytopk_scan_small_cases,
           "hytopk_rescue": hytopk_rescue_cases, "hytopk_finalize": hytopk_finalize_cases, "tile_head_probs": tile_head_probs_cases}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("presets", nargs="+", choices=sorted(PRESETS))
    ap.add_argument("--loops", action="store_true", help="also print each loop's instruction count (sass_loops)")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, target sm_90")
    failed = 0
    for preset in args.presets:
        for label, fn, pointers, consts, options in PRESETS[preset]():
            try:
                k = compile_for_sm90(fn, pointers, consts, options)
                print(f"ok    {label}: {options['num_warps']} warps, {k.metadata.shared} B shared, {ptxas_usage(k.asm['ptx'])}")
                if args.loops:
                    loops = sass_loops(k.asm["cubin"])
                    print(f"      instructions per loop iteration, in address order: {[n for n, _ in loops]}")
                    print(f"      instructions each forward branch inside a loop skips: {[skips for _, skips in loops]}")
            except Exception as e:  # the compiler's own error, reported per kernel
                failed += 1
                print(f"FAIL  {label}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
