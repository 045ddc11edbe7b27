"""CIFAR image classification with PyTorch Lightning + Hydra, built around mixed precision."""
