"""Each extra's configs/ on Hydra's search path, its hydra_plugins/ in this (scanned) package."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from cifar_amp.config import EXTRAS

__path__ = [*__path__, *map(str, sorted(EXTRAS.glob("*/hydra_plugins")))]


class ExtrasSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for configs in sorted(EXTRAS.glob("*/configs")):
            search_path.append(f"extra {configs.parent.name}", f"file://{configs}")
