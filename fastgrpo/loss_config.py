"""The loss's options: one frozen dataclass, validated on construction, defaults equal to TRL 1.16's GRPOConfig."""

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LossType:
    """What sets one loss type apart (TRL 1.16): the per-token policy term and the normaliser of the summed loss.

    policy:     "clip"  -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) (r capped at delta); logs clip_ratio/*
                "cispo" -sg(min(r, eps_high)) A logp; logs cispo_clip_ratio
                "sapo"  -sigmoid(tau (r - 1)) 4 / tau A, tau by the advantage's sign
                "vespo" -sg(phi(w)) A logp, phi(w) = exp(lam (1 - w)) w^k the gamma weight of the sequence's ratio w
                        (k, lam by the advantage's sign); logs vespo/phi_seq_mean
    normaliser: "sequence"   each row's masked mean, then the mean over rows
                "tokens"     the micro-batch's loss tokens
                "max_length" rows x max_completion_length
                "items"      num_items_in_batch (the round's loss tokens spread over its optimizer steps)
                "rows"       the micro-batch's rows
    """

    policy: str
    normaliser: str

    POLICIES = ("clip", "cispo", "sapo", "vespo")
    NORMALISERS = ("sequence", "tokens", "max_length", "items", "rows")

    def __post_init__(self):
        if self.policy not in self.POLICIES or self.normaliser not in self.NORMALISERS:
            raise ValueError(f"LossType needs a policy in {self.POLICIES} and a normaliser in {self.NORMALISERS}, got "
                             f"{self.policy!r} and {self.normaliser!r}")

    def share_scale(self, world_size: int, token_share: float) -> float:
        """The factor on one of K equal shares of a micro-batch such that the K shares' gradients, averaged, are the
        whole micro-batch's: a per-row mean is the same on every share (1); a sum over the round's tokens is split
        over the shares (K); a mean over the micro-batch's tokens weighs the share by its tokens (token_share =
        K x its fraction of the tokens)."""
        return {"items": float(world_size), "tokens": token_share}.get(self.normaliser, 1.0)


# The one table of loss types: adding one is a row here (and its policy term in fastgrpo.reference.token_objective).
LOSS_TYPES = {
    "grpo": LossType("clip", "sequence"),
    "bnpo": LossType("clip", "tokens"),
    "dr_grpo": LossType("clip", "max_length"),
    "dapo": LossType("clip", "items"),
    "luspo": LossType("clip", "rows"),
    "cispo": LossType("cispo", "items"),
    "sapo": LossType("sapo", "sequence"),
    "vespo": LossType("vespo", "items"),
}
# Loss types that clip the ratio PPO-style and log TRL's clip_ratio/* metrics.
CLIP_LOSS_TYPES = tuple(name for name, kind in LOSS_TYPES.items() if kind.policy == "clip")
# Loss types normalised by the token count of the whole batch (`num_items_in_batch`), not per micro-batch.
TOKEN_NORMALISED_LOSS_TYPES = tuple(name for name, kind in LOSS_TYPES.items() if kind.normaliser == "items")
# The options named differently in TRL's GRPOConfig (and fastgrpo's TrainConfig): LossConfig field -> TRL name.
TRL_NAMES = {"epsilon_low": "epsilon"}


@dataclass(frozen=True, slots=True)
class LossConfig:
    """Options of the GRPO objective, named as in TRL's `GRPOConfig`.

    `epsilon_low` is TRL's `epsilon`; `epsilon_high=None` means equal to `epsilon_low` (TRL's rule). For `cispo`,
    `epsilon_high` is the absolute cap of the importance weight (ScaleRL recommends 5.0). `max_completion_length` is the
    `dr_grpo` normaliser. `sapo_temperature_*` are SAPO's gate temperatures. `vespo_k_*` and `vespo_lambda_*` are
    VESPO's power and decay of its gamma weight, for advantages >= 0 (`_pos`) and < 0 (`_neg`). `entropy_coef` is TRL's
    static entropy bonus: `loss - entropy_coef * (masked mean entropy)`. `logit_scale` and `logit_softcap` describe the
    model's head (Cohere's `logit_scale`, Gemma 2's `final_logit_softcapping`): the logits the loss scores are
    `softcap * tanh(scale * (x W^T + b) / softcap) / temperature` (no tanh when `logit_softcap` is None).
    """

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    beta: float = 0.0
    temperature: float = 1.0
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = True
    max_completion_length: int = 512
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    entropy_coef: float = 0.0
    logit_scale: float = 1.0
    logit_softcap: float | None = None

    @property
    def kind(self) -> LossType:
        return LOSS_TYPES[self.loss_type]

    @classmethod
    def from_trl(cls, args) -> "LossConfig":
        """The loss options of `args`, any object with TRL's `GRPOConfig` names (a `GRPOConfig`, fastgrpo's
        `TrainConfig`); a None takes the default. An invalid value raises the same error, naming both spellings
        of a renamed option."""
        values = {name: getattr(args, TRL_NAMES.get(name, name), None) for name in cls.__dataclass_fields__}
        values = {name: value for name, value in values.items() if value is not None}
        try:
            return cls(**values)
        except (TypeError, ValueError) as error:
            renamed = [f"{ours} is the option {theirs}" for ours, theirs in TRL_NAMES.items() if ours in str(error)]
            raise type(error)(f"{error} ({', '.join(renamed)})" if renamed else str(error)) from error

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {tuple(LOSS_TYPES)}, got {self.loss_type!r}")
        if self.epsilon_high is None:
            object.__setattr__(self, "epsilon_high", self.epsilon_low)
        for name in ("epsilon_low", "epsilon_high", "beta", "vespo_k_pos", "vespo_k_neg"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not (isinstance(self.entropy_coef, (int, float)) and math.isfinite(self.entropy_coef)):
            raise ValueError(f"entropy_coef must be a finite number, got {self.entropy_coef!r}")
        if self.logit_softcap is not None and not (isinstance(self.logit_softcap, (int, float))
                                                   and math.isfinite(self.logit_softcap) and self.logit_softcap > 0):
            raise ValueError(f"logit_softcap must be None or a finite number > 0, got {self.logit_softcap!r}")
        for name in ("temperature", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos",
                     "vespo_lambda_neg", "logit_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.delta is not None and not (isinstance(self.delta, (int, float)) and math.isfinite(self.delta)
                                           and self.delta > 0):
            raise ValueError(f"delta must be None or a finite number > 0, got {self.delta!r}")
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ValueError(
                f"importance_sampling_level must be 'token' or 'sequence', got {self.importance_sampling_level!r}"
            )
        if not isinstance(self.use_bias_correction_kl, bool):
            raise TypeError(f"use_bias_correction_kl must be a bool, got {self.use_bias_correction_kl!r}")
        if isinstance(self.max_completion_length, bool) or not isinstance(self.max_completion_length, int) or (
            self.max_completion_length <= 0
        ):
            raise ValueError(f"max_completion_length must be a positive int, got {self.max_completion_length!r}")
