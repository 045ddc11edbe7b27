"""The sharding extra: `trainer=fsdp` and `trainer=deepspeed` that keep the `precision` choice
(under `16-mixed`: FSDP's sharded GradScaler, DeepSpeed's loss scaler, from `precision.scaler`)."""

NEEDS = ()  # the extras it uses (docs/fork.md); none: it stands alone
