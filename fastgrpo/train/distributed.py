"""Several processes on torch.distributed: one per GPU (NCCL), or per CPU process (gloo), started by torchrun.

    torchrun --nproc-per-node K -m fastgrpo train ...

Every rank holds the same prompts, data order, schedule and seeds. A round's prompt groups are dealt to ranks in
contiguous slices; each rank samples its slice with its own engine (random stream per prompt group, not per process)
and scores it; the rollout is then gathered, so every rank computes the same advantages, normalisers and micro-batch
plan as one process would. Each global micro-batch of K * per_device_train_batch_size samples is cut into K equal
shares, one per rank; the gradients, summed over ranks, are those of one process training on the whole micro-batch.

Parallelism:
    fsdp    FSDP2 (`fully_shard`) per decoder layer plus the root: parameters, gradients and AdamW states sharded;
            gradients reduce-scattered in fp32. The fused loss runs inside the root's forward (`PolicyLoss`), where
            the lm_head (tied or not) is whole, so its gradient is reduce-scattered like any other.
    ddp     DistributedDataParallel: every rank holds the whole model; gradients all-reduced.

A rank that fails where ranks work apart (loading, sampling, rewards) reports its error to all at the next exchange
(`together`), and every rank raises it. A rank that fails inside a collective leaves the others blocked until torchrun
stops them (it ends all workers when one exits with an error) or the collective's timeout (ddp_timeout) runs out.
"""

import datetime
import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

PARALLELISMS = ("fsdp", "ddp")


class RankFailed(RuntimeError):
    """Another rank failed (the message is its error; `kind` its class name), or stopped answering."""

    def __init__(self, message: str, kind: str | None = None):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    timeout: float = 0.0  # seconds a collective waits (ddp_timeout)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, n: int) -> range:
        """This rank's contiguous slice of n items (the first n % size ranks take one more)."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order (picklable objects; one collective)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        with self._collective():
            dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        with self._collective():
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def any_rank(self, flag: torch.Tensor) -> torch.Tensor:
        """Whether the bool tensor `flag` (on this process's device) is true on any process: one all-reduce."""
        if self.size == 1:
            return flag
        value = flag.to(torch.int32)
        with self._collective():
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value.bool()

    def barrier(self) -> None:
        if self.size > 1:
            with self._collective():
                dist.barrier()

    @contextmanager
    def _collective(self):
        """A collective that fails because another process hung or died says so in one line."""
        try:
            yield
        except (RuntimeError, dist.DistError) as error:
            if "timed out" in str(error).lower() or "timeout" in str(error).lower():
                raise RankFailed(f"rank {self.rank}: no answer from every process within ddp_timeout="
                                 f"{self.timeout:g} s (another process hung or died)") from error
            raise RankFailed(f"rank {self.rank}: lost another process ({' '.join(str(error).split())[:300]})"
                             ) from error

    @contextmanager
    def together(self, what: str):
        """Runs the block on every rank, then exchanges whether it failed: a rank that raised re-raises its own
        error; every other rank raises RankFailed with the first failing rank's error. So no rank goes on into a
        collective that a failed rank will never join. RankFailed.kind is the failed rank's error class name."""
        try:
            yield
        except Exception as error:
            self._exchange((type(error).__name__, str(error)))
            raise
        failed = self._exchange(None)
        if failed:
            rank, (kind, message) = failed[0]
            raise RankFailed(f"rank {rank} failed in {what}: {kind}: {message}", kind)

    def _exchange(self, error: tuple[str, str] | None) -> list[tuple[int, tuple[str, str]]]:
        return [(r, m) for r, m in enumerate(self.gather(error)) if m is not None]


def current(timeout_seconds: float, join_alone: bool = False) -> World:
    """This process's place: one process unless torchrun (or a launcher setting WORLD_SIZE, RANK, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT) started several; with `join_alone`, a single process that torchrun started forms a
    group of one too (to run FSDP2 or DDP on one GPU). The process group is created once per process, NCCL with one
    GPU per rank or gloo on CPU; every collective gives up after `timeout_seconds`."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    launched = "MASTER_ADDR" in os.environ and "RANK" in os.environ
    if size == 1 and not dist.is_initialized() and not (join_alone and launched):
        return World()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_seconds))
    return World(dist.get_rank(), dist.get_world_size(), local_rank, timeout_seconds)


def device(world: World) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", world.local_rank if world.size > 1 else torch.cuda.current_device())
    return torch.device("cpu")


def leave(finished: bool) -> None:
    """Ends this process's part in the process group (if it has one): the wrappers that hold it, a barrier, the group.

    A gloo worker thread drops each finished collective's tensors, holding the group's work lock; a tensor Python
    also held (broadcast_object_list's) needs the GIL to go. The group's destructor takes that lock, then joins the
    workers, with the GIL held: run while a worker waits for the GIL, it never returns. That hung 2 of 5 DDP runs on
    2 CPU processes: DDP's Reducer, freed as `fastgrpo train` returned, held the last reference to the group and freed
    it milliseconds after the checkpoint's last broadcast (the gdb stacks: ~ProcessGroupGloo in ~Reducer; the worker
    in ~AsyncBroadcastWork, in take_gil). So the wrappers (DDP's Reducer, FSDP2's states) go first, while the group
    lives; after a finished run every rank then waits at a barrier, which releases the GIL until every rank is past
    its last collective (the workers' drops take it then); only then is the group destroyed, by its last reference,
    its workers done. After an error there is no barrier: another rank may never reach it. Call it once nothing
    refers to the Trainer any more: the collection here frees its wrappers, reference cycles included."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()  # wrappers in reference cycles too
    if finished:
        dist.barrier()
    dist.destroy_process_group()


# -- sharding --


def block_classes(model: nn.Module) -> set[str]:
    """The class names of the model's repeated blocks (transformers' `_no_split_modules`: decoder layers)."""
    from fastgrpo.models import find_hf_model

    names = set(getattr(find_hf_model(model), "_no_split_modules", None) or ())
    if not names:
        raise ValueError(f"parallelism=fsdp: {type(find_hf_model(model)).__name__} does not name its decoder layers "
                         "(_no_split_modules), so fastgrpo cannot shard it per layer; use --parallelism ddp")
    return names


def fully_shard(root: nn.Module, model: nn.Module, reduce_dtype: torch.dtype | None) -> nn.Module:
    """FSDP2 on every decoder layer of `model`, then on `root` (the module whose forward runs the whole step, and
    that holds the embeddings, final norm and lm_head). Parameters stay in their dtype (bf16 on GPU); gradients are
    reduce-scattered in `reduce_dtype`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, register_fsdp_forward_method
    from torch.distributed.fsdp import fully_shard as shard

    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    names = block_classes(model)
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"parallelism=fsdp: no module of {type(model).__name__} is one of its decoder layers {names}")
    for block in blocks:
        shard(block, mp_policy=policy)
    shard(root, mp_policy=policy)
    if hasattr(root, "logprobs"):  # PolicyLoss's no-grad pass all-gathers the root's weights as its forward does
        register_fsdp_forward_method(root, "logprobs")
    return root


def fsdp_modules(root: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in root.modules() if isinstance(m, FSDPModule)]


@contextmanager
def unsharded(root: nn.Module):
    """Every parameter under the FSDP2 `root` whole on every rank for the block (sampling: each rank runs its own
    number of forwards, so none may all-gather), resharded after. Costs one full copy of the weights per rank (in
    their dtype) while it lasts; gradients and optimizer states stay sharded. A no-op for a module FSDP does not
    manage."""
    modules = fsdp_modules(root)
    if not modules:
        yield
        return
    # FSDP picks its root on the first forward; the sampler's forwards start below the root, so settle it here.
    # (torch 2.13 has no public call for this.)
    modules[0]._get_fsdp_state()._lazy_init()
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
            module.set_reshard_after_forward(module is not modules[0], recurse=False)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
