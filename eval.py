"""Test a checkpoint: `python eval.py ckpt_path=<file> [data.data_dir=...]`."""

import hydra

from cifar_amp import evaluate


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def main(cfg):
    return evaluate.main(cfg)


if __name__ == "__main__":
    main()
