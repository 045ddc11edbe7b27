"""bench/kill_campaign.py: the draw of kill points, the comparison of runs, what counts as a
kill that landed; a short campaign passes, and one whose resume is broken on purpose fails."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from bench import kill_campaign
from bench.kill_campaign import POINTS, Attempt, Kill
from conftest import PICTURES, built_once, tiny_data  # noqa: F401 (fixtures)

TIMELINE = {
    "micro_batches": 22,
    "writes": 14,
    "validation_batches": 12,
    "window_starts": [1, 4, 7, 10, 12, 15, 18, 21],
}


def test_the_same_seed_draws_the_same_points_and_each_round_draws_every_kind():
    kills = kill_campaign.draw(TIMELINE, 20, seed=3)
    assert kills == kill_campaign.draw(TIMELINE, 20, seed=3)
    assert kills != kill_campaign.draw(TIMELINE, 20, seed=4)
    for first in range(0, 20, len(POINTS)):  # every kind once in each round of five
        kinds = [(k.point, k.signal) for k in kills[first : first + len(POINTS)]]
        assert sorted(kinds) == sorted(POINTS)
    for k in kills:
        assert k.at in kill_campaign.choices(TIMELINE, k.point)
    windows = [k.at for k in kills if k.point == "window"]
    assert set(windows) <= set(TIMELINE["window_starts"])
    # over enough draws, points spread over the run, not one favourite
    assert len({k.at for k in kill_campaign.draw(TIMELINE, 200, seed=0) if k.point == "step"}) > 15


def test_a_recipe_without_a_point_of_a_kind_is_named():
    with pytest.raises(SystemExit, match="no window to kill at"):
        kill_campaign.draw({**TIMELINE, "window_starts": []}, 5, seed=0)


RESULT = {
    "precision": "32-true",
    "epochs": 2,
    "fit_seconds": 28.9,
    "train_seconds": 20.7,
    "perf/images_per_sec": 314.0,
    "val/acc": 0.23152709007263184,
    "test/acc_per_class": {"cat": 0.049504950642585754, "dog": 0.021978022530674934},
    "tested_ckpt": "/runs/a/checkpoints/best-epoch001.ckpt",
}


def test_metrics_that_differ_in_one_number_are_named_with_both_values():
    # Times differ between any two runs, and a restarted run has another dir: not differences.
    same = {**RESULT, "fit_seconds": 40.1, "perf/images_per_sec": 99.0}
    same["tested_ckpt"] = "/runs/b-restart/checkpoints/best-epoch001.ckpt"
    assert kill_campaign.first_metric_difference(RESULT, same) is None
    cat = torch.tensor(0.049504950642585754, dtype=torch.float64)
    cat = torch.nextafter(cat, torch.tensor(1.0, dtype=torch.float64)).item()  # one ulp more
    other = {**RESULT, "test/acc_per_class": {**RESULT["test/acc_per_class"], "cat": cat}}
    found = kill_campaign.first_metric_difference(RESULT, other)
    assert found == f"metrics.json test/acc_per_class/cat: 0.049504950642585754 vs {cat!r}"
    fewer = {k: v for k, v in RESULT.items() if k != "val/acc"}
    assert kill_campaign.first_metric_difference(RESULT, fewer) == (
        "metrics.json val/acc: 0.23152709007263184 vs missing"
    )
    renamed = {**RESULT, "tested_ckpt": "/runs/a/checkpoints/best-epoch001-v1.ckpt"}
    assert "tested_ckpt: best-epoch001.ckpt vs best-epoch001-v1.ckpt" in (
        kill_campaign.first_metric_difference(RESULT, renamed)
    )


def test_the_first_tensor_that_differs_is_named():
    ref = {"a.weight": torch.ones(3), "b.weight": torch.zeros(2, 2), "c.bias": torch.ones(1)}
    run = {k: v.clone() for k, v in ref.items()}
    assert kill_campaign.first_tensor_difference(ref, run) is None
    run["b.weight"][1, 0] = torch.nextafter(torch.tensor(0.0), torch.tensor(1.0))  # one ulp
    run["c.bias"] += 1
    assert kill_campaign.first_tensor_difference(ref, run).startswith("b.weight: max |difference| ")
    assert kill_campaign.first_tensor_difference(ref, {**ref, "b.weight": torch.zeros(4)}) == (
        "b.weight: shape (2, 2) vs (4,)"
    )
    extra = {**ref, "d.weight": torch.ones(1)}
    assert kill_campaign.first_tensor_difference(ref, extra) == "d.weight: missing vs present"


def test_a_checkpoint_that_differs_in_one_tensor_is_named_with_its_file(tmp_path):
    ckpt = {"global_step": 6, "state_dict": {"w": torch.ones(2), "v": torch.ones(2)}}
    torch.save(ckpt, tmp_path / "a.ckpt")
    ckpt["state_dict"]["v"] = torch.tensor([1.0, 2.0])
    torch.save(ckpt, tmp_path / "b.ckpt")
    found = kill_campaign.first_checkpoint_difference(tmp_path / "a.ckpt", tmp_path / "b.ckpt")
    assert found == "a.ckpt state_dict v: max |difference| 1"


def landed(tmp_path, kill: Kill, done: Attempt, marker: dict | None, stopped: int | None = None):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    if marker is not None:
        (tmp_path / "marker.json").write_text(json.dumps(marker))
    if stopped is not None:
        torch.save({"global_step": stopped}, run / "checkpoints" / "last.ckpt")
    return kill_campaign.landed(kill, done, tmp_path / "marker.json", run, ddp=False)


def test_a_kill_that_did_not_land_where_drawn_is_no_pass(tmp_path):
    kill = Kill("window", "SIGTERM", 7)
    said = {"point": "window", "signal": "SIGTERM", "at": 7, "step": 2, "stops_at": 3}
    term = 128 + signal.SIGTERM
    # the run ended before the point: no marker
    where, why = landed(tmp_path / "1", kill, Attempt(1, 0, "done\n", []), None)
    assert why.startswith("not landed: no marker (exit 0")
    # stopped one window late
    where, why = landed(tmp_path / "2", kill, Attempt(1, term, "", []), said, stopped=4)
    assert why == "not landed: stopped at step 4, not 3"
    where, why = landed(tmp_path / "3", kill, Attempt(1, term, "", []), said, stopped=3)
    assert (where, why) == ("step 2, stopped at step 3", "")
    sigkill = Kill("step", "SIGKILL", 7)
    mark = {"point": "step", "signal": "SIGKILL", "at": 7, "step": 2}
    crashed = Attempt(1, 1, "Traceback\nValueError: x\n", [])
    where, why = landed(tmp_path / "4", sigkill, crashed, mark)
    assert why == f"not landed: exit 1, not {-signal.SIGKILL}: ValueError: x"


# The smallest recipe that still accumulates (windows of 3, an epoch's last of 2) and validates
# mid-epoch: 180 images, 11 batches of 16 an epoch, 3 validation batches.
TINY = (
    "model=small_cnn",
    "model.width=8",
    "model.hidden=32",
    "data.batch_size=16",
    "data.eval_batch_size=8",
    "module.optimizer.lr=0.05",
    "logger=none",
    *PICTURES,
)


def campaign(tmp_path, tiny_data, capsys, *args: str, recipe=TINY) -> tuple[int, str, list]:
    """(exit status, what it printed, the rows of the table it wrote)."""
    out = tmp_path / "campaign.md"
    where = ("--data-dir", str(tiny_data), "--out", str(out))
    code = kill_campaign.main([*args, *where, "--", *recipe])
    rows = [ln for ln in out.read_text().splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    return code, capsys.readouterr().out, rows


@pytest.mark.slow
def test_a_short_campaign_lands_every_kill_and_ends_equal(tmp_path, tiny_data, capsys):
    code, printed, rows = campaign(tmp_path, tiny_data, capsys, "--kills", "3", "--seed", "1")
    assert code == 0, printed
    assert len(rows) == 3 and all(r.endswith("| equal |") for r in rows), printed
    assert "all 3 equal to the uninterrupted run" in printed


@pytest.mark.slow
def test_a_sigkill_of_a_ddp_command_lands_and_no_rank_outlives_it(tmp_path, tiny_data):
    """The command is rank 0; the rank it started waits for it in a collective, until the
    campaign kills the command's process group."""
    run, marker = tmp_path / "run", tmp_path / "marker.json"
    recipe = [*kill_campaign.RECIPE, *kill_campaign.DDP, f"data.data_dir={tiny_data}", *TINY]
    spec = {"point": "step", "signal": "SIGKILL", "at": 4, "marker": str(marker)}
    done = kill_campaign.attempt([*recipe, f"hydra.run.dir={run}"], tmp_path / "log", spec)
    where, why = kill_campaign.landed(Kill("step", "SIGKILL", 4), done, marker, run, ddp=True)
    assert (where, why) == ("step 1", ""), done.stderr[-3000:]  # 4th batch: 1 window of 3 done
    assert done.left and kill_campaign.session(done.pid) == []


@pytest.mark.slow
def test_a_resume_that_loses_the_loaders_position_fails_naming_the_first_kill_that_differs(
    tmp_path, tiny_data, capsys
):
    broken = "+callbacks.drop._target_=bench.tests.broken_resume.DropLoaderPosition"
    # Seed 8 draws a SIGTERM at the start of a window mid-epoch first, where a resume that
    # starts the epoch's batches over differs: one kill shows it (three took 20 s more).
    code, printed, rows = campaign(
        tmp_path, tiny_data, capsys, "--kills", "1", "--seed", "8", recipe=(*TINY, broken)
    )
    differing = [r for r in rows if not r.endswith("| equal |")]
    assert code == 1 and differing, printed
    first = differing[0].split(" | ")[0].removeprefix("| ")
    assert f"FAILED: {len(differing)} of 1; first: kill {first} " in printed
    assert "metrics.json " in differing[0] or ".ckpt " in differing[0]  # a difference, landed
