"""Extra (docs/fork.md): `init_from=<ckpt>`, a new run from a checkpoint's network weights
(with EMA, the averaged ones); all else starts afresh, unlike `ckpt_path=`. A head sized for
other classes is re-initialised; any other difference refuses the run. Nothing in the core
imports this module; src/cifar_amp/extras/finetune/configs/finetune/default.yaml adds `init_from` and this callback."""

from __future__ import annotations

import logging

from lightning import Callback
from torch import Tensor, nn

from cifar_amp import build
from cifar_amp.checkpoints import Checkpoint, mismatch
from cifar_amp.errors import UserError
from cifar_amp.seams import BeforeRun

log = logging.getLogger(__name__)
NET = "net"  # the attribute holding a module's network (docs/fork.md, own LightningModule)
PREFIX = f"{NET}."  # the network's keys in its module's state_dict


class FineTune(Callback, BeforeRun):
    def __init__(
        self,
        init_from: str | None = None,
        ckpt_path: str | None = None,
        trust_checkpoint: bool = False,
    ):
        if init_from and ckpt_path:
            raise UserError(
                f"init_from={init_from} and ckpt_path={ckpt_path} exclude each other: ckpt_path "
                "resumes a run exactly (weights, optimizer, schedule, epoch), init_from starts a new "
                "one from a checkpoint's weights; drop one"
            )
        # Read when built, so that a bad file stops the run before anything is written; its
        # module's class, looked up by name, must be a LightningModule here.
        self.source = None
        if init_from:
            self.source = Checkpoint(init_from, key="init_from", trust=trust_checkpoint)
            cls = build.module_class(self.source)
            if not network_weights(self.source):
                raise UserError(
                    f"init_from={init_from}: its module, {cls.__name__}, keeps no network as "
                    f"`{NET}` (no {PREFIX}* weights), which init_from loads"
                )

    def before_run(self, trainer, pl_module) -> None:
        """Load the network weights into the built module (training.py calls this before the
        run dir is touched)."""
        if self.source is None:
            return
        src, net = self.source, network(pl_module)
        # Without num_classes no tensor is taken for the head: one of another size is refused.
        n, theirs = pl_module.hparams.get("num_classes"), src.hparams.get("num_classes")
        ours, saved = net.state_dict(), network_weights(src)

        def is_head(saved: Tensor, mine: Tensor) -> bool:  # differs in the classes only
            rest = saved.shape != mine.shape and saved.shape[1:] == mine.shape[1:]
            return rest and mine.shape[0] == n and saved.shape[0] == (theirs or saved.shape[0])

        head = [k for k, mine in ours.items() if k in saved and is_head(saved[k], mine)]
        load = {k: v for k, v in saved.items() if k not in head}
        problems = mismatch(load, {k: v for k, v in ours.items() if k not in head})
        if problems:
            theirs_net = (src.hparams.get("net") or {}).get("_target_", "unknown")
            raise UserError(
                f"init_from={src.path} does not fit this model (the checkpoint's network: "
                f"{theirs_net}; check model=...): " + "; ".join(problems)
            )
        net.load_state_dict(load, strict=False)
        log.info(
            f"init_from={src.path}: loaded {len(load)} of the network's {len(ours)} tensors "
            f"(checkpoint at epoch {src.data.get('epoch', '?')}, step "
            f"{src.data.get('global_step', '?')}); optimizer, schedule and epoch start afresh"
        )
        if head:
            log.info(
                f"init_from: re-initialised the classification head for {n} classes (the "
                f"checkpoint's has {theirs or 'another number'}): {', '.join(head)}"
            )

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # The checkpoint holds the weights: rebuilding from it (eval.py, predict) fetches none.
        hp = checkpoint.get("hyper_parameters", {})
        net = hp.get("net")
        if isinstance(net, dict) and (net.get("pretrained") or net.get("pretrained_path")):
            hp["net"] = {**net, "pretrained": False, "pretrained_path": None}


def network(module) -> nn.Module:
    """The network that init_from loads into: `module`'s submodule `net`, or one line."""
    try:
        return module.get_submodule(NET)
    except AttributeError:
        raise UserError(
            f"init_from needs the module's network as its attribute `{NET}` (an nn.Module); "
            f"{type(module).__name__} has none"
        ) from None


def network_weights(ckpt: Checkpoint) -> dict[str, Tensor]:
    """The weights of `ckpt`'s network (its module's `net`), by the network's own keys."""
    return {k[len(PREFIX) :]: v for k, v in ckpt.data["state_dict"].items() if k.startswith(PREFIX)}
