"""The per-stage learning-rate schedules of the recipe (base model and indexer)."""

import math
import pickle

import pytest
import torch

from hyscale_hf.recipes.schedule import StageSchedule, stage_schedules


def test_base_is_idle_in_the_warmup_and_decays_over_its_own_steps():
    base, indexer = stage_schedules(max_steps=40, dense_pretrain_steps=0, dense_warmup_steps=30, warmup_steps=10)
    assert [base(s) for s in range(30)] == [0.0] * 30  # frozen in the warm-up: its curve has not begun
    assert base.warmup == 1  # a tenth of its 10 steps, not the run's 10
    assert base(30) == pytest.approx(1 / 2)  # first sparse step: warm-up
    assert base(31) == pytest.approx(1.0)  # then cosine from the peak...
    assert base(39) < base(35) < base(31)
    assert base(39) == pytest.approx(0.5 * (1 + math.cos(math.pi * 8 / 9)))  # ...towards 0 at the end
    assert indexer.warmup == 4
    assert indexer(0) == pytest.approx(1 / 5) and indexer(4) == 1.0 and indexer(39) == 1.0  # constant after warm-up


def test_base_schedule_spans_pretraining_and_sparse_steps_skipping_the_warmup():
    base, _ = stage_schedules(max_steps=30, dense_pretrain_steps=10, dense_warmup_steps=10, warmup_steps=0)
    assert base(0) == 1.0
    assert base(9) > base(10) == 0.0  # frozen in the warm-up
    mid = base(20)  # first sparse step, 10 of its 20 steps done: it resumes where it stopped, halfway down
    assert mid == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert base(25) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.75)))


def test_schedule_drives_lambda_lr_per_group_and_pickles():
    base, indexer = stage_schedules(max_steps=20, dense_pretrain_steps=0, dense_warmup_steps=10, warmup_steps=0)
    p, q = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p], "lr": 1e-4}, {"params": [q], "lr": 1e-2}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [base, indexer])
    for _ in range(12):
        opt.step()
        sched.step()
    assert opt.param_groups[1]["lr"] == pytest.approx(1e-2)
    assert 0 < opt.param_groups[0]["lr"] < 1e-4
    assert pickle.loads(pickle.dumps(base)) == base  # a checkpointed scheduler state holds it


def test_a_group_that_never_trains_gets_rate_zero():
    assert StageSchedule(((0, 0),), warmup=0, decay=True)(0) == 0.0
