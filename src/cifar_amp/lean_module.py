"""LeanModule: a LightningModule whose host work per training step is small, so that a fast GPU
step does not wait for Python (`python -m bench.call_count` counts it). Subclass it as you would
LightningModule, and in each step hand the loss, the logits and the targets to `self.track()`.

What it does out of sight, so that a subclass's steps and hooks stay its own:
- The metrics (`metrics`: name -> a torchmetrics class and its arguments) take a stage's steps
  once an epoch, and at each checkpoint, not at every step: an update per step cost about 200
  Python calls. They are logged as `<stage>/loss` and `<stage>/<name>` at each epoch's end by
  `EpochMetrics`, a callback that train.py and eval.py attach (and `configure_callbacks`, for a
  Trainer of your own), so a subclass that overrides an epoch hook loses nothing. A stage whose
  batches ran without a `track()` call stops the run, naming the step.
- The best validation value of the run's `monitor` (config.Monitor: `acc` unless set) is
  `val/<monitor>_best`, checkpointed.
- A checkpoint holds the running training metrics, reset where the epoch ended, so a resume
  from anywhere logs what the uninterrupted run logs; and what was logged so far
  (`logged_before_resume`), for a resume that has no epoch or validation left to log it again.
- Lightning sets the running hook's name (`compat.HOOK_NAME`) twice at each hook call (36
  times a step); it is stored without nn.Module.__setattr__'s checks (six Python calls a set).
- The test stage also counts a confusion matrix, `confusion` once the test has ended: per-class
  accuracy in metrics.json, and the curves extra's picture of it."""

from collections.abc import Mapping

import torch
from lightning import Callback, LightningModule
from torch import Tensor
from torchmetrics import MaxMetric, MeanMetric, Metric, MinMetric
from torchmetrics.classification import MulticlassConfusionMatrix

from cifar_amp import compat, config, metrics, seams
from cifar_amp.errors import InvalidArgument, UserError

STAGES = ("train", "val", "test")
# A stage's queued logits beyond this many numbers are handed to its metrics before the epoch
# ends (256 MB of float32): CIFAR never reaches it; a large data set's epoch would.
QUEUE_LIMIT = 1 << 26
# The checkpoint's key for the metrics logged up to it (Lightning's callback_metrics).
LOGGED = "logged_metrics"
# ... and, under DDP, for every rank's running training metrics (state_dict holds rank 0's).
RANKS = "train_metrics_of_ranks"


def build_metric(name: str, node: Mapping, num_classes: int) -> Metric:
    """The torchmetrics object of `node` ({"_target_": class, **arguments}); `num_classes` and
    `validate_args=False` (its checks read the device) filled in where the class takes them.
    Nothing is called before the class is found to be a torchmetrics Metric."""
    key = f"metrics.{name}"
    if name == metrics.LOSS:
        raise InvalidArgument(key, repr(name), "every stage logs its loss as <stage>/loss already")
    if not name.isidentifier():
        raise InvalidArgument(key, repr(name), "a metric's name is a Python identifier")
    if not isinstance(node, Mapping) or "_target_" not in node:
        raise InvalidArgument(key, node, "give it a _target_: a torchmetrics class")
    try:
        cls = config.find_class(node["_target_"])
    except LookupError as e:
        raise InvalidArgument(f"{key}._target_", node["_target_"], f"no such class ({e})") from e
    if not (isinstance(cls, type) and issubclass(cls, Metric)):
        raise InvalidArgument(f"{key}._target_", node["_target_"], "not a torchmetrics Metric")
    takes = config.arguments(cls)
    if bad := [k for k in node if k != "_target_" and k not in takes]:
        raise InvalidArgument(f"{key}.{bad[0]}", node[bad[0]], f"{cls.__name__} takes no {bad[0]}")
    filled = {"num_classes": num_classes, "validate_args": False}
    args = {k: v for k, v in filled.items() if k in takes} | dict(node)
    args.pop("_target_")
    try:
        return cls(**args)
    except Exception as e:
        raise InvalidArgument(key, node["_target_"], f"{type(e).__name__}: {e}") from e


class LeanModule(LightningModule):
    """See the module's doc. `metrics`: name -> {"_target_": a torchmetrics class, arguments};
    each is computed in every stage on (logits, class indices)."""

    def __init__(
        self,
        metrics: Mapping[str, Mapping],
        num_classes: int,
        monitor: str = metrics.ACC,  # the run's monitor.metric (build.module passes it)
        monitor_mode: str = "max",  # the run's monitor.mode
    ) -> None:
        super().__init__()
        self.metric_names = list(metrics)
        for stage in STAGES:
            setattr(self, f"{stage}_loss", MeanMetric(nan_strategy="disable"))
            for name, node in metrics.items():
                setattr(self, f"{stage}_{name}", build_metric(name, node, num_classes))
        check_monitor(monitor, monitor_mode, self.stage_metrics("val"))
        self.monitor = monitor
        self.best_name = f"val_{monitor}_best"  # val_acc_best by default, as checkpoints hold it
        setattr(self, self.best_name, MaxMetric() if monitor_mode == "max" else MinMetric())
        # Checkpointed: the best score, and the running training metrics for a mid-epoch resume.
        for name in (self.best_name, "train_loss", *(f"train_{n}" for n in self.metric_names)):
            getattr(self, name).persistent(True)
        self.test_confusion = MulticlassConfusionMatrix(num_classes, validate_args=False)
        self.confusion: Tensor | None = None  # rows: true class, columns: predicted
        self._queued: dict[str, list] = {stage: [] for stage in STAGES}
        self._queued_size = dict.fromkeys(STAGES, 0)
        self.tracked = dict.fromkeys(STAGES, False)  # in this stage's epoch: EpochMetrics checks

    def track(self, stage: str, loss: Tensor, logits: Tensor, targets: Tensor) -> None:
        """A step's mean `loss`, `logits` (N, C) and `targets`: class indices (N,), or class
        weights (N, C) such as mixup's, where each row's heaviest class is the one counted."""
        self.tracked[stage] = True
        # A copy: under CUDA graphs (module.compile_mode=reduce-overhead) the network's output
        # is overwritten by its next replay, before the queue reaches the metrics.
        self._queued[stage].append((loss.detach(), logits.detach().clone(), targets))
        self._queued_size[stage] += logits.numel()
        if self._queued_size[stage] > QUEUE_LIMIT:
            self.update_metrics(stage)

    def stage_metrics(self, stage: str) -> dict[str, Metric]:
        """`stage`'s metrics by logged name: `<stage>/loss` first."""
        names = [metrics.LOSS, *self.metric_names]
        return {metrics.key(stage, n): getattr(self, f"{stage}_{n}") for n in names}

    def update_metrics(self, stage: str) -> None:
        """Hand `stage`'s queued steps to its metrics."""
        queued = self._queued[stage]
        if not queued:
            return
        losses, logits, targets = zip(*queued, strict=True)
        queued.clear()
        self._queued_size[stage] = 0
        # One loss per sample: a per-sample epoch mean whatever the batch sizes and ranks.
        losses = [loss.expand(len(x)) for loss, x in zip(losses, logits, strict=True)]
        preds = torch.cat(logits).float()
        labels = torch.cat([t if t.ndim == 1 else t.argmax(-1) for t in targets])
        getattr(self, f"{stage}_loss").update(torch.cat(losses))
        for name in self.metric_names:
            getattr(self, f"{stage}_{name}").update(preds, labels)
        if stage == "test":
            self.test_confusion.update(preds, labels)

    def reset_stage(self, stage: str) -> None:
        """Empty `stage`'s metrics and queue (before its epoch, in the epoch's grad mode)."""
        self._queued[stage].clear()
        self._queued_size[stage] = 0
        self.tracked[stage] = False
        for metric in self.stage_metrics(stage).values():
            metric.reset()
        if stage == "test":
            self.test_confusion.reset()

    def log_stage(self, stage: str) -> None:
        """Log `stage`'s metrics for the epoch: Lightning computes them (synced across ranks)
        and resets them."""
        self.update_metrics(stage)
        for key, metric in self.stage_metrics(stage).items():
            bar = stage != "train" or key != metrics.TRAIN_LOSS
            self.log(key, metric, prog_bar=bar, on_step=False, on_epoch=True)

    def state_dict(self, *args, **kwargs):
        self.update_metrics("train")  # a checkpoint holds the running training metrics
        return super().state_dict(*args, **kwargs)

    def __setattr__(self, name: str, value) -> None:
        if name == compat.HOOK_NAME:
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def configure_callbacks(self) -> list[Callback]:
        # For a Trainer of your own; train.py and eval.py attach EpochMetrics themselves
        # (attach), so that a subclass's configure_callbacks cannot lose it.
        if any(isinstance(c, EpochMetrics) for c in self.trainer.callbacks):
            return []
        return [EpochMetrics()]


def check_monitor(name: str, mode: str, val_metrics: dict[str, Metric]) -> None:
    """One line, before any step, if the monitor names no metric of the module or ranks it the
    wrong way round (`higher_is_better`, torchmetrics' own word; a loss is lower-is-better)."""
    if mode not in ("max", "min"):
        raise UserError(f"monitor.mode={mode}: valid: max, min")
    metric = val_metrics.get(metrics.key("val", name))
    if metric is None:
        names = ", ".join(k.removeprefix("val/") for k in val_metrics)
        raise UserError(
            f"monitor.metric={name} names no metric of this run; its metrics: {names} "
            "(module.metrics; `loss` is every run's)"
        )
    higher = False if name == metrics.LOSS else metric.higher_is_better
    if higher is not None and mode != ("max" if higher else "min"):
        better = "higher" if higher else "lower"
        raise UserError(
            f"monitor.mode={mode} for {name}, where {better} is better: monitor.mode="
            f"{'max' if higher else 'min'}"
        )


def attach(trainer, module) -> None:
    """EpochMetrics on `trainer`, where `module` is a LeanModule that needs it (once)."""
    if isinstance(module, LeanModule) and not any(
        isinstance(c, EpochMetrics) for c in trainer.callbacks
    ):
        trainer.callbacks.append(EpochMetrics())


def untracked(module: LeanModule, stage: str) -> UserError:
    step = {"train": "training_step", "val": "validation_step", "test": "test_step"}[stage]
    return UserError(
        f"{type(module).__name__}.{step} ran without calling self.track({stage!r}, loss, logits, "
        f"targets), so {stage}/ metrics have nothing to count: call it in each {step} "
        "(LeanModule, src/cifar_amp/lean_module.py)"
    )


class EpochMetrics(Callback):
    """LeanModule's epoch work: each stage's metrics logged, the monitor's best validation
    value, the confusion matrix, and the training metrics saved reset at an epoch's end."""

    def __init__(self) -> None:
        self.batches = dict.fromkeys(STAGES, 0)  # of the running val or test epoch

    def on_train_batch_end(self, trainer, module: LeanModule, outputs, batch, batch_idx) -> None:
        # Not at on_train_epoch_end: the other callbacks' run first there, and they read these.
        # A loader without a length has no num_training_batches: Lightning's look-ahead tells.
        last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if last or batch_idx + 1 >= trainer.num_training_batches:
            if not module.tracked["train"]:
                raise untracked(module, "train")
            module.log_stage("train")
            module.tracked["train"] = False

    # Reset in each epoch's grad mode: states made under inference_mode fail under gloo's no_grad.
    def on_validation_epoch_start(self, trainer, module: LeanModule) -> None:
        module.reset_stage("val")
        module.reset_stage("test")
        self.batches = dict.fromkeys(STAGES, 0)

    on_test_epoch_start = on_validation_epoch_start

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, *idx) -> None:
        self.batches["val"] += 1

    def on_test_batch_end(self, trainer, module, outputs, batch, batch_idx, *idx) -> None:
        self.batches["test"] += 1

    def on_validation_epoch_end(self, trainer, module: LeanModule) -> None:
        if self.batches["val"] and not module.tracked["val"]:
            raise untracked(module, "val")
        module.log_stage("val")  # first: it hands val/<monitor> the epoch's steps
        if not trainer.sanity_checking:
            best = getattr(module, module.best_name)
            best(getattr(module, f"val_{module.monitor}").compute())
            module.log(metrics.best(module.monitor), best.compute(), sync_dist=False)

    def on_test_epoch_end(self, trainer, module: LeanModule) -> None:
        if self.batches["test"] and not module.tracked["test"]:
            raise untracked(module, "test")
        module.log_stage("test")
        module.confusion = module.test_confusion.compute().cpu()

    logged: dict[str, Tensor] = {}  # from the checkpoint a run resumed from

    def on_load_checkpoint(self, trainer, module: LeanModule, checkpoint: dict) -> None:
        self.logged = checkpoint.get(LOGGED, {})
        ranks = checkpoint.get(RANKS, {})
        for name, states in ranks.items():  # each rank its own, not rank 0's
            own = {k: v[trainer.global_rank] for k, v in states.items()}
            getattr(module, name).load_state_dict(own)

    def on_save_checkpoint(self, trainer, module: LeanModule, checkpoint: dict) -> None:
        # Tensors, not floats: a read of each would wait for the device at every checkpoint.
        checkpoint[LOGGED] = dict(trainer.callback_metrics)
        names = ("train_loss", *(f"train_{n}" for n in module.metric_names))
        # A resume from an epoch's end starts the next one, so training metrics are saved reset.
        if not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            if trainer.world_size > 1:  # every rank saves (a collective): a resume sums them all
                checkpoint[RANKS] = {n: gathered(trainer, getattr(module, n)) for n in names}
            return
        copies = (c for c in trainer.callbacks if isinstance(c, seams.ModelStateCopy))
        keys = checkpoint.keys() & {"state_dict", *(c.model_state_key for c in copies)}
        for name in names:
            fresh = getattr(module, name).clone()
            fresh.reset()
            for key in keys:
                checkpoint[key].update(fresh.state_dict(prefix=f"{name}."))


def gathered(trainer, metric: Metric) -> dict[str, Tensor]:
    """A metric's state on every rank: each tensor stacked by rank (rank 0's first)."""
    return {k: trainer.strategy.all_gather(v) for k, v in metric.state_dict().items()}


def logged_before_resume(trainer) -> dict[str, float]:
    """What a resumed run had logged before the checkpoint it resumed from. A run stopped by
    SIGTERM after its last validation resumes with nothing left to log val/*: an uninterrupted
    run's metrics.json holds them (bench.kill_campaign found them missing)."""
    found = [cb.logged for cb in trainer.callbacks if isinstance(cb, EpochMetrics)]
    return {k: float(v) for k, v in (found[0] if found else {}).items()}
