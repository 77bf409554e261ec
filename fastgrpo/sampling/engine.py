"""In-process sampling from the policy being trained, with a paged KV cache.

    engine = Engine(model, tokenizer=tokenizer)
    outputs = engine.generate(prompt_token_ids, n=8, params=SamplingParams(temperature=1.0, max_new_tokens=512))
    outputs[i][j].token_ids, .logprobs, .finish_reason     # prompt i, completion j

The engine owns no weights. Llama/Qwen2/Qwen3 models run through the engine's own decoder layers over the model's
parameters (decode_layers.py: fused q/k/v and gate/up GEMMs, fused elementwise kernels); other models run their own
modules with attention swapped (transformers' AttentionInterface) for the duration of `generate`. On CUDA the
sampler is two kernels that read the logits once (fastgrpo/kernels/sampling.py) unless top-p is on (a repetition
penalty adds a penalised fp32 copy for them to read). The KV pool is allocated per call and released at its end, so
the training step that follows gets the memory back.

Streamed groups (dynamic sampling): `generate(..., admit=k, group_done=g)` starts at most k prompt groups, hands
each finished group to `g`, which lets more start or stops the call (the rest are dropped, their pages freed).

Multi-turn rollouts (agents): `generate(..., turn_end=f)` parks a sequence whose turn ended, with its pages, and
appends the tokens `f` returns for it as a prefill continuation (turns.py): no token is computed twice.

Hybrid models (Qwen3.5's Gated DeltaNet, Mamba-2, LFM2's convolutions beside attention): each sequence's recurrent
state lives in a slot beside its pages (state.py), allocated, copied to a prompt's children and freed with them.

Mixture-of-experts models: `generate(..., record_routes=True)` records the experts every position went through
(routes.py); each Completion's `routes` [prompt + completion positions, MoE layers, k] is what the trainer replays.
"""

import os
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from fastgrpo.kernels.sampling import fused_sample
from fastgrpo.models import find_hf_model, stop_token_ids
from fastgrpo.routing import RouteStep, routing_of
from fastgrpo.sampling.attention import (
    ATTENTION_NAME,
    FEATURES,
    TRITON_BACKENDS,
    build_paged_batch,
    paged_batch,
    triton_tiles,
)
from fastgrpo.sampling.batch import DecodeBatch, Outputs
from fastgrpo.sampling.block_pool import blocks_for, least_pages, most_pages
from fastgrpo.sampling.cuda_graphs import DecodeGraphs
from fastgrpo.sampling.decode_layers import FusedDecoder, kv_scales, kv_scales_unsupported, unsupported
from fastgrpo.sampling.kv_cache import KVCache
from fastgrpo.sampling.layers import probe
from fastgrpo.sampling.pages import PagePool, window_pool_pages
from fastgrpo.sampling.params import EngineConfig, SamplingParams, check_int
from fastgrpo.sampling.routes import RouteRecords
from fastgrpo.sampling.sampler import SeenTokens, logit_floor, penalized, sample
from fastgrpo.sampling.scheduler import Scheduler, Step
from fastgrpo.sampling.sequence import Group, Sequence
from fastgrpo.sampling.state import RecurrentState, StateStep, running_groups, slots_for, state_step, wrapped
from fastgrpo.sampling.turns import TurnEnd, end_turns, wants_turns

# group_done(group index, its n completions) -> how many more groups may start, or None to stop the call
GroupDone = Callable[[int, list["Completion"]], int | None]

# Where model configs keep their context window: most architectures (GPT-2's n_positions is mapped to it too), then
# configs that name it otherwise (MPT, ChatGLM / Qwen-1).
CONTEXT_WINDOW_ATTRIBUTES = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def context_window(model_config) -> int | None:
    """The most positions the model was built for; None when its config does not say (then nothing is checked)."""
    text_config = model_config.get_text_config()
    for name in CONTEXT_WINDOW_ATTRIBUTES:
        value = getattr(text_config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@dataclass(slots=True)
class Completion:
    token_ids: list[int]  # everything after the prompt: sampled tokens, and the tokens turn_end appended
    logprobs: list[float]  # per token: log-softmax of the processed logits it was sampled from; 0 for appended ones
    finish_reason: str  # "stop" (stop token or stop string) or "length"
    tool_mask: list[int]  # per token: 1 sampled, 0 appended by turn_end (TRL's tool_mask: 0 leaves the loss)
    # record_routes (MoE): [prompt + completion positions, MoE layers, k] expert ids (routing.py; UNROUTED rows:
    # positions never computed, as the last token)
    routes: torch.Tensor | None = None


@dataclass(slots=True)
class GenerateStats:
    """What the last `generate` call did."""

    num_blocks: int = 0  # logical pages (the full-attention layers')
    window_blocks: tuple[int, ...] = ()  # pages of each sliding window's pool
    state_slots: int = 0  # recurrent state slots (hybrid models: state.py), of state_bytes each
    state_bytes: int = 0  # one sequence's recurrent state, all layers
    peak_pages: tuple[int, ...] = ()  # the most pages held at once: logical, then each window's
    num_steps: int = 0
    num_graph_steps: int = 0  # decode steps replayed from a CUDA graph (CUDA, triton/flash backends)
    num_forward_tokens: int = 0  # tokens fed through the model, all steps
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    leaked_blocks: int = 0  # pages still referenced when the call ended (always 0)
    prompt_tokens_computed: tuple[int, ...] = ()  # per prompt: prompt positions run through the model
    # Of num_forward_tokens: positions computed again after a preemption (prompts and completions). Without one,
    # num_forward_tokens = sum(prompt lengths) + sum(completion lengths - 1): every position once, bar each
    # completion's last token (and the tool tokens that filled it to max_new_tokens, which nothing reads).
    num_recomputed_tokens: int = 0
    # Multi-turn (turn_end): turns handed to it, its calls, the tokens it appended (kept, not dropped), and the
    # positions continuations computed (first time only): each resumed turn's last token and the appended tokens.
    num_groups_started: int = 0  # prompt groups that ran (all of them, unless `admit` held some back)
    num_groups_finished: int = 0  # (all that started, unless group_done stopped the call)
    num_turns: int = 0
    num_turn_end_calls: int = 0
    num_appended_tokens: int = 0
    num_continuation_tokens: int = 0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class HostBatch:
    """A step's host work as host lists: the new tokens of the sequences that are not decode rows."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slots: list[list[int]]  # [pools, T]: cache slot (block * block_size + offset) of each new token in each pool
    query_lens: list[int]  # [S]: new tokens per sequence
    context_lens: list[int]  # [S]: cached tokens per sequence, this step's included
    block_tables: list[list[list[int]]]  # [pools, S, width], padded with page 0
    last_tokens: list[int]  # [rows that sample]: packed index of each sampling sequence's last new token
    sample_counts: list[int]  # [rows that sample]: tokens each samples (n for a first fork)
    state_slots: list[int] = field(default_factory=list)  # [S]: recurrent state slot per sequence (-1: none)
    fresh: list[bool] = field(default_factory=list)  # [S]: nothing cached yet (it starts with no recurrent state)


def host_batch(step: Step, block_size: int, width: int, tables=lambda logical: [logical]) -> HostBatch:
    """Pack each host sequence's new tokens (its next `chunk` positions) one after another; `tables` gives a table of
    logical pages as each pool's table (pages.PagePool.tables)."""
    input_ids, positions, last_tokens, counts, num_tokens = [], [], [], [], 0
    pool_tables = [tables(seq.block_table) for seq in step.seqs]  # [S][pools]
    num_pools = len(tables([]))
    slots, padded = [[] for _ in range(num_pools)], [[] for _ in range(num_pools)]
    for seq, chunk, samples, own in zip(step.seqs, step.chunks, step.num_samples, pool_tables, strict=True):
        start, end = seq.num_cached, seq.num_cached + chunk
        input_ids += seq.token_ids[start:end]
        positions += range(start, end)
        for pool, table in enumerate(own):
            slots[pool] += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            padded[pool].append(table + [0] * (width - len(table)))
        num_tokens += chunk
        if samples:
            last_tokens.append(num_tokens - 1)
            counts.append(samples)
    context_lens = [seq.num_cached + chunk for seq, chunk in zip(step.seqs, step.chunks, strict=True)]
    return HostBatch(input_ids, positions, slots, list(step.chunks), context_lens, padded, last_tokens, counts,
                     [seq.state_slot for seq in step.seqs], [seq.num_cached == 0 for seq in step.seqs])


def available_memory(device: torch.device) -> int | None:
    """Bytes a new tensor on `device` can take: free device memory on CUDA; on a CPU the least of MemAvailable in
    /proc/meminfo, what the process's cgroup still allows (memory.max - memory.current, cgroup v2) and what its
    address-space limit leaves (RLIMIT_AS less the process's virtual size). None where none of these is known."""
    if device.type == "cuda":
        # Free on the device, plus what torch's caching allocator holds unused (e.g. the last training step's
        # activations): the pool's allocation is served from that first.
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    limits = [_meminfo_available(), _cgroup_room(), _address_space_room()]
    known = [limit for limit in limits if limit is not None]
    return min(known) if known else None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
    """memory.max - memory.current of this process's cgroup (v2); None without a limit ("max") or a cgroup v2."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line.strip().split(":", 2)[2] for line in f if line.startswith("0::")), None)
        if path is None:
            return None
        folder = os.path.join(root, path.lstrip("/"))
        with open(os.path.join(folder, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(folder, "memory.current")) as f:
            return max(0, int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        return None


def _address_space_room() -> int | None:
    """RLIMIT_AS less the process's virtual size (VmSize); None without a limit."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status") as status:
            size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        return None
    return max(0, limit - size)


def _largest(ok: Callable[[int], bool], most: int) -> int:
    """The largest b in [0, most] with ok(b) (ok falls from True to False as b grows); -1 if none."""
    low, high = -1, most
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if ok(mid) else (low, mid - 1)
    return low


def _flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


class Engine:
    def __init__(self, model: torch.nn.Module, *, tokenizer=None, **config):
        self.model = model
        self.tokenizer = tokenizer
        self.config = EngineConfig(**config)
        self.hf_model = find_hf_model(model)
        text_config = self.hf_model.config.get_text_config()
        self.vocab_size = text_config.vocab_size
        self.max_positions = context_window(self.hf_model.config)
        self.layer_model = probe(self.hf_model, model)  # what each attention layer needs (layers.py), or one line
        modules = dict(self.hf_model.named_modules())
        self.state_modules = [modules[layer.name] for layer in self.layer_model.states]  # recurrent layers (state.py)
        first = self.layer_model.layers[0]
        self.num_layers = len(self.layer_model.layers)  # attention layers (their slots in the cache)
        self.num_heads, self.num_kv_heads, self.head_dim = first.query_heads, first.kv_heads, first.key_dim
        # One Triton tile setting serves every layer: it holds the largest GQA group and fits the widest head.
        self._group = max(layer.query_heads // layer.kv_heads for layer in self.layer_model.layers)
        self._widest = max(layer.key_dim for layer in self.layer_model.layers)
        self.device = self.hf_model.get_input_embeddings().weight.device
        self.dtype = self.hf_model.get_input_embeddings().weight.dtype
        self.fp8 = self.config.kv_cache_dtype == "fp8"
        self.backend = self._resolve_backend()
        # The fused kernels (decode layers, sampler) run where Triton does: the triton/flash backends.
        self.fused_kernels = self.backend in TRITON_BACKENDS
        if self.fp8:
            self._check_fp8()
        self._kv_scales: torch.Tensor | None = None  # [layers, 2, Hkv] fp32 during a call with an fp8 cache
        reason = unsupported(self.hf_model) if self.config.fused_layers else "fused_layers=False"
        self.decoder = None if reason else FusedDecoder(self.hf_model, "triton" if self.fused_kernels else "torch")
        self.layers = "fused" if self.decoder else f"transformers ({reason})"
        self.routing = routing_of(self.hf_model)  # an MoE's routers (routing.py), None otherwise
        self.stats = GenerateStats()
        self._stop_candidates: dict[tuple, torch.Tensor] = {}  # (tokenizer, stop strings) -> [V] bool

    def _resolve_backend(self) -> str:
        choice, cuda = self.config.attention, self.device.type == "cuda"
        half = self.dtype in (torch.float16, torch.bfloat16)
        needs = self.layer_model.features()
        if choice == "auto":
            if not cuda:
                return "torch"
            flash = half and not self.fp8 and self.config.block_size % 256 == 0  # flash-attn reads no fp8 pages
            for backend in ("flash", "triton", "torch") if flash and _flash_attn_installed() else ("triton", "torch"):
                if needs <= FEATURES[backend]:
                    return backend
        missing = sorted(needs - FEATURES.get(choice, needs))
        if missing:
            raise ValueError(f"{type(self.hf_model).__name__} needs attention with {', '.join(missing)}, which "
                             f"attention={choice!r} does not compute; use attention='torch' or 'auto'")
        if choice == "flash" and not (cuda and half and _flash_attn_installed()):
            raise ValueError("attention='flash' needs flash-attn installed, a CUDA model and fp16/bf16 weights")
        if choice == "triton" and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention='triton' needs a CUDA model (or TRITON_INTERPRET=1 on CPU)")
        return choice

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV pages' dtype."""
        return torch.float8_e4m3fn if self.fp8 else self.dtype

    def _check_fp8(self) -> None:
        reason = kv_scales_unsupported(self.hf_model)
        if reason is not None:
            raise ValueError(f"kv_cache_dtype='fp8' bounds the keys and values of Llama/Qwen2/Qwen3 layers from their "
                             f"weights: {reason}")
        if self.fused_kernels and self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ValueError("kv_cache_dtype='fp8' with the Triton kernels needs a GPU with e4m3 conversions (compute "
                             "capability 8.9 or newer: Ada, Hopper); use attention='torch' or kv_cache_dtype='auto'")

    # -- the public call --

    def generate(
        self, prompt_token_ids: list[list[int]], n: int = 1, params: SamplingParams | None = None,
        group_ids: list[int] | None = None, *, first_columns: list[int] | None = None,
        turn_end: TurnEnd | None = None, turn_batch: int = 1, admit: int | None = None,
        group_done: GroupDone | None = None, record_routes: bool | None = None,
    ) -> list[list[Completion] | None]:
        """G = n completions of each prompt. With a seed, completion j of prompt i draws its k-th token from random
        stream group_ids[i] * n + j (default group_ids: 0, 1, ...) at column first_columns[i] + k (default 0 + k):
        give each prompt group its place in a larger batch and a call over any slice of that batch (another
        process's share, say) samples what one call over the whole batch would; a prompt that holds the first
        `first_columns[i]` tokens of a completion (a re-prefill of its earlier turns) samples what the completion
        would have sampled next.

        turn_end (multi-turn, turns.py): a completion that samples a stop token or completes a stop string ends its
        turn and parks, its pages kept, instead of finishing; `turn_end(turns)` gets the parked ones (a list of
        turns.Turn) and returns, per turn, the token ids to append (fed as a continuation, then decoding resumes)
        or None to finish it. It is called before a step once `turn_batch` sequences are parked, or when the parked
        ones hold the others up (nothing else can run, or the pool ran dry).

        Streamed (dynamic sampling): with `admit`, at most that many prompt groups start, in call order (the rest
        wait); `group_done(index, completions)` is called as each group finishes and returns how many more groups
        may start (0 or more), or None to stop the call: the groups still running are dropped, their pages freed.
        A group that did not finish (dropped, or never started) is None in the result. Each group's tokens are the
        same as in a call without these (its random stream is its own).

        record_routes (mixture-of-experts models; None: EngineConfig.record_routes): each Completion carries the
        experts every position of its prompt and completion was routed through (routes.py); CUDA graphs are off for
        the call."""
        params = SamplingParams() if params is None else params
        self._check_inputs(prompt_token_ids, n, params)
        for name, values in (("group_ids", group_ids), ("first_columns", first_columns)):
            if values is not None:
                if not isinstance(values, (list, tuple)) or len(values) != len(prompt_token_ids):
                    raise ValueError(f"{name} must be a list with one int per prompt")
                for value in values:
                    check_int(f"{name}[i]", value, 0)
        if turn_end is not None and not callable(turn_end):
            raise TypeError(f"turn_end must be a callable or None, got {type(turn_end).__name__}")
        check_int("turn_batch", turn_batch, 1)
        if admit is not None:
            check_int("admit", admit, 0)
        if group_done is not None and not callable(group_done):
            raise TypeError(f"group_done must be a callable or None, got {type(group_done).__name__}")
        record_routes = self.config.record_routes if record_routes is None else record_routes
        if record_routes and (self.routing is None or not self.routing.can_record):
            why = "has no mixture-of-experts router" if self.routing is None else self.routing.unsupported
            raise ValueError(f"record_routes: {type(self.hf_model).__name__} {why}")
        start = time.perf_counter()
        groups = [Group(prompt=Sequence(list(prompt), len(prompt)), n=n, index=i)
                  for i, prompt in enumerate(prompt_token_ids)]  # fmt: skip
        max_rows, max_groups, state_slots = self._state_seats(len(prompt_token_ids), n)
        num_blocks, window_blocks = self._num_blocks(prompt_token_ids, n, params, state_slots)
        pool = PagePool(num_blocks, self.config.block_size, window_blocks, state_slots)
        max_blocks_per_seq = blocks_for(max(map(len, prompt_token_ids)) + params.max_new_tokens, pool.block_size)
        batch = DecodeBatch(max(max_rows, n), max_blocks_per_seq, pool.block_size, self.device, pool.tables)
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, ()).item())
        streams = None if group_ids is None else (torch.tensor(group_ids)[:, None] * n + torch.arange(n)).view(-1)
        columns = None if first_columns is None else torch.tensor(first_columns).repeat_interleave(n)
        outputs = Outputs(len(groups) * n, params.max_new_tokens, self.device, None if params.greedy else seed,
                          streams, columns)
        scheduler = Scheduler(groups, pool, batch, outputs, max_rows, self.config.max_num_batched_tokens,
                              multi_turn=turn_end is not None, admit=admit, max_groups=max_groups)  # fmt: skip
        finish = self._finish_check(params, outputs)
        seen = SeenTokens(prompt_token_ids, n, outputs.tokens) if params.repetition_penalty != 1 else None
        self.stats = GenerateStats(num_blocks=num_blocks, window_blocks=tuple(window_blocks.values()),
                                   state_slots=state_slots, state_bytes=self.layer_model.state_bytes)
        if self.decoder is not None:  # the model may have changed since: LoRA wrapped in place, hooks, `.to()`
            reason = unsupported(self.hf_model)
            if reason is None:
                self.decoder.refresh()
            else:
                self.decoder, self.layers = None, f"transformers ({reason})"
        with self._sampling_mode():
            if self.fp8:  # from this call's weights (the model trains between calls)
                self._check_fp8()
                self._kv_scales = kv_scales(self.hf_model).to(self.device)
            # One page past each pool: scratch for the padding rows of CUDA graphs and out-of-window table entries.
            kv_cache = KVCache(self.layer_model, [num_blocks, *window_blocks.values()], pool.block_size,
                               self.kv_dtype, self.device)  # fmt: skip
            state = RecurrentState(self.layer_model.states, state_slots, self.device) if state_slots else None
            routes = (RouteRecords(self.routing, groups, n, params.max_new_tokens, self.device) if record_routes
                      else None)
            # (a captured step would replay its first step's route rows: routes are recorded eagerly)
            graphs = None if record_routes else self._decode_graphs(kv_cache, max_blocks_per_seq)
            while True:
                if group_done is not None and scheduler.done_groups:  # (before `done`: it may grant more starts)
                    self._report_groups(scheduler, outputs, group_done, routes)
                    continue
                if scheduler.done:
                    break
                if wants_turns(scheduler, turn_batch):
                    self._end_turns(scheduler, outputs, turn_end)
                    continue
                step = scheduler.schedule()
                if not (step.num_rows or step.seqs) and scheduler.parked:  # only the parked ones can go on
                    self._end_turns(scheduler, outputs, turn_end)
                    continue
                assert step.num_rows or step.seqs, "scheduler made no progress"
                for pairs in scheduler.take_copies():
                    kv_cache.copy(pairs)
                if state is not None:
                    state.copy(scheduler.take_state_copies())
                targets = scheduler.sample_targets(step)
                u = None if outputs.uniforms is None else outputs.uniforms[targets.seq_ids, targets.columns]
                rows_seen = None if seen is None else seen(*targets)
                route_step = None if routes is None else routes.step(step, batch)
                tokens, logprobs = self._run(step, batch, kv_cache, params, u, graphs, rows_seen, state, route_step)
                scheduler.update(step, tokens, logprobs, targets, finish)
                self._count_pages(pool)
                self.stats.num_steps += 1
                self.stats.num_forward_tokens += step.num_tokens
            done = [completions(group, outputs, routes) if group.done else None for group in groups]
            del kv_cache, graphs, state, routes
            self._kv_scales = None
        self.stats.num_preemptions = scheduler.num_preemptions
        self.stats.leaked_blocks = pool.num_leaked
        self.stats.prompt_tokens_computed = tuple(group.prompt_tokens_computed for group in groups)
        self.stats.num_recomputed_tokens = scheduler.num_recomputed
        self.stats.num_continuation_tokens = scheduler.num_continued
        seqs = [seq for group in groups for seq in group.children]
        self.stats.seconds = time.perf_counter() - start
        self.stats.num_appended_tokens = sum(count for seq in seqs for _, count in seq.appended)
        self.stats.num_generated_tokens = sum(seq.num_generated for seq in seqs) - self.stats.num_appended_tokens
        self.stats.num_groups_started = scheduler.num_admitted
        self.stats.num_groups_finished = sum(group.done for group in groups)
        return done

    def _report_groups(self, scheduler: Scheduler, outputs: Outputs, group_done: GroupDone,
                       routes: RouteRecords | None = None) -> None:
        """Hand each newly finished group to group_done; raise the admission limit by its answers, or stop."""
        for group in scheduler.take_done():
            more = group_done(group.index, completions(group, outputs, routes))
            if more is None:
                scheduler.abandon()
                return
            check_int("group_done's answer", more, 0)
            if scheduler.admit_limit is not None:
                scheduler.admit_limit += more

    def _end_turns(self, scheduler: Scheduler, outputs: Outputs, turn_end: TurnEnd) -> None:
        self.stats.num_turns += end_turns(scheduler, outputs, turn_end, self.vocab_size)
        self.stats.num_turn_end_calls += 1

    def _check_inputs(self, prompt_token_ids, n, params) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
            raise ValueError("prompt_token_ids must be a non-empty list of token id lists")
        for i, prompt in enumerate(prompt_token_ids):
            if not isinstance(prompt, (list, tuple)) or not prompt:
                raise ValueError(f"prompt_token_ids[{i}] must be a non-empty list of token ids")
            for token in prompt:
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                    raise ValueError(f"prompt_token_ids[{i}] holds {token!r}, not a token id in [0, {self.vocab_size})")
        check_int("n", n, 1)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine to have a tokenizer: Engine(model, tokenizer=...)")
        for i, prompt in enumerate(prompt_token_ids):
            if self.max_positions is not None and len(prompt) + params.max_new_tokens > self.max_positions:
                raise ValueError(
                    f"prompt_token_ids[{i}] has {len(prompt)} tokens: with max_new_tokens={params.max_new_tokens} they "
                    f"reach past the model's context window of {self.max_positions} positions"
                )

    def _state_seats(self, num_prompts: int, n: int) -> tuple[int, int | None, int]:
        """(row limit, running-group limit, recurrent state slots) for a call. A model without recurrent layers:
        (min(max_num_seqs, max_num_batched_tokens), None, 0). A hybrid one holds a state slot per row (children that
        hold pages, prompts being prefilled) and one per running group's prompt (its children start from it): as many
        groups run as fill the rows, and one more that prefills; the rows are cut to what half the memory budget's
        states allow (Qwen3.5-9B keeps ~50 MiB a sequence)."""
        max_rows = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        per_seq = self.layer_model.state_bytes
        if not per_seq:
            return max_rows, None, 0

        rows = min(max_rows, num_prompts * n)
        available = available_memory(self.device)
        if available is not None:
            limit = available * self.config.memory_fraction / 2
            fit = _largest(lambda r: (slots_for(r, num_prompts, n) + 1) * per_seq <= limit, most=rows)
            if fit < 1:
                raise ValueError(f"the recurrent state of one sequence ({per_seq / 2**20:.1f} MiB, "
                                 f"{len(self.layer_model.states)} layers) does not fit half of the sampling memory "
                                 f"({limit / 2**30:.2f} GiB); raise memory_fraction or free memory")
            rows = fit
        return rows, running_groups(rows, num_prompts, n), slots_for(rows, num_prompts, n)

    def _num_blocks(self, prompts: list[list[int]], n: int, params: SamplingParams,
                    state_slots: int = 0) -> tuple[int, dict[int, int]]:
        """Pages for this call: (logical pages, {window: pages of its pool}). The logical pool is as configured, or a
        fraction of free memory capped at what the call can use (every group at full length at once); at least one
        prompt's pages and one completion's: the scheduler runs the completions of a group one by one when that is
        all there is. A window's pool holds pages.window_pool_pages: a window for each sequence the logical pool holds
        at full length, at most one for every seat. The recurrent state's `state_slots` (and a scratch slot) come out
        of the same memory first."""
        block_size = self.config.block_size
        state_bytes = (state_slots + 1) * self.layer_model.state_bytes if state_slots else 0
        sizes = [(len(p), n, params.max_new_tokens, block_size) for p in prompts]
        least = max(least_pages(*size) for size in sizes)
        itemsize = torch.empty((), dtype=self.kv_dtype).element_size()  # (1 byte a value with fp8 pages)
        page_bytes = self._page_bytes(itemsize)  # [pools]
        sequence_pages = blocks_for(max(map(len, prompts)) + params.max_new_tokens, block_size)
        seats = min(self.config.max_num_seqs, len(prompts) * n)

        def pools(num_blocks: int) -> dict[int, int]:
            return {w: window_pool_pages(w, block_size, num_blocks, sequence_pages, seats,
                                         self.config.max_num_batched_tokens) for w in self.layer_model.windows}

        def nbytes(num_blocks: int) -> int:  # with each pool's scratch page, and the recurrent state
            sizes_ = [num_blocks, *pools(num_blocks).values()]
            return sum((size + 1) * b for size, b in zip(sizes_, page_bytes, strict=True)) + state_bytes

        available = available_memory(self.device)
        most = sum(most_pages(*size) for size in sizes)
        if self.config.num_blocks is not None:
            num_blocks = self.config.num_blocks
            if available is not None and nbytes(num_blocks) > available:  # before the page lists
                fit = _largest(lambda b: nbytes(b) <= available, most=num_blocks)
                raise ValueError(f"num_blocks={num_blocks} pages of {sum(page_bytes)} bytes take more than the "
                                 f"{available / 2**30:.1f} GiB available on {self.device}; at most {fit}")
        elif available is None:
            raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass num_blocks")
        else:
            budget = int(available * self.config.memory_fraction)
            num_blocks = _largest(lambda b: nbytes(b) <= budget, most=most)
        if num_blocks < least:
            raise ValueError(
                f"num_blocks={num_blocks} pages of {block_size} tokens cannot hold a prompt and one completion "
                f"(needs {least}); raise num_blocks or memory_fraction, or lower max_new_tokens"
            )
        return num_blocks, pools(num_blocks)

    def _page_bytes(self, itemsize: int) -> list[int]:
        """Bytes of one page in each pool (the logical pool first): block_size positions of every layer that keeps
        its keys and values there."""
        out = [0] * (1 + len(self.layer_model.windows))
        for layer in self.layer_model.layers:
            if layer.owns_pages:
                out[self.layer_model.pool_of(layer.slot)] += (self.config.block_size * layer.kv_heads
                                                              * (layer.key_dim + layer.value_dim) * itemsize)
        return out

    def _count_pages(self, pool: PagePool) -> None:
        held = [pool.num_blocks - len(pool.free_ids), *(w.pool.num_blocks - w.pool.num_free for w in pool.windows)]
        self.stats.peak_pages = tuple(max(a, b) for a, b in zip(self.stats.peak_pages or held, held, strict=True))

    def _finish_check(self, params: SamplingParams, outputs: Outputs) -> "FinishCheck":
        stop_ids = set(stop_token_ids(self.hf_model) if params.stop_token_ids is None else params.stop_token_ids)
        candidates = None
        if params.stop:
            key = (id(self.tokenizer), params.stop)
            if key not in self._stop_candidates:
                self._stop_candidates[key] = stop_string_candidates(self.tokenizer, params.stop, self.vocab_size)
            candidates = self._stop_candidates[key].to(self.device)
        return FinishCheck(params, stop_ids, outputs, self.tokenizer, candidates)

    @contextmanager
    def _sampling_mode(self):
        """Paged attention, eval mode, no autograd; everything put back afterwards, even on error."""
        attn_implementation = self.hf_model.config._attn_implementation
        modes = [(module, module.training) for module in self.model.modules()]
        if self.routing is not None:  # (routes a training forward replayed are not this call's)
            self.routing.stop()
        self.hf_model.set_attn_implementation(ATTENTION_NAME)
        if self.hf_model.config._attn_implementation != ATTENTION_NAME:
            self.hf_model.set_attn_implementation(attn_implementation)
            raise ValueError(f"{type(self.hf_model).__name__} does not support a swappable attention implementation")
        self.model.eval()
        try:
            with torch.no_grad(), wrapped(self.state_modules):
                yield
        finally:
            self.hf_model.set_attn_implementation(attn_implementation)
            for module, training in modes:
                module.training = training

    def _decode_graphs(self, kv_cache: torch.Tensor, max_blocks_per_seq: int) -> DecodeGraphs | None:
        if not (self.config.cuda_graphs and self.device.type == "cuda" and self.backend in ("triton", "flash")):
            return None
        if self.layer_model.states:  # the recurrent layers run each host segment alone: decode steps run eagerly
            return None
        tiles, _, _ = triton_tiles([1], self._group, self.dtype, self._widest)  # one token per sequence
        return DecodeGraphs(self._forward, kv_cache, self.config.max_num_seqs, max_blocks_per_seq, self.backend,
                            tiles)  # fmt: skip

    # -- one forward --

    def _run(self, step: Step, batch: DecodeBatch, kv_cache, params, u, graphs, seen=None, state=None,
             routes: RouteStep | None = None):
        """Forward the step and sample with the rows' uniforms `u` [R] (None: greedy) and tokens so far `seen`
        [R, L] (repetition_penalty; else None): (tokens [R], logprobs [R]) on the device, the decode rows' first."""
        rows = batch.inputs() if step.num_rows else None
        width = batch.block_tables.shape[2]
        host = host_batch(step, self.config.block_size, width, batch.tables) if step.seqs else None
        logits = None
        if host is None and graphs is not None and not graphs.failed and step.num_rows <= self.config.max_num_seqs:
            logits = graphs(rows["input_ids"], rows["positions"], rows["slots"], rows["block_tables"],
                            rows["context_lens"])  # fmt: skip
            self.stats.num_graph_steps += logits is not None
        if logits is None:
            row_slots = batch.state_slots[: step.num_rows] if rows is not None and state is not None else None
            logits = self._eager_forward(rows, batch.max_context(), host, kv_cache, state, row_slots, routes)
        if host is not None and any(count > 1 for count in host.sample_counts):  # a first fork samples n tokens
            counts = torch.cat([torch.ones(step.num_rows, dtype=torch.long), torch.tensor(host.sample_counts)])
            logits = logits[torch.repeat_interleave(torch.arange(len(counts)), counts).to(self.device)]
        return self._sample(logits, params, u, seen)

    def _sample(self, logits: torch.Tensor, params: SamplingParams, u: torch.Tensor | None,
                seen: torch.Tensor | None):
        """The fused sampler where Triton runs: the repetition penalty on an fp32 copy of the logits first, top-k and
        min-p as one threshold per row (sampler.logit_floor). Top-p needs a sort, and runs the PyTorch sampler."""
        if self.fused_kernels and params.top_p == 1:
            if seen is not None:
                logits = penalized(logits, seen, params.repetition_penalty)
            return fused_sample(logits, params.temperature, u, logit_floor(logits, params))
        return sample(logits.float(), params, u, seen)

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _eager_forward(self, rows: dict | None, rows_max_context: int, host: HostBatch | None,
                       kv_cache: KVCache | torch.Tensor, state: RecurrentState | None = None,
                       row_slots: torch.Tensor | None = None,
                       routes: RouteStep | None = None) -> torch.Tensor:  # [rows that sample, V]
        """The step's logits; with `state`, the recurrent layers run from the rows' state slots `row_slots` [R] and
        the host sequences' (host.state_slots); with `routes`, the routers' choices are recorded there."""
        if isinstance(kv_cache, torch.Tensor):  # one [layers, 2, pages + 1, block_size, Hkv, D] tensor (the tracer's)
            kv_cache = KVCache.from_tensor(kv_cache, self.layer_model)
            if host is not None:
                host = replace(host, slots=[host.slots[0]], block_tables=[host.block_tables[0]])
        lists = (host.slots, host.block_tables, host.query_lens, host.context_lens) if host else ([], [], [], [])
        paged = build_paged_batch(kv_cache, *lists, self.backend, self._group, rows=rows,
                                  rows_max_context=rows_max_context, query_dtype=self.dtype,
                                  head_dim=self._widest)  # fmt: skip
        input_ids = rows["input_ids"] if rows else None
        positions = rows["positions"] if rows else None
        keep = 0  # decode rows only: every token samples
        if host is not None:
            host_ids, host_positions = self._tensor([host.input_ids, host.positions], torch.long)
            input_ids = host_ids if rows is None else torch.cat([input_ids, host_ids])
            positions = host_positions if rows is None else torch.cat([positions, host_positions])
            num_rows = 0 if rows is None else rows["input_ids"].numel()
            keep = self._tensor(host.last_tokens, torch.long) + num_rows
            if num_rows:
                keep = torch.cat([torch.arange(num_rows, device=self.device), keep])
        states = None
        if state is not None:
            segments = (host.query_lens, host.state_slots, host.fresh) if host else ([], [], [])
            states = StateStep(state, row_slots, *map(list, segments))
        with nullcontext() if routes is None else self.routing.recording(routes):
            return self._forward(input_ids, positions, paged, keep, states)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, paged, keep: torch.Tensor | int = 0,
                 states: StateStep | None = None):
        """[rows kept, V] logits of the packed tokens input_ids/positions [T]; keep: 0 (all) or packed indices;
        `states`: where the recurrent layers' states are (hybrid models)."""
        if self._kv_scales is not None and paged.kv_scales is None:  # an fp8 cache (and the batches of CUDA graphs)
            paged = replace(paged, kv_scales=self._kv_scales)
        if self.decoder is not None:
            return self.decoder(input_ids, positions, paged, keep)
        with paged_batch(paged), state_step(states):
            return self.model(
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False, logits_to_keep=keep
            ).logits[0]


def completions(group: Group, outputs: Outputs, routes: RouteRecords | None = None) -> list[Completion]:
    """A finished group's n completions (with their routes when they were recorded)."""
    ids, lengths = [seq.seq_id for seq in group.children], [seq.num_generated for seq in group.children]
    per_child = routes.of(group) if routes is not None else [None] * len(ids)
    return [Completion(tokens, logprobs, seq.finish_reason, tool_mask(seq), child_routes)
            for seq, tokens, logprobs, child_routes in zip(group.children, outputs.token_lists(ids, lengths),
                                                          outputs.logprob_lists(ids, lengths), per_child,
                                                          strict=True)]


def tool_mask(seq: Sequence) -> list[int]:
    """[num_generated]: 1 for sampled tokens, 0 for the ones turn_end appended."""
    mask = [1] * seq.num_generated
    for column, count in seq.appended:
        mask[column : column + count] = [0] * count
    return mask


def stop_string_candidates(tokenizer, stop: tuple[str, ...], vocab_size: int) -> torch.Tensor:
    """[V] bool: tokens whose text could complete one of the stop strings. A stop string that was not in the text
    before a token and is after it ends inside that token's text, so the token's text holds its last character;
    tokens that decode to partial characters (U+FFFD), to nothing, or beyond the tokenizer are kept as candidates,
    and a stop string ending in whitespace (which tokenizers may strip from a lone token) makes every token one."""
    if any(s[-1].isspace() for s in stop):
        return torch.ones(vocab_size, dtype=torch.bool)
    ends = {s[-1] for s in stop}
    known = min(vocab_size, len(tokenizer))
    texts = tokenizer.batch_decode([[token] for token in range(known)])
    flags = [not text or "\ufffd" in text or any(end in text for end in ends) for text in texts]
    return torch.tensor(flags + [True] * (vocab_size - known), dtype=torch.bool)


class FinishCheck:
    """Which of a step's sampled tokens end their sequence: the length limit (from the host's column counts), a stop
    token or a stop string. Stop tokens and stop-string candidates are flagged on the device, and one small read
    brings back only the flagged ones; stop strings are then checked on the host for the candidates alone
    (stop_string_candidates)."""

    STOP, STRING = 1, 2

    def __init__(self, params: SamplingParams, stop_ids: set[int], outputs: Outputs, tokenizer, candidates):
        device = outputs.tokens.device
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device) if stop_ids else None
        self.max_new_tokens = params.max_new_tokens
        self.stop = params.stop
        self.window = max(map(len, params.stop), default=0) + 1  # a stop string spans at most len(s) tokens
        self.outputs, self.tokenizer, self.candidates = outputs, tokenizer, candidates

    def __call__(self, tokens: torch.Tensor, seq_ids: torch.Tensor, columns: torch.Tensor,
                 host_columns: np.ndarray) -> dict[int, str]:
        """tokens, and where each went (output row, column) [R] on the device, the columns also on the host ->
        {index: "stop" or "length"} of those that end. The length limit is checked on the host; without stop
        tokens or strings nothing is read from the device."""
        reasons = dict.fromkeys(np.flatnonzero(host_columns >= self.max_new_tokens - 1).tolist(), "length")
        if self.stop_ids is None and self.candidates is None:
            return reasons
        flags = torch.zeros_like(tokens, dtype=torch.uint8)
        if self.stop_ids is not None:
            flags += torch.isin(tokens, self.stop_ids).to(torch.uint8) * self.STOP
        if self.candidates is not None:
            flags += self.candidates[tokens].to(torch.uint8) * self.STRING
        hits = flags.nonzero()[:, 0]  # the step's one host read
        if not hits.numel():
            return reasons
        index, kinds = hits.tolist(), flags[hits].tolist()
        strings = [i for i, kind in zip(index, kinds, strict=True) if kind == self.STRING]
        completes = self._completes_string(strings, seq_ids, columns)
        for i, kind in zip(index, kinds, strict=True):
            if kind & self.STOP or i in completes:
                reasons[i] = "stop"
        return reasons

    def _completes_string(self, index: list[int], seq_ids: torch.Tensor, columns: torch.Tensor) -> set[int]:
        if not index:
            return set()
        done = set()
        at = torch.tensor(index, device=seq_ids.device)
        for i, seq_id, column in zip(index, seq_ids[at].tolist(), columns[at].tolist(), strict=True):
            start = max(int(self.outputs.turn_starts[seq_id]), column + 1 - self.window)  # within the current turn
            tail = self.outputs.tokens[seq_id, start : column + 1].tolist()
            if any(s in self.tokenizer.decode(tail) for s in self.stop):
                done.add(i)
        return done
