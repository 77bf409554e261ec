"""LoRA adapters (peft) on the policy: which modules and parameters get them, per model family.

The default, lora_target_modules ["all-linear"] with lora_experts:
  modules      every linear layer but the output head, as peft's all-linear takes them (attention and MLP
               projections, an MoE's shared experts, Gemma 4's per-layer input projections), except an MoE's routers
               (ROUTERS): a low-rank change to the [E, H] router moves which experts every token uses, so the routers
               stay the base model's
  parameters   an MoE's experts: transformers 5 fuses them into 3-D parameters ([E, 2I, H] gate_up_proj, [E, H, I]
               down_proj; gpt-oss's transposed), which peft reaches with target_parameters (peft >= 0.17), one
               adapter per expert. peft applies no dropout to them, so lora_dropout must be 0.
all-linear is resolved here to the layers' names: given to peft as the string, peft (0.21) would also put LoRA on the
routers of Mixtral, Qwen3-MoE and OLMoE (it maps transformers 4's names of their experts and router onto their
transformers 5 parameters). The reference stays the base: with the adapters disabled peft computes the base weights.
"""

import re

import torch
from transformers.pytorch_utils import Conv1D

from fastgrpo.train.config import TrainConfig
from fastgrpo.train.moe import expert_parameters

ALL_LINEAR = ["all-linear"]
# Linear layers that route tokens to experts, as peft's exclude_modules takes them (a regex the whole module name
# matches): Qwen2-MoE's shared_expert_gate, Gemma 4's router.proj, a router named gate (Mixtral and OLMoE in
# transformers 4); SwiGLU's gate_proj is not one.
ROUTERS = r".*\.(gate|shared_expert_gate|router)(\..+)?"
# peft (0.21) refuses LoRA on a Mamba mixer's out_proj in these model types (their fused Mamba kernels read the
# weight directly): all-linear leaves it out there, as it leaves the routers.
PEFT_MAMBA_TYPES = frozenset({"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"})
PEFT_MAMBA_EXCLUDED = "out_proj"


def linear_layers(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(the names of the model's linear layers but the output head and the routers, as peft's all-linear lists them:
    the last part of the module name; the full names of the routers among them)."""
    head = model.get_output_embeddings()
    names, routers = set(), []
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.Linear, Conv1D)) or module is head:
            continue
        if re.fullmatch(ROUTERS, name):
            routers.append(name)
        else:
            names.add(name.rpartition(".")[2])
    if getattr(model.config, "model_type", None) in PEFT_MAMBA_TYPES:
        names.discard(PEFT_MAMBA_EXCLUDED)
    return sorted(names), routers


def lora_targets(config: TrainConfig, model: torch.nn.Module) -> dict:
    """peft LoraConfig keywords {target_modules, exclude_modules, target_parameters} for `model`, by the rule above;
    ValueError for lora_dropout > 0 where parameters get adapters."""
    targets = {"target_modules": config.lora_target_modules}
    if config.lora_target_modules == ALL_LINEAR:
        names, routers = linear_layers(model)
        targets = {"target_modules": names, **({"exclude_modules": ROUTERS} if routers else {})}
    parameters = config.lora_target_parameters
    if parameters is None:
        parameters = expert_parameters(model) if config.lora_experts else []
    if parameters:
        if config.lora_dropout > 0 and config.lora_target_parameters:
            raise ValueError(f"lora_dropout {config.lora_dropout}: peft's LoRA on parameters (lora_target_parameters "
                             f"{parameters}) takes no dropout; set lora_dropout to 0")
        if config.lora_dropout > 0:
            raise ValueError(f"lora_dropout {config.lora_dropout}: LoRA on the experts of {type(model).__name__} "
                             f"(lora_experts, on by default: {', '.join(parameters)}) takes no dropout, which peft "
                             "cannot apply to parameters; set lora_dropout to 0, or turn lora_experts off to leave "
                             "the experts frozen")
        targets["target_parameters"] = list(parameters)
    return targets


def add_adapters(config: TrainConfig, model: torch.nn.Module) -> torch.nn.Module:
    """`model` as a peft model with fresh LoRA adapters (lora_r, lora_alpha, lora_dropout, lora_targets)."""
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(config, model)
    if "target_parameters" in targets and "target_parameters" not in LoraConfig.__dataclass_fields__:
        raise ImportError("LoRA on parameters (an MoE's experts) needs peft >= 0.17 (target_parameters): pip install "
                          "-U peft, or turn lora_experts off to leave the experts frozen")
    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      task_type="CAUSAL_LM", **targets)
    return get_peft_model(model, lora)
