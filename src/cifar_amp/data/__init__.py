"""The core's data: CIFAR-10/100 resident on the training device, augmented there."""
