"""docs/fork.md's example of mixup and cutmix in a DataModule of your own: the noise
DataModule's training batches, mixed on the device by the template's Mixer."""

from noise_datamodule import NoiseDataModule

from cifar_amp.data.augment import Mixer, Mixing

NO_MIXING = Mixing()  # off: data.augment.mixup_alpha / cutmix_alpha turn it on


class MixingNoiseDataModule(NoiseDataModule):
    def __init__(self, augment: Mixing = NO_MIXING, **kwargs):
        super().__init__(**kwargs)
        self.mixer = Mixer(augment, self.num_classes, self.seed)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return self.mixer.training_batch(batch, self.trainer)  # training batches only
