"""Each extra (src/cifar_amp/extras/<name>/) to Hydra: its configs/ joins the search path after
configs/, its hydra_plugins/ this package, where Hydra's plugin scan finds them."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from cifar_amp.config import EXTRAS

__path__ = [*__path__, *map(str, sorted(EXTRAS.glob("*/hydra_plugins")))]


class ExtrasSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for configs in sorted(EXTRAS.glob("*/configs")):
            search_path.append(f"extra {configs.parent.name}", f"file://{configs}")
