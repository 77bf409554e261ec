"""What each attention layer of a model needs from the engine, read from what transformers actually passes.

`probe(hf_model)` runs the model once on two tokens with a recording attention function (transformers' public
AttentionInterface) and reads, for every call, what the model's own forward hands to the attention function: the
keys' and values' heads and head dims, `sliding_window`, `softcap` (Gemma 2's cap on scores), `s_aux` (gpt-oss's
per-head sink logits), and whether the keys are another layer's (Gemma 3n/4's KV-shared layers pass the very tensors
an earlier layer computed). Nothing is read from a single config attribute, so a window given as a keyword (Mistral)
is seen as surely as one kept on the module (Gemma 3).

Layers that keep recurrent state through transformers' cache (Gated DeltaNet, Mamba-2, short convolutions: state.py)
are recorded in the same forward, with the shapes and dtypes of the state they keep per sequence. A model with other
stateful layers (RWKV, xLSTM, ...), that attends bidirectionally, or that passes the attention function something it
does not know, is refused in one line.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake
from transformers import AttentionInterface

from fastgrpo.sampling.state import StateLayer, calls_attention, recording, state_modules, unsupported

PROBE_NAME = "fastgrpo_probe"
# Keywords the attention function gets that change nothing it computes in the engine (the engine packs the batch
# itself and runs without dropout).
IGNORED_KWARGS = frozenset({"dropout", "scaling", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                            "max_length_k", "output_attentions", "use_cache", "cache_position", "is_causal",
                            "sliding_window", "softcap", "s_aux", "head_mask", "layer_idx", "output_router_logits",
                            "output_hidden_states", "return_dict"})  # fmt: skip
# config.layer_types entries of layers that attend over keys and values the engine keeps in pages.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# Modules whose presence means a layer that keeps a recurrent state (names as transformers spells its classes); those
# that keep it through transformers' cache (state.keeps_state), and the layers and parts around them, are the
# engine's.
STATEFUL_MODULES = ("Mamba", "GatedDeltaNet", "ShortConv", "LinearAttention", "Recurrent", "Rwkv", "RWKV", "SSM")


@dataclass(frozen=True, slots=True)
class AttentionLayer:
    """One attention call of the model's forward, in call order (`slot`)."""

    slot: int
    kv_heads: int
    key_dim: int
    value_dim: int
    query_heads: int
    window: int | None  # a token attends to the last `window` positions (itself included); None: all
    softcap: bool  # scores are capped: softcap * tanh(score / softcap)
    sinks: bool  # per-head sink logits join the softmax's denominator
    source: int  # the slot whose keys and values it reads: itself, or the layer it shares them with

    @property
    def owns_pages(self) -> bool:
        return self.source == self.slot


@dataclass(frozen=True, slots=True)
class LayerModel:
    layers: tuple[AttentionLayer, ...]
    slot_of: dict[int, int]  # id(attention module) -> slot
    states: tuple[StateLayer, ...] = ()  # the layers that keep recurrent state, in module order

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's recurrent state, all layers."""
        return sum(layer.nbytes for layer in self.states)

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct sliding windows of layers that keep pages, in first-use order."""
        return tuple(dict.fromkeys(layer.window for layer in self.layers if layer.owns_pages and layer.window))

    @property
    def has_full(self) -> bool:
        return any(layer.window is None for layer in self.layers if layer.owns_pages)

    def pool_of(self, slot: int) -> int:
        """The page pool of a layer: 0, the logical pool (full attention), or 1 + its window's index."""
        layer = self.layers[self.layers[slot].source]
        return 0 if layer.window is None else 1 + self.windows.index(layer.window)

    @property
    def uniform(self) -> bool:
        """Every layer full attention with pages of its own, all of the same shape: one cache tensor for all."""
        shapes = {(layer.kv_heads, layer.key_dim, layer.value_dim) for layer in self.layers}
        return len(shapes) == 1 and all(layer.owns_pages and layer.window is None for layer in self.layers)

    def features(self) -> set[str]:
        """What the attention backends must do for this model: window, softcap, sinks, value_dim (keys and values of
        different head dims)."""
        found = set()
        for layer in self.layers:
            found |= {name for name, on in (("window", layer.window), ("softcap", layer.softcap),
                                             ("sinks", layer.sinks), ("value_dim", layer.key_dim != layer.value_dim))
                      if on}  # fmt: skip
        return found


class Refused(ValueError):
    """A model the engine cannot sample exactly; the message is one line."""


def probe(hf_model, model=None) -> LayerModel:
    """The model's attention layers as its own forward calls them (see the module's docstring). `model`: what to call
    for a forward, when it wraps `hf_model` (peft, FSDP2's root: its hooks gather sharded parameters)."""
    model = hf_model if model is None else model
    name = type(hf_model).__name__
    text_config = hf_model.config.get_text_config()
    layer_types = getattr(text_config, "layer_types", None) or []
    stateful = state_modules(hf_model)
    other = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    if other and not stateful:
        raise Refused(f"{name} has {', '.join(other)} layers (config.layer_types), which the paged engine does not "
                      f"sample: it keeps keys and values of full and sliding-window attention, and the state of "
                      f"layers that keep it in transformers' cache")
    names = [state_name for state_name, _ in stateful]
    for module_name, module in hf_model.named_modules():
        kind = type(module).__name__
        reason = unsupported(module)
        if reason is not None:
            raise Refused(f"{name}'s {kind} ({module_name}) {reason}")
        around = any(_related(module_name, state_name) for state_name in names)
        stateless = calls_attention(module) or "Norm" in kind  # an attention layer, or a norm named after its family
        if module_name and not around and not stateless and any(word in kind for word in STATEFUL_MODULES):
            raise Refused(f"{name} has a {kind} ({module_name}), a layer with recurrent state, which the paged engine "
                          f"does not keep")
    weight = hf_model.get_input_embeddings().weight
    # (the memory plan's meta build and the tracer's fake tensors hold shapes only: no values to compare)
    shapes_only = weight.device.type == "meta" or is_fake(weight)
    problem = None if shapes_only else _position_problem(hf_model, model)
    if problem is not None:
        raise Refused(f"{name}'s forward {problem}, so it cannot run the engine's packed batches")
    calls, states = _record_calls(hf_model, model, stateful)
    split = next((layer.name for layer in states if not layer.one_per_token), None)
    if split is not None:
        raise Refused(f"{name}'s recurrent layer {split} does not return one tensor with a row per token, which the "
                      f"engine cannot split per sequence")
    if not calls and states:
        raise Refused(f"{name} has recurrent layers only: the paged engine samples models with attention layers (a "
                      f"hybrid's recurrent state it keeps beside their pages)")
    if not calls:
        raise Refused(f"{name} makes no call to transformers' attention interface, which the paged engine replaces")
    layers, slot_of, seen_keys = [], {}, {}
    for slot, (module, query, key, value, kwargs) in enumerate(calls):
        if id(module) in slot_of:
            raise Refused(f"{name} calls one attention module twice in a forward, which the paged engine does not "
                          f"sample")
        slot_of[id(module)] = slot
        unknown = sorted(k for k, v in kwargs.items() if k not in IGNORED_KWARGS and v is not None)
        if unknown:
            raise Refused(f"{name} passes {', '.join(unknown)} to its attention function, which the paged engine does "
                          f"not implement")
        if getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
            raise Refused(f"{name} attends bidirectionally (is_causal=False), which the paged engine does not sample")
        window = kwargs.get("sliding_window")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise Refused(f"{name} passes sliding_window={window!r}, not a positive int")
        source = seen_keys.get(id(key), slot)
        seen_keys.setdefault(id(key), slot)
        sinks = kwargs.get("s_aux")
        if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
            raise Refused(f"{name} passes s_aux of shape {tuple(sinks.shape)}: the engine takes one sink per head")
        layers.append(AttentionLayer(
            slot=slot, kv_heads=key.shape[1], key_dim=key.shape[-1], value_dim=value.shape[-1],
            query_heads=query.shape[1], window=window, softcap=bool(kwargs.get("softcap")), sinks=sinks is not None,
            source=source,
        ))  # fmt: skip
        if query.shape[1] % key.shape[1]:
            raise Refused(f"{name}: {query.shape[1]} query heads do not split over {key.shape[1]} key/value heads")
        if source != slot and layers[source].window != window:
            raise Refused(f"{name}: layer {slot} shares layer {source}'s keys with another sliding window")
    return LayerModel(tuple(layers), slot_of, tuple(states))


def _related(name: str, state_name: str) -> bool:
    """Whether module `name` is part of the decoder layer of state module `state_name` (the module itself, inside
    it, beside it: Mamba's norms) or around it (the layer, the backbone)."""
    layer = state_name.rpartition(".")[0]
    return name == layer or name.startswith(layer + ".") or state_name.startswith(name + ".")


def _position_problem(hf_model, model) -> str | None:
    """Why the model's forward cannot take the engine's packed batches, whose every token carries its own position
    (0, 1, ... in its sequence); None when it can. Read through the model's own attention, on two tokens:
      - the second token comes out the same at positions (0, 1) and (0, 5): the forward counts positions itself
        (BART's and Marian's decoders) or has none at all;
      - it comes out differently with positions (0, 1) than without position_ids: the forward's own positions start
        elsewhere (RoBERTa's start past the padding index)."""
    device = hf_model.get_input_embeddings().weight.device
    ids = torch.tensor([[3, 4]], device=device)

    def last(positions):
        position_ids = None if positions is None else torch.tensor([positions], device=device)
        return model(input_ids=ids, position_ids=position_ids, use_cache=False, logits_to_keep=1).logits

    with _implementation(hf_model, hf_model.config._attn_implementation), torch.no_grad():
        near, far, own = last([0, 1]), last([0, 5]), last(None)
    if not all(bool(torch.isfinite(x).all()) for x in (near, far, own)):
        return None  # a model that computes inf or nan tells nothing here (the trainer's own checks name it)
    if torch.equal(near, far) and _has_positions(hf_model):
        return "ignores position_ids (it counts positions itself)"
    if not torch.allclose(near, own, rtol=1e-4, atol=1e-5):
        return "numbers positions from other than 0 when given none"
    return None


def _has_positions(hf_model) -> bool:
    """Whether the model has a module that encodes positions (rotary, learned or sinusoidal tables); a model with
    none (Nemotron-H and Granite-4.0-H's attention: the Mamba layers carry the order) needs no position_ids."""
    words = ("rotary", "position", "positional")
    return any(any(word in f"{name} {type(module).__name__}".lower() for word in words)
               for name, module in hf_model.named_modules())  # fmt: skip


def _record_calls(hf_model, model, stateful) -> tuple[list[tuple], list[StateLayer]]:
    """(module, query, key, value, kwargs) of every attention call of a forward over two tokens, and the state each
    of the `stateful` modules keeps."""
    calls = []

    def record(module, query, key, value, attention_mask, **kwargs):  # query [1, Hq, 2, D], key/value [1, Hkv, 2, D]
        calls.append((module, query, key, value, kwargs))
        out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
        return out, None

    AttentionInterface.register(PROBE_NAME, record)
    device = hf_model.get_input_embeddings().weight.device
    with _implementation(hf_model, PROBE_NAME), torch.no_grad(), recording(stateful) as states:
        model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device),
              position_ids=torch.arange(2, device=device)[None], use_cache=False, logits_to_keep=1)  # fmt: skip
    return calls, states


@contextmanager
def _implementation(hf_model, name: str):
    """The model in eval mode with attention implementation `name`; both put back afterwards."""
    before = hf_model.config._attn_implementation
    modes = [(module, module.training) for module in hf_model.modules()]
    hf_model.set_attn_implementation(name)
    if hf_model.config._attn_implementation != name:
        hf_model.set_attn_implementation(before)
        raise Refused(f"{type(hf_model).__name__} does not support a swappable attention implementation")
    hf_model.eval()
    try:
        yield
    finally:
        hf_model.set_attn_implementation(before)
        for module, training in modes:
            module.training = training
