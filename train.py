"""Train a CIFAR classifier: `python train.py [overrides]` (see README)."""

import hydra

from cifar_amp import train


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg):
    return train.main(cfg)


if __name__ == "__main__":
    main()
