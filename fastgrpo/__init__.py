"""fastgrpo: fused GRPO loss kernels and a lean GRPO trainer for one GPU node (one GPU, or several with torchrun)."""

from fastgrpo.loss import GRPOLoss, LossConfig, fused_grpo_loss, grpo_loss, token_logprobs

__version__ = "0.1.0"
__all__ = ["GRPOLoss", "LossConfig", "fused_grpo_loss", "grpo_loss", "token_logprobs", "__version__"]
