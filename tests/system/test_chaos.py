"""The chaos test at CI size: a real 2-process training run SIGKILLed three times (two of the
kills aimed at a save in progress) and resumed each time ends bitwise equal to an uninterrupted
run. `python tests/chaos.py --kills 20` is the full-size version."""
from tests.chaos import run_chaos


def test_sigkilled_and_resumed_run_is_bitwise_equal(tmp_path):
    res = run_chaos(kills=3, seed=1, workdir=tmp_path, nproc=2, steps=10, log=lambda *a: None)
    assert res["bitwise_equal"], res["problems"]
    assert res["kills"] == 3
    assert res["kills_during_save"] >= 1, res
    assert res["tensors_compared"] > 0
