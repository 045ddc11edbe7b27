"""Plain nn.Modules (no Lightning), chosen with `model=<name>` (configs/model/<name>.yaml)."""
