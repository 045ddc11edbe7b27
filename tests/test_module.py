"""What a researcher changes in the module: its metrics by config, its own class through every
entry that starts from a checkpoint, and what a test reports (per-class accuracy)."""

from __future__ import annotations

import csv
import json

import marked_module
import numpy as np
import pytest
import torch

from cifar_amp import build, metrics
from cifar_amp.checkpoints import SETTINGS, Checkpoint
from cifar_amp.data.cifar import read_batch
from cifar_amp.errors import UserError
from cifar_amp.evaluation import evaluate
from cifar_amp.training import train
from conftest import MARKED, OWN, TOP5, compose_cfg

TOP5_KEYS = {stage: metrics.key(stage, "acc_top5") for stage in ("train", "val", "test")}


def test_top5_by_config_is_in_metrics_json_and_the_log_for_val_and_test(marked_run):
    result = json.loads((marked_run / "metrics.json").read_text())
    for stage in ("val", "test"):
        assert result[TOP5_KEYS[stage]] >= result[metrics.key(stage, metrics.ACC)]
    assert 0 < result[TOP5_KEYS["test"]] <= 1
    with open(marked_run / "metrics.csv") as f:
        columns = next(csv.reader(f))
    assert {TOP5_KEYS["train"], TOP5_KEYS["val"], TOP5_KEYS["test"]} <= set(columns)


def test_a_metric_is_added_with_or_without_a_plus():
    plus = [f"+{o}" for o in TOP5]
    assert compose_cfg("train", TOP5).module.metrics == compose_cfg("train", plus).module.metrics


@pytest.mark.parametrize(
    "override, said",
    [
        (
            "module.metrics.f1._target_=torchmetrics.classification.MulticlassF1Scor",
            "module.metrics.f1._target_: torchmetrics.classification.MulticlassF1Scor; "
            "no such class",
        ),
        (
            "module.metrics.acc.top_kk=5",
            "module.metrics.acc.top_kk: 5; MulticlassAccuracy takes no top_kk",
        ),
        (  # a class that is not a metric is refused before it is called
            "module.metrics.acc._target_=marked_module.NotAModule",
            "module.metrics.acc._target_: marked_module.NotAModule; not a torchmetrics Metric",
        ),
        (
            "+module.metrics.loss._target_=torchmetrics.MeanMetric",
            "module.metrics.loss: 'loss'; every stage logs its loss as <stage>/loss already",
        ),
    ],
)
def test_a_bad_metric_is_one_line_naming_it(make_cfg, override, said):
    with pytest.raises(UserError, match=f"invalid config value for {said}") as e:
        build.module(make_cfg(override), num_classes=10)
    assert "\n" not in str(e.value) and marked_module.NotAModule.made == 0


def test_eval_builds_the_class_that_trained_the_checkpoint_with_its_own_argument(
    make_cfg, marked_run
):
    last = marked_run / "checkpoints" / "last.ckpt"
    result = evaluate(make_cfg(f"ckpt_path={last}", config_name="eval"))
    assert result["test/note_length"] == len("hello")  # Marked's test, with its note
    trained = json.loads((marked_run / "metrics.json").read_text())
    assert trained["test/note_length"] == len("hello")
    assert result[TOP5_KEYS["test"]] >= result[metrics.TEST_ACC]  # its metrics came along


def test_each_class_has_its_test_accuracy_in_metrics_json(marked_run, tiny_data):
    result = json.loads((marked_run / "metrics.json").read_text())
    per_class = result[metrics.TEST_ACC_PER_CLASS]
    assert list(per_class)[:2] == ["airplane", "automobile"]  # the data's names, in label order
    labels = read_batch(tiny_data / "cifar-10-batches-py" / "test_batch")[1]
    counts = np.bincount(labels, minlength=10)
    present = {name: n for name, n in zip(per_class, counts, strict=True) if n}
    assert all(per_class[name] is None for name in per_class.keys() - present.keys())
    right = sum(per_class[name] * n for name, n in present.items())
    assert right / len(labels) == pytest.approx(result[metrics.TEST_ACC])


def with_settings(tmp_path, marked_run, **settings):
    """A copy of the Marked run's last.ckpt whose recorded settings are changed."""
    ckpt = torch.load(marked_run / "checkpoints" / "last.ckpt", weights_only=True)
    ckpt[SETTINGS] |= settings
    torch.save(ckpt, tmp_path / "changed.ckpt")
    return tmp_path / "changed.ckpt"


@pytest.mark.parametrize(
    "module, said",
    [
        (
            "gone_package.Module",
            "was trained by the module gone_package.Module, which does not import",
        ),
        (
            "marked_module.NotAModule",
            "names marked_module.NotAModule as its module, which is not a",
        ),
    ],
)
def test_a_checkpoint_whose_module_is_not_one_here_is_one_line_and_nothing_is_built(
    make_cfg, tmp_path, marked_run, module, said
):
    changed = with_settings(tmp_path, marked_run, **{"module._target_": module})
    with pytest.raises(UserError, match=said):
        evaluate(make_cfg(f"ckpt_path={changed}", config_name="eval"))
    assert marked_module.NotAModule.made == 0


def test_a_resume_keeps_the_module_class(make_cfg, tmp_path, marked_run):
    last = marked_run / "checkpoints" / "last.ckpt"
    again = ("trainer.max_epochs=2", "logger=csv", *TOP5, f"ckpt_path={last}")
    with pytest.raises(UserError, match="trained with module._target_=marked_module.Marked; "):
        train(make_cfg(*again))  # the template's module asked for
    result = train(make_cfg(*again, *MARKED))
    assert result[metrics.EPOCHS] == 2 and result["test/note_length"] == len("hello")
    assert Checkpoint(last).settings["module._target_"] == "marked_module.Marked"


def test_a_metric_by_code_as_docs_fork_md_shows_it(make_cfg, tmp_path):
    result = train(make_cfg("module._target_=flip_module.WithFlipAgreement"))
    assert 0 <= result["val/flip_agreement"] <= 1 and 0 <= result[metrics.TEST_ACC] <= 1
    # A fork's class, found on the path (tests/examples), is one a checkpoint may name.
    module = build.module_from_checkpoint(Checkpoint(tmp_path / "checkpoints" / "last.ckpt"))
    assert type(module).__name__ == "WithFlipAgreement"


def test_a_lightning_module_of_its_own_trains_and_eval_tests_it(make_cfg, own_run, tmp_path):
    """tests/examples/own_module.py subclasses LightningModule directly: train.py chooses the
    best by its val/acc and tests it; eval.py rebuilds it from a checkpoint and writes its
    metrics.json (no per-class accuracy: it counts no confusion matrix)."""
    trained = json.loads((own_run / "metrics.json").read_text())
    assert trained[metrics.TESTED_CKPT].endswith("best-epoch000.ckpt")
    assert 0 <= trained[metrics.VAL_ACC] <= 1 and trained[metrics.TEST_LOSS] > 0
    last = own_run / "checkpoints" / "last.ckpt"
    assert Checkpoint(last).settings["module._target_"] == "own_module.OwnClassifier"
    result = evaluate(make_cfg(f"ckpt_path={last}", config_name="eval"))
    assert result == json.loads((tmp_path / "metrics.json").read_text())
    # One epoch: the best is the last, and the same weights test the same.
    assert result[metrics.TEST_ACC] == pytest.approx(trained[metrics.TEST_ACC])
    assert result[metrics.TEST_LOSS] == pytest.approx(trained[metrics.TEST_LOSS])
    assert metrics.TEST_ACC_PER_CLASS not in result


def test_a_lightning_module_of_its_own_resumes(make_cfg, own_run, tmp_path):
    last = own_run / "checkpoints" / "last.ckpt"
    with pytest.raises(UserError, match="trained with module._target_=own_module.OwnClassifier"):
        train(make_cfg("trainer.max_epochs=2", f"ckpt_path={last}"))  # the template's module
    result = train(make_cfg(*OWN, "trainer.max_epochs=2", "logger=csv", f"ckpt_path={last}"))
    assert result[metrics.EPOCHS] == 2 and 0 <= result[metrics.TEST_ACC] <= 1
    with open(tmp_path / "metrics.csv") as f:
        epochs = {row["epoch"] for row in csv.DictReader(f) if row[metrics.VAL_ACC]}
    assert epochs == {"1"}  # it went on from the end of epoch 0
