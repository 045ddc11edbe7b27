import json

from cifar_amp import metrics
from cifar_amp.training import train


def test_train_writes_metrics_and_checkpoints(make_cfg, tmp_path):
    result = train(make_cfg())
    saved = json.loads((tmp_path / "metrics.json").read_text())
    for key in (
        metrics.TEST_ACC,
        metrics.TEST_LOSS,
        metrics.VAL_ACC_BEST,
        metrics.EPOCHS,
        metrics.FIT_SECONDS,
        metrics.PRECISION,
        metrics.TESTED_CKPT,
        metrics.TRAIN_LOSS,  # the metrics logged during fit, as their last values
        metrics.VAL_ACC,
    ):
        assert key in saved, key
    assert saved == result
    assert saved[metrics.EPOCHS] == 1
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
