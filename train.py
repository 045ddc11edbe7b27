"""Train a CIFAR classifier: `python train.py [overrides]` (see README)."""

from cifar_amp import cli, training

if __name__ == "__main__":
    cli.main(training.main, "train")
