"""hyscale_hf.benchmarking.timing: warm-up calls are not timed, and a budget caps the timed calls (at least
3). CUDA events are replaced by a fake clock so the logic runs on the CPU."""

import pytest
import torch

from hyscale_hf.benchmarking import timing as timing_module


@pytest.fixture
def timing(monkeypatch):
    clock = {"now": 0.0}

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.at = clock["now"]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return timing_module, clock


def test_warmup_is_not_timed_and_reps_are(timing):
    module, clock = timing
    calls = []

    def fn():
        calls.append(1)
        clock["now"] += 100.0 if len(calls) == 1 else 2.0  # a slow first (compiling) call

    assert module.cuda_times(fn, 4, warmup=1) == [2.0] * 4
    assert len(calls) == 5


def test_budget_caps_the_timed_calls_but_keeps_three(timing):
    module, clock = timing

    def slow():
        clock["now"] += 50.0

    assert len(module.cuda_times(slow, 10, warmup=0, budget_ms=120.0)) == 3  # 120 / 50 -> 2, raised to 3
    assert len(module.cuda_times(slow, 10, warmup=0, budget_ms=400.0)) == 8
    assert len(module.cuda_times(slow, 10, warmup=0, budget_ms=10_000.0)) == 10
    assert module.cuda_median_ms(slow, 5, warmup=0) == 50.0


def test_host_issue_and_back_to_back_times(monkeypatch):
    """A fake op whose host issue takes 1 ms and whose kernels take 3 ms a call, queued behind each
    other: 1 ms to issue a call, and back to back the first call's issue then 3 ms a call; the
    warm-up call is counted in neither."""
    clock = {"host": 0.0, "device_done": 0.0}

    def fn():
        clock["host"] += 1.0
        clock["device_done"] = max(clock["device_done"], clock["host"]) + 3.0

    def synchronize():
        clock["host"] = max(clock["host"], clock["device_done"])

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(timing_module.time, "perf_counter", lambda: clock["host"] / 1e3)
    host, b2b = timing_module.host_and_stream_ms(fn, 5)
    assert host == pytest.approx(1.0)
    assert b2b == pytest.approx((1.0 + 5 * 3.0) / 5)


@pytest.mark.gpu
def test_graph_replay_times_the_captured_call_alone():
    # a call of many small launches: replayed from a graph it takes the device's time, which is below the
    # host-paced per-call time; the captured call really runs (its output changes on replay)
    x = torch.zeros(1024, device="cuda")

    def many_launches():
        for _ in range(200):
            x.add_(1.0)

    ms = timing_module.graph_replay_ms(many_launches, 5)
    adds = float(x[0])
    assert ms > 0.0
    assert adds == 200 * (2 + 1 + 5)  # two warm calls, then one warm-up replay and five timed ones
    assert ms < timing_module.cuda_median_ms(many_launches, 5)
