import lightning as L
import pytest
import torch

from cifar_amp.reliability.nonfinite import NonFiniteLossError
from cifar_amp.training import train

GUARD = (
    "callbacks.non_finite.patience=3",
    "callbacks.non_finite.check_every=2",
    "callbacks.step_checkpoint.every_n_train_steps=2",
)


class PoisonInputs(L.Callback):
    """Feeds inf images from optimizer step `start` on, for `steps` steps: the loss is NaN."""

    def __init__(self, start: int, steps: int = 10**9) -> None:
        self.start, self.steps = start, steps

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.start <= trainer.global_step < self.start + self.steps:
            batch[0].fill_(float("inf"))


def poison(start: int, steps: int = 10**9) -> tuple[str, ...]:
    return (
        f"+callbacks.poison._target_={__name__}.PoisonInputs",
        f"+callbacks.poison.start={start}",
        f"+callbacks.poison.steps={steps}",
    )


def finite_weights(path) -> bool:
    ckpt = torch.load(path, weights_only=False)
    net = {
        k: v
        for k, v in ckpt["state_dict"].items()
        if k.startswith("net.") and v.is_floating_point()
    }
    return bool(net) and all(torch.isfinite(v).all() for v in net.values())


# Epoch 0 is steps 1-11; inputs turn inf at step 14. 32-true: NaN gradients reach the weights,
# so the step-14 checkpoint is refused; 16-mixed: the GradScaler skips those steps, the weights
# stay finite and step 14 is saved.
@pytest.mark.parametrize("precision, last_step", [("32-true", 12), ("16-mixed", 14)])
def test_persistent_nan_loss_stops_and_keeps_last_good_checkpoint(
    make_cfg, tmp_path, precision, last_step, caplog
):
    with pytest.raises(
        NonFiniteLossError, match=r"non-finite for \d+ consecutive steps|weights became non-finite"
    ) as e:
        train(make_cfg(*GUARD, *poison(start=13), f"precision={precision}", "trainer.max_epochs=2"))
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert f"the last good checkpoint is {last}" in str(e.value)
    assert finite_weights(last) and torch.load(last, weights_only=False)["global_step"] == last_step
    assert (
        "non-finite training loss at step 14" in caplog.text
    )  # steps count from 1 after the update
    assert [p.name for p in tmp_path.glob("checkpoints/best-*.ckpt")] == ["best-epoch000.ckpt"]
    assert finite_weights(tmp_path / "checkpoints" / "best-epoch000.ckpt")


def test_a_short_burst_under_16_mixed_is_reported_but_not_fatal(make_cfg, caplog):
    result = train(make_cfg(*GUARD, *poison(start=5, steps=2), "precision=16-mixed"))
    assert "non-finite training loss at step 6" in caplog.text
    assert result["test/acc"] >= 0
