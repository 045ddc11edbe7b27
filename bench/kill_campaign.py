"""Kill a run at points drawn at random, resume it, and check that it ends bit-identical to
an uninterrupted run: the exact resume docs/reliability.md promises, shown broadly rather than
at a few chosen batches.

    python -m bench.kill_campaign                                  # 10 kills, the CIFAR subset
    python -m bench.kill_campaign --kills 20 --ddp-kills 6 --seed 0
    python -m bench.kill_campaign --kills 3 --data-dir <folder> -- model=small_cnn trainer=cpu

One uninterrupted reference run of the recipe (RECIPE below, then the overrides after `--`),
then N runs of it, each killed from inside (KillAt, a callback every run has) at a point drawn
from numpy's default_rng(--seed): SIGKILL in a training step, in a checkpoint write (on the
writer thread, the bytes in the temp file, before its rename) or in a validation; SIGTERM one
micro-batch into an accumulation window or in a validation. --ddp-kills M runs M more on two
CPU processes (trainer=ddp_cpu), the signal going to the command's process (rank 0), as a
user's kill would. Each killed run must have stopped where its marker says, without
metrics.json; it is then resumed into its run dir from its last.ckpt (SIGTERM: with the command
it printed), or restarted in a fresh run dir where there is none, until it ends. Every number
of its metrics.json but the times (TIMES) and every tensor of its last.ckpt and of the tested
best checkpoint must equal the reference's. One row per kill, printed and written to --out;
exit status 1 on any difference or kill that did not land.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch import Callback
from lightning.pytorch.plugins.io import CheckpointIO

from cifar_amp import metrics
from cifar_amp.extras.diagnostics.diagnostics import MEASURED
from cifar_amp.extras.reliability.reliability import BackgroundCheckpointIO
from cifar_amp.runs import write_atomically

REPO = Path(__file__).resolve().parents[1]
# What KillAt does in a run: unset, nothing; {"record": <file>}: write the run's timeline
# there; {"point", "signal", "at", "marker"}: kill it there, after writing the marker.
ENV = "CIFAR_AMP_KILL_AT"

# The default recipe, deterministic, with what a resume has to get right: accumulation windows
# (3 micro-batches), a validation mid-epoch, a step checkpoint at every optimizer step (so
# that most kills resume mid-epoch), 2 epochs. Validation batches of 128 rather than 1,024:
# 4 per validation to draw from on the subset's 406 validation images instead of 1.
RECIPE = (
    "trainer.deterministic=true",
    "seed=42",
    "trainer.max_epochs=2",
    "trainer.accumulate_grad_batches=3",
    "trainer.val_check_interval=0.5",
    "callbacks.step_checkpoint.every_n_train_steps=1",
    "data.eval_batch_size=128",
    "trainer.enable_progress_bar=false",
    "+callbacks.kill._target_=bench.kill_campaign.KillAt",  # (as -m runs it, this is __main__)
)
# Two processes with half the batch each: the same global batch as one process.
DDP = ("trainer=ddp_cpu", "data.batch_size=256")

# (point, signal) of each kind of kill; the timeline key that counts a run's points of it.
POINTS = (
    ("step", "SIGKILL"),
    ("write", "SIGKILL"),
    ("validation", "SIGKILL"),
    ("window", "SIGTERM"),
    ("validation", "SIGTERM"),
)
COUNTED = {"step": "micro_batches", "write": "writes", "validation": "validation_batches"}

# metrics.json keys that measure the machine, not the training: they differ between any two
# runs (wall times, images/s, peak memory). Every other number must be equal.
TIMES = frozenset((metrics.FIT_SECONDS, *MEASURED))
# A path: compared by file name (a restarted run has another run dir).
PATHS = frozenset((metrics.TESTED_CKPT,))
# The tensors compared in a checkpoint: the weights; with EMA, state_dict holds the average
# and current_model_state the raw weights (the speedrun extra).
WEIGHTS = ("state_dict", "current_model_state", "averaging_state")


# -- inside each run -------------------------------------------------------------------------
class KillAt(Callback):
    """Kills its own process at the point ENV names (on rank 0 only), after writing a marker
    that says where: the campaign's proof that the kill landed. With {"record": file}, counts
    the run's points of each kind instead and writes them there at the end of training."""

    def __init__(self) -> None:
        self.spec = json.loads(os.environ.get(ENV, "null")) or {}
        self.counts = {"micro_batches": 0, "writes": 0, "validation_batches": 0}
        self.window_starts: list[int] = []  # micro-batches that open a window of 2 or more
        self.window_open = False  # the last training batch left its window open

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit" or trainer.global_rank or self.spec.get("point") != "write":
            return
        io = trainer.strategy.checkpoint_io
        if isinstance(io, BackgroundCheckpointIO):  # on its writer thread
            io.checkpoint_io = KillInWrite(io.checkpoint_io, self)
        else:
            trainer.strategy.checkpoint_io = KillInWrite(io, self)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.counts["micro_batches"] += 1
        every, n = trainer.accumulate_grad_batches, trainer.num_training_batches
        if every > 1 and batch_idx % every == 0 and batch_idx + 1 < n:
            self.window_starts.append(self.counts["micro_batches"])

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.due(trainer, "step", self.counts["micro_batches"]):
            self.fire(trainer.global_step, micro_batch=self.counts["micro_batches"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        ends = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        self.window_open = not (ends or batch_idx + 1 == trainer.num_training_batches)
        if self.due(trainer, "window", self.counts["micro_batches"]):
            # SIGTERM finishes the window: the run stops at the next optimizer step
            step = trainer.global_step
            self.fire(step, micro_batch=self.counts["micro_batches"], stops_at=step + 1)

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0
    ) -> None:
        if trainer.sanity_checking:
            return
        self.counts["validation_batches"] += 1
        if self.due(trainer, "validation", self.counts["validation_batches"]):
            step = trainer.global_step
            at = self.counts["validation_batches"]
            self.fire(step, validation_batch=at, stops_at=step + int(self.window_open))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.counts["writes"] += 1  # one write of the file on rank 0 for each

    def on_train_end(self, trainer, pl_module) -> None:
        if "record" in self.spec and not trainer.global_rank:
            timeline = {**self.counts, "window_starts": self.window_starts}
            Path(self.spec["record"]).write_text(json.dumps(timeline))

    def due(self, trainer, point: str, count: int) -> bool:
        spec = self.spec
        return not trainer.global_rank and spec.get("point") == point and spec["at"] == count

    def fire(self, step: int, **where) -> None:
        """Write the marker (flushed and fsynced: a SIGKILL follows), then signal this process."""
        spec = self.spec
        marker = {"point": spec["point"], "signal": spec["signal"], "at": spec["at"]}
        with open(spec["marker"], "w") as f:
            f.write(json.dumps({**marker, "step": step, **where}))
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.Signals[spec["signal"]])


class KillInWrite(CheckpointIO):
    """The checkpoint writer it wraps, but for its `at`-th save: written with the same atomic
    write, killed once the checkpoint is in the temp file and before the rename."""

    def __init__(self, inner: CheckpointIO, kill: KillAt) -> None:
        self.inner, self.kill, self.saves = inner, kill, 0

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.saves += 1
        if self.saves != self.kill.spec["at"]:
            return self.inner.save_checkpoint(checkpoint, path, storage_options)

        def write(f) -> None:
            torch.save(checkpoint, f)
            f.flush()
            self.kill.fire(checkpoint["global_step"], file=Path(path).name)

        write_atomically(Path(path), write)

    def load_checkpoint(self, *args, **kwargs):
        return self.inner.load_checkpoint(*args, **kwargs)

    def remove_checkpoint(self, path) -> None:
        self.inner.remove_checkpoint(path)


# -- the draw --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kill:
    point: str  # a POINTS name
    signal: str  # SIGKILL or SIGTERM
    at: int  # the run's n-th micro-batch, checkpoint write or validation batch (from 1)


def choices(timeline: dict, point: str) -> list[int]:
    """Where a kill of `point` can land in a run of this timeline."""
    if point == "window":
        return list(timeline["window_starts"])
    return list(range(1, timeline[COUNTED[point]] + 1))


def draw(timeline: dict, n: int, seed: int) -> list[Kill]:
    """`n` kills: the kinds in a shuffled order, each in turn (so n >= len(POINTS) draws every
    kind), each at a point drawn among the run's points of that kind."""
    rng = np.random.default_rng(seed)
    kills: list[Kill] = []
    while len(kills) < n:
        for i in rng.permutation(len(POINTS))[: n - len(kills)]:
            point, signum = POINTS[i]
            where = choices(timeline, point)
            if not where:
                raise SystemExit(f"error: this recipe's runs have no {point} to kill at")
            kills.append(Kill(point, signum, int(rng.choice(where))))
    return kills


# -- the comparison --------------------------------------------------------------------------
def comparable(result: dict, prefix: str = "") -> dict:
    """metrics.json flattened (test/acc_per_class/cat), without TIMES, paths as file names."""
    out = {}
    for key, value in result.items():
        if key in TIMES:
            continue
        if isinstance(value, dict):
            out |= comparable(value, f"{prefix}{key}/")
        elif key in PATHS:
            out[prefix + key] = os.path.basename(value)
        else:
            out[prefix + key] = value
    return out


def first_metric_difference(ref: dict, run: dict) -> str | None:
    """The first key whose value differs (bit for bit: the values as JSON), with both values."""
    a, b = comparable(ref), comparable(run)
    for key in [*a, *(k for k in b if k not in a)]:
        if json.dumps(a.get(key)) != json.dumps(b.get(key)):
            return f"metrics.json {key}: {a.get(key, 'missing')} vs {b.get(key, 'missing')}"
    return None


def first_tensor_difference(ref: dict, run: dict) -> str | None:
    """The first tensor of two state dicts that is not torch.equal (or is in one only)."""
    for key in [*ref, *(k for k in run if k not in ref)]:
        a, b = ref.get(key), run.get(key)
        if a is None or b is None:
            said = ["missing" if t is None else "present" for t in (a, b)]
            return f"{key}: {said[0]} vs {said[1]}"
        if a.shape != b.shape:
            return f"{key}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            return f"{key}: max |difference| {diff:.3g}"
    return None


def first_checkpoint_difference(ref: Path, run: Path) -> str | None:
    a = torch.load(ref, map_location="cpu", weights_only=False)
    b = torch.load(run, map_location="cpu", weights_only=False)
    if a["global_step"] != b["global_step"]:
        return f"{ref.name} global_step: {a['global_step']} vs {b['global_step']}"
    for section in WEIGHTS:
        if section in a or section in b:
            found = first_tensor_difference(a.get(section, {}), b.get(section, {}))
            if found:
                return f"{ref.name} {section} {found}"
    return None


def first_difference(ref: Path, run: Path) -> str | None:
    """Between two finished run dirs: metrics.json, then last.ckpt, then the tested checkpoint."""
    results = [json.loads((d / "metrics.json").read_text()) for d in (ref, run)]
    found = first_metric_difference(*results)
    # each its own tested file (named alike unless the metrics differ already)
    tested = [Path(r[metrics.TESTED_CKPT]) for r in results]
    pairs = ((ref / "checkpoints" / "last.ckpt", run / "checkpoints" / "last.ckpt"), tested)
    for a, b in pairs:
        found = found or first_checkpoint_difference(a, b)
    return found


# -- the runs --------------------------------------------------------------------------------
def session(sid: int) -> list[int]:
    """The live processes of session `sid` (a command started in a session of its own)."""
    found = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(d))
    return found


def end_session(sid: int, grace: float) -> list[int]:
    """Wait up to `grace` s for the session's processes to end, then SIGKILL its process group
    and wait until none is left; the processes that were left after the grace."""
    deadline = time.monotonic() + grace
    while session(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = session(sid)
    if left:
        try:
            os.killpg(sid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        while session(sid):
            time.sleep(0.1)
    return left


@dataclass
class Attempt:
    pid: int  # the command's, its session's id
    returncode: int
    stderr: str
    left: list[int]  # processes of the command still running after it ended


def attempt(args: list[str], log: Path, kill: dict | None = None) -> Attempt:
    """`python train.py <args>` from the repository root, in a session of its own (its DDP
    ranks with it), output to `log`.out/.err; with KillAt told `kill` through ENV."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if kill is not None:
        env[ENV] = json.dumps(kill)
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
        proc.wait()
    # A SIGKILLed command leaves its DDP ranks waiting for it: killed at once, as its whole group.
    left = end_session(proc.pid, grace=0 if proc.returncode == -signal.SIGKILL else 10)
    return Attempt(proc.pid, proc.returncode, Path(f"{log}.err").read_text(), left)


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def printed_resume(stderr: str) -> list[str] | None:
    """The overrides of the resume command a SIGTERM stop printed (reliability extra)."""
    said = [ln for ln in stderr.splitlines() if "Resume with: python " in ln]
    if not said:
        return None
    return shlex.split(said[-1].split("Resume with: python ", 1)[1])[1:]  # after train.py


def global_step(ckpt: Path) -> int:
    return torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"]


@dataclass
class Row:
    number: int
    ddp: bool
    kill: Kill
    landed: str = ""  # where it stopped, from its marker
    resumed_from: str = ""  # last.ckpt's global step, or "restart"
    result: str = ""  # "equal", or what differs, or why the kill did not land
    ok: bool = False


def landed(kill: Kill, done: Attempt, marker: Path, run: Path, ddp: bool) -> tuple[str, str]:
    """(where the kill landed, why it did not land or ""): the process ended by the signal,
    its marker names the drawn point, no metrics.json, and a SIGTERM stop saved last.ckpt at
    the window end the marker expects."""
    if not marker.is_file():
        return "", f"not landed: no marker (exit {done.returncode}: {last_line(done.stderr)})"
    said = json.loads(marker.read_text())
    where = f"step {said['step']}" + (f", writing {said['file']}" if "file" in said else "")
    if (said["point"], said["signal"], said["at"]) != (kill.point, kill.signal, kill.at):
        return where, f"not landed: the marker says {said}"
    wanted = -signal.SIGKILL if kill.signal == "SIGKILL" else 128 + signal.SIGTERM
    if done.returncode != wanted:
        return where, f"not landed: exit {done.returncode}, not {wanted}: {last_line(done.stderr)}"
    if (run / "metrics.json").exists():
        return where, "not landed: the killed run wrote metrics.json"
    if kill.signal == "SIGTERM":
        stopped = global_step(run / "checkpoints" / "last.ckpt")
        where += f", stopped at step {stopped}"
        # Under DDP the ranks share the signal every few steps: a later window end.
        early = stopped < said["stops_at"] if ddp else stopped != said["stops_at"]
        if early:
            return where, f"not landed: stopped at step {stopped}, not {said['stops_at']}"
    if done.left and not (ddp and kill.signal == "SIGKILL"):
        return where, f"processes left after the command ended: {done.left}"
    return where, ""


def kill_row(row: Row, recipe: list[str], folder: Path, ref: Path) -> Row:
    """Kill a run as `row.kill` says, resume it to the end, compare it with `ref`."""
    name = f"kill{row.number:02d}"
    run, marker = folder / name, folder / f"{name}.marker.json"
    spec = {"point": row.kill.point, "signal": row.kill.signal, "at": row.kill.at}
    spec["marker"] = str(marker)
    done = attempt([*recipe, f"hydra.run.dir={run}"], folder / name, spec)
    row.landed, why = landed(row.kill, done, marker, run, row.ddp)
    if why:
        row.result = why
        return row
    last = run / "checkpoints" / "last.ckpt"
    tries = 0
    while True:
        tries += 1
        if last.is_file():
            row.resumed_from = row.resumed_from or f"step {global_step(last)}"
            resume = printed_resume(done.stderr) or [*recipe, f"ckpt_path={last}"]
            resume = [o for o in resume if not o.startswith("hydra.run.dir=")]
            done = attempt([*resume, f"hydra.run.dir={run}"], folder / f"{name}.resume{tries}")
        else:  # killed before its first checkpoint: what a user would do, a new run
            row.resumed_from = row.resumed_from or "restart"
            run = folder / f"{name}-restart"
            last = run / "checkpoints" / "last.ckpt"
            done = attempt([*recipe, f"hydra.run.dir={run}"], folder / f"{name}.restart")
        ended_by_signal = done.returncode in (-signal.SIGKILL, 128 + signal.SIGTERM)
        if not (ended_by_signal and tries < 3):  # killed again: resumed again
            break
    if done.returncode or done.left:
        why = f"exit {done.returncode}, left {done.left}: {last_line(done.stderr)}"
        row.result = f"resume failed: {why}"
        return row
    found = first_difference(ref, run)
    row.result, row.ok = found or "equal", found is None
    return row


def campaign(
    recipe: list[str], n: int, seed: int, folder: Path, ddp: bool, first: int
) -> list[Row]:
    """The reference run of `recipe` in folder/reference, then `n` kills of it, numbered from
    `first`; a row each, printed as it ends."""
    folder.mkdir(parents=True, exist_ok=True)
    ref, timeline = folder / "reference", folder / "timeline.json"
    record = {"record": str(timeline)}
    done = attempt([*recipe, f"hydra.run.dir={ref}"], folder / "reference", record)
    if done.returncode or not timeline.is_file():
        raise SystemExit(
            f"error: the reference run failed (exit {done.returncode}): {last_line(done.stderr)}; "
            f"its log: {folder / 'reference.err'}"
        )
    rows = []
    for i, kill in enumerate(draw(json.loads(timeline.read_text()), n, seed)):
        rows.append(kill_row(Row(first + i, ddp, kill), recipe, folder, ref))
        print(format_row(rows[-1]), flush=True)
    return rows


HEADER = (
    "| # | processes | point | signal | drawn | landed at | resumed from | result |\n"
    "|---|---|---|---|---|---|---|---|"
)
UNITS = {
    "step": "micro-batch",
    "window": "micro-batch",
    "write": "write",
    "validation": "val batch",
}


def format_row(row: Row) -> str:
    k = row.kill
    cells = (
        row.number,
        "2 (ddp_cpu)" if row.ddp else "1",
        k.point,
        k.signal,
        f"{UNITS[k.point]} {k.at}",
        row.landed,
        row.resumed_from,
        row.result.replace("|", "\\|"),
    )
    return "| " + " | ".join(map(str, cells)) + " |"


def table(rows: list[Row], command: str, seconds: float) -> str:
    bad = [r for r in rows if not r.ok]
    verdict = (
        f"all {len(rows)} equal to the uninterrupted run"
        if not bad
        else f"FAILED: {len(bad)} of {len(rows)}; first: kill {bad[0].number} "
        f"({bad[0].kill.point}, {bad[0].kill.signal}): {bad[0].result}"
    )
    return "\n".join(
        [
            f"`{command}`",
            "",
            HEADER,
            *map(format_row, rows),
            "",
            f"{verdict}; total {seconds:.0f} s",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kill_campaign", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--kills", type=int, default=10, help="kills of one process (default 10)")
    p.add_argument("--ddp-kills", type=int, default=0, help="kills under trainer=ddp_cpu")
    p.add_argument("--seed", type=int, default=0, help="seeds the draw of the kill points")
    p.add_argument("--data-dir", type=Path, default=Path("../shared/data/cifar10-subset"))
    p.add_argument("--out", type=Path, help="the table (logs/kill_campaign/<time>/campaign.md)")
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="after --: train.py overrides")
    args = p.parse_args(argv)
    overrides = args.overrides[1:] if args.overrides[:1] == ["--"] else args.overrides
    if args.kills < 0 or args.ddp_kills < 0 or args.kills + args.ddp_kills == 0:
        p.error("--kills and --ddp-kills must be >= 0, and one of them > 0")
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    out = (args.out or REPO / "logs" / "kill_campaign" / stamp / "campaign.md").resolve()
    recipe = [*RECIPE, f"data.data_dir={args.data_dir.resolve()}", *overrides]
    given = argv if argv is not None else sys.argv[1:]
    command = " ".join(["python -m bench.kill_campaign", shlex.join(given)]).strip()
    start = time.perf_counter()
    print(HEADER, flush=True)
    rows = []
    if args.kills:
        rows = campaign(recipe, args.kills, args.seed, out.parent / "single", False, 1)
    if args.ddp_kills:
        ddp = [*recipe[: len(RECIPE)], *DDP, *recipe[len(RECIPE) :]]
        rows += campaign(ddp, args.ddp_kills, args.seed, out.parent / "ddp", True, len(rows) + 1)
    text = table(rows, command, time.perf_counter() - start)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text.rsplit("\n", 2)[-2], f"(table: {out})", flush=True)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
