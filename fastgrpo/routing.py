"""Routing replay for mixture-of-experts models: the engine records which experts each token went through, and the
trainer's forwards route every token through those experts again (R3), with the routing weights recomputed from the
current router at the recorded experts, so the router still learns.

transformers 5's MoE layers call their router module as `logits, weights, experts = router(hidden)` ([N, E],
[N, k], [N, k] for the N tokens of the forward, flattened) and hand `experts, weights` to the experts module; the
model names the router class in `_can_record_outputs["router_logits"]`. One forward hook per router (PyTorch's
public seam) sees that triple and may return another: nothing of the model is patched.

    routing = routing_of(model)          # None: the model has no routers
    with routing.recording(step):       # the engine: write each token's experts where `step` says (RouteStep)
        model(...)
    routing.replay(routes, force=True)  # the trainer: routes [N, layers, k] of the next forwards' N tokens
    loss = model(...); loss.backward()  # (a checkpointed layer's recompute replays the same routes)
    routing.stop()

A route is stored as the router gave it (its k expert ids in its order) in uint8 (models of up to 254 experts) or
int16; UNROUTED rows (every id at the dtype's sentinel) are positions the engine never computed (a completion's
last token, padding): the trainer routes them itself.

The weights at forced experts are the router's own rule, found by running the router once on random states and
checking which of RULES reproduces its weights: softmax over all experts then the top k's (renormalised or not:
Qwen-MoE, OLMoE, Mixtral), a softmax over the top k's logits (gpt-oss, Granite), DeepSeek-V3's sigmoid scores times
routed_scaling_factor (Nemotron-H), Gemma 4's probabilities times each expert's scale. A router that returns no triple
or whose weights no rule reproduces cannot be replayed (`Routing.unsupported` says why, in one line); its routes can
still be recorded and compared (the mismatch metrics) when it returns a triple.

Replay and comparison count, per router call, the routes whose own top k (as a set) differs from the recorded one
(`take_counts`); a layer recomputed by checkpointing is counted once per `replay`.
"""

import weakref
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastgrpo.models import find_hf_model


def route_dtype(num_experts: int) -> torch.dtype:
    """The narrowest dtype that holds every expert id and the UNROUTED sentinel."""
    return torch.uint8 if num_experts < 255 else torch.int16


def unrouted(dtype: torch.dtype) -> int:
    """The sentinel id of a position that was never routed."""
    return 255 if dtype == torch.uint8 else -1


def _normalised(weights: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    return weights / (weights.sum(-1, keepdim=True) + eps)


def _sigmoid(router, logits, experts):
    """DeepSeek-V3's (GLM-4.5, Nemotron-H): sigmoid scores of the experts (chosen with a bias and by group, but
    weighted without), renormalised with norm_topk_prob, times routed_scaling_factor."""
    weights = logits.float().sigmoid().gather(-1, experts)
    if getattr(router, "norm_topk_prob", False):
        weights = _normalised(weights, 1e-20)
    return weights * getattr(router, "routed_scaling_factor", 1.0)


def _scaled_probabilities(router, probabilities, experts):
    """Gemma 4's: its first output is already the softmax; renormalised, times the expert's own scale."""
    return _normalised(probabilities.float().gather(-1, experts)) * router.per_expert_scale[experts]


# (name, weights(router module, logits [N, E], experts [N, k] int64) -> [N, k]) in the order they are tried
RULES: tuple[tuple[str, Callable], ...] = (
    ("softmax, top k renormalised (Qwen-MoE, Mixtral, OLMoE)",
     lambda router, logits, experts: _normalised(F.softmax(logits.float(), -1).gather(-1, experts))),
    ("softmax, top k", lambda router, logits, experts: F.softmax(logits.float(), -1).gather(-1, experts)),
    ("softmax of the top k logits (gpt-oss, Granite)",
     lambda router, logits, experts: F.softmax(logits.gather(-1, experts), -1)),
    ("sigmoid x routed_scaling_factor (DeepSeek-V3, Nemotron-H)", _sigmoid),
    ("given probabilities x per_expert_scale (Gemma 4)", _scaled_probabilities),
)


@dataclass(slots=True)
class Router:
    module: torch.nn.Module
    layer: int  # its place among the model's routers
    num_experts: int
    top_k: int
    rule: Callable | None  # None: its weights cannot be recomputed at other experts

    def weights(self, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return self.rule(self.module, logits, experts)


@dataclass(slots=True)
class RouteStep:
    """Where an engine forward's routes go: per layer, row `dest[i]` of the records gets token i's experts.
    `forced`: rows already recorded (a recompute after a preemption) route through their records again."""

    records: torch.Tensor  # [layers, rows, k]
    dest: torch.Tensor  # [N] int64
    forced: bool = False


class Routing:
    """A model's routers, each with a forward hook that passes its output through, records it (engine) or replays
    recorded routes (trainer); replay and comparison count the routes the router itself would have chosen
    otherwise."""

    def __init__(self, routers: list[Router], dtype: torch.dtype, unsupported: str | None):
        self.routers = routers
        self.dtype = dtype
        self.unsupported = unsupported  # why routes cannot be replayed (None: they can)
        self.sentinel = unrouted(dtype)
        self._step: RouteStep | None = None  # recording
        self._routes: torch.Tensor | None = None  # [N, layers, k] replaying or comparing
        self._force = False
        self._seen: set[int] = set()  # layers counted since replay() (a checkpoint's recompute is not counted twice)
        self._counts: torch.Tensor | None = None  # [2]: (routes that differ, routes compared)
        for router in routers:
            router.module.register_forward_hook(self._hook(router))

    @property
    def can_record(self) -> bool:
        """Every router hands its experts over (a triple): they can be recorded and compared."""
        return all(router.top_k for router in self.routers)

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @property
    def top_k(self) -> int:
        return self.routers[0].top_k

    # -- the engine --

    @contextmanager
    def recording(self, step: RouteStep | None):
        """Routes of the forwards inside go to `step` (None: nothing recorded)."""
        self._step = step
        try:
            yield
        finally:
            self._step = None

    # -- the trainer --

    def replay(self, routes: torch.Tensor | None, force: bool) -> None:
        """The next forwards' tokens (flattened as the routers see them: [N] = [B * L] or a packed row) route through
        `routes` [N, layers, k] (force) or are only compared with them; None: route freely, compare nothing. Holds
        until the next call or `stop` (a checkpointed layer recomputes in the backward)."""
        if force and self.unsupported:
            raise ValueError(f"routing replay: {self.unsupported}")
        self._routes, self._force, self._seen = routes, force, set()

    def stop(self) -> None:
        self._routes, self._force, self._seen = None, False, set()

    def take_counts(self) -> tuple[int, int]:
        """(routes where the router's own top k differs from the recorded one, routes compared) since the last take:
        one read."""
        if self._counts is None:
            return 0, 0
        differ, compared = self._counts.tolist()
        self._counts = None
        return int(differ), int(compared)

    # -- the hook --

    def _hook(self, router: Router):
        def hook(module, args, output):
            if self._step is not None:
                return self._record(router, output)
            if self._routes is not None:
                return self._replay(router, output)
            return None

        return hook

    def _record(self, router: Router, output):
        logits, weights, experts = output  # [N, E], [N, k], [N, k]
        step = self._step
        records = step.records[router.layer]  # [rows, k]
        if step.forced:  # positions computed before: their recorded experts again
            recorded = records[step.dest].long()  # [N, k]
            seen = recorded[:, 0] != self.sentinel  # [N]
            if seen.any():
                experts = torch.where(seen[:, None], recorded, experts)
                weights = torch.where(seen[:, None], router.weights(logits, experts).to(weights.dtype), weights)
        records.index_copy_(0, step.dest, experts.to(records.dtype))
        return logits, weights, experts

    def _replay(self, router: Router, output):
        logits, weights, experts = output
        routes = self._routes
        if routes.shape[0] != experts.shape[0]:
            raise RuntimeError(f"routing replay: {routes.shape[0]} recorded routes for a forward of "
                               f"{experts.shape[0]} tokens at router {router.layer}")
        recorded = routes[:, router.layer].to(experts.device)  # [N, k]
        routed = recorded[:, 0] != self.sentinel  # [N]
        recorded = recorded.long()
        if router.layer not in self._seen:
            self._seen.add(router.layer)
            differ = (experts.sort(-1).values != recorded.sort(-1).values).any(-1) & routed  # [N]
            counts = torch.stack([differ.sum(), routed.sum()])
            self._counts = counts if self._counts is None else self._counts + counts
        if not self._force:
            return None
        chosen = torch.where(routed[:, None], recorded, experts)  # [N, k]
        forced = router.weights(logits, chosen).to(weights.dtype)  # differentiable: the current router's weights
        return logits, torch.where(routed[:, None], forced, weights), chosen


_ROUTINGS: "weakref.WeakKeyDictionary[torch.nn.Module, Routing | None]" = weakref.WeakKeyDictionary()


def routing_of(model: torch.nn.Module) -> Routing | None:
    """The model's Routing (its hooks installed on the first call, the same object afterwards); None for a model
    without routers."""
    net = find_hf_model(model)
    if net not in _ROUTINGS:
        _ROUTINGS[net] = _routing(net)
    return _ROUTINGS[net]


def router_class(net: torch.nn.Module) -> type | None:
    """The class transformers records router logits from (`_can_record_outputs["router_logits"]` of the model or its
    backbone), if the model has one."""
    for model in (net, getattr(net, getattr(net, "base_model_prefix", ""), None)):
        recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
        target = getattr(recorder, "target_class", recorder)
        if isinstance(target, type):
            return target
    return None


def _routing(net: torch.nn.Module) -> Routing | None:
    cls = router_class(net)
    modules = [] if cls is None else [m for m in net.modules() if isinstance(m, cls)]
    if not modules:
        return None
    name = cls.__name__
    hidden = net.config.get_text_config().hidden_size
    routers, unsupported = [], None
    for layer, module in enumerate(modules):
        found = _probe(module, hidden)
        if isinstance(found, str):
            unsupported = f"{name} {found}"
            # (a meta or fake model, as a memory trace builds: its routes are still recorded at their real size)
            known = [getattr(module, attribute, None) for attribute in ("num_experts", "top_k")]
            routers.append(Router(module, layer, *known, None) if found.startswith(FAKE) and all(known)
                           else Router(module, layer, 0, 0, None))
            continue
        num_experts, top_k, rule = found
        if rule is None:
            unsupported = f"{name}'s routing weights are none of: " + "; ".join(r for r, _ in RULES)
        routers.append(Router(module, layer, num_experts, top_k, rule))
    return Routing(routers, route_dtype(max(r.num_experts for r in routers)), unsupported)


FAKE = "has no values to probe (a meta or fake model)"


@torch.no_grad()
def _probe(module: torch.nn.Module, hidden_size: int, tokens: int = 16):
    """(experts, top k, the rule of its weights or None) from one call on random states of the model's width in its
    parameters' dtype; a string when its output is not transformers' (logits, weights, experts) triple, or when it
    cannot run on real values (a meta or fake model: a memory trace's)."""
    weight = next((p for p in module.parameters() if p.dtype.is_floating_point), None)
    if weight is None:
        return "has no floating-point weight"
    generator = torch.Generator().manual_seed(0)
    try:
        hidden = torch.randn(tokens, hidden_size, generator=generator).to(weight.device, weight.dtype)
        output = module(hidden)
        if not (isinstance(output, tuple) and len(output) == 3 and output[2].dtype in (torch.int64, torch.int32)):
            return "returns no (logits, weights, experts) triple"
        logits, weights, experts = output
        experts = experts.long()
        same = []  # the rules that give its weights' shape, and their weights
        for index, (_, rule) in enumerate(RULES):
            try:
                found = rule(module, logits, experts).to(weights.dtype)
            except (AttributeError, RuntimeError):  # (a rule that reads what this router does not have)
                continue
            if found.shape == weights.shape:
                same.append((index, found))
        exact = [i for i, found in same if torch.equal(found, weights)]
        close = [i for i, found in same if torch.allclose(found.float(), weights.float(), rtol=1e-2, atol=1e-6)]
    except Exception as error:  # (a router that needs more than the states, or has no values to compare)
        if weight.device.type == "meta" or type(weight).__name__ == "FakeTensor" or "Fake" in type(error).__name__:
            return f"{FAKE} ({type(error).__name__})"
        return f"cannot be probed on random states ({type(error).__name__}: {error})"
    picked = (exact or close or [None])[0]  # (a rule that rounds as the router does, where one does)
    return logits.shape[-1], experts.shape[-1], None if picked is None else RULES[picked][1]
