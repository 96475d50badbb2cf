"""The paged KV cache: its tensor, its size, and the bookkeeping of its blocks.

Consumes the engine's block requests (take, share, release, register) on the engine
thread only; emits block ids. Keys the prefix cache by chain hashes of full blocks.

Layout: one tensor ``[layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim]``
whose ``[l, 0]`` / ``[l, 1]`` views are layer l's caches (docs/engine.md "KV cache"), so
one indexed copy moves a block in every layer at once (a group's partial prompt block).
Block 0 is never handed out: padding rows of a captured graph write there.

Blocks have reference counts. A block whose count drops to 0 goes to the free list in
release order and keeps its prefix-cache entry until it is taken again (oldest first),
so the free list is also the LRU of evictable cached blocks. Only full blocks are
registered, and a sequence only writes past its shared blocks, so a shared block is
never written.

Weight updates: KV computed under one policy version is wrong for the next, so a weight
load drops every cache entry (:meth:`BlockManager.drop_prefix_cache`) and advances
``epoch``; a sequence admitted in an earlier epoch holds KV of the old weights (and of
both, if it continues across the update), so it never registers its blocks again
(:meth:`~tapioca.engines.scheduler.Scheduler.register_full` compares epochs).

Reservations: the engine admits a sequence only when its worst case (prompt +
``max_new_tokens``) fits in the free blocks not already reserved by running sequences,
and reserves the difference; decode steps then take reserved blocks and never run out.
No preemption: a preempted sequence would be recomputed under newer weights, which
breaks the per-token version semantics (nothing is recomputed,
docs/design.md#3-policy-versions-and-the-staleness-window).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from ..schemas.errors import EngineError

NULL_BLOCK = 0
# The chain hash of "no previous block".
ROOT_KEY = 0


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * kv_heads * head_dim * itemsize


def plan_num_blocks(device: torch.device, *, block_bytes: int, block_size: int, cache_tokens: int,
                    memory_fraction: float, cpu_default_tokens: int, need_tokens: int = 0) -> int:
    """How many blocks to allocate (block 0 included).

    ``cache_tokens > 0`` fixes the size. Otherwise on CUDA ``need_tokens`` (what the
    rollout needs, config/schema.py kv_tokens_needed; 0: no bound), capped by
    ``memory_fraction`` of the device's total memory and by what is free now (less a
    10% margin for activations and graphs); on CPU ``cpu_default_tokens``.
    """
    if cache_tokens > 0:
        return blocks_for(cache_tokens, block_size) + 1
    if device.type != "cuda":
        return blocks_for(cpu_default_tokens, block_size) + 1
    free, total = torch.cuda.mem_get_info(device)
    budget = min(int(total * memory_fraction), int(free * 0.9))
    if need_tokens > 0:  # a colocated trainer gets the rest (issue 37: 20 GB where 2 did)
        budget = min(budget, (blocks_for(need_tokens, block_size) + 1) * block_bytes)
    n = budget // block_bytes
    if n < 2:
        raise EngineError(
            f"no room for a KV cache on {device}: {free / 2**30:.1f} GiB free of {total / 2**30:.1f}; "
            "raise rollout.kv_cache_memory_fraction or free GPU memory")
    return int(n)


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed, so keys past a row's context (masked, never read) are never NaN."""
    return torch.zeros(num_layers, 2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype,
                       device=device)


def images_root(sha256s: Sequence[str]) -> int:
    """The chain root of a prompt with images: its blocks are cached under keys of these
    images (image placeholders are the same token whatever the image, so the tokens alone
    would share KV computed from another image)."""
    return hash((ROOT_KEY, "images", tuple(sha256s))) if sha256s else ROOT_KEY


def chain_key(parent: int, tokens: Sequence[int]) -> int:
    """The prefix-cache key of a full block: its tokens and everything before them.

    Python's tuple hash of ints (64-bit, not salted per process). A lookup also compares
    the block's stored tokens and parent key, so a false hit needs two different prefixes
    whose 64-bit keys collide AND identical block tokens.
    """
    return hash((parent, tuple(tokens)))


class BlockManager:
    """Free list, reference counts, reservations and the prefix cache of ``num_blocks``
    blocks of ``block_size`` tokens (block 0 reserved). Engine thread only."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise EngineError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.prefix_caching = bool(prefix_caching)
        self.ref = [0] * self.num_blocks
        self.ref[NULL_BLOCK] = 1  # never free
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, self.num_blocks))
        self.reserved = 0
        self._key: list[int | None] = [None] * self.num_blocks
        self._entry: list[tuple[int, tuple[int, ...]] | None] = [None] * self.num_blocks
        self._table: dict[int, int] = {}
        self.hit_blocks = 0  # blocks served from the prefix cache (counter for reports)
        self.epoch = 0  # weight loads so far: a sequence of an older epoch never registers

    @property
    def usable(self) -> int:
        """Blocks one sequence could ever hold (all but the null block)."""
        return self.num_blocks - 1

    def available(self) -> int:
        """Free blocks not promised to a running sequence."""
        return len(self.free) - self.reserved

    def cached_blocks(self) -> int:
        return len(self._table)

    # ------------------------------------------------------------------ blocks

    def take(self) -> int:
        """A fresh block (ref 1): the least recently freed; its cache entry is dropped."""
        if not self.free:
            raise EngineError(
                "the KV cache ran out of blocks although admission reserves every sequence's "
                "worst case (an engine bug): the requests in flight fail with this error; retry "
                "them, and please report it with the engine's stats()")
        block, _ = self.free.popitem(last=False)
        key = self._key[block]
        if key is not None:
            if self._table.get(key) == block:
                del self._table[key]
            self._key[block] = None
            self._entry[block] = None
        self.ref[block] = 1
        return block

    def take_reserved(self) -> int:
        self.reserved -= 1
        return self.take()

    def share(self, block: int) -> None:
        """One more holder of ``block`` (a cache hit or a group sample); revives a free one."""
        if self.ref[block] == 0:
            del self.free[block]
        self.ref[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free[block] = None  # most recently used end

    def copy_cost(self, blocks: Sequence[int]) -> int:
        """Free blocks that sharing ``blocks`` would take off the free list."""
        return sum(1 for b in blocks if self.ref[b] == 0)

    # ------------------------------------------------------------------ prefix cache

    def match(self, tokens: Sequence[int], max_blocks: int, root: int = ROOT_KEY) -> tuple[list[int], int]:
        """``(blocks, key)``: the cached full blocks that start ``tokens`` (at most
        ``max_blocks``) and the chain key of the last one (``root`` if none; a prompt with
        images chains from :func:`images_root`)."""
        blocks: list[int] = []
        parent = root
        if not self.prefix_caching:
            return blocks, parent
        bs = self.block_size
        for i in range(max_blocks):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            key = chain_key(parent, chunk)
            block = self._table.get(key)
            if block is None or self._entry[block] != (parent, chunk):
                break
            blocks.append(block)
            parent = key
        return blocks, parent

    def register(self, block: int, parent: int, tokens: Sequence[int]) -> int:
        """Enter full ``block`` (holding ``tokens`` after the prefix keyed ``parent``) into
        the prefix cache; returns its key. A key already cached keeps its first block."""
        chunk = tuple(tokens)
        key = chain_key(parent, chunk)
        if self.prefix_caching and key not in self._table and self._key[block] is None:
            self._table[key] = block
            self._key[block] = key
            self._entry[block] = (parent, chunk)
        return key

    def drop_prefix_cache(self) -> None:
        """Forget every cache entry and start a new epoch (the weights changed). Blocks
        held by running sequences stay theirs; freed ones stay on the free list."""
        self._table.clear()
        self._key = [None] * self.num_blocks
        self._entry = [None] * self.num_blocks
        self.epoch += 1

    def reset(self) -> None:
        """Forget every sequence and cache entry (after a failed step); the epoch goes on,
        so a sequence of before the reset could never register."""
        epoch = self.epoch
        self.__init__(self.num_blocks, self.block_size, self.prefix_caching)
        self.epoch = epoch + 1
