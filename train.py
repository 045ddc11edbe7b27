"""Train a CIFAR classifier: `python train.py [overrides]` (see README)."""

from pathlib import Path

from cifar_amp import cli, training

if __name__ == "__main__":
    cli.main(training.main, Path(__file__).parent / "configs", "train")
