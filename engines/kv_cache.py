"""A batch KV cache the engine can reshape between decode steps.

Consumes the key/value states a transformers attention layer hands to ``cache.update``;
holds them in preallocated ``[batch, kv_heads, capacity, head_dim]`` buffers (so a
decode step writes one column in place instead of ``torch.cat``-ing the whole cache,
as ``transformers.DynamicLayer`` does), and lets the engine drop finished rows, trim
all-padding columns on the left, and merge a freshly prefilled batch into a running
one (left-padding the shorter one). Rows are left-padded: column ``j`` of every row is
the same cache slot; which slots are real is the engine's 2-D attention mask.

Attention sees the cache in buckets of ``bucket`` columns (the filled part rounded up;
the tail is zeros and masked out), so tensor shapes change once every ``bucket`` decode
steps instead of every step: shape-keyed kernel plans (cuDNN attention re-plans on
every new shape, ~1.5 ms of CPU per layer call on an H200) are reused.

It is a ``transformers.DynamicCache`` (so models accept it as ``cache=`` /
``past_key_values=``) whose layers are :class:`SlotLayer`. Full-attention layers only:
sliding-window / linear-attention layers keep different shapes per layer.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

DEFAULT_BUCKET = 64


def round_up(n: int, bucket: int) -> int:
    return -(-n // bucket) * bucket


class SlotLayer(DynamicLayer):
    """One layer's keys and values in a growable buffer; ``keys`` views the filled part, bucketed."""

    def __init__(self, bucket: int = DEFAULT_BUCKET, reserve: int = 0) -> None:
        super().__init__()
        self.k_buf: torch.Tensor | None = None
        self.v_buf: torch.Tensor | None = None
        self.length = 0  # filled columns
        self.bucket = bucket
        self.reserve = reserve  # capacity to allocate at the first update

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n_new = key_states.shape[-2]
        end = self.length + n_new
        if self.k_buf is None or round_up(end, self.bucket) > self.k_buf.shape[2]:
            # Past the first update only if the engine under-reserved; grow geometrically.
            cap = end if self.k_buf is None else max(end, self.k_buf.shape[2] * 3 // 2)
            self._reallocate(round_up(max(cap, self.reserve), self.bucket), key_states)
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
        view = round_up(self.length, self.bucket)
        self.keys = self.k_buf[:, :, :view]
        self.values = self.v_buf[:, :, :view]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # What attention will see after this step's update (transformers pads a 2-D mask to it).
        return round_up(self.length + query_length, self.bucket), 0

    def set_buffers(self, k_buf: torch.Tensor, v_buf: torch.Tensor, length: int) -> None:
        self.k_buf, self.v_buf, self.length = k_buf, v_buf, length
        self.is_initialized = True
        self.device = k_buf.device
        self._refresh_views()


class SlotKVCache(DynamicCache):
    """A ``DynamicCache`` of :class:`SlotLayer` with row selection and batch merging."""

    def __init__(self, num_layers: int, reserve: int = 0, bucket: int = DEFAULT_BUCKET) -> None:
        self.bucket = bucket
        Cache.__init__(self, layers=[SlotLayer(bucket, reserve) for _ in range(num_layers)])

    @property
    def length(self) -> int:
        return self.layers[0].length

    def view_length(self, query_length: int) -> int:
        """Key/value length attention sees in the next forward of ``query_length`` tokens."""
        return round_up(self.length + query_length, self.bucket)

    def reindex(self, rows_b: torch.Tensor, drop_left: int, capacity: int) -> None:
        """Keep rows ``rows_b`` and columns ``[drop_left:]``, in buffers of ``capacity`` columns."""
        for layer in self.layers:
            new_len = layer.length - drop_left
            cap = round_up(max(capacity, new_len), self.bucket)
            k, v = layer.k_buf, layer.v_buf
            nk = k.new_zeros(len(rows_b), k.shape[1], cap, k.shape[3])
            nv = v.new_zeros(len(rows_b), v.shape[1], cap, v.shape[3])
            nk[:, :, :new_len].copy_(k[rows_b, :, drop_left : layer.length])
            nv[:, :, :new_len].copy_(v[rows_b, :, drop_left : layer.length])
            layer.set_buffers(nk, nv, new_len)

    @staticmethod
    def merge(a: "SlotKVCache", b: "SlotKVCache", capacity: int) -> "SlotKVCache":
        """Rows of ``a`` then rows of ``b``, right-aligned (the shorter one left-padded)."""
        out = SlotKVCache(len(a.layers), bucket=a.bucket)
        length = max(a.length, b.length)
        cap = round_up(max(capacity, length), a.bucket)
        for la, lb, lo in zip(a.layers, b.layers, out.layers):
            ba, bb = la.k_buf.shape[0], lb.k_buf.shape[0]
            shape = (ba + bb, la.k_buf.shape[1], cap, la.k_buf.shape[3])
            nk, nv = la.k_buf.new_zeros(shape), la.v_buf.new_zeros(shape)
            nk[:ba, :, length - la.length : length].copy_(la.k_buf[:, :, : la.length])
            nv[:ba, :, length - la.length : length].copy_(la.v_buf[:, :, : la.length])
            nk[ba:, :, length - lb.length : length].copy_(lb.k_buf[:, :, : lb.length])
            nv[ba:, :, length - lb.length : length].copy_(lb.v_buf[:, :, : lb.length])
            lo.set_buffers(nk, nv, length)
        return out
