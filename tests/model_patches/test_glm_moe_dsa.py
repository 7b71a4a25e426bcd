"""GLM-5 specifics of the patch (IndexShare, checkpointing, PEFT, memory at T = 8192); the checks every
DSA family shares are in test_dsa_families.py."""

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hyscale_hf
from hyscale_hf.model_patches import _dsa_step

from . import dsa_checks
from .tiny_models import build, has_family

FAMILY = "glm_moe_dsa"
pytestmark = pytest.mark.skipif(not has_family(FAMILY), reason=f"the installed Transformers has no {FAMILY}")


def _record(monkeypatch, name):
    calls, original = [], getattr(_dsa_step, name)

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append((args[0], out))
        return out

    monkeypatch.setattr(_dsa_step, name, recording)
    return calls


def test_indexshare_shared_layer_reuses_its_source_of_the_same_forward(monkeypatch):
    """Layers full/shared/full: the shared layer attends over layer 0's indices of the same forward call
    through share_selection, the same tensor (no copy), also in backward's checkpoint recompute."""
    model, config = build(FAMILY, index_topk=4)
    assert config.indexer_types == ["full", "shared", "full"]
    assert model.model.layers[1].self_attn.indexer is None
    hyscale_hf.patch_model(model, backend="torch")
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    selections = _record(monkeypatch, "hytopk")
    reuses = _record(monkeypatch, "share_selection")
    x = dsa_checks.tokens(2, 14)
    model(x, labels=x).loss.backward()
    # forward: layers 0 and 2 select, layer 1 reuses; backward recomputes all three layers
    assert len(selections) == 4 and len(reuses) == 2
    forward_source = selections[0][1][0]  # hytopk's (indices, lse): training wants the lse for the KL
    for reused_input, shared in reuses:
        assert reused_input is forward_source and shared.data_ptr() == forward_source.data_ptr()


def test_generate_with_a_static_cache_matches_unpatched():
    ref, _ = build(FAMILY, index_topk=4)
    pat = dsa_checks.patched_copy(ref)
    x = dsa_checks.tokens(2, 10, seed=3)
    kwargs = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0, cache_implementation="static")
    assert torch.equal(pat.generate(x, **kwargs), ref.generate(x, **kwargs))


def test_gradient_checkpointing_gives_the_same_gradients():
    ref, _ = build(FAMILY, index_topk=4)
    plain = dsa_checks.patched_copy(ref)
    ckpt = dsa_checks.patched_copy(ref)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    x = dsa_checks.tokens(2, 16)
    for model in (plain, ckpt):
        model.train()
        model(x, labels=x).loss.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_peft_wrapped_model_is_unwrapped_and_patched():
    peft = pytest.importorskip("peft")
    ref, _ = build(FAMILY, index_topk=64)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_a_proj", "kv_b_proj"])
    ref = peft.get_peft_model(ref, lora)
    for name, p in ref.named_parameters():  # non-zero LoRA B so the adapters change the outputs
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    pat = copy.deepcopy(ref)
    hyscale_hf.patch_model(pat, backend="torch")
    assert hyscale_hf.is_patched(pat) and hyscale_hf.is_patched(pat.get_base_model())
    ref.train()
    pat.train()
    x = dsa_checks.tokens(2, 12)
    out_ref, out_pat = ref(x, labels=x), pat(x, labels=x)
    dsa_checks.assert_close(out_ref.logits, out_pat.logits, what="peft logits")
    out_ref.loss.backward()
    out_pat.loss.backward()
    for (name, a), (_, b) in zip(ref.named_parameters(), pat.named_parameters()):
        if "lora_" in name:
            err, scale = (a.grad - b.grad).abs().max().item(), a.grad.abs().max().item()
            assert err <= dsa_checks.GRAD_RTOL * scale + 1e-7, f"{name}: grad diff {err} vs scale {scale}"
    hyscale_hf.unpatch_model(pat)
    assert not hyscale_hf.is_patched(pat)


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)
    import hyscale_hf
    from tests.model_patches.tiny_models import build

    def rss_mib(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) / 1024
        raise RuntimeError(field)

    T = 8192
    model, _ = build("glm_moe_dsa", index_n_heads=32, index_topk=4, hidden_size=32, intermediate_size=32,
                     num_hidden_layers=2, first_k_dense_replace=2, indexer_types=["full", "shared"], use_cache=False)
    hyscale_hf.patch_model(model, backend="torch")
    model.train()
    warm = torch.randint(3, 128, (1, 64))
    model(warm, labels=warm).loss.backward()  # lazy initialisation outside the measurement
    model.zero_grad(set_to_none=False)
    x = torch.randint(3, 128, (1, T))
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    before = rss_mib("VmRSS:")
    out = model(x, labels=x)
    out.loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if n.endswith("indexer.wk.weight")]
    assert torch.isfinite(out.loss) and all(g is not None and g.abs().sum() > 0 for g in grads)
    print(f"EXTRA_MIB {rss_mib('VmHWM:') - before:.1f}")
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to read peak RSS")
def test_t8192_forward_backward_allocates_nothing_quadratic():
    """T = 8192, 32 indexer heads, training forward+backward on the CPU. The unpatched path builds a
    [1, 8192, 32, 8192] fp32 score table (8 GiB); one fp32 [T, T] table alone is 256 MiB. The patched
    model's whole extra peak (activations for backward included) must stay far below that."""
    root = Path(__file__).resolve().parents[2]
    env = {"MALLOC_MMAP_THRESHOLD_": "131072", "PATH": "/usr/bin:/bin"}  # freed blocks return to the OS
    if "PYTHONPATH" in os.environ:  # the same Transformers as this process
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    proc = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    extra = float(proc.stdout.split("EXTRA_MIB")[1].split()[0])
    assert extra < 160, f"extra peak {extra:.1f} MiB at T=8192"
