"""A fork's own module: the template's, with one more argument, which its test logs as a length
(`test/note_length`), so that whoever tests a checkpoint shows which class and argument it built."""

from cifar_amp.module import ImageClassifier


class Marked(ImageClassifier):
    def __init__(self, note: str = "", **kwargs) -> None:
        super().__init__(**kwargs)

    def test_step(self, batch, batch_idx: int) -> None:
        super().test_step(batch, batch_idx)
        self.log("test/note_length", float(len(self.hparams.note)))


class NotAModule:
    """Neither a LightningModule nor a metric: a config or checkpoint naming it as one is refused
    before it is built, which would count in `made`."""

    made = 0

    def __init__(self, **kwargs) -> None:
        NotAModule.made += 1
