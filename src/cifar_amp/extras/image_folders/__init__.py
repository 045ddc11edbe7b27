"""The image_folders extra: `data=image_folder`: your own images in class folders."""

NEEDS = ("images",)  # the extras it uses (docs/fork.md); none: it stands alone
