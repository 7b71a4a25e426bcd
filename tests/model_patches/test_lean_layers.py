"""HyScaleConfig.lean_activations: patched models give their RMSNorms and SwiGLU MLPs forwards that
compute the same bits and save less; everything else keeps its own forward."""

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hyscale_hf
from hyscale_hf.model_patches import _lean_layers
from hyscale_hf.model_patches._lean_layers import apply_lean_layers
from hyscale_hf.state import PatchState

from ._dense_tiny import tiny_model, tokens
from .tiny_models import build


def _instance_forward(m: nn.Module):
    """The module's own instance forward, under the tiled wrapper every patched MLP and norm gets."""
    forward = m.__dict__.get("forward")
    return getattr(forward, "previous", forward)


def lean_modules(model) -> list[str]:
    return [name for name, m in model.named_modules()
            if _instance_forward(m) is not None and "_lean_" in _instance_forward(m).__name__]


def logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids).logits
    out.float().pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def build_glm5():
    return build("glm_moe_dsa")[0]


def build_llama():
    return tiny_model("llama")


@pytest.mark.parametrize("make, expected", [
    (build_glm5, ("input_layernorm", "post_attention_layernorm", "q_a_layernorm", "kv_a_layernorm", "model.norm",
                  "layers.0.mlp", "shared_experts")),
    (build_llama, ("input_layernorm", "post_attention_layernorm", "model.norm", "layers.0.mlp", "layers.1.mlp")),
], ids=["glm_moe_dsa", "llama"])
def test_lean_forwards_give_the_same_logits_and_gradients(make, expected):
    ids = tokens(2, 24)
    plain = hyscale_hf.patch_model(make().train(), topk=8, lean_activations=False)
    lean = hyscale_hf.patch_model(make().train(), topk=8)
    assert not lean_modules(plain)
    names = lean_modules(lean)
    for part in expected:
        assert any(part in n for n in names), (part, names)
    want_logits, want = logits_and_grads(plain, ids)
    got_logits, got = logits_and_grads(lean, ids)
    assert torch.equal(got_logits, want_logits)  # fp32 CPU: the forward is bit-identical
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-6, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_unpatch_removes_every_lean_forward_and_deepcopy_carries_them():
    model = hyscale_hf.patch_model(build_llama(), topk=8)
    twin = copy.deepcopy(model)
    assert lean_modules(twin) == lean_modules(model)
    with torch.no_grad():
        twin.model.norm.weight.mul_(2)  # the copy's lean forward reads the copy's weights
        assert not torch.equal(twin(input_ids=tokens(1, 8)).logits, model(input_ids=tokens(1, 8)).logits)
    hyscale_hf.unpatch_model(model)
    assert not lean_modules(model)


def test_lora_on_an_mlp_projection_added_after_patching_is_not_bypassed():
    peft = pytest.importorskip("peft")
    ids = tokens(1, 12)
    outs = []
    for lean in (False, True):
        model = hyscale_hf.patch_model(build_llama(), topk=8, lean_activations=lean)
        config = peft.LoraConfig(r=4, target_modules=["gate_proj", "down_proj"], init_lora_weights=False)
        model = peft.get_peft_model(model, config)
        out = model(input_ids=ids).logits
        out.sum().backward()
        assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
        outs.append(out.detach())
    assert torch.equal(outs[0], outs[1])


class GemmaStyleRMSNorm(nn.Module):
    """A norm that scales by (1 + weight): the lean forward does not reproduce it, so it is left alone."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        x32 = x.float()
        return ((1 + self.weight) * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class GeluMLP(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(n, 2 * n, bias=False), nn.Linear(n, 2 * n, bias=False), \
            nn.Linear(2 * n, n, bias=False)
        self.act_fn = nn.SiLU()  # looks like SwiGLU, but the forward below is not

    def forward(self, x):
        return self.down_proj(torch.nn.functional.gelu(self.gate_proj(x)) * self.up_proj(x))


def test_modules_whose_forward_differs_keep_their_own():
    model = nn.Sequential(GemmaStyleRMSNorm(8), GeluMLP(8))
    undo = apply_lean_layers(model, PatchState(config=hyscale_hf.HyScaleConfig(), family=None))
    assert not lean_modules(model) and not undo.modules


def test_the_probe_checks_the_ops_torch_path(monkeypatch):
    # On CUDA the lean forward runs the Triton kernels, whose fp32 statistics may differ from torch's in
    # the last bits: the bit-for-bit probe runs the ops' torch path, so such norms still get it.
    real = _lean_layers.rms_norm

    def an_ulp_off_unless_torch(x, weight, eps, backend="auto"):
        y = real(x, weight, eps, backend="torch")
        return y if backend == "torch" else torch.nextafter(y, torch.full_like(y, float("inf")))

    monkeypatch.setattr(_lean_layers, "rms_norm", an_ulp_off_unless_torch)
    names = lean_modules(hyscale_hf.patch_model(build_llama(), topk=8))
    assert any("input_layernorm" in n for n in names) and any("model.norm" in n for n in names), names


def test_the_lean_forwards_follow_the_patch_backend(monkeypatch):
    # patch_model(backend="torch") keeps every op off the kernels, the lean norms and MLPs included.
    seen = []
    real_norm, real_mlp = _lean_layers.rms_norm, _lean_layers.swiglu_mlp
    monkeypatch.setattr(_lean_layers, "rms_norm", lambda *a, backend="auto": seen.append(backend) or real_norm(*a, backend=backend))
    monkeypatch.setattr(_lean_layers, "swiglu_mlp", lambda *a, backend="auto", **kw: seen.append(backend) or real_mlp(*a, backend=backend, **kw))
    model = hyscale_hf.patch_model(build_llama(), topk=8, backend="torch")
    seen.clear()
    model(input_ids=tokens(1, 16))
    assert seen and set(seen) == {"torch"}


class _DownProducts(TorchDispatchMode):
    """Counts the matmuls that form an MLP's output: ``mm(product, w_down.t())`` (the backward's
    ``d_out @ w_down`` reads the weight untransposed)."""

    def __init__(self, weights):
        super().__init__()
        self.transposed = {(w.data_ptr(), (w.stride(1), w.stride(0))) for w in weights}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += any(isinstance(a, torch.Tensor) and (a.data_ptr(), a.stride()) in self.transposed
                              for a in args)
        return func(*args, **(kwargs or {}))


def _checkpointed_step(model, ids, mode=None):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids).logits.float().pow(2).mean()
    if mode is None:
        loss.backward()
    else:
        with mode:
            loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("make", [build_llama, build_glm5], ids=["llama", "glm_moe_dsa"])
def test_a_layer_recompute_skips_its_mlp_output_with_the_same_gradients(make, monkeypatch):
    """Under checkpointing, a decoder layer's recompute drops the layer's output, so a family whose
    layers end in residual + mlp(x) skips the down projection of the layer's own MLP there (not of
    an MLP inside it, such as GLM-5's shared experts, whose output the MoE adds to); the gradients
    are bit for bit those of a full recompute."""
    ids = tokens(2, 24)
    model = hyscale_hf.patch_model(make().train(), topk=8, backend="torch")
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing") and hasattr(m, "mlp")]
    lean = [m for m in model.modules() if "_lean_mlp" in getattr(_instance_forward(m), "__name__", "")]
    ends = [m for m in lean if any(layer.mlp is m for layer in layers)]
    assert ends
    counter = _DownProducts([m.down_proj.weight for m in lean])
    got = _checkpointed_step(model, ids, counter)
    assert counter.count == len(lean) - len(ends)  # the recomputes' down products
    monkeypatch.setattr(_lean_layers, "recompute_owner", lambda: None)  # every recompute runs in full
    counter = _DownProducts([m.down_proj.weight for m in lean])
    want = _checkpointed_step(model, ids, counter)
    assert counter.count == len(lean)
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n
