"""lily.testing: synthetic checkpoints in the published format, for tests and benchmarks."""
from .chat_template import CHAT_TEMPLATE
from .checkpoint_writer import (QWEN_SPECIAL_TOKENS, export_checkpoint, with_mtp_layers, write_hf_checkpoint,
                                write_mlx_checkpoint, write_tokenizer)
from .configs import full_config, full_config_dict, tiny_config_dicts, tiny_configs
from .synthetic import config_dict, write_synthetic_checkpoint
from .weights import (drafting_weights, linear_modules, random_dense_weights, random_mtp_dense_weights, random_mtp_weights,
                      random_weights)

__all__ = ["CHAT_TEMPLATE", "QWEN_SPECIAL_TOKENS", "export_checkpoint", "write_hf_checkpoint",
           "write_mlx_checkpoint", "write_tokenizer", "with_mtp_layers", "full_config", "full_config_dict",
           "tiny_config_dicts", "tiny_configs", "config_dict", "write_synthetic_checkpoint", "linear_modules", "random_dense_weights",
           "random_mtp_dense_weights", "random_mtp_weights", "random_weights", "drafting_weights"]
