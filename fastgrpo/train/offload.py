"""Offloaded checkpoint boundaries (`offload_activations`): each decoder layer's checkpointed input waits for its
recompute in host memory instead of on the device.

With gradient checkpointing a micro-batch keeps one [tokens, hidden] input per decoder layer until the backward
recomputes that layer: L * T * H * 2 bytes in bf16 (28 layers x 8192 tokens x 3584 x 2 B = 1.6 GiB for Qwen2.5-7B).
Here every layer but the last hands its input to `ActivationOffload.pack`, which copies it into pinned host memory on
a side stream (the copy overlaps the next layers' compute; the device tensor is freed when the copy is done) and keeps
only the host copy. In the backward, layers are recomputed last to first: unpacking layer k's input also starts the
host-to-device copy of layer k-1's, so the next recompute finds its input on the device (one prefetch in flight).
The last layer's input is kept on the device: its recompute is the first thing the backward does.

On a CPU the same code runs with plain copies (no streams, no pinned memory): the values, and so the gradients, are
those of plain checkpointing, which tests/test_memory_constrained.py checks.
"""

from contextlib import nullcontext

import torch
from torch.utils.checkpoint import checkpoint


class _Offloaded:
    """One layer input: its host copy, the event that marks the copy done, and its way back to the device."""

    __slots__ = ("host", "device", "stream", "done", "back", "previous", "used")

    def __init__(self, tensor: torch.Tensor, stream, previous: "_Offloaded | None"):
        self.device, self.stream, self.back, self.previous, self.used = tensor.device, stream, None, previous, False
        if stream is None:  # a CPU: a plain copy
            self.host, self.done = tensor.detach().clone(), None
            return
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is written
        with torch.cuda.stream(stream):
            self.host.copy_(tensor, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record(stream)
        tensor.record_stream(stream)  # the allocator reuses its memory only after the copy

    def fetch(self, prefetch: bool = False) -> None:
        """Starts the copy back to the device, unless it is under way (or, for a prefetch, already used)."""
        if self.back is not None or (prefetch and self.used):
            return
        if self.stream is None:
            self.back = self.host.clone()
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.done)
            self.back = self.host.to(self.device, non_blocking=True)

    def tensor(self) -> torch.Tensor:
        """The input on the device; the previous layer's input starts its way back meanwhile."""
        self.fetch()
        if self.previous is not None:
            self.previous.fetch(prefetch=True)
        back, self.back, self.previous, self.used = self.back, None, None, True
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            back.record_stream(torch.cuda.current_stream(self.device))
        return back


class ActivationOffload:
    """The checkpoint function of a model's decoder layers with offloaded inputs (`install`). `host_copies`: a context
    manager factory entered around each copy to the host (a measurement of device memory leaves them out with it)."""

    def __init__(self, device: torch.device, host_copies=nullcontext):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.host_copies = host_copies
        self.last = None  # the input packed last: the previous layer of the next one packed
        self.packed = 0  # inputs offloaded so far (tests count them)

    def install(self, model: torch.nn.Module) -> None:
        """Routes the checkpointed decoder layers of `model` (gradient checkpointing on) through this offload,
        all but the last."""
        layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)
                  and hasattr(m, "_gradient_checkpointing_func")]
        if not layers:
            raise ValueError(f"offload_activations: {type(model).__name__} has no checkpointed decoder layers")
        for layer in layers[:-1]:
            layer._gradient_checkpointing_func = self.checkpoint

    def checkpoint(self, function, *args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return checkpoint(function, *args, use_reentrant=False, **kwargs)

    def _pack(self, tensor: torch.Tensor):
        if not tensor.is_floating_point():  # a mask or an index
            return tensor
        chained = self.last if self.last is not None and not self.last.used else None
        with self.host_copies():
            self.last = _Offloaded(tensor, self.stream, chained)
        self.packed += 1
        return self.last

    @staticmethod
    def _unpack(packed):
        return packed.tensor() if isinstance(packed, _Offloaded) else packed
