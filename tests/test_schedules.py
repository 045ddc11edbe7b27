"""One-cycle and cosine schedules for every run length, re-planned when a resume changes it."""

from __future__ import annotations

import math

import pytest
import torch

from cifar_amp import build, metrics
from cifar_amp.errors import UserError
from cifar_amp.schedules import CosineAnnealingLR, OneCycleLR, warmup_steps
from cifar_amp.training import train
from conftest import CPU_DDP

MAX_LR = 0.2
ARGS = {"max_lr": MAX_LR, "pct_start": 0.25, "anneal_strategy": "linear"}  # the default recipe's


def make(total: int, cls=OneCycleLR, **kwargs):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0, momentum=0.9)
    if cls is CosineAnnealingLR:
        return opt, cls(opt, total_steps=total, **kwargs)
    return opt, cls(opt, total_steps=total, **{**ARGS, **kwargs})


def trace(opt, sched, steps: int) -> list[tuple[float, float]]:
    """(learning rate, momentum) of each of the next `steps` optimizer steps."""
    out = []
    for _ in range(steps):
        out.append((opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]))
        opt.step()
        sched.step()
    return out


def lrs(opt, sched, steps: int) -> list[float]:
    return [lr for lr, _ in trace(opt, sched, steps)]


@pytest.mark.parametrize("three_phase", [False, True])
@pytest.mark.parametrize("anneal", ["linear", "cos"])
def test_every_length_from_1_to_50_steps_trains(three_phase, anneal):
    for total in range(1, 51):
        opt, sched = make(total, anneal_strategy=anneal, three_phase=three_phase)
        rates = lrs(opt, sched, total)
        assert all(math.isfinite(r) and r > 0 for r in rates), total
        w = sched.warmup_steps
        assert rates[w] == pytest.approx(MAX_LR, rel=1e-12), total  # the peak on a whole step
        assert max(rates) == rates[w]
        if total >= (6 if three_phase else 3):  # room for a warm-up and what follows it
            assert w >= 1 and rates[0] < rates[w], total
        if total >= 2:
            assert rates[-1] == min(rates), total  # annealed to the end
        final = opt.param_groups[0]["lr"]  # after the last step: the minimum, never below
        assert 0 < final <= rates[-1]


def test_warmup_is_torchs_pct_start_rounded_to_whole_steps():
    # torch: the peak at step pct_start * total - 1
    assert [warmup_steps(t, 0.25) for t in (1, 2, 3, 4, 5, 6, 8, 100, 102)] == [
        0, 0, 1, 1, 1, 1, 1, 24, 25
    ]  # fmt: skip
    assert warmup_steps(100, 0.0) == 0
    assert warmup_steps(5, 0.9) == 3  # a step is left to anneal
    assert warmup_steps(6, 0.5, three_phase=True) == 2  # up to step 2, down to 4, anneal to 5


@pytest.mark.parametrize("kwargs", [{}, {"anneal_strategy": "cos"}, {"three_phase": True}])
def test_same_rates_as_torch_where_its_phases_are_whole_steps(kwargs):
    ours, theirs = make(100, **kwargs), make(100, cls=torch.optim.lr_scheduler.OneCycleLR, **kwargs)
    assert trace(*ours, 100) == trace(*theirs, 100)


@pytest.mark.parametrize("total", [1, 2, 7, 100])
def test_cosine_has_torchs_rates_over_the_run_and_stays_at_its_end(total):
    """torch's CosineAnnealingLR (T_max=total) over the run; after it, the minimum, where torch's
    rises again."""
    eta_min, opt = 0.01, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ours = make(total, CosineAnnealingLR, eta_min=eta_min)
    theirs = opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, total, eta_min)
    assert lrs(*ours, total) == pytest.approx(lrs(*theirs, total), rel=1e-12, abs=1e-15)
    assert lrs(*ours, 3) == [eta_min] * 3 != lrs(*theirs, 3)


def resumed(planned: int, done: int, total: int, cls=OneCycleLR):
    """A schedule planned for `planned` steps, checkpointed after `done`, loaded as Lightning
    does (optimizer state first) into a run of `total` steps."""
    opt, sched = make(planned, cls)
    lrs(opt, sched, done)
    opt2, sched2 = make(total, cls)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    return opt2, sched2


@pytest.mark.parametrize("cls", [OneCycleLR, CosineAnnealingLR])
@pytest.mark.parametrize("total", [20, 8], ids=["longer", "shorter"])
def test_resume_with_another_length_continues_on_the_new_plan(total, cls, caplog):
    opt, sched = resumed(planned=10, done=6, total=total, cls=cls)
    assert f"{cls.__name__}: planned for 10 steps, re-planned for {total}" in caplog.text
    fresh_opt, fresh = make(total, cls)
    lrs(fresh_opt, fresh, 6)
    # From step 6 on, the same rates and momentum as a run planned for `total` from the start.
    assert trace(opt, sched, total - 6) == trace(fresh_opt, fresh, total - 6)
    assert (sched.last_epoch, sched.total_steps) == (fresh.last_epoch, fresh.total_steps)


@pytest.mark.parametrize("cls", [OneCycleLR, CosineAnnealingLR])
def test_resume_with_the_same_length_is_exact(cls, caplog):
    opt, sched = resumed(planned=10, done=6, total=10, cls=cls)
    assert "re-planned" not in caplog.text
    ref_opt, ref = make(10, cls)
    lrs(ref_opt, ref, 6)
    assert sched.state_dict() == ref.state_dict()
    assert trace(opt, sched, 4) == trace(ref_opt, ref, 4)


def test_resume_shorter_than_the_steps_done_is_refused():
    with pytest.raises(UserError) as e:
        resumed(planned=10, done=6, total=5)
    assert str(e.value) == (
        "trainer.max_epochs/max_steps: this run would take 5 optimizer steps, but the checkpoint "
        "has done 6 (its schedule was planned for 10); resume with at least 6 steps, or start a "
        "new run"
    )


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_very_short_runs_train(make_cfg, steps):
    out = train(make_cfg(f"trainer.max_steps={steps}", "callbacks=none", "test=false"))
    assert out["epochs"] == 1


def test_ddp_run_of_four_steps_per_rank_trains(make_cfg):
    # The reported crash: 2 ranks x 4 steps, pct_start=0.25 (ZeroDivisionError in torch's OneCycleLR).
    # 180 training images: 90 per rank, 4 batches of 22.
    cfg = make_cfg(
        "trainer.devices=2",
        f"trainer.strategy={CPU_DDP}",
        "data.batch_size=22",
        "callbacks=none",
        "test=false",
    )
    # train() refuses ranks started per stage (fork) from Python (tests/test_ddp.py): fit here.
    dm = build.datamodule(cfg)
    trainer = build.trainer(cfg)
    trainer.fit(build.module(cfg, dm.num_classes), datamodule=dm)
    assert metrics.VAL_ACC_BEST in trainer.callback_metrics  # trained and validated
