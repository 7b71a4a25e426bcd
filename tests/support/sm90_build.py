"""Builds a Gluon kernel for sm_90 on any machine (CPU tests of the Hopper kernels).

Gluon kernels do not run under Triton's CPU interpreter, so CI cannot execute them; their results
are checked by the GPU tests. Here a kernel is built for sm_90 with the installed Triton and its
bundled ptxas: a change that breaks the build, needs more shared memory than an SM has, or spills
registers fails on the CPU machine. The build runs in a subprocess without TRITON_INTERPRET (the
test session sets it, and Gluon cannot compile against the interpreter's stand-ins for Triton's
library functions).
"""

import json
import os
import re
import subprocess
import sys

SM90_SHARED_BYTES = 227 * 1024  # the most dynamic shared memory one program may use on sm_90

_BUILD = r"""
import json, os, subprocess, sys, tempfile
import importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

spec = json.loads(sys.argv[1])
kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
sig = dict(spec["signature"])
for name, ty in sig.items():  # "tensordesc:bf16:64x128": a TMA descriptor with its default layout
    if ty.startswith("tensordesc:"):
        _, dt, shape = ty.split(":")
        block = [int(x) for x in shape.split("x")]
        layout = gl.NVMMASharedLayout.get_default_for(block, dict(bf16=gl.bfloat16, fp16=gl.float16)[dt])
        sig[name] = f"tensordesc<{dt}{block},{layout!r}>"
sig.update(dict.fromkeys(spec["constexprs"], "constexpr"))
attrs = {(list(sig).index(n),): [["tt.divisibility", 16]] for n in spec["aligned"]}
c = triton.compile(GluonASTSource(kernel, sig, spec["constexprs"], attrs), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=4))
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(c.asm["cubin"])
    f.flush()
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
print("RESULT", json.dumps(dict(shared=c.metadata.shared, usage=next(l for l in usage.splitlines() if "REG:" in l),
                                ptx=c.asm["ptx"])))
"""


def build_sm90(spec: dict) -> dict:
    """Builds ``spec["module"].spec["kernel"]`` for sm_90: ``signature`` (name -> Triton type, in
    parameter order; ``"tensordesc:bf16:64x128"`` for a TMA descriptor), ``constexprs`` (name -> value), ``aligned`` (16-byte divisible arguments). Returns the shared
    memory bytes, cuobjdump's resource line (registers, stack, local memory) and the PTX."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run(
        [sys.executable, "-c", _BUILD, json.dumps(spec)], capture_output=True, text=True, env=env, timeout=600
    )
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, run.stderr[-3000:]
    return json.loads(line[len("RESULT ") :])


def assert_fits_one_sm_without_spills(build: dict) -> None:
    assert build["shared"] <= SM90_SHARED_BYTES
    usage = build["usage"]
    assert "LOCAL:0" in usage and "STACK:0" in usage, usage  # no spills to local memory


def assert_warp_specialised(build: dict, *instructions: str) -> None:
    """Warpgroups with their own register budgets (setmaxnreg) that hand work over through
    mbarriers, and the PTX instructions (regular expressions) a kernel's job needs."""
    ptx = build["ptx"]
    assert "setmaxnreg" in ptx and "mbarrier.try_wait" in ptx
    for pattern in instructions:
        assert re.search(pattern, ptx), pattern
