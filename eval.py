"""Test a checkpoint: `python eval.py ckpt_path=<file> [data.data_dir=...]`."""

import sys
from pathlib import Path

import hydra

from cifar_amp import evaluate
from cifar_amp.errors import check_overrides


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def main(cfg):
    return evaluate.main(cfg)


if __name__ == "__main__":
    check_overrides(sys.argv[1:], Path(__file__).parent / "configs", "eval")
    main()
