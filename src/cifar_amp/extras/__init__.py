"""The extras: one folder each (its code, `configs/`, and its tests in tests/extras/<name>/).
Nothing in the core imports them; delete a folder and the extra is gone (docs/fork.md)."""
