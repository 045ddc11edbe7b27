"""Predict with a checkpoint: `python predict.py ckpt_path=<file> input=<folder|image|batch file>`."""

from pathlib import Path

from cifar_amp import cli, prediction

if __name__ == "__main__":
    cli.main(prediction.main, Path(__file__).parent / "configs", "predict")
