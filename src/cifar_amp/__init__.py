"""CIFAR image classification with PyTorch Lightning + Hydra, built around mixed precision."""

from cifar_amp.compiling import use_cache_dir

use_cache_dir()  # before anything imports torch._dynamo, which fixes the directory
