"""The reliability extra: Atomic checkpoint and CSV-log writes (a kill or a full disk never tears
last.ckpt); SIGTERM/Ctrl+C stop at an accumulation window's end (every DDP rank at the same
one), save last.ckpt and print the resume command; a stop on losses that stay inf/NaN;
`debug=anomaly`."""

NEEDS = ()  # the extras it uses (docs/fork.md); none: it stands alone
