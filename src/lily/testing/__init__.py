"""lily.testing: synthetic checkpoints in the published format, for tests and benchmarks."""
from .configs import full_config, full_config_dict, tiny_config_dicts, tiny_configs
from .weights import linear_modules, random_dense_weights, random_weights

__all__ = ["full_config", "full_config_dict", "tiny_config_dicts", "tiny_configs", "linear_modules",
           "random_dense_weights", "random_weights"]
