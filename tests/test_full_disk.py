"""A file a run writes that does not fit (a full disk, any OSError) stops the run in one line:
the file, the free space there, the size it needed and the checkpoint to resume from; nothing
partial is left (checkpoints, the CSV log and the history: tests/extras/)."""

from __future__ import annotations

import re

import pytest

from cifar_amp.errors import reported
from cifar_amp.training import train

SIZE = r"\d[\d.]* (bytes|[kMGT]B)"
SIZES = rf"\({SIZE} free there, {SIZE} needed\)"


def failed_write(path, then: str) -> str:
    """The line that says `path` could not be written for a full disk, then `then`."""
    path = re.escape(str(path))
    return rf"error: cannot write {path}: No space left on device {SIZES}; {re.escape(then)}"


def one_line_error(capsys, run) -> str:
    """The one line a failed run printed; no partial (temp) file left in its run dir."""
    with pytest.raises(SystemExit) as e, reported():
        run()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


def test_a_full_disk_at_metrics_json_or_config_yaml_names_the_checkpoint_to_resume_from(
    make_cfg, tmp_path, full_disk, capsys
):
    first, second = tmp_path / "first", tmp_path / "second"
    full_disk("metrics.json")  # the run's last write: after training and the test
    err = one_line_error(capsys, lambda: train(make_cfg(f"run_dir={first}")))
    last = first / "checkpoints" / "last.ckpt"
    resume_from_last = f"resume with ckpt_path={last} once there is room"
    assert re.fullmatch(failed_write(first / "metrics.json", resume_from_last), err)
    assert last.is_file() and not (first / "metrics.json").exists()
    assert not list(first.rglob("*.tmp"))

    full_disk("config.yaml")  # the run's first write: a resume names what it resumes from
    resume = (f"run_dir={second}", f"ckpt_path={last}", "trainer.max_epochs=2")
    err = one_line_error(capsys, lambda: train(make_cfg(*resume)))
    assert re.fullmatch(failed_write(second / "config.yaml", resume_from_last), err)
    assert not list(second.rglob("*.tmp")) and not (second / "config.yaml").exists()


def test_a_full_disk_before_any_checkpoint_says_there_is_none(
    make_cfg, tmp_path, full_disk, capsys
):
    full_disk("config.yaml")
    err = one_line_error(capsys, lambda: train(make_cfg()))
    assert err.endswith(f"{SIZES[:0]}; no checkpoint has been written yet")
    assert err.startswith(
        f"error: cannot write {tmp_path / 'config.yaml'}: No space left on device ("
    )
