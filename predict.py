"""Predict with a checkpoint: `python predict.py ckpt_path=<file> input=<folder|image|batch file>`."""

from cifar_amp import cli
from cifar_amp.extras.predict import prediction

if __name__ == "__main__":
    cli.main(prediction.main, "predict", prediction.PredictConfig)
