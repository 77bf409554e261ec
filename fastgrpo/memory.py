"""Peak memory probes: the CUDA allocator's peak on a GPU, the resident set's peak on a CPU (Linux `/proc`); and
`LiveBytes`, bytes of live tensor storages counted at the dispatcher (on real, fake or meta tensors).

Shared by the trainer's step metrics, the memory plan (it counts recurrent layers by running one on meta tensors)
and the benchmark harness (fastgrpo/bench/memory_trace.py).
"""

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_memory(device: torch.device) -> int:
    """Start a new peak window; returns the memory in use now (bytes): CUDA allocated, or resident set (Linux)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset the peak RSS to the current RSS
    return _status_kib("VmRSS") * 1024


def peak_memory(device: torch.device) -> int:
    """Peak bytes in use since the last reset_peak_memory."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return _status_kib("VmHWM") * 1024


class PeakMemory:
    """Peak memory above the level at entry: CUDA allocator peak on a GPU, resident set peak on a CPU (Linux).

    On a CPU the allocator keeps freed pages resident, so measure one method per process for clean figures.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes = 0

    @contextmanager
    def measure(self):
        base = reset_peak_memory(self.device)
        yield self
        self.peak_bytes = peak_memory(self.device) - base


class LiveBytes(TorchDispatchMode):
    """Bytes of live tensor storages, counted at the dispatcher while the mode is active.

    Each storage counts once, by its nbytes, from the op that made it until it is freed (a weakref finalizer on the
    storage); views and in-place results share a counted storage and add nothing. `base` tensors (a model's
    parameters and buffers) exist before the mode starts and are counted from the start (`add` counts more later).

        with LiveBytes(model.parameters()) as live:
            with live.phase("forward"):
                loss = model(x).sum()
            with live.phase("backward"):
                loss.backward()
        live.base, live.current, live.peak, live.peaks["backward"]

    `peak` is the most bytes live at once since the start; `peaks[name]` the most during `phase(name)` (everything
    live counts, the base included; phases may nest, and a phase entered again keeps its maximum). Tensors made
    inside `uncounted()` are not counted, nor views of them (host copies of an offload, say). What is not seen: the
    temporaries inside one kernel, memory outside tensors, and tensors made before the mode that are not in `base`.
    """

    def __init__(self, base: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.current = 0
        self.peak = 0
        self.peaks: dict[str, int] = {}
        self._live: dict[int, list[int]] = {}  # storage key -> [nbytes] (the list is the record its finalizer frees)
        self._ignored: set[int] = set()  # storages made inside uncounted()
        self._phases: list[str] = []
        self._uncounted = 0
        self.add(*base)
        self.base = self.current

    def add(self, *tensors: torch.Tensor) -> int:
        """Counts `tensors` (made outside the mode) not counted yet; returns the bytes added."""
        before = self.current
        for t in tensors:
            self._track(t)
        return self.current - before

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator["LiveBytes"]:
        self.peaks[name] = max(self.peaks.get(name, 0), self.current)
        self._phases.append(name)
        try:
            yield self
        finally:
            self._phases.remove(name)

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        self._uncounted += 1
        try:
            yield
        finally:
            self._uncounted -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, or a wrapper subclass without one storage
            return
        key, size = storage._cdata, storage.nbytes()
        if key in self._ignored:
            return
        if self._uncounted:
            self._ignored.add(key)
            weakref.finalize(storage, self._ignored.discard, key)
            return
        record = self._live.get(key)
        if record is None:
            record = self._live[key] = [size]
            weakref.finalize(storage, self._free, key, record)
            self.current += size
        elif record[0] != size:  # resized in place (an out= argument)
            self.current += size - record[0]
            record[0] = size
        else:
            return
        if self.current > self.peak:
            self.peak = self.current
        for name in self._phases:
            if self.current > self.peaks[name]:
                self.peaks[name] = self.current

    def _free(self, key: int, record: list[int]) -> None:
        if self._live.get(key) is record:
            del self._live[key]
            self.current -= record[0]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages of `tensors`."""
    sizes = {}
    for t in tensors:
        storage = t.untyped_storage()
        sizes[storage._cdata] = storage.nbytes()
    return sum(sizes.values())
