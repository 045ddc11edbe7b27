"""Predict with a checkpoint: `python predict.py ckpt_path=<file> input=<folder|image|batch file>`."""

from cifar_amp import cli, config
from cifar_amp.errors import fail

try:
    from cifar_amp.extras.predict import prediction
except ModuleNotFoundError as e:  # an extra it needs was deleted: one line, not a traceback
    if (said := config.deleted_extra(e)) is None:
        raise
    fail(said)

if __name__ == "__main__":
    cli.main(prediction.main, "predict", prediction.PredictConfig)
