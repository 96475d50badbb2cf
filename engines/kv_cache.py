"""A batch KV cache the engine can reshape between decode steps.

Consumes the key/value states a transformers attention layer hands to ``cache.update``;
holds them in preallocated ``[batch, kv_heads, capacity, head_dim]`` buffers (so a
decode step writes one column in place instead of ``torch.cat``-ing the whole cache,
as ``transformers.DynamicLayer`` does), and lets the engine drop finished rows, trim
all-padding columns on the left, and merge a freshly prefilled batch into a running
one (left-padding the shorter one). Rows are left-padded: column ``j`` of every row is
the same cache slot; which slots are real is the engine's 2-D attention mask.

It is a ``transformers.DynamicCache`` (so models accept it as ``cache=`` /
``past_key_values=``) whose layers are :class:`SlotLayer`. Full-attention layers only:
sliding-window / linear-attention layers keep different shapes per layer.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


class SlotLayer(DynamicLayer):
    """One layer's keys and values in a growable buffer; ``keys`` is a view of the filled part."""

    def __init__(self) -> None:
        super().__init__()
        self.k_buf: torch.Tensor | None = None
        self.v_buf: torch.Tensor | None = None
        self.length = 0
        self.reserve = 0  # capacity to allocate at the first update

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n_new = key_states.shape[-2]
        end = self.length + n_new
        if self.k_buf is None or end > self.k_buf.shape[2]:
            # Only reached if the engine under-reserved; grow geometrically to stay amortised O(1).
            cap = end if self.k_buf is None else max(end, self.k_buf.shape[2] * 3 // 2)
            self._reallocate(max(cap, self.reserve), key_states)
        self.k_buf[:, :, self.length : end].copy_(key_states)
        self.v_buf[:, :, self.length : end].copy_(value_states)
        self.length = end
        self._refresh_views()
        return self.keys, self.values

    def _reallocate(self, capacity: int, like: torch.Tensor) -> None:
        b, h, _, d = like.shape
        k = like.new_zeros(b, h, capacity, d)
        v = like.new_zeros(b, h, capacity, d)
        if self.k_buf is not None and self.length:
            k[:, :, : self.length].copy_(self.k_buf[:, :, : self.length])
            v[:, :, : self.length].copy_(self.v_buf[:, :, : self.length])
        self.k_buf, self.v_buf = k, v

    def _refresh_views(self) -> None:
        self.keys = self.k_buf[:, :, : self.length]
        self.values = self.v_buf[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def set_buffers(self, k_buf: torch.Tensor, v_buf: torch.Tensor, length: int) -> None:
        self.k_buf, self.v_buf, self.length = k_buf, v_buf, length
        self.is_initialized = True
        self.device = k_buf.device
        self._refresh_views()


class SlotKVCache(DynamicCache):
    """A ``DynamicCache`` of :class:`SlotLayer` with row selection and batch merging."""

    def __init__(self, num_layers: int, reserve: int = 0) -> None:
        layers = [SlotLayer() for _ in range(num_layers)]
        for layer in layers:
            layer.reserve = reserve
        Cache.__init__(self, layers=layers)

    @property
    def length(self) -> int:
        return self.layers[0].length

    def reindex(self, rows_b: torch.Tensor, drop_left: int, capacity: int) -> None:
        """Keep rows ``rows_b`` and columns ``[drop_left:]``, in buffers of ``capacity`` columns."""
        for layer in self.layers:
            new_len = layer.length - drop_left
            cap = max(capacity, new_len)
            k, v = layer.k_buf, layer.v_buf
            nk = k.new_zeros(len(rows_b), k.shape[1], cap, k.shape[3])
            nv = v.new_zeros(len(rows_b), v.shape[1], cap, v.shape[3])
            nk[:, :, :new_len].copy_(k[rows_b, :, drop_left : layer.length])
            nv[:, :, :new_len].copy_(v[rows_b, :, drop_left : layer.length])
            layer.set_buffers(nk, nv, new_len)

    @staticmethod
    def merge(a: "SlotKVCache", b: "SlotKVCache", capacity: int) -> "SlotKVCache":
        """Rows of ``a`` then rows of ``b``, right-aligned (the shorter one left-padded)."""
        out = SlotKVCache(len(a.layers))
        length = max(a.length, b.length)
        cap = max(capacity, length)
        for la, lb, lo in zip(a.layers, b.layers, out.layers):
            ba, bb = la.k_buf.shape[0], lb.k_buf.shape[0]
            shape = (ba + bb, la.k_buf.shape[1], cap, la.k_buf.shape[3])
            nk, nv = la.k_buf.new_zeros(shape), la.v_buf.new_zeros(shape)
            nk[:ba, :, length - la.length : length].copy_(la.keys)
            nv[:ba, :, length - la.length : length].copy_(la.values)
            nk[ba:, :, length - lb.length : length].copy_(lb.keys)
            nv[ba:, :, length - lb.length : length].copy_(lb.values)
            lo.set_buffers(nk, nv, length)
        return out
