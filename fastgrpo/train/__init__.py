"""`fastgrpo train`: GRPO on one device, or on several through torchrun, with the paged sampler and the fused loss.

    from fastgrpo.train import TrainConfig, Trainer
    Trainer(TrainConfig.from_yaml("recipes/gsm8k.yaml", max_steps=10)).train()
"""

from fastgrpo.train.config import TrainConfig

__all__ = ["TrainConfig", "Trainer"]


def __getattr__(name: str):
    # The Trainer pulls in transformers' training stack (seconds of imports): only on first use, so that
    # `fastgrpo --help` and the bench suites start without it.
    if name == "Trainer":
        from fastgrpo.train.trainer import Trainer

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
