"""The Hopper MLA forward (Gluon) compiles for sm_90 and fits one SM, checked on any machine.

Gluon kernels do not run under Triton's CPU interpreter, so CI cannot execute this kernel; its
results are checked against the Triton forward by the GPU tests
(``test_sparse_attention_gpu.py::test_mla_gluon_forward_matches_triton_forward``). Here the
kernel is built for sm_90 with the installed Triton and its bundled ptxas: a change that breaks
the build, needs more shared memory than an SM has, or spills registers fails on the CPU machine.
The build runs in a subprocess without TRITON_INTERPRET (the test session sets it, and Gluon
cannot compile against the interpreter's stand-ins for Triton's library functions).
"""

import importlib
import json
import os
import subprocess
import sys

import pytest

sa = importlib.import_module("hyscale_hf.kernels.sparse_attention")
pytestmark = pytest.mark.skipif(sa.mla_forward_gluon is None, reason="needs Triton with Gluon's Hopper ops")

SM90_SHARED_BYTES = 227 * 1024  # the most dynamic shared memory one program may use on sm_90

BUILD = r"""
import json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from hyscale_hf.kernels import mla_forward_gluon as m

ptrs = dict(q_ptr="*bf16", k_ptr="*bf16", idx_ptr="*i32", num_ptr="*i32", o_ptr="*bf16", lse_ptr="*fp32")
ints = "s_qb s_qs s_qh s_kb s_kt s_ib s_is s_nb s_ob s_os s_oh s_lb s_ls s_lh num_head_blocks".split()
sig = {**ptrs, **dict.fromkeys(ints, "i32"), "qk_scale": "fp32"}
aligned = list(ptrs) + ["s_qb", "s_qs", "s_qh", "s_kb", "s_kt", "s_ob", "s_os", "s_oh"]
attrs = {(list(sig).index(n),): [["tt.divisibility", 16]] for n in aligned}
c = triton.compile(GluonASTSource(m._mla_forward_kernel, sig, {}, attrs), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=4))
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(c.asm["cubin"])
    f.flush()
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
print("RESULT", json.dumps(dict(shared=c.metadata.shared, usage=next(l for l in usage.splitlines() if "REG:" in l),
                                ptx=c.asm["ptx"])))
"""


@pytest.fixture(scope="module")
def sm90_build():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, text=True, env=env, timeout=600)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, run.stderr[-3000:]
    return json.loads(line[len("RESULT ") :])


def test_fits_one_sm_without_spills(sm90_build):
    assert sm90_build["shared"] <= SM90_SHARED_BYTES
    usage = sm90_build["usage"]
    assert "LOCAL:0" in usage and "STACK:0" in usage, usage  # no spills to local memory


def test_warpgroups_are_specialised(sm90_build):
    # warpgroups with their own register budgets (setmaxnreg), mbarrier hand-offs, cp.async gathers
    ptx = sm90_build["ptx"]
    assert "setmaxnreg" in ptx
    assert "mbarrier.try_wait" in ptx
    assert "cp.async" in ptx and "wgmma.mma_async" in ptx
