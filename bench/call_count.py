"""Python calls per ordinary training step: the default recipe's Lightning run against the plain
loop's (bench/reference_loop.Step), for the same network, batches and precision.

    python -m bench.call_count                                   # 32-true, bf16-mixed, 16-mixed
    python -m bench.call_count --modes bf16-mixed --owners 15    # ... and who makes the calls
    python -m bench.call_count --data-dir ../shared/data/cifar10-subset -- logger=none

Counts do not drift with the machine's load, where host milliseconds do: a call is a 'call' or
'c_call' profile event in any thread of the process (`sys.setprofile`, and `threading.setprofile`
for every thread started after it, such as a progress bar's renderer), from the start of
Lightning's `_TrainingEpochLoop.advance` to the end of its `on_advance_end`, an evaluation loop
inside it paused. The plain loop's step is the same span of work: the next batch, the step, the
epoch's loss and accuracy accumulated on the device. The median over the steps of one epoch is
what a step costs; the first steps and an epoch's last (which logs) fall outside it.

The run is `train.py`'s with every default (callbacks, the CSV logger, the progress bar that a
user sees, clipping) on a tiny network (SpeedNet 4,4,4, batch 8), so the host work dominates;
overrides after `--` change it. Stable to about 1% for a given torch and Lightning.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import sys
import tempfile
import threading
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from bench import reference_loop, synthetic
from bench.compat import EvaluationLoop, TrainingEpochLoop
from cifar_amp import config, training

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MODES = ("32-true", "bf16-mixed", "16-mixed")
TINY = (
    "trainer=cpu",
    "model=speednet",
    "model.widths=[4,4,4]",
    "data.batch_size=8",
    "trainer.max_epochs=1",
    "+trainer.limit_train_batches=120",
)


class Counter:
    """A profile function counting calls while `on`; `owners` also tallies each callee's file."""

    def __init__(self, owners: bool = False) -> None:
        self.n, self.on, self.steps = 0, False, []
        self.owners: collections.Counter | None = collections.Counter() if owners else None

    def __call__(self, frame, event, arg) -> None:
        if self.on and (event == "call" or event == "c_call"):
            self.n += 1
            if self.owners is not None:
                where = frame.f_code.co_filename if event == "call" else "(built-in)"
                name = frame.f_code.co_name if event == "call" else arg.__qualname__
                self.owners[f"{_short(where)}:{name}"] += 1

    def start(self) -> None:
        self.n, self.on = 0, True

    def stop(self) -> None:
        self.on = False
        self.steps.append(self.n)

    @contextlib.contextmanager
    def installed(self):
        sys.setprofile(self)
        threading.setprofile(self)
        try:
            yield self
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]


def _short(path: str) -> str:
    for root in ("site-packages/", "/bench/", "/src/"):
        if root in path:
            return path.rpartition(root)[2]
    return path


@contextlib.contextmanager
def lightning_steps(counter: Counter):
    """Count from each `advance`'s start to its `on_advance_end`'s end, evaluation paused."""
    advance, end, evaluate = (
        TrainingEpochLoop.advance,
        TrainingEpochLoop.on_advance_end,
        EvaluationLoop.run,
    )

    def counted_advance(self, *args, **kwargs):
        counter.start()
        return advance(self, *args, **kwargs)

    def counted_end(self, *args, **kwargs):
        try:
            return end(self, *args, **kwargs)
        finally:
            counter.stop()

    def paused(self, *args, **kwargs):
        was, counter.on = counter.on, False
        try:
            return evaluate(self, *args, **kwargs)
        finally:
            counter.on = was

    TrainingEpochLoop.advance, TrainingEpochLoop.on_advance_end = counted_advance, counted_end
    EvaluationLoop.run = paused
    try:
        yield
    finally:
        TrainingEpochLoop.advance, TrainingEpochLoop.on_advance_end = advance, end
        EvaluationLoop.run = evaluate


def compose_run(mode: str, data_dir: Path, run_dir: Path, overrides: list[str]):
    config.register(CONFIGS)
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose(
            "train",
            [*TINY, f"precision={mode}", f"data.data_dir={data_dir}", "data.download=false"]
            + [f"run_dir={run_dir}", "test=false", *overrides],
        )


def count_lightning(cfg, owners: bool = False) -> Counter:
    counter = Counter(owners)
    run = training.build_run(cfg)
    with training.holding_run_dir(run):
        training.record_config(run)
        with counter.installed(), lightning_steps(counter):
            training.fit(run)
    return counter


def count_plain(cfg, owners: bool = False) -> Counter:
    """The plain loop's steps over the same DataModule's batches, as reference_loop.fit runs
    them, with the recipe's network, optimizer, schedule, precision and clipping."""
    run = training.build_run(cfg)
    module, dm = run.module, run.datamodule
    dm.setup("fit")
    loader = dm.train_dataloader()
    optimizer = instantiate(module.hparams.optimizer, params=module.net.parameters())
    scheduler = module.hparams.scheduler and instantiate(
        module.hparams.scheduler, optimizer=optimizer, total_steps=len(loader)
    )
    clip = cfg.trainer.get("gradient_clip_val")
    step = reference_loop.Step(
        module.net,
        optimizer,
        scheduler,
        cfg.precision.name,
        module.hparams.label_smoothing,
        clip=clip,
    )
    loss_sum = torch.zeros((), device=step.device)
    correct = torch.zeros((), device=step.device, dtype=torch.long)
    counter = Counter(owners)
    batches = iter(loader)
    steps = min(len(loader), cfg.trainer.get("limit_train_batches") or len(loader))
    with counter.installed():
        for _ in range(int(steps)):
            counter.start()
            x, y = next(batches)
            loss, logits = step(x, y)
            loss_sum += loss.detach() * len(y)
            correct += (logits.detach().argmax(1) == y).sum()
            counter.stop()
    return counter


def measure(modes, data_dir: Path, work: Path, overrides: list[str], owners: int = 0) -> dict:
    out = {}
    for mode in modes:
        cfg = compose_run(mode, data_dir, work / f"run-{mode}", overrides)
        lightning, plain = count_lightning(cfg, owners > 0), count_plain(cfg, owners > 0)
        out[mode] = {
            "template": int(statistics.median(lightning.steps)),
            "plain": int(statistics.median(plain.steps)),
            "steps": len(lightning.steps),
        }
        if owners:
            per_step = len(lightning.steps)
            out[mode]["owners"] = {
                k: round(v / per_step, 1) for k, v in lightning.owners.most_common(owners)
            }
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.call_count", description=__doc__)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--data-dir", help="a CIFAR-10 folder (default: random pixels)")
    ap.add_argument("--owners", type=int, default=0, help="list the N most-called functions")
    ap.add_argument("--out", type=Path, help="also write the figures here (JSON)")
    ap.add_argument("overrides", nargs="*", help="train.py overrides, after --")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        data_dir, _ = synthetic.write(Path(tmp) / "data", 1200, 64, args.data_dir)
        result = measure(args.modes.split(","), data_dir, Path(tmp), args.overrides, args.owners)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
