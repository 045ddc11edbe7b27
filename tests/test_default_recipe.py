"""The default recipe, unshrunk but for one epoch on the tiny folder: what `python train.py`
trains. `.ci/extras.py` runs this file in every copy of the core with one extra."""

import json

from cifar_amp import metrics
from cifar_amp.training import train
from conftest import compose_cfg


def test_the_default_recipe_trains_one_epoch_and_tests_its_best_checkpoint(tmp_path, tiny_data):
    cfg = compose_cfg(
        "train",
        (
            f"data.data_dir={tiny_data}",
            "data.download=false",
            "trainer.max_epochs=1",
            "trainer.enable_progress_bar=false",
            f"run_dir={tmp_path}",
        ),
    )
    assert cfg.model._target_.endswith(".SpeedNet") and cfg.precision.name == "32-true"
    result = train(cfg)
    assert json.loads((tmp_path / "metrics.json").read_text()) == result
    assert result[metrics.EPOCHS] == 1 and 0.0 <= result[metrics.TEST_ACC] <= 1.0
    assert (tmp_path / "metrics.csv").is_file()  # the default logger
    assert result[metrics.TESTED_CKPT].startswith(str(tmp_path / "checkpoints"))
