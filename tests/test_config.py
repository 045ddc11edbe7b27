"""Every config option composes and validates; bad values fail with the key named."""

import pytest
import torch
from hydra.errors import ConfigCompositionException, MissingConfigException

from cifar_amp import build, config, metrics
from cifar_amp.errors import UserError
from conftest import CONFIGS, options


@pytest.mark.parametrize(
    "group,option",
    [
        (g, o)
        for g in ("data", "model", "precision", "trainer", "callbacks", "logger")
        for o in options(g)
    ],
)
def test_every_group_option_composes(make_cfg, group, option):
    cfg = make_cfg(f"{group}={option}")
    if group == "precision":
        assert cfg.precision.name == option
    if group == "model":
        assert cfg.model["_target_"].startswith(("cifar_amp.models.", "cifar_amp.extras."))


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_composes(make_cfg, experiment):
    make_cfg(f"experiment={experiment}")


def test_eval_config_composes(make_cfg, tmp_path):
    cfg = make_cfg(f"ckpt_path={tmp_path}/x.ckpt", config_name="eval")
    assert cfg.ckpt_path.endswith("x.ckpt")


def test_metric_resolver_points_at_code_constants(make_cfg):
    cfg = make_cfg("callbacks=default")
    assert cfg.callbacks["model_checkpoint"]["monitor"] == metrics.VAL_ACC
    with pytest.raises(ValueError, match="unknown metric"):
        metrics.resolve("val_accuracy")


def test_model_arguments_are_typed_from_the_constructor(make_cfg):
    assert make_cfg("model=speednet", "model.widths=[8,16,32]").model["widths"] == [8, 16, 32]
    with pytest.raises(ConfigCompositionException, match="widht"):
        make_cfg("model=speednet", "model.widht=3")
    with pytest.raises(ConfigCompositionException, match="width"):
        make_cfg("model=small_cnn", "model.width=abc")


@pytest.mark.parametrize(
    "override,key",
    [
        ("trainer.gradient_clip_algorithm=max", "gradient_clip_algorithm` max is invalid"),
        ("data.batch_size=0", "data.batch_size"),
        ("data.val_split=1.5", "data.val_split"),
        ("module.optimizer.lr=-0.1", "module.optimizer.lr"),
        ("module.label_smoothing=1.0", "module.label_smoothing"),
        ("precision.scaler.backoff_factor=2", "precision.scaler.backoff_factor"),
        ("data.augment.translate=-1", "data.augment.translate"),
        ("model.activation_checkpointing=-1", "model.activation_checkpointing"),
        ("model.checkpoint_stages=[5]", "model.checkpoint_stages"),
    ],
)
def test_out_of_range_values_name_the_key(make_cfg, override, key):
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        cfg = make_cfg(override)
        from cifar_amp.training import train

        train(cfg)  # model arguments are checked when the model is built


@pytest.mark.parametrize("group", ["precision", "model", "trainer", "data"])
def test_unknown_group_option_lists_valid_choices(make_cfg, group):
    with pytest.raises(MissingConfigException) as err:
        make_cfg(f"{group}=nope")
    for option in options(group):
        assert option in str(err.value)


def test_typos_and_wrong_types_fail_at_composition(make_cfg):
    with pytest.raises(ConfigCompositionException, match="max_epoch"):
        make_cfg("trainer.max_epoch=3")
    with pytest.raises(ConfigCompositionException, match="max_epochs"):
        make_cfg("trainer.max_epochs=abc")


@pytest.mark.parametrize(
    "overrides,expected",
    [((), True), (("trainer.deterministic=true",), False), (("trainer.benchmark=false",), False)],
)
def test_benchmark_defaults_on_unless_deterministic(make_cfg, overrides, expected):
    cfg = make_cfg(*overrides)
    build.trainer(cfg, build.precision(cfg), [], [])
    assert torch.backends.cudnn.benchmark is expected


@pytest.mark.parametrize(
    "argv",
    [
        ["experiment=cpu_quick", "data.data_dir=x"],
        ["hydra.run.dir=/tmp/x", "seed=3", "model=speednet", "model.activation_checkpointing=2"],
        ["+callbacks.extra._target_=x.Y"],
        ["-m", "precision=32-true,bf16-mixed,16-mixed"],
        ["experiment=precision_sweep", "precision=32-true,bf16-mixed"],  # a sweep config, no -m
        ["not-an-override"],  # malformed: left to Hydra's own message
    ],
)
def test_override_precheck_lets_valid_and_unparsable_commands_through(argv):
    from cifar_amp.cli import check_overrides

    config.register(CONFIGS)
    check_overrides(argv, CONFIGS, "train")  # no SystemExit


@pytest.mark.parametrize("declared", [True, False])
def test_an_extra_deleted_while_another_needs_it_is_one_line_naming_that_extra(
    tmp_path, monkeypatch, declared
):
    user = tmp_path / "extras" / "user"
    (user / "configs" / "data").mkdir(parents=True)
    (user / "__init__.py").write_text(f"NEEDS = {('gone',) if declared else ()}\n")
    (conf := user / "configs" / "data" / "x.yaml").write_text(
        "defaults:\n  - /schema/cifar_amp.extras.gone.module.Data@_here_\n"
    )
    monkeypatch.setattr(config, "EXTRAS", tmp_path / "extras")
    who = "user need it: delete their folders" if declared else f"{conf} names it: delete that"
    with pytest.raises(UserError, match=rf"^the gone extra is deleted \(.*\), but {who}"):
        config.register(CONFIGS)


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer=cpu", "trainer.max_epochs=3", "model=small_cnn", "model.width=4"],
        ["+callbacks.crash._target_=test_resume.CrashAt", "+callbacks.crash.step=5"],
        ["++callbacks.curves=null", "~callbacks.lr_monitor", "module/optimizer=adamw"],
        ["data.augment.mixup_alpha=0.5", "module.metrics.acc_top5._target_=x.Y"],
    ],
)
def test_compose_cfg_is_what_hydra_composes(overrides):
    """The tests' compose_cfg applies key overrides to a config composed once, by Hydra's own
    code (tests/compat.py): the result is Hydra's compose of the whole command line."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from conftest import _registered, compose_cfg

    _registered()
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        hydras = compose("train", overrides=overrides)
    ours = compose_cfg("train", overrides)
    assert OmegaConf.to_container(ours) == OmegaConf.to_container(hydras)
    assert OmegaConf.is_struct(ours) == OmegaConf.is_struct(hydras)


def test_key_overrides_reuse_the_config_composed_for_the_options():
    """compose_cfg composes once per set of options; key overrides cost no compose of their own
    (a fallback to Hydra's compose on every call once hid a missing helper)."""
    from conftest import _compose, compose_cfg

    compose_cfg("train", ["trainer=cpu"])
    composed = _compose.cache_info().misses
    cfg = compose_cfg("train", ["trainer=cpu", "trainer.max_epochs=7", "+callbacks.x.y=1"])
    assert _compose.cache_info().misses == composed
    assert cfg.trainer.max_epochs == 7 and cfg.callbacks.x.y == 1
