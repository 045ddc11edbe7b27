"""The images extra: The one way image files are read: Pillow, EXIF orientation, RGB, the suffixes;
the evaluation resize + centre crop."""

NEEDS = ()  # the extras it uses (docs/fork.md); none: it stands alone
