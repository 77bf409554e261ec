"""Recurrent state beside the pages: the engine's side of hybrid models' linear-attention, Mamba and convolution
layers (Qwen3.5 and Qwen3-Next's Gated DeltaNet, Nemotron-H, Granite-4.0-H and Bamba's Mamba-2, LFM2's short
convolutions).

Such a layer keeps, per sequence, its causal convolution's last K inputs (a conv state [C, K], the model's dtype) and
a state matrix per head (a recurrent state: [Hv, Dk, Dv] for Gated DeltaNet, [H, P, N] for Mamba-2, fp32 where the
model computes it so). transformers' modules read and write them through five methods of its cache
(cache_utils.LinearAttentionLayer): `get_conv_state`, `get_recurrent_state`, `is_recording_past`,
`update_conv_state`, `update_recurrent_state`. A module takes its one-token recurrent form when it is given a state
and one token, its chunked form otherwise (from the given state, or from zeros when it has none).

The engine keeps these states in slots: one tensor per layer and kind, [slots + 1, *state] (the last is scratch).
A sequence holds a slot for as long as it holds pages (the scheduler allocates, moves and frees both together:
pages.PagePool.release), and the state in it always covers exactly the sequence's cached tokens:
  - a prompt starts with no state and prefills from nothing, chunk after chunk;
  - a child of a group of n > 1 starts from a copy of its prompt's final state (a group of one takes the prompt's
    slot over), so the prefix is computed once;
  - a parked multi-turn sequence keeps its slot, and the next turn's tokens continue it;
  - a preempted sequence's slot goes with its pages: it recomputes its tokens (from its prompt's state, or a prompt
    from nothing), as it recomputes their keys and values.

A step's packed tokens (the decode rows' one token each, then each host sequence's new tokens) cannot run through a
recurrent module as one sequence. While the engine samples, each state module's forward is wrapped (`wrapped`): the
decode rows run as one batch of one-token sequences, their states gathered from their slots and written back, and
each host segment runs alone from its slot. The modules compute what they compute in `model.generate`.
"""

import inspect
import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version

# The cache methods a module's forward calls when it keeps recurrent state (transformers' names), and all those the
# engine's view answers (_View).
STATE_METHODS = ("update_conv_state", "update_recurrent_state")
VIEW_METHODS = frozenset({"get_conv_state", "get_recurrent_state", "is_recording_past", *STATE_METHODS})
# The forward a state module must have for the engine to run it on its own segments: nothing per token but these.
STATE_PARAMETERS = (["hidden_states", "cache"], ["hidden_states", "cache", "attention_mask"])
# The first transformers whose state modules take `cache` and call only the methods above (5.21-5.23 take
# cache_params; older ones ask has_previous_state and read the cache's layers).
HYBRID_TRANSFORMERS = "5.24"
_CACHE_CALL = re.compile(r"\b(?:cache|cache_params|past_key_values)\.(\w+)\(")
_SOURCES: dict[type, tuple[str, frozenset[str]]] = {}  # class -> (forward's source, cache calls)


@dataclass(frozen=True, slots=True)
class StateLayer:
    """One state module of the model, in call order, and the state it keeps per sequence."""

    name: str  # its module name
    conv: tuple[tuple[int, ...], torch.dtype] | None  # ([C, K], dtype) of its causal convolution's inputs
    recurrent: tuple[tuple[int, ...], torch.dtype] | None  # (shape, dtype) of its state matrices
    one_per_token: bool = True  # its forward returns one tensor with a row per token (else the engine cannot split)

    @property
    def nbytes(self) -> int:
        """Bytes of one sequence's state."""
        kinds = [kind for kind in (self.conv, self.recurrent) if kind is not None]
        return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in kinds)


def _source(module: torch.nn.Module) -> str:
    """The source of the module's forward ("" where there is none to read), read once per class."""
    kind = type(module)
    if kind not in _SOURCES:
        try:
            source = inspect.getsource(inspect.unwrap(kind.forward))
        except (OSError, TypeError):
            source = ""
        _SOURCES[kind] = (source, frozenset(_CACHE_CALL.findall(source)))
    return _SOURCES[kind][0]


def cache_calls(module: torch.nn.Module) -> frozenset[str]:
    """The methods of transformers' cache that the module's forward calls."""
    _source(module)
    return _SOURCES[type(module)][1]


def calls_attention(module: torch.nn.Module) -> bool:
    """Whether the module's forward calls transformers' attention interface (an attention layer, whatever its class is
    named: Kimi Linear's full-attention KimiLinearAttention)."""
    source = _source(module)
    return "ALL_ATTENTION_FUNCTIONS" in source or "attention_interface(" in source


def keeps_state(module: torch.nn.Module) -> bool:
    """Whether the module's forward writes transformers' conv or recurrent state."""
    return any(method in cache_calls(module) for method in STATE_METHODS)


def unsupported(module: torch.nn.Module) -> str | None:
    """Why the engine cannot run this module's state (one clause), or None: its forward must take the hidden states,
    the cache and at most an attention mask, and ask of the cache only what the engine's view answers. Any module
    that writes other state in the cache (update_indexer: a sparse-attention indexer's keys) is refused too."""
    writes = sorted(m for m in cache_calls(module) if m.startswith("update_") and m not in STATE_METHODS)
    if writes:
        return f"keeps state in transformers' cache ({', '.join(writes)}) that the engine does not keep"
    if not keeps_state(module):
        return None
    if Version(transformers.__version__) < Version(HYBRID_TRANSFORMERS):  # (has_previous_state; cache_params=)
        return (f"keeps its state through transformers {transformers.__version__}'s cache interface; the engine "
                f"samples hybrid models with transformers >= {HYBRID_TRANSFORMERS}")
    asks = sorted(cache_calls(module) - VIEW_METHODS)
    if asks:
        return f"asks its cache for {', '.join(asks)}, which the engine's recurrent state does not answer"
    parameters = inspect.signature(inspect.unwrap(type(module).forward)).parameters.values()
    names = [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)][1:]
    if names not in STATE_PARAMETERS:
        return f"takes {', '.join(names)} in its forward, which the engine does not split per sequence"
    return None


def state_modules(hf_model) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every module that keeps recurrent state, in module order."""
    return [(name, module) for name, module in hf_model.named_modules() if keeps_state(module)]


def running_groups(rows: int, num_prompts: int, n: int) -> int:
    """Groups that may hold pages at once beside `rows` rows: as many as fill the rows with children, and one more
    that prefills its prompt."""
    return min(num_prompts, -(-rows // n) + 1)


def slots_for(rows: int, num_prompts: int, n: int) -> int:
    """State slots of a call: one per row (children that hold pages, prompts being prefilled) and one per running
    group's prompt (its children start from its state)."""
    return rows + running_groups(rows, num_prompts, n)


class StateSlots:
    """Which state slots are free; the scheduler's bookkeeping (the tensors are a RecurrentState's)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free_ids = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self) -> int:
        assert self.free_ids, "no free state slot: the scheduler admits no more holders than there are slots"
        return self.free_ids.pop()

    def free(self, slot: int) -> None:
        self.free_ids.append(slot)


class RecurrentState:
    """The state tensors of one `generate` call: per state layer, [slots + 1, *shape] of each kind it keeps."""

    def __init__(self, layers: tuple[StateLayer, ...], num_slots: int, device: torch.device):
        self.layers = layers
        self.num_slots = num_slots
        self.conv = [None if layer.conv is None else
                     torch.zeros(num_slots + 1, *layer.conv[0], dtype=layer.conv[1], device=device)
                     for layer in layers]  # fmt: skip
        self.recurrent = [None if layer.recurrent is None else
                          torch.zeros(num_slots + 1, *layer.recurrent[0], dtype=layer.recurrent[1], device=device)
                          for layer in layers]  # fmt: skip

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Slot dst takes slot src's state, for each (src, dst) (a child starting from its prompt's)."""
        if not pairs:
            return
        device = next(t.device for t in self.conv + self.recurrent if t is not None)
        src, dst = torch.tensor(pairs, device=device).T
        for tensor in self.conv + self.recurrent:
            if tensor is not None:
                tensor[dst] = tensor[src]


@dataclass(frozen=True, slots=True)
class StateStep:
    """Where a step's packed tokens come from, for the state modules: the decode rows (one token each) first, their
    slots on the device; then the host sequences' new tokens, one segment each."""

    state: RecurrentState
    rows: torch.Tensor | None  # [R] int64 slot of each decode row; None without rows
    lengths: list[int]  # [S] new tokens of each host sequence
    slots: list[int]  # [S] its slot
    fresh: list[bool]  # [S] it has no token cached: it starts with no state


_current: StateStep | None = None


@contextmanager
def state_step(step: StateStep | None):
    """The state modules run `step` (see `wrapped`) inside this block."""
    global _current
    _current = step
    try:
        yield
    finally:
        _current = None


class _View:
    """What one state module's forward asks of transformers' cache, for a batch of sequences: their states (the
    caller gathers them from their slots and writes them back), none for sequences that start. As
    cache_utils.LinearAttentionLayer keeps it: a prefill from nothing pads its convolution's inputs on the left to
    the kernel's size; the conv state is the last K inputs."""

    def __init__(self, conv: torch.Tensor | None, recurrent: torch.Tensor | None, fresh: bool):
        self.conv, self.recurrent, self.fresh = conv, recurrent, fresh

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self.recurrent

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(self, inputs: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:  # inputs [B, C, T]
        kernel = self.conv.shape[-1]
        if self.fresh:
            full = F.pad(inputs, (max(0, kernel - inputs.shape[-1]), 0))
        else:
            full = torch.cat([self.conv, inputs], dim=-1)
        self.conv.copy_(full[..., -kernel:])
        return full

    def update_recurrent_state(self, state: torch.Tensor, layer_idx: int | None = None, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        self.recurrent.copy_(state)
        return self.recurrent


class _Recorder(_View):
    """A view for one sequence that starts: it keeps what the module writes, to learn the state's shapes."""

    def __init__(self):
        super().__init__(None, None, True)

    def update_conv_state(self, inputs, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        kernel = conv_kernel_size or inputs.shape[-1]
        self.conv = inputs.new_zeros(*inputs.shape[:-1], kernel)
        return super().update_conv_state(inputs, layer_idx, state_idx)

    def update_recurrent_state(self, state, layer_idx=None, state_idx=0, **kwargs):
        self.recurrent = torch.empty_like(state)
        return super().update_recurrent_state(state)


def _run(module, forward, hidden: torch.Tensor, conv, recurrent, fresh: bool) -> torch.Tensor:
    out = forward(hidden, cache=_View(conv, recurrent, fresh), attention_mask=None)
    assert isinstance(out, torch.Tensor) and out.shape[:2] == hidden.shape[:2]  # (the probe refuses others)
    return out


def _forward_step(index: int, module, forward, hidden: torch.Tensor) -> torch.Tensor:
    """The module over the step's packed tokens hidden [1, T, H]: the decode rows as one batch, each host segment
    alone."""
    step = _current
    conv = step.state.conv[index]
    recurrent = step.state.recurrent[index]
    parts, start = [], 0
    if step.rows is not None:
        rows = step.rows
        count = rows.numel()
        gathered = [None if t is None else t[rows] for t in (conv, recurrent)]  # [R, ...] copies, updated in place
        out = _run(module, forward, hidden[0, :count, None], *gathered, fresh=False)  # [R, 1, H']
        for tensor, part in zip((conv, recurrent), gathered, strict=True):
            if tensor is not None:
                tensor.index_copy_(0, rows, part)
        parts.append(out.transpose(0, 1))
        start = count
    for length, slot, fresh in zip(step.lengths, step.slots, step.fresh, strict=True):
        views = [None if t is None else t[slot : slot + 1] for t in (conv, recurrent)]  # written in place
        parts.append(_run(module, forward, hidden[:, start : start + length], *views, fresh=fresh))
        start += length
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


@contextmanager
def wrapped(modules: list[torch.nn.Module]):
    """Each state module's forward runs the current StateStep's segments (`_forward_step`) while the block runs, and
    is itself again afterwards. Outside a step (a forward of the model's own), a module runs as it always does."""
    replacements = []
    for index, module in enumerate(modules):

        def step_forward(hidden_states, *args, _index=index, _module=module, _forward=module.forward, **kwargs):
            if _current is None:
                return _forward(hidden_states, *args, **kwargs)
            return _forward_step(_index, _module, _forward, hidden_states)

        replacements.append((module, step_forward))
    with _forwards(replacements):
        yield


@contextmanager
def recording(modules: list[tuple[str, torch.nn.Module]]):
    """While the block runs a forward of one sequence (no cache), each state module runs with a recording view; yields
    the list that holds a StateLayer per module once the block ends (in `modules`' order)."""
    views: dict[str, _Recorder] = {}
    replacements = []
    for name, module in modules:

        def record(hidden_states, *args, _name=name, _forward=module.forward, **kwargs):
            view = views[_name] = _Recorder()
            kwargs.pop("cache", None), kwargs.pop("cache_params", None), kwargs.pop("past_key_values", None)
            out = _forward(hidden_states, *args, **{**kwargs, "cache": view})
            view.one_per_token = isinstance(out, torch.Tensor) and out.shape[:2] == hidden_states.shape[:2]
            return out

        replacements.append((module, record))
    layers: list[StateLayer] = []
    with _forwards(replacements):
        yield layers
    for name, _ in modules:
        view = views.get(name)
        if view is None:
            continue
        conv = None if view.conv is None else (tuple(view.conv.shape[1:]), view.conv.dtype)
        recurrent = None if view.recurrent is None else (tuple(view.recurrent.shape[1:]), view.recurrent.dtype)
        layers.append(StateLayer(name, conv, recurrent, view.one_per_token))


@contextmanager
def _forwards(replacements: list[tuple[torch.nn.Module, object]]):
    """Each (module, forward): the module's forward is that one while the block runs, then as it was (its own
    attribute, which accelerate's hooks set, or its class's)."""
    originals = [(module, vars(module).get("forward")) for module, _ in replacements]
    for module, forward in replacements:
        module.forward = forward
    try:
        yield
    finally:
        for module, own in originals:
            if own is None:
                del module.forward
            else:
                module.forward = own
