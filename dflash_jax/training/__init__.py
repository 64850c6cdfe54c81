"""DFlash drafter training: data generation by the target, random-anchor block training, export.

Modules: schema (YAML -> dataclass loading), config (the typed training config), records (prompt sources and
formats), data (restartable generation shards, reading them back), blocks (anchors, batch schedule), loss (drafter
and LM objectives), optim, trainer (generic data-parallel optax loop), checkpoint (orbax), metrics_log, pipeline
(the end-to-end recipe behind `python -m train`).
"""
from .config import TrainConfig, default_gamma, load_config
from .data import SequenceData, generate_data, load_sequences
from .loss import DrafterObjective, LMObjective, position_weights
from .pipeline import export, run, train
from .records import DataError
from .schema import ConfigError
from .trainer import Trainer, TrainState

__all__ = ["ConfigError", "TrainConfig", "default_gamma", "load_config", "DataError", "SequenceData",
           "generate_data", "load_sequences", "DrafterObjective", "LMObjective", "position_weights", "export", "run",
           "train", "Trainer", "TrainState"]
