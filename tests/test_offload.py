"""hyscale_hf.offload.HostOffload: saved tensors to host memory and back, with prefetch.

On CPU the offload runs with ``devices=("cpu",)`` (plain copies, no streams), which exercises the
bookkeeping; the GPU test runs the stream path on a patched model."""

from __future__ import annotations

import pytest
import torch

from hyscale_hf.offload import HostOffload


def _graph(x, ws):
    h = x
    for w in ws:
        h = torch.tanh(h @ w)
    return h.sum()


def test_cpu_tensors_stay_put_by_default():
    off = HostOffload(min_bytes=0)
    x = torch.randn(3, 4, requires_grad=True)
    assert off.pack(x) is x
    assert off.stats["offloaded"] == 0


def test_small_tensors_stay_put():
    off = HostOffload(min_bytes=1 << 20, devices=("cpu",))
    x = torch.randn(3, 4)
    assert off.pack(x) is x


def test_offloaded_saved_tensors_give_the_same_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    ws = [torch.randn(8, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    _graph(x, ws).backward()
    ref = [t.grad.clone() for t in (x, *ws)]
    for t in (x, *ws):
        t.grad = None
    off = HostOffload(min_bytes=0, devices=("cpu",))
    with off.hooks():
        loss = _graph(x, ws)
    assert off.stats["offloaded"] > 0
    loss.backward()
    for got, want in zip((x.grad, *(w.grad for w in ws)), ref):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # backward runs in reverse: each fetch prefetches the tensor packed just before it
    assert off.stats["prefetched"] > 0
    assert off.stats["prefetched"] + off.stats["fetched_on_demand"] == off.stats["offloaded"]


def test_prefetch_follows_the_packing_order_per_kind():
    off = HostOffload(min_bytes=0, devices=("cpu",))
    a, b, c = (torch.full((2,), float(i)) for i in range(3))
    ha, hb = off.pack(a, "input"), off.pack(b, "input")
    hs = off.pack(c, "stash")
    assert torch.equal(off.unpack(hb), b)
    assert ha.fetched is not None and hs.fetched is None  # the previous input, not the stash
    assert torch.equal(off.unpack(ha), a)
    assert off.stats == {"offloaded": 3, "offloaded_bytes": 24, "prefetched": 1, "fetched_on_demand": 1,
                         "offloaded_input": 2, "offloaded_stash": 1}
    assert off.fetch(off.stash((None, c)))[1].tolist() == [2.0, 2.0]


def test_the_host_copy_is_independent_of_later_writes():
    off = HostOffload(min_bytes=0, devices=("cpu",))
    t = torch.ones(4)
    handle = off.pack(t)
    t.fill_(5.0)
    assert off.unpack(handle).tolist() == [1.0] * 4


@pytest.mark.gpu
def test_cuda_offload_round_trip_on_a_side_stream():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    off = HostOffload(min_bytes=0)
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    ws = [(torch.randn(256, 256, device="cuda") / 16).requires_grad_() for _ in range(4)]
    _graph(x, ws).backward()
    ref = x.grad.clone()
    x.grad = None
    with off.hooks():
        loss = _graph(x, ws)
    loss.backward()
    torch.testing.assert_close(x.grad, ref, rtol=0, atol=0)
    assert off.stats["offloaded"] > 0 and off.stats["prefetched"] > 0
