"""`fastgrpo train`: GRPO on one device with the paged sampler and the fused loss.

    from fastgrpo.train import TrainConfig, Trainer
    Trainer(TrainConfig.from_yaml("recipes/gsm8k.yaml", max_steps=10)).train()
"""

from fastgrpo.train.config import TrainConfig
from fastgrpo.train.trainer import Trainer

__all__ = ["TrainConfig", "Trainer"]
