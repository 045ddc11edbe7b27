"""Train a CIFAR classifier: `python train.py [overrides]` (see README)."""

import sys
from pathlib import Path

import hydra

from cifar_amp import train
from cifar_amp.errors import check_overrides


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg):
    return train.main(cfg)


if __name__ == "__main__":
    check_overrides(sys.argv[1:], Path(__file__).parent / "configs", "train")
    main()
