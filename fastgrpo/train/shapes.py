"""What the memory plan needs of a model, read layer by layer off a build of its config on the meta device.

Nothing is allocated and no weight is read: `AutoModelForCausalLM.from_config` under `torch.device("meta")` gives every
module and parameter shape. Each decoder layer is read from its own modules, not from one global attribute, because
the 2026 families differ per layer:

    gpt-oss      even layers slide over 128 positions, odd ones attend to all; learned sinks; 32 experts, 4 a token
    Gemma 3      5 of every 6 layers slide (1024); four norms a layer; GeGLU
    Gemma 4      global layers with their own head dim (and KV heads); the last layers reuse earlier layers' K/V
                 (KV-shared: no pages of their own) and have twice the MLP; a per-layer input beside the residual
    Qwen3-MoE    128 experts, 8 a token; peft adapts the experts' 3-D parameters too (all-linear on a v5 MoE)
    Mistral      one window for every layer, passed from the config; GPT-2 Conv1D projections and LayerNorms

    Qwen3.5      3 of every 4 layers mix tokens with Gated DeltaNet (a recurrent state per head) instead of attention
    Nemotron-H   each layer one of: Mamba-2, attention, a dense MLP, experts

A recurrent mixer (Gated DeltaNet, Mamba-2, a short convolution: a module that keeps state in transformers' cache) is
counted by running it (`mixer_bytes`): its own forward and backward on meta tensors under LiveBytes, at two lengths,
give bytes per token of each moment. That is transformers' PyTorch path (what a CPU, and a GPU without
flash-linear-attention or mamba-ssm, runs); those kernels recompute inside and keep less, so the plan is an upper
bound there. A layer whose attention or MLP is of a kind the plan has no terms for is refused in one line
(`ValueError`), naming the layer and its module.
"""

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn")
MIXER_NAMES = ("mixer",)  # Nemotron-H: the one block of a layer, whatever its kind
# Lengths a recurrent mixer is run at (mixer_bytes): multiples of every chunk size in use (Gated DeltaNet 64,
# Mamba-2 128 and 256), so that both are whole chunks and the difference is per token.
MIXER_LENGTHS = (512, 1024)
GATED = ("gate_proj", "up_proj", "down_proj")  # tiling.MLP_PROJECTIONS: the MLPs --mlp-tile-tokens tiles
SWIGLU_W = ("w1", "w2", "w3")  # the same SwiGLU named as in the LLaMA paper (LFM2)


def _conv1d():
    from transformers.pytorch_utils import Conv1D

    return Conv1D


def is_linear(module: nn.Module) -> bool:
    """nn.Linear or transformers' Conv1D (GPT-2): what bitsandbytes' 4-bit loading quantizes and peft's all-linear
    adapts."""
    return isinstance(module, (nn.Linear, _conv1d()))


def linear_shape(module: nn.Module) -> tuple[int, int]:
    """(in, out) of a linear layer: nn.Linear's weight is [out, in], Conv1D's [in, out]."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.weight.shape[1]


@dataclass(frozen=True, slots=True)
class MixerBytes:
    """A recurrent mixer's bytes, each as (per token, fixed) over the tokens of a micro-batch, besides its input: what
    its forward with grad keeps for the backward (`saved`, its output not included), the most its backward holds
    besides those and its output's gradient (`backward`), and the most a no-grad forward of one sequence holds, its
    output included (`forward`; the engine runs each prefill segment alone). `decode`: (per row, fixed) of the
    engine's decode step of the layer (the rows' states gathered from their slots, stepped, written back), besides
    the slots. `state`: one sequence's state in the engine (its conv and recurrent state)."""

    saved: tuple[int, int]
    backward: tuple[int, int]
    forward: tuple[int, int]
    decode: tuple[int, int] = (0, 0)
    state: int = 0

    @staticmethod
    def at(term: tuple[int, int], tokens: int) -> int:
        return term[0] * tokens + term[1]


@dataclass(frozen=True, slots=True)
class LayerShape:
    """One decoder layer, as its modules say. Widths in values; q, k, v, o_in are the projections' widths."""

    heads: int
    kv_heads: int  # of the K/V it attends to (a KV-shared layer: the source layer's)
    head_dim: int  # of queries and keys
    v_head_dim: int
    window: int | None = None  # sliding window (positions it attends to), None: every position
    kv_shared: bool = False  # reads another layer's K/V (Gemma 4's is_kv_shared_layer): keeps no KV pages
    sinks: bool = False  # a learned per-head logit in the softmax (gpt-oss)
    head_norms: bool = False  # RMSNorms over each head's q and k (Qwen3, Gemma 3/4)
    v_norm: bool = False  # Gemma 4's norm of v, without a weight (so recompute_norms leaves it: tiling._is_rms_norm)
    intermediate: int = 0  # the dense MLP's width (0: none)
    gated: bool = True  # act(gate) * up (SwiGLU, GeGLU), or act(fc) (GPT-2)
    tileable: bool = False  # gate_proj, up_proj, down_proj modules: what --mlp-tile-tokens tiles
    experts: int = 0  # routed experts (0: a dense layer)
    top_k: int = 0  # experts a token goes through
    expert_intermediate: int = 0
    expert_gate_values: int = 2  # [pairs, I] tensors the experts' gate keeps: act(gate), product; gpt-oss's clamped
    expert_bias: bool = False  # SwiGLU 5 (two clamps, sigmoid, glu, up + 1); per-expert biases (gpt-oss)
    expert_lora: bool = False  # LoRA on them (peft's ParamWrapper): each forward forms W + B A, a whole weight
    expert_weights: int = 0  # values of the experts' 3-D weights (gate_up and down)
    norms: int = 2  # hidden-width norms: Llama 2, Gemma 3 4 (around attention and MLP), Gemma 4 5
    layer_norm: bool = False  # LayerNorm (GPT-2) rather than RMSNorm
    per_layer_input: int = 0  # Gemma 4: the width of the per-layer input gated into the residual
    # (in, out) of the linear layers: all of them (Shapes.per_layer), or with LoRA those peft adapted (Shapes.lora)
    attention_linears: tuple[tuple[int, int], ...] = ()
    mlp_linears: tuple[tuple[int, int], ...] = ()
    other_linears: tuple[tuple[int, int], ...] = ()  # the rest of the layer's (Gemma 4's per-layer input gate)
    # A recurrent layer (Qwen3.5's Gated DeltaNet, Mamba-2, LFM2's convolution) mixes tokens with this instead of
    # attention (heads 0, no pages); its linears are attention_linears
    mixer: MixerBytes | None = None

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def k(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def v(self) -> int:
        return self.kv_heads * self.v_head_dim

    @property
    def o_in(self) -> int:  # the attention's output: o_proj's input
        return self.heads * self.v_head_dim

    @property
    def linears(self) -> tuple[tuple[int, int], ...]:
        return self.attention_linears + self.mlp_linears + self.other_linears

    def page_values(self) -> int:
        """Values of one position in this layer's KV pages: kv_heads x (key dim + value dim); none if KV-shared."""
        return 0 if self.kv_shared else self.kv_heads * (self.head_dim + self.v_head_dim)


@dataclass(slots=True)
class Shapes:
    """The model as the plan counts it: per-layer shapes and whole-model counts, from the meta build."""

    name: str  # the model class, for messages
    hidden: int
    vocab: int
    tied: bool
    params: int  # every parameter (a tied head once)
    per_layer: tuple[LayerShape, ...]
    linears: list[tuple[int, int]]  # every linear layer but the output head: what 4-bit quantizes
    expert_params: int = 0  # the experts' 3-D parameters: kept in the compute dtype (bitsandbytes quantizes linears)
    attention: str = "sdpa"  # the attention implementation transformers picks for this model (gpt-oss: eager)
    rotary_dims: tuple[int, ...] = ()  # head dims of the rotary tables the decoder computes per step
    per_layer_inputs: int = 0  # Gemma 4: values per token of the per-layer inputs the decoder holds
    softcap: float | None = None  # final_logit_softcapping (the fused loss applies it: no bytes)
    lora_sizes: tuple[int, ...] = ()  # with LoRA (Shapes.lora): every adapter tensor's values
    model: nn.Module | None = field(default=None, repr=False, compare=False)  # the meta build
    _lora: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def layers(self) -> int:
        return len(self.per_layer)

    @property
    def kinds(self) -> list[LayerShape]:
        """The distinct layers (a layer's moments are the same for every layer of one kind)."""
        return list(dict.fromkeys(self.per_layer))

    @property
    def linear_params(self) -> int:
        return sum(i * o for i, o in self.linears)

    # The widest layer's widths: for a model whose layers are all alike (Llama, Qwen), the model's.
    heads = property(lambda self: max(layer.heads for layer in self.per_layer))
    kv_heads = property(lambda self: max(layer.kv_heads for layer in self.per_layer))
    head_dim = property(lambda self: max(layer.head_dim for layer in self.per_layer))
    intermediate = property(lambda self: max(layer.intermediate for layer in self.per_layer))
    head_norms = property(lambda self: any(layer.head_norms for layer in self.per_layer))

    @property
    def windows(self) -> list[int]:
        """The sliding windows of layers that keep pages, smallest first."""
        return sorted({layer.window for layer in self.per_layer if layer.window and not layer.kv_shared})

    @property
    def tileable(self) -> bool:
        return any(layer.tileable for layer in self.per_layer)

    def lora(self, config) -> "Shapes":
        """These shapes with LoRA as load_policy adds it (fastgrpo.train.lora.add_adapters on a copy of the meta
        build): each layer's linears are those that got adapters, `expert_lora` where its experts' 3-D weights did,
        and `lora_sizes` every adapter tensor's values. ValueError where add_adapters refuses the options (its one
        line, as `fastgrpo train` says it)."""
        key = (config.lora_r, config.lora_alpha, config.lora_dropout, tuple(config.lora_target_modules),
               config.lora_experts, tuple(config.lora_target_parameters or ()))
        if key not in self._lora:
            self._lora[key] = _with_adapters(self, config)
        return self._lora[key]


def model_shapes(model_config) -> Shapes:
    """Shapes of the causal LM `model_config` describes, read per layer from a build on the meta device. ValueError,
    one line, for a model the plan cannot count."""
    from transformers import AutoModelForCausalLM

    from fastgrpo.sampling.layers import probe

    with torch.device("meta"):  # bf16, as trained: grouped_mm (the experts' GEMM) takes bf16 only
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.bfloat16)
    text = model_config.get_text_config()
    name = type(model).__name__
    layers = _decoder_layers(model, text)
    try:
        attention = probe(model)  # the engine's own reading of each attention call (its refusals are the plan's)
    except (RuntimeError, NotImplementedError) as error:  # a forward that reads values the meta device has not
        reason = " ".join(str(error).split())[:200]
        raise ValueError(f"model_name_or_path: cannot plan {name}: the engine's probe of its attention does not run "
                         f"on the meta device ({type(error).__name__}: {reason})") from None
    states = {layer.name: layer for layer in attention.states}
    names = {id(module): module_name for module_name, module in model.named_modules()}
    per_layer = [_layer_shape(name, i, layer, text, attention, states, names) for i, layer in enumerate(layers)]
    head = model.get_output_embeddings()
    linears = [linear_shape(m) for m in model.modules() if is_linear(m) and m is not head]
    expert_params = sum(p.numel() for m in layers for p in m.parameters() if p.dim() == 3)
    head_dims = sorted({(layer.window is not None, layer.head_dim) for layer in per_layer})
    rotary = any(type(m).__name__.endswith("RotaryEmbedding") for m in model.modules())
    per_layer_inputs = len(per_layer) * max(layer.per_layer_input for layer in per_layer)
    return Shapes(
        name=name, hidden=text.hidden_size, vocab=text.vocab_size,
        tied=bool(getattr(text, "tie_word_embeddings", False) or getattr(model_config, "tie_word_embeddings", False)),
        params=sum(p.numel() for p in model.parameters()), per_layer=tuple(per_layer), linears=linears,
        expert_params=expert_params, attention=model.config._attn_implementation or "eager",
        rotary_dims=tuple(d for _, d in head_dims) if rotary else (), per_layer_inputs=per_layer_inputs,
        softcap=getattr(text, "final_logit_softcapping", None), model=model,
    )  # fmt: skip


def _decoder_layers(model: nn.Module, text) -> nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    count = getattr(text, "num_hidden_layers", None)
    lists = [m for m in decoder.modules() if isinstance(m, nn.ModuleList)]
    for modules in lists:
        if count is None or len(modules) == count:
            return modules
    raise ValueError(f"model_name_or_path: cannot plan {type(model).__name__}: no list of its {count} decoder layers")


def _child(module: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, nn.Module):
            return child
    return None


def _token_mixer(layer: nn.Module, attention) -> tuple[nn.Module | None, nn.Module | None]:
    """(attention module, recurrent mixer) of a decoder layer: the module the engine's probe saw call the attention
    interface, and a module that keeps recurrent state (sampling.state.keeps_state); either or both None."""
    from fastgrpo.sampling.state import keeps_state

    attn = next((m for m in layer.modules() if id(m) in attention.slot_of), None)
    mixer = next((m for m in layer.modules() if keeps_state(m)), None)
    return attn, mixer


def _layer_shape(model: str, index: int, layer: nn.Module, text, attention, states: dict,
                 names: dict[int, str]) -> LayerShape:  # states: module name -> sampling.state.StateLayer
    where = f"model_name_or_path: cannot plan {model}: layer {index} ({type(layer).__name__})"
    attn, recurrent = _token_mixer(layer, attention)
    named = _child(layer, ATTENTION_NAMES)
    if attn is None and recurrent is None and named is not None:
        raise ValueError(f"{where}: its attention ({type(named).__name__}) makes no call to transformers' attention "
                         "interface")
    if attn is not None:
        call = attention.layers[attention.slot_of[id(attn)]]
        widths = dict(heads=call.query_heads, kv_heads=call.kv_heads, head_dim=call.key_dim, v_head_dim=call.value_dim,
                      window=call.window, kv_shared=not call.owns_pages, sinks=call.sinks)
    else:
        widths = dict(heads=0, kv_heads=0, head_dim=0, v_head_dim=0)
    mixer = None
    if recurrent is not None:
        mixer = mixer_bytes(recurrent, text.hidden_size, states.get(names.get(id(recurrent))))
    token_mixer = attn if attn is not None else recurrent
    mlp, experts = _mlp(layer, token_mixer), _experts(layer)
    dense = mlp if experts is None or not _contains(mlp, experts) else _child(mlp, ("shared_expert", "shared_experts"))
    intermediate, gated, tileable = _dense_mlp(where, dense) if dense is not None else (0, True, False)
    expert_count, top_k, expert_intermediate = _expert_widths(where, experts, layer, text) if experts else (0, 0, 0)
    if not intermediate and not expert_count and token_mixer is None:
        raise ValueError(f"{where} has no MLP the plan knows (a dense MLP or experts)")
    in_mlp = {id(m) for part in (mlp, experts) if part is not None for m in part.modules()}
    in_attn = {id(m) for m in token_mixer.modules()} if token_mixer is not None else set()
    routers = {id(m) for m in layer.modules()  # a router's linear layer: out 1 (a shared expert's gate) or E
               if is_linear(m) and expert_count and linear_shape(m)[1] in (1, expert_count)}
    linears = [(m, linear_shape(m)) for m in layer.modules() if is_linear(m) and id(m) not in routers]
    norms = [m for m in layer.children() if _is_norm(m) and _width(m) in (None, text.hidden_size)]
    return LayerShape(
        **widths, mixer=mixer,
        head_norms=attn is not None and isinstance(getattr(attn, "q_norm", None), nn.Module),
        v_norm=(attn is not None and isinstance(getattr(attn, "v_norm", None), nn.Module)
                and _width(attn.v_norm) is None),
        intermediate=intermediate, gated=gated, tileable=tileable, experts=expert_count, top_k=top_k,
        expert_intermediate=expert_intermediate,
        expert_gate_values=5 if experts is not None and hasattr(experts, "limit") else 2,
        expert_bias=bool(getattr(experts, "has_bias", False)),
        expert_weights=sum(p.numel() for p in experts.parameters() if p.dim() == 3) if experts is not None else 0,
        norms=len(norms),
        layer_norm=any(isinstance(m, nn.LayerNorm) for m in norms),
        per_layer_input=getattr(layer, "hidden_size_per_layer_input", 0) or 0,
        attention_linears=tuple(s for m, s in linears if id(m) in in_attn),
        mlp_linears=tuple(s for m, s in linears if id(m) in in_mlp),
        other_linears=tuple(s for m, s in linears if id(m) not in in_attn and id(m) not in in_mlp),
    )  # fmt: skip


def _mlp(layer: nn.Module, token_mixer: nn.Module | None) -> nn.Module | None:
    """A layer's MLP: its child of a known name, or (Nemotron-H) its one block when that does not mix tokens."""
    mlp = _child(layer, MLP_NAMES)
    if mlp is None:
        block = _child(layer, MIXER_NAMES)
        mlp = block if block is not None and block is not token_mixer else None
    return mlp


def mixer_bytes(module: nn.Module, hidden: int, state=None) -> MixerBytes:
    """A recurrent mixer's moments (MixerBytes), from its own forward and backward on meta tensors at MIXER_LENGTHS
    tokens (one sequence each), in training mode, its parameters frozen (their gradients are the plan's weight
    terms); per token is the difference over the difference in tokens, fixed what is left. With `state` (the engine's
    StateLayer of the module) the decode step too, at MIXER_ROWS rows, through the engine's own state path."""
    from fastgrpo.memory import LiveBytes

    parameters = tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())
    key = (type(module), hidden, state is None, parameters)
    if key not in _MIXERS:  # a model's recurrent layers are alike: measured once
        weight = next(module.parameters())
        held = [*module.parameters(), *module.buffers()]  # counted from the start: the views of them add nothing
        training = module.training
        frozen = [(p, p.requires_grad) for p in module.parameters()]
        module.train()
        measured = []
        try:
            for p, _ in frozen:
                p.requires_grad_(False)
            for tokens in MIXER_LENGTHS:
                x = torch.empty(1, tokens, hidden, device="meta", dtype=weight.dtype, requires_grad=True)
                with LiveBytes([x, *held]) as live:
                    out = module(x)
                    output = out.untyped_storage().nbytes()
                    saved = live.current - live.base - output
                    grad = torch.empty_like(out)
                    start = live.current
                    live.peak = start
                    out.backward(grad)
                    backward = live.peak - start
                    del out, grad
                with torch.no_grad(), LiveBytes([x, *held]) as live:
                    out = module(x)
                    forward = live.peak - live.base
                    del out
                measured.append((saved, backward, forward))
            decode = _decode_bytes(module, hidden, weight.dtype, state) if state is not None else []
        finally:
            module.train(training)
            for p, requires_grad in frozen:
                p.requires_grad_(requires_grad)
        terms = [_linear(a, b, MIXER_LENGTHS) for a, b in zip(*measured, strict=True)]
        decode_term = _linear(*decode, MIXER_ROWS) if decode else (0, 0)
        _MIXERS[key] = MixerBytes(*terms, decode=decode_term)
    return dataclasses.replace(_MIXERS[key], state=state.nbytes if state is not None else 0)


MIXER_ROWS = (8, 16)  # decode rows the engine's step of a recurrent layer is run at


def _linear(a: int, b: int, at: tuple[int, int]) -> tuple[int, int]:
    """(per unit, fixed) through the counts a at at[0] units and b at at[1]."""
    per_unit = -(-(b - a) // (at[1] - at[0]))
    return per_unit, max(0, a - per_unit * at[0])


def _decode_bytes(module: nn.Module, hidden: int, dtype: torch.dtype, state) -> list[int]:
    """The engine's decode step of the module at each of MIXER_ROWS rows, on meta tensors: its rows' states gathered
    from their slots, the module's one-token form, the states written back (sampling.state), eval mode, no grad;
    bytes besides the slots and the input."""
    from fastgrpo.memory import LiveBytes
    from fastgrpo.sampling.state import RecurrentState, StateStep, state_step, wrapped

    module.eval()
    out = []
    with torch.no_grad(), wrapped([module]):
        for rows in MIXER_ROWS:
            slots = RecurrentState((state,), rows, torch.device("meta"))
            x = torch.empty(1, rows, hidden, device="meta", dtype=dtype)
            held = [x, *module.parameters(), *module.buffers(),
                    *(t for t in slots.conv + slots.recurrent if t is not None)]
            with LiveBytes(held) as live:
                with state_step(StateStep(slots, torch.arange(rows, device="meta"), [], [], [])):
                    y = module(x)
                out.append(live.peak - live.base)
                del y
    return out


_MIXERS: dict[tuple, MixerBytes] = {}


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")


def _experts(layer: nn.Module) -> nn.Module | None:
    """The module holding a layer's routed experts as 3-D parameters ([experts, out, in] or transposed)."""
    for module in layer.modules():
        if isinstance(getattr(module, "num_experts", None), int) and any(
                p.dim() == 3 for p in module.parameters(recurse=False)):
            return module
    return None


def _contains(module: nn.Module | None, part: nn.Module) -> bool:
    return module is not None and any(m is part for m in module.modules())


def _width(norm: nn.Module) -> int | None:
    weight = getattr(norm, "weight", None)
    return weight.shape[-1] if isinstance(weight, torch.Tensor) else None


def _dense_mlp(where: str, mlp: nn.Module) -> tuple[int, bool, bool]:
    """(intermediate width, gated, tileable) of a dense MLP."""
    named = {name: getattr(mlp, name, None) for name in GATED}
    if all(is_linear(m) for m in named.values()):
        return linear_shape(named["up_proj"])[1], True, True
    if all(is_linear(getattr(mlp, name, None)) for name in SWIGLU_W):  # LFM2: w1 the gate, w3 up, w2 down
        return linear_shape(mlp.w3)[1], True, False
    fused = getattr(mlp, "gate_up_proj", None)
    if is_linear(fused):  # Phi-3: gate and up in one projection
        return linear_shape(fused)[1] // 2, True, False
    linears = [m for m in mlp.modules() if is_linear(m)]
    if len(linears) == 2:  # GPT-2's c_fc and c_proj, fc1 and fc2
        return linear_shape(linears[0])[1], False, False
    raise ValueError(f"{where}: its MLP ({type(mlp).__name__}) is not one the plan knows (gate/up/down projections, "
                     "a fused gate_up projection, or two linear layers)")


def _expert_widths(where: str, experts: nn.Module, layer: nn.Module, text) -> tuple[int, int, int]:
    """(experts, experts per token, each expert's intermediate width) of a layer's 3-D experts; experts per token
    from the layer's router (its top_k) or the config."""
    count = experts.num_experts
    down = getattr(experts, "down_proj", None)
    if not isinstance(down, torch.Tensor) or down.dim() != 3:
        raise ValueError(f"{where}: its experts ({type(experts).__name__}) have no 3-D down_proj the plan knows")
    intermediate = down.numel() // (count * text.hidden_size)
    top_k = next((m.top_k for m in layer.modules() if isinstance(getattr(m, "top_k", None), int)), None)
    top_k = top_k or getattr(text, "num_experts_per_tok", None) or getattr(text, "top_k_experts", None)
    if not top_k:
        raise ValueError(f"{where}: how many experts a token goes through is not in its router or config")
    return count, top_k, intermediate


def _with_adapters(s: Shapes, config) -> Shapes:
    import copy
    import dataclasses

    from fastgrpo.sampling.state import keeps_state
    from fastgrpo.train.lora import add_adapters

    # peft wraps in place (the meta build stays as it is) and draws its adapters' initial values from the global
    # generator even on the meta device: forked, so that a plan leaves the run's seeded LoRA init as it would be
    with torch.random.fork_rng(devices=[]):
        wrapped = add_adapters(config, copy.deepcopy(s.model))
    sizes = tuple(p.numel() for name, p in wrapped.named_parameters() if ".lora_" in name)
    layers = _decoder_layers(wrapped.get_base_model(), wrapped.config.get_text_config())
    per_layer = []
    for shape, layer in zip(s.per_layer, layers, strict=True):
        attn = _child(layer, ATTENTION_NAMES)
        if attn is None or shape.mixer is not None:  # a recurrent mixer (or Nemotron-H's one block)
            attn = next((m for m in layer.modules() if keeps_state(m)), None) or attn
        mlp = _mlp(layer, attn)
        parts = {"attention_linears": [], "mlp_linears": [], "other_linears": []}
        expert_lora = False
        for module in layer.modules():
            if not _is_adapter(module):
                continue
            base = module.get_base_layer()
            if not is_linear(base):  # peft's ParamWrapper on a 3-D (or a router's 2-D) parameter
                expert_lora = expert_lora or getattr(module, "num_experts", 1) > 1
                continue
            part = ("attention_linears" if _contains(attn, module) else
                    "mlp_linears" if _contains(mlp, module) else "other_linears")
            parts[part].append(linear_shape(base))
        per_layer.append(dataclasses.replace(shape, expert_lora=expert_lora,
                                             **{k: tuple(v) for k, v in parts.items()}))
    return dataclasses.replace(s, per_layer=tuple(per_layer), lora_sizes=sizes, model=None, _lora={})


def _is_adapter(module: nn.Module) -> bool:
    """A peft LoRA layer (lora_A per adapter) holding the base layer or parameter it adapts."""
    return isinstance(getattr(module, "lora_A", None), nn.ModuleDict) and hasattr(module, "get_base_layer")
