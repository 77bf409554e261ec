"""The policy's training forward: the backbone to the hidden states of completion tokens, then the fused GRPO loss
(`PolicyLoss.forward`) or, without gradient, the completion tokens' logprobs (`PolicyLoss.logprobs`)."""

import torch

from fastgrpo.loss import fused_grpo_loss, token_logprobs
from fastgrpo.loss_config import LossConfig
from fastgrpo.models import find_hf_model


def completion_hidden(model: torch.nn.Module, sequences: list[list[int]], prompt_lengths: list[int],
                      max_completion: int, packed: bool) -> torch.Tensor:
    """Last hidden states that predict each completion token: [B, max_completion, H] (rows past a completion's end
    hold a copy of some other state; mask them).

    sequences[i] = prompt_i + completion_i. Packed: one row, positions restarting per sequence (flash-attn varlen,
    or transformers' block-diagonal mask elsewhere). Padded: right-padded to the longest sequence.
    """
    net = find_hf_model(model)
    backbone = getattr(net, net.base_model_prefix)
    device = net.get_input_embeddings().weight.device
    lengths = [len(s) for s in sequences]
    if packed:
        input_ids = torch.tensor([t for s in sequences for t in s])[None]  # [1, sum L]
        position_ids = torch.cat([torch.arange(n) for n in lengths])[None]  # [1, sum L]
        hidden = backbone(input_ids=input_ids.to(device), position_ids=position_ids.to(device),
                          use_cache=False).last_hidden_state
        starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)  # [B]
    else:
        L = max(lengths)
        input_ids = torch.zeros(len(sequences), L, dtype=torch.long)  # [B, L]
        attention_mask = torch.zeros(len(sequences), L, dtype=torch.long)  # [B, L]
        for i, s in enumerate(sequences):
            input_ids[i, : len(s)] = torch.tensor(s)
            attention_mask[i, : len(s)] = 1
        hidden = backbone(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                          use_cache=False).last_hidden_state
        starts = torch.arange(len(sequences)) * L  # [B]
    hidden = hidden.reshape(-1, hidden.shape[-1])  # [tokens, H]
    offsets = torch.arange(max_completion)  # [T]
    last = torch.tensor(lengths) - 1  # [B] the final token predicts nothing
    rows = starts[:, None] + torch.minimum(torch.tensor(prompt_lengths)[:, None] - 1 + offsets, last[:, None] - 1)
    return hidden[rows.to(device)]  # [B, T, H]


def lm_head(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    head = find_hf_model(model).get_output_embeddings()
    return head.weight, getattr(head, "bias", None)


class PolicyLoss(torch.nn.Module):
    """One micro-batch through the model: the backbone, then the lm_head's fused GRPO loss (`forward`, the pass DDP
    and FSDP2 wrap) or, without gradient, the completion tokens' logprobs (`logprobs`). Under FSDP2 this module is the
    root: the embeddings, final norm and lm_head (tied or not) are whole inside both, so the fused head reads the full
    weight and FSDP reduce-scatters its gradient like any other; under DDP it is the module DDP wraps."""

    def __init__(self, model: torch.nn.Module, packed: bool, head: dict):
        super().__init__()
        self.model = model
        self.packed = packed
        self.head = head  # the model's logit transform {logit_scale, logit_softcap} (check_head)

    def hidden(self, mb) -> torch.Tensor:
        """The backbone's last hidden states that predict micro-batch `mb`'s completion tokens: [b, T, H]."""
        return completion_hidden(self.model, mb.sequences, mb.prompt_lengths, mb.mask.shape[1], self.packed)

    def loss(self, hidden: torch.Tensor, mb, config: LossConfig, num_items_in_batch: float | None = None):
        """The fused GRPO loss of micro-batch `mb` from its `hidden` states (and its metrics), its gradient computed
        on the way."""
        weight, bias = lm_head(self.model)
        return fused_grpo_loss(hidden, weight, mb.completion_ids, mb.mask, mb.advantages, bias=bias,
                               old_logps=mb.old_logps, ref_logps=mb.ref_logps, config=config,
                               importance_weights=mb.importance_weights, num_items_in_batch=num_items_in_batch)

    def forward(self, mb, config: LossConfig, num_items_in_batch: float | None = None):
        """`loss(hidden(mb), ...)`: the pass DDP and FSDP2 wrap (a memory trace counts its two parts apart)."""
        return self.loss(self.hidden(mb), mb, config, num_items_in_batch)

    def logprobs(self, mb, temperature: float = 1.0) -> torch.Tensor:
        """Logprobs of the completion tokens of micro-batch `mb`: [b, T] fp32 (one GEMM per chunk without grad)."""
        weight, bias = lm_head(self.model)
        return token_logprobs(self.hidden(mb), weight, mb.completion_ids, bias=bias, temperature=temperature,
                              **self.head)[0]
