"""scripts/bench_hytopk.py's sweeps: the one-run A/B of a config knob alternates the knob's other value
with the default, and an old package without the knob (an A/B's baseline tree) times its default twice;
the stage sweep and ``--sweep-set`` bracket their variants with the default and check them first."""

import pytest

from tests.support.scripts import load_script


def test_knob_ab_alternates_other_value_and_default():
    bench = load_script("bench_hytopk")
    bench.H, bench.D = 4, 64
    configs = bench.knob_ab_configs("finalize_l1", False)
    assert [c.finalize_l1 for c, _ in configs] == [False, True, False, True]
    assert [cap for _, cap in configs] == [None] * 4
    base = configs[1][0]
    assert all(c == base for c, _ in configs[1::2])  # the default arm is the default config itself


def test_knob_ab_on_a_package_without_the_knob_times_its_default_twice():
    bench = load_script("bench_hytopk")
    bench.H, bench.D = 4, 64
    configs = bench.knob_ab_configs("a_knob_this_package_lacks", 0)
    assert len(configs) == 2 and configs[0] == configs[1]
    assert configs[0][0] == bench.pick_config(4, 64, bench.torch.bfloat16, bench.torch.device("cuda"))


def test_stage_sweep_brackets_its_variants_with_the_default():
    bench = load_script("bench_hytopk")
    bench.H, bench.D = 4, 64
    configs = [c for c, _ in bench.stage_configs()]
    base = bench.pick_config(4, 64, bench.torch.bfloat16, bench.torch.device("cuda"))
    assert configs[0] == base and configs[-1] == base  # drift over the run shows in the default's two entries
    assert [(c.BQ, c.num_warps, c.num_stages, c.gluon_columns) for c in configs[1:-1]] == [
        (base.BQ, base.num_warps, 3, None), (base.BQ, base.num_warps, 4, None), (16, 8, 2, None), (16, 8, 3, None),
        (16, 8, 4, None), (base.BQ, base.num_warps, base.num_stages, 64)]


def test_sweep_set_changes_the_named_fields_between_two_defaults():
    bench = load_script("bench_hytopk")
    bench.H, bench.D = 4, 64
    configs = [c for c, _ in bench.override_configs(["BQ=4,num_warps=2", "finalize_maxnreg=None", "presample_z=4.5"])]
    base = bench.pick_config(4, 64, bench.torch.bfloat16, bench.torch.device("cuda"))
    assert configs[0] == base and configs[-1] == base
    assert configs[1] == bench.dataclasses.replace(base, BQ=4, num_warps=2)
    assert configs[2].finalize_maxnreg is None and configs[3].presample_z == 4.5


@pytest.mark.parametrize(
    "spec, error, words",
    [("BQ", SystemExit, "FIELD=VALUE"), ("no_such_field=1", SystemExit, "FIELD=VALUE"),
     ("BQ=four", SystemExit, "'four'"), ("lanes=0", ValueError, "lanes")],  # the last: HyTopKConfig's own check
)
def test_sweep_set_rejects_an_unknown_field_or_value_before_running(spec, error, words):
    bench = load_script("bench_hytopk")
    bench.H, bench.D = 4, 64
    with pytest.raises(error, match=words):
        bench.override_configs([spec])
