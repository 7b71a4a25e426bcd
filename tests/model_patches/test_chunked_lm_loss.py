"""HyScaleConfig.lm_loss_chunk: a forward with labels gives the model's own loss without the logits."""

import pytest
import torch

import hyscale_hf

from ._dense_tiny import tiny_model, tokens
from .tiny_models import build


def build_glm5():
    return build("glm_moe_dsa")[0].train()


def build_llama():
    return tiny_model("llama").train()


def loss_and_grads(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("make", [build_glm5, build_llama], ids=["glm_moe_dsa", "llama"])
def test_same_loss_and_gradients_without_logits(make):
    ids = tokens(2, 24)
    labels = ids.clone()
    labels[0, :5] = -100  # ignored positions, as a collator writes them
    plain = hyscale_hf.patch_model(make(), topk=8)
    chunked = hyscale_hf.patch_model(make(), topk=8, lm_loss_chunk=7)
    want, want_grads = loss_and_grads(plain, ids, labels=labels)
    got, got_grads = loss_and_grads(chunked, ids, labels=labels)
    assert got.logits is None and want.logits is not None
    torch.testing.assert_close(got.loss, want.loss, atol=1e-6, rtol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], atol=1e-6, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    # gradient accumulation's normalisation (the Trainer passes num_items_in_batch)
    n_items = torch.tensor(17)
    torch.testing.assert_close(chunked(input_ids=ids, labels=labels, num_items_in_batch=n_items).loss,
                               plain(input_ids=ids, labels=labels, num_items_in_batch=n_items).loss, atol=1e-6, rtol=1e-6)
    # without labels the model's own forward runs: logits as usual
    with torch.no_grad():
        assert torch.equal(chunked(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_unpatch_restores_the_forward_and_the_head():
    model = hyscale_hf.patch_model(build_llama(), topk=8, lm_loss_chunk=4)
    ids = tokens(1, 12)
    model(input_ids=ids, labels=ids)
    assert isinstance(model.lm_head, torch.nn.Linear) and "_loss_function" not in model.__dict__
    hyscale_hf.unpatch_model(model)
    assert "forward" not in model.__dict__
    assert model(input_ids=ids, labels=ids).logits is not None


def test_a_model_that_rescales_its_logits_is_refused():
    model = build_llama()

    class Scaled(type(model)):  # logit scaling between the head and the loss (as some families do)
        def forward(self, input_ids=None, labels=None, **kwargs):
            out = self.model(input_ids=input_ids)
            logits = self.lm_head(out.last_hidden_state) * 0.5
            return {"loss": self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size),
                    "logits": logits}

    model.__class__ = Scaled
    hyscale_hf.patch_model(model, topk=8, lm_loss_chunk=4)
    with pytest.raises(RuntimeError, match="changes the LM head's output"):
        model(input_ids=tokens(1, 8), labels=tokens(1, 8))
    assert isinstance(model.lm_head, torch.nn.Linear) and "_loss_function" not in model.__dict__  # restored


def test_bad_value_is_named():
    with pytest.raises(ValueError, match="lm_loss_chunk"):
        hyscale_hf.HyScaleConfig(lm_loss_chunk=0)
