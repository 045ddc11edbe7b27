"""Training behaviour on CPU: every model and precision runs, fp16 really scales and skips,
clipping sees unscaled gradients, resume is exact, eval reproduces the test accuracy."""

import logging
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

import compat
from cifar_amp import build, cli, metrics, seams
from cifar_amp.evaluation import evaluate
from cifar_amp.lean_module import LOGGED, EpochMetrics
from cifar_amp.precision import Autocast
from cifar_amp.training import build_run, train
from conftest import deterministic, options


def weights(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


@pytest.mark.slow  # each model's fast_dev_run (the default recipe's model: test_default_recipe.py)
@pytest.mark.parametrize("model", options("model"))
def test_fast_dev_run_per_model(make_cfg, model):
    overrides = {"speednet": ["model.widths=[8,8,8]"], "small_cnn": ["model.width=8"]}.get(
        model, []
    )
    result = train(make_cfg(f"model={model}", *overrides, "trainer.fast_dev_run=true"))
    assert 0.0 <= result[metrics.TEST_ACC] <= 1.0


@pytest.mark.parametrize("prec", options("precision"))
def test_fast_dev_run_per_precision(make_cfg, prec, caplog):
    short = ("precision.probe_seconds=1",) if prec == "auto" else ()  # its probe's budget
    with caplog.at_level(logging.INFO):
        result = train(make_cfg(f"precision={prec}", *short, "trainer.fast_dev_run=true"))
    # auto: the mode its probe chose among the CPU's candidates
    assert result[metrics.PRECISION] in (("32-true", "bf16-mixed") if prec == "auto" else (prec,))
    assert any(r.message.startswith(f"Precision: {prec}") for r in caplog.records)


def test_16_mixed_on_cpu_is_float16_with_a_real_scaler(make_cfg):
    cfg = make_cfg(
        "precision=16-mixed",
        "precision.scaler.init_scale=1024",
        "precision.scaler.growth_factor=4",
        "precision.scaler.backoff_factor=0.25",
        "precision.scaler.growth_interval=7",
    )
    plugin = build.trainer(cfg, build.precision(cfg)).precision_plugin
    assert type(plugin) is Autocast and type(plugin.scaler) is torch.amp.GradScaler
    assert plugin.device == "cpu" and plugin.precision == "16-mixed"
    with plugin.forward_context():
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float16
    sc = plugin.scaler
    assert sc.is_enabled() and sc.get_scale() == 1024 and sc.get_growth_interval() == 7
    assert sc.get_growth_factor() == 4 and sc.get_backoff_factor() == 0.25


class Recorder(L.Callback):
    """Weights before/after each optimizer step, and gradients as the optimizer sees them."""

    def __init__(self):
        self.before, self.seen_grad_norms, self.unclipped_norms = None, [], []

    def on_train_start(self, trainer, module):
        self.before = {k: v.clone() for k, v in module.state_dict().items()}

        # after the step: under 32-true the closure (backward + clipping) runs inside step()
        def post_step(optimizer, args, kwargs):
            grads = [
                p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None
            ]
            self.seen_grad_norms.append(
                float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            )

        trainer.optimizers[0].register_step_post_hook(post_step)

    def on_before_optimizer_step(self, trainer, module, optimizer):
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        self.unclipped_norms.append(
            float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        )


class StopAfterEpoch(L.Callback):
    def on_train_epoch_end(self, trainer, module):
        trainer.should_stop = True


def fit(cfg, *callbacks):
    L.seed_everything(cfg.seed)
    dm = build.datamodule(cfg)
    cfg.module.scheduler = None
    module = build.module(cfg, 10)
    trainer = build.trainer(cfg, build.precision(cfg), callbacks, enable_checkpointing=False)
    trainer.fit(module, datamodule=dm)
    return trainer, module


FOREACH = ("module.optimizer.fused=false",)
FUSED_CLIPPED = ("module.optimizer.fused=true", "trainer.gradient_clip_val=1.0")


@pytest.mark.parametrize("overrides", [FOREACH, FUSED_CLIPPED], ids=["foreach", "fused-clipped"])
def test_fp16_overflow_skips_the_step_and_backs_off_the_scale(make_cfg, overrides):
    # A scale this large overflows float16 gradients on the first backward. A fused step skips
    # itself on the device's inf flag (its gradients unscaled and clipped before it: precision.py).
    cfg = make_cfg(
        "precision=16-mixed",
        "precision.scaler.init_scale=1e30",
        "trainer.limit_train_batches=1",
        "trainer.limit_val_batches=0",
        *overrides,
    )
    rec = Recorder()
    trainer, module = fit(cfg, rec)
    scaler = trainer.precision_plugin.scaler
    assert scaler.get_scale() == pytest.approx(0.5e30)
    after = module.state_dict()
    assert all(
        torch.equal(rec.before[k], after[k]) for k in rec.before if "net." in k
    )  # step skipped


def test_fp16_without_overflow_steps_and_keeps_the_scale(make_cfg):
    cfg = make_cfg(
        "precision=16-mixed",
        "precision.scaler.init_scale=256",
        "trainer.limit_train_batches=1",
        "trainer.limit_val_batches=0",
    )
    rec = Recorder()
    trainer, module = fit(cfg, rec)
    assert trainer.precision_plugin.scaler.get_scale() == 256
    assert not torch.equal(
        rec.before["net.head.3.weight"], module.state_dict()["net.head.3.weight"]
    )


@pytest.mark.parametrize(
    "overrides, clip",
    [((), 2.0), (("precision=16-mixed",), 2.0), (("experiment=cpu_quick",), None)],
)
def test_the_default_recipe_clips_by_norm_and_the_quick_recipe_does_not(make_cfg, overrides, clip):
    # The design card: the default trainer clips the global norm (at a value above the norms
    # measured on the subset); cpu_quick stays as measured (the speed recipes: their extra's tests).
    t = make_cfg(*overrides).trainer
    assert t.gradient_clip_val == clip and t.gradient_clip_algorithm in (None, "norm")


def test_clipping_acts_on_unscaled_gradients(make_cfg):
    clip, recs, nets = 1e-3, {}, {}
    foreach = ("module.optimizer.fused=false",)  # the default optimizer is fused
    cases = {"32-true": (), "16-mixed": foreach, "16-mixed fused": (), "bf16-mixed fused": ()}
    for case, overrides in cases.items():
        cfg = make_cfg(
            f"precision={case.split()[0]}",
            "precision.scaler.init_scale=4096",
            f"trainer.gradient_clip_val={clip}",
            "trainer.limit_train_batches=3",
            "trainer.limit_val_batches=0",
            *overrides,
        )
        recs[case] = Recorder()
        nets[case] = fit(cfg, recs[case])[1].state_dict()
    fp32, fp16, fused = recs["32-true"], recs["16-mixed"], recs["16-mixed fused"]
    # A fused optimizer's hooks see the scaled gradients; it is unscaled before clipping, so its
    # steps are those of the foreach optimizer (clipped 4096x harder they would differ widely).
    assert fused.unclipped_norms[0] == pytest.approx(4096 * fp16.unclipped_norms[0], rel=1e-3)
    assert fused.seen_grad_norms == pytest.approx([clip] * 3, rel=1e-3)
    for k, v in nets["16-mixed"].items():
        assert torch.allclose(v.float(), nets["16-mixed fused"][k].float(), atol=1e-6), k
    # what the clipping hook sees under 16-mixed is the true gradient, not 4096x it
    assert fp16.unclipped_norms[0] == pytest.approx(fp32.unclipped_norms[0], rel=0.02)
    assert all(n > 10 * clip for n in fp16.unclipped_norms)  # so clipping really bites
    # the optimizer steps with norm == clip: clipped after unscaling (not clip / 4096)
    assert fp16.seen_grad_norms == pytest.approx([clip] * 3, rel=1e-3)
    assert fp32.seen_grad_norms == pytest.approx([clip] * 3, rel=1e-3)
    # bf16-mixed clips a fused optimizer too (Lightning's own plugin refuses it)
    assert recs["bf16-mixed fused"].seen_grad_norms == pytest.approx([clip] * 3, rel=1e-2)


def test_resume_restores_everything_and_matches_an_uninterrupted_run(make_cfg, tmp_path):
    # a scale that overflows at first, so the scaler backs off: its state then matters
    common = (
        "precision=16-mixed",
        "precision.scaler.init_scale=16777216",
        "trainer.deterministic=true",
        "trainer.limit_train_batches=4",  # float16 on a CPU is slow; 4 steps overflow enough
    )
    full = make_cfg(*common, "trainer.max_epochs=2", f"run_dir={tmp_path}/full")
    train(full)
    # the same run, stopped after its first epoch (as if killed then), resumed from last.ckpt
    interrupted = make_cfg(
        *common,
        "trainer.max_epochs=2",
        f"run_dir={tmp_path}/part",
        "+callbacks.stop._target_=test_train.StopAfterEpoch",
    )
    train(interrupted)
    stopped = torch.load(tmp_path / "part/checkpoints/last.ckpt", weights_only=True)
    assert (
        0
        < stopped["global_step"]
        < torch.load(tmp_path / "full/checkpoints/last.ckpt", weights_only=True)["global_step"]
    )
    resumed = make_cfg(
        *common,
        "trainer.max_epochs=2",
        f"run_dir={tmp_path}/part",
        f"ckpt_path={tmp_path}/part/checkpoints/last.ckpt",
    )
    r = train(resumed)
    a = torch.load(tmp_path / "full/checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    b = torch.load(tmp_path / "part/checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    assert a["global_step"] == b["global_step"] and r[metrics.EPOCHS] == 2
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    assert a["MixedPrecision"] == b["MixedPrecision"]  # GradScaler state
    assert b["MixedPrecision"]["scale"] < 16777216
    assert a["lr_schedulers"] == b["lr_schedulers"]
    assert torch.equal(
        a["optimizer_states"][0]["state"][0]["momentum_buffer"],
        b["optimizer_states"][0]["state"][0]["momentum_buffer"],
    )


def test_same_seed_repeats_exactly_and_another_seed_does_not(make_cfg, tmp_path):
    runs = [
        train(make_cfg("trainer.deterministic=true", f"seed={s}", f"run_dir={tmp_path}/{i}"))
        for i, s in enumerate((5, 5, 6))
    ]
    w = [weights(tmp_path / f"{i}/checkpoints/last.ckpt") for i in range(3)]
    assert all(torch.equal(w[0][k], w[1][k]) for k in w[0])
    assert deterministic(runs[0]) == deterministic(runs[1])
    assert not all(torch.equal(w[0][k], w[2][k]) for k in w[0])


def assert_eval_reproduces_the_test(make_cfg, tmp_path, *recipe: str) -> None:
    """eval.py of the checkpoint the run tested gives the run's own test figures."""
    result = train(make_cfg(*recipe, "trainer.max_epochs=2", f"run_dir={tmp_path}/train"))
    ckpt = result["tested_ckpt"]
    assert ckpt and "best" in ckpt
    again = evaluate(
        make_cfg(
            f"ckpt_path={ckpt}",
            f"precision={result[metrics.PRECISION]}",  # the recipe's (bf16-mixed for EMA's)
            f"run_dir={tmp_path}/eval",
            config_name="eval",
        )
    )
    assert again[metrics.TEST_ACC] == result[metrics.TEST_ACC]
    assert again[metrics.TEST_LOSS] == pytest.approx(result[metrics.TEST_LOSS], rel=1e-6)
    assert (tmp_path / "eval" / "metrics.json").is_file()


def test_eval_of_the_tested_checkpoint_gives_the_same_accuracy(make_cfg, tmp_path):
    assert_eval_reproduces_the_test(make_cfg, tmp_path)


def test_channels_last_reaches_weights_and_batches(make_cfg):
    cfg = make_cfg("precision.channels_last=true", "trainer.fast_dev_run=true")
    prec = build.precision(cfg)
    build.trainer(cfg, prec)  # the layout is decided once the Trainer has chosen its device
    layout = prec.channels_last
    assert layout is True
    dm = build.datamodule(cfg, channels_last=layout)
    dm.setup()
    x, _ = next(iter(dm.train_dataloader()))
    assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    module = build.module(cfg, 10, channels_last=layout)
    assert module.net.blocks[0][0].weight.is_contiguous(memory_format=torch.channels_last)
    assert 0.0 <= train(cfg)[metrics.TEST_ACC] <= 1.0


@pytest.mark.slow
def test_compiled_network_trains_and_saves_plain_keys(make_cfg, tmp_path):
    result = train(
        make_cfg("module.compile=true", "trainer.max_epochs=1", "trainer.limit_train_batches=6")
    )
    keys = weights(tmp_path / "checkpoints" / "last.ckpt").keys()
    assert not any(
        compat.COMPILED_WRAPPER in k for k in keys
    )  # loads into an uncompiled network too
    assert 0.0 <= result[metrics.TEST_ACC] <= 1.0


def test_the_trainer_is_built_with_the_16_mixed_plugin_and_keeps_it(make_cfg):
    # Given at construction, so Lightning checks it against the strategy itself; nothing swaps
    # it afterwards (the connector's choice is the strategy's), and the configured plugins stay.
    cfg = make_cfg("precision=16-mixed", "precision.scaler.init_scale=512")
    trainer = build.trainer(cfg, build.precision(cfg))
    plugin = trainer.strategy.precision_plugin
    assert plugin is compat.accelerator_connector(trainer).precision_plugin
    assert type(plugin) is Autocast and plugin.scaler.get_scale() == 512
    for node in cfg.trainer.get("plugins") or []:  # the reliability extra's checkpoint IO
        assert type(trainer.strategy.checkpoint_io).__name__ == node._target_.rsplit(".", 1)[1]


def test_a_hook_is_called_only_on_a_class_that_declares_its_seam(make_cfg, monkeypatch):
    # A method that merely has a hook's name is not a hook: a grep for the seam finds them all.
    called = []

    class Declared(L.Callback, seams.BeforeRun):
        def before_run(self, trainer, module):
            called.append("declared")

    class Undeclared(L.Callback):
        def before_run(self, trainer, module):
            called.append("undeclared")

    monkeypatch.setattr(build, "callbacks", lambda cfg: [Declared(), Undeclared()])
    build_run(make_cfg("trainer.fast_dev_run=true"))
    assert called == ["declared"]


def test_a_job_runner_must_declare_its_seam(capsys):
    node = {"_target_": "lightning.Callback"}  # has no run_job: not a seams.JobRunner
    hc = OmegaConf.create({"callbacks": {cli.JOB_RUNNER: node}})
    HydraConfig.instance().cfg = OmegaConf.create({"hydra": hc})
    try:
        with pytest.raises(SystemExit) as e:
            cli.job(lambda cfg: 1.0)(OmegaConf.create({}))
    finally:
        HydraConfig.instance().cfg = None
    assert e.value.code == 2
    assert (
        "hydra.callbacks.job_runner: lightning.Callback is not a seams.JobRunner"
        in capsys.readouterr().err
    )


def test_a_declared_copy_of_the_state_is_saved_with_the_epochs_metrics_reset(make_cfg):
    # The EMA extra keeps the trained weights beside the average (seams.ModelStateCopy).
    class Copy(L.Callback, seams.ModelStateCopy):
        model_state_key = "copy"

    class Undeclared(L.Callback):
        model_state_key = "other"

    module = build.module(make_cfg(), 10)
    module.train_loss.update(torch.ones(4))
    progress = SimpleNamespace(batch_progress=SimpleNamespace(is_last_batch=True))
    loop = SimpleNamespace(epoch_loop=progress)
    logged = {"val/acc": torch.tensor(0.5)}
    trainer = SimpleNamespace(
        fit_loop=loop, callbacks=[Copy(), Undeclared()], callback_metrics=logged
    )
    keys = ("state_dict", "copy", "other")
    checkpoint = {key: module.state_dict() for key in keys}
    EpochMetrics().on_save_checkpoint(trainer, module, checkpoint)
    saved = {key: float(checkpoint[key]["train_loss.weight"]) for key in keys}
    assert saved == {"state_dict": 0.0, "copy": 0.0, "other": 4.0}
    assert checkpoint[LOGGED] == logged  # what was logged so far, for a resume


def test_under_ddp_each_rank_resumes_its_own_running_training_metrics(make_cfg):
    """state_dict holds rank 0's running sums; every rank's are kept beside them, and each
    rank takes its own back (all took rank 0's: train/loss differed; bench.kill_campaign)."""
    module = build.module(make_cfg(), 10)
    module.train_loss.update(torch.ones(4))  # rank 0's 4 samples of loss 1: sums 4 and 4
    progress = SimpleNamespace(batch_progress=SimpleNamespace(is_last_batch=False))

    def all_gather(t):  # as DDP stacks a tensor of each rank; rank 1's are 3 times rank 0's
        return torch.stack([t, t * 3])

    trainer = SimpleNamespace(
        fit_loop=SimpleNamespace(epoch_loop=progress),
        callbacks=[],
        callback_metrics={},
        world_size=2,
        global_rank=1,
        strategy=SimpleNamespace(all_gather=all_gather),
    )
    checkpoint = {"state_dict": module.state_dict()}
    EpochMetrics().on_save_checkpoint(trainer, module, checkpoint)
    resumed = build.module(make_cfg(), 10)
    resumed.load_state_dict(checkpoint["state_dict"])  # rank 0's
    EpochMetrics().on_load_checkpoint(trainer, resumed, checkpoint)
    assert (float(resumed.train_loss.mean_value), float(resumed.train_loss.weight)) == (12, 12)


@pytest.mark.parametrize(
    "mixing", ["data.augment.mixup_alpha=1.0", "data.augment.cutmix_alpha=1.0"]
)
def test_mixup_and_cutmix_change_training(make_cfg, tmp_path, mixing):
    short = ("trainer.limit_train_batches=3", "trainer.limit_val_batches=1", "test=false")
    plain = train(make_cfg(*short, f"run_dir={tmp_path / 'plain'}"))
    mixed = train(make_cfg(*short, mixing, f"run_dir={tmp_path / 'mixed'}"))
    # Soft targets: a higher training loss for the same images and network.
    assert mixed[metrics.TRAIN_LOSS] > plain[metrics.TRAIN_LOSS]
    weights = [
        torch.load(tmp_path / run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        for run in ("plain", "mixed")
    ]
    assert not torch.equal(weights[0]["net.head.3.weight"], weights[1]["net.head.3.weight"])
