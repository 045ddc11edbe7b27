"""Test a checkpoint: `python eval.py ckpt_path=<file> [data.data_dir=...]`."""

from cifar_amp import cli, evaluation

if __name__ == "__main__":
    cli.main(evaluation.main, "eval")
