"""The extras, as Hydra sees them: a folder src/cifar_amp/extras/<name>/ is an extra, and this
plugin is why nothing else has to name it.

- `<name>/configs/` joins the config search path after configs/, so its options belong to the
  same groups (`logger=mlflow` finds extras/tracking/configs/logger/mlflow.yaml, a
  `- optional reliability: default` default finds the reliability extra's file, or nothing).
- `<name>/hydra_plugins/` joins this package's path, so Hydra's plugin scan, which walks the
  `hydra_plugins` namespace, finds an extra's own plugins there (the sweeps extra's sweeper is
  `hydra_plugins.cifar_amp_extras.optuna_asktell_sweeper`): Hydra instantiates only plugins of
  that namespace."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from cifar_amp.config import extra_dirs

__path__ = [*__path__, *map(str, extra_dirs("hydra_plugins"))]


class ExtrasSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for configs in extra_dirs("configs"):
            search_path.append(f"extra {configs.parent.name}", f"file://{configs}")
