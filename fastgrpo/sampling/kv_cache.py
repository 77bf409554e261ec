"""The KV cache tensors of one `generate` call: per attention layer its key and value pages, in its page pool.

Layers that keep pages of the same shape in the same pool share one tensor [layers, 2, pages + 1, block_size, Hkv,
D] (keys and values of different head dims, MLA's, get a tensor each). The page past each pool's last is scratch:
the padding rows of CUDA graphs write there, and window tables point out-of-window entries at it. A KV-shared layer
(Gemma 3n/4) gets its source layer's pages.
"""

from dataclasses import dataclass

import torch

from fastgrpo.sampling.layers import AttentionLayer, LayerModel


@dataclass(slots=True)
class _Stack:
    """Layers of one pool and shape: keys and values in one tensor (dim 1: K, V) or, of different dims, two."""

    pool: int
    slots: list[int]
    kv: torch.Tensor | None  # [layers, 2, pages + 1, block_size, Hkv, D]
    k: torch.Tensor | None  # [layers, pages + 1, block_size, Hkv, Dk] (when Dk != Dv)
    v: torch.Tensor | None  # [layers, pages + 1, block_size, Hkv, Dv]


class KVCache:
    def __init__(self, layer_model: LayerModel, pool_pages: list[int], block_size: int, dtype: torch.dtype,
                 device: torch.device):
        """`pool_pages[p]`: pages of pool p (pages.PagePool: 0 the logical pool, then one per window)."""
        self.layer_model = layer_model
        self.pool_pages = list(pool_pages)
        self.block_size = block_size
        self.stacks: list[_Stack] = []
        shapes: dict[tuple, list[int]] = {}
        for layer in layer_model.layers:
            if layer.owns_pages:
                key = (layer_model.pool_of(layer.slot), layer.kv_heads, layer.key_dim, layer.value_dim)
                shapes.setdefault(key, []).append(layer.slot)
        self._where: dict[int, tuple[_Stack, int]] = {}
        for (pool, heads, key_dim, value_dim), slots in shapes.items():
            size = (len(slots), pool_pages[pool] + 1, block_size, heads)
            if key_dim == value_dim:
                kv = torch.zeros(size[0], 2, *size[1:], key_dim, dtype=dtype, device=device)
                stack = _Stack(pool, slots, kv, None, None)
            else:
                k = torch.zeros(*size, key_dim, dtype=dtype, device=device)
                v = torch.zeros(*size, value_dim, dtype=dtype, device=device)
                stack = _Stack(pool, slots, None, k, v)
            self.stacks.append(stack)
            for i, slot in enumerate(slots):
                self._where[slot] = (stack, i)

    @classmethod
    def from_tensor(cls, kv_cache: torch.Tensor, layer_model: LayerModel | None = None) -> "KVCache":
        """A cache over an existing [layers, 2, pages + 1, block_size, Hkv, D] tensor: full attention in every layer
        (`layer_model`'s, which must be uniform; default: as the tensor's shape says)."""
        num_layers, _, pages, block_size, heads, dim = kv_cache.shape
        if layer_model is None:
            layers = tuple(AttentionLayer(i, heads, dim, dim, heads, None, False, False, i) for i in range(num_layers))
            layer_model = LayerModel(layers, {})
        if not layer_model.uniform or len(layer_model.layers) != num_layers:
            raise ValueError("one KV cache tensor holds full attention layers of one shape only")
        cache = cls.__new__(cls)
        cache.layer_model, cache.pool_pages, cache.block_size = layer_model, [pages - 1], block_size
        stack = _Stack(0, list(range(num_layers)), kv_cache, None, None)
        cache.stacks = [stack]
        cache._where = {i: (stack, i) for i in range(num_layers)}
        return cache

    @property
    def dtype(self) -> torch.dtype:
        stack = self.stacks[0]
        return (stack.kv if stack.kv is not None else stack.k).dtype

    @property
    def device(self) -> torch.device:
        stack = self.stacks[0]
        return (stack.kv if stack.kv is not None else stack.k).device

    def layer(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) [pages + 1, block_size, Hkv, D] of a layer (its source's, for a KV-shared layer)."""
        stack, i = self._where[self.layer_model.layers[slot].source]
        if stack.kv is not None:
            return stack.kv[i, 0], stack.kv[i, 1]
        return stack.k[i], stack.v[i]

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy page src into dst in every layer, (src, dst) per pool (pages.PagePool.copy_pairs)."""
        for stack in self.stacks:
            src, dst = pairs[stack.pool]
            if stack.kv is not None:
                stack.kv[:, :, dst] = stack.kv[:, :, src]
            else:
                stack.k[:, dst] = stack.k[:, src]
                stack.v[:, dst] = stack.v[:, src]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.stacks for t in (s.kv, s.k, s.v) if t is not None)
