"""Compile Triton kernels for sm_90 on a machine without a GPU, to catch compiler failures before a GPU call.

Triton lowers a kernel to PTX and runs ptxas without a device, so a pass that asserts on a kernel (as
Triton 3.6's thread-locality pass did on the tiled indexer KL forward) fails here as it would on the
H100. Use the GPU image's Triton, installed beside the project's without touching it:

    pip install --no-deps --target /tmp/tri36 triton==3.6.0
    PYTHONPATH=/tmp/tri36 python scripts/compile_sm90.py tiled_kl

Each preset names kernels, their pointer types and the constexpr values the host code launches them
with; integer arguments not named are i32. Prints one line per compile: ok with its warps,
or FAIL with the compiler's last line. Exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hyscale_hf.kernels.indexer_kl import tiled  # noqa: E402


def compile_for_sm90(fn, pointers: dict[str, str], constexprs: dict, num_warps: int):
    """The compiled kernel of ``fn`` for sm_90: ``pointers`` maps argument names to Triton pointer types
    ("*bf16"), ``constexprs`` gives every constexpr argument; other arguments are i32."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    src = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def tiled_kl_cases():
    """The tiled indexer KL kernels at the tile shapes SmolLM2's indexers launch (42-query tiles)."""
    import torch

    pointers = dict(IQ="*bf16", IK="*bf16", IW="*fp32", IDX="*i32", UNION="*i32", NUM="*i32", BITS="*i32",
                    P="*fp32", KL="*fp32", Z="*fp32", LSEI="*fp32", GKL="*fp32", DQ="*fp32", DW="*fp32", DK="*fp32")
    cuda = torch.device("cuda")
    for tqp, hp, bd in [(64, 2, 64), (64, 4, 64), (32, 4, 64), (64, 4, 32)]:
        consts = dict(RELU=True, TQP=tqp, HP=hp, BLOCK_D=bd, BLOCK_N=tiled.BLOCK_N, PRECISION="tf32")
        for fn, backward in [(tiled.indexer_kl_fwd_tiled_kernel, False), (tiled.indexer_kl_bwd_tiled_kernel, True)]:
            warps = tiled._launch(tqp, hp, bd, cuda, backward)["num_warps"]
            yield f"{fn.fn.__name__} TQP={tqp} HP={hp} BLOCK_D={bd}", fn, pointers, consts, warps


PRESETS = {"tiled_kl": tiled_kl_cases}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("presets", nargs="+", choices=sorted(PRESETS))
    args = ap.parse_args()
    print(f"triton {triton.__version__}, target sm_90")
    failed = 0
    for preset in args.presets:
        for label, fn, pointers, consts, warps in PRESETS[preset]():
            try:
                compile_for_sm90(fn, pointers, consts, warps)
                print(f"ok    {label}: {warps} warps")
            except Exception as e:  # the compiler's own error, reported per kernel
                failed += 1
                print(f"FAIL  {label}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
