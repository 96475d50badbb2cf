"""Continuous batching for the paged engine: which requests join, where their tokens go.

Consumes the engine's queue of pending requests and the block manager; emits prefill
units (a prompt to prefill once plus the samples sharing it) and, every decode step,
the host arrays of the running rows (position, block table, where the fed token is in
the last step's outputs, sampling parameters). Keyed by row: ``running[i]`` is row i of
the next decode step.

Admission (FIFO, never skipping the head): a request joins when a row is free
(``max_batch_size``), its worst case fits in the unreserved free blocks (see
:mod:`tapioca.engines.block_manager`: reserve at admission, no preemption), and the
prefill tokens computed this step stay within ``max_prefill_tokens`` (one unit always
goes, however long). Requests with the same ``prompt_ids`` admitted together form one
unit: the prompt is prefilled once, the samples share its full blocks and get a copy
of its partial last block, and all sample their first token from the same logits
(a GRPO group). A prompt that starts with full blocks already in the prefix cache
prefills only the rest (at least one token: the last position's logits are needed).
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .base import GenRequest, GenResult
from .block_manager import BlockManager, blocks_for, images_root


@dataclass
class Pending:
    request: GenRequest
    future: concurrent.futures.Future
    t_submit: float
    t_admit: float = 0.0


class Sequence:
    """One request being generated: its tokens, blocks and outputs (host side)."""

    __slots__ = ("pending", "tokens", "prompt_len", "max_new", "logprobs", "version_runs", "blocks",
                 "reserve_left", "hashed", "last_key", "stops", "stop_strings", "done", "epoch",
                 "rope_delta", "seed")

    def __init__(self, pending: Pending, eos: tuple[int, ...]) -> None:
        sp = pending.request.sampling
        self.pending = pending
        self.tokens = list(pending.request.prompt_ids)  # prompt + sampled; the last has no KV yet
        self.prompt_len = len(self.tokens)
        self.max_new = sp.max_new_tokens
        self.logprobs: list[float] = []
        self.version_runs: list[tuple[int, int]] = []  # (first output index, version)
        self.blocks: list[int] = []
        self.reserve_left = 0
        self.hashed = 0  # leading full blocks entered in (or taken from) the prefix cache
        images = pending.request.images
        self.last_key = images_root(images.sha256 if images else ())  # chain key of block ``hashed - 1``
        self.rope_delta = 0  # a VL prompt's decode position offset (models/vision.py)
        self.stops = tuple(sp.stop_token_ids) + eos
        self.stop_strings = sp.stop_strings
        self.done = False  # its result is delivered (a later in-flight token is dropped)
        self.epoch = -1  # the block manager's epoch at admission (weights it was prefilled with)
        # The request's sampling seed: every draw is keyed by (seed, position sampled).
        self.seed = int(sp.seed or 0)

    @property
    def num_out(self) -> int:
        return len(self.tokens) - self.prompt_len

    def result(self, reason: str, now: float) -> GenResult:
        p = self.pending
        n = self.num_out
        versions: list[int] = []
        for i, (start, ver) in enumerate(self.version_runs):
            end = self.version_runs[i + 1][0] if i + 1 < len(self.version_runs) else n
            versions += [ver] * (end - start)
        return GenResult(
            request_id=p.request.request_id, prompt_ids=list(p.request.prompt_ids),
            output_ids=self.tokens[self.prompt_len:], output_logprobs=list(self.logprobs),
            output_versions=versions, finish_reason=reason,  # type: ignore[arg-type]
            timings={"queued_s": p.t_admit - p.t_submit, "generate_s": now - p.t_admit},
            seed=p.request.sampling.seed)


@dataclass
class PrefillUnit:
    """A prompt prefilled once: ``leader`` computes tokens ``[start:]``; ``followers``
    (the same prompt) share its full blocks and copy its partial last block."""

    leader: Sequence
    start: int
    followers: list[Sequence] = field(default_factory=list)

    @property
    def rows(self) -> list[Sequence]:
        return [self.leader] + self.followers


class Scheduler:
    """Admission, block allocation and the prefix-cache chain of every running sequence."""

    def __init__(self, bm: BlockManager, *, max_rows: int, max_prefill_tokens: int,
                 eos: tuple[int, ...]) -> None:
        self.bm = bm
        self.max_rows = max_rows
        self.max_prefill_tokens = max_prefill_tokens
        self.eos = eos
        self.running: list[Sequence] = []
        self.prefill_tokens_computed = 0
        self.prefill_tokens_requested = 0

    def total_blocks(self, prompt_len: int, max_new: int) -> int:
        """Blocks a sequence holds at most: every token but the last sampled one has KV."""
        return blocks_for(prompt_len + max_new - 1, self.bm.block_size)

    # ------------------------------------------------------------------ admission

    def admit(self, queue: deque[Pending], now: float) -> list[PrefillUnit]:
        """Pop what fits from the head of ``queue``; allocate and reserve its blocks."""
        bm, bs = self.bm, self.bm.block_size
        units: list[PrefillUnit] = []
        # A group shares a unit: the same tokens and the same images.
        by_prompt: dict[tuple, PrefillUnit] = {}
        rows = len(self.running)
        tokens = 0
        while queue and rows < self.max_rows:
            pending = queue[0]
            prompt = tuple(pending.request.prompt_ids)
            images = pending.request.images
            unit_key = (prompt, tuple(images.sha256) if images else ())
            p_len = len(prompt)
            total = self.total_blocks(p_len, pending.request.sampling.max_new_tokens)
            prompt_blocks = blocks_for(p_len, bs)
            unit = by_prompt.get(unit_key)
            if unit is not None:  # a sample of a prompt admitted this step
                shared = p_len // bs
                if bm.available() < total - shared:
                    break
                seq = Sequence(pending, self.eos)
                for block in unit.leader.blocks[:shared]:
                    bm.share(block)
                seq.blocks = unit.leader.blocks[:shared] + ([bm.take()] if p_len % bs else [])
                unit.followers.append(seq)
            else:
                hits, _ = bm.match(prompt, (p_len - 1) // bs, root=images_root(images.sha256 if images else ()))
                new_tokens = p_len - len(hits) * bs
                if units and tokens + new_tokens > self.max_prefill_tokens:
                    break
                if bm.available() < bm.copy_cost(hits) + total - len(hits):
                    break
                seq = Sequence(pending, self.eos)
                for block in hits:
                    bm.share(block)
                bm.hit_blocks += len(hits)
                seq.blocks = hits + [bm.take() for _ in range(prompt_blocks - len(hits))]
                unit = PrefillUnit(seq, len(hits) * bs)
                units.append(unit)
                by_prompt[unit_key] = unit
                tokens += new_tokens
                self.prefill_tokens_computed += new_tokens
            self.prefill_tokens_requested += p_len
            seq.epoch = bm.epoch
            seq.reserve_left = total - len(seq.blocks)
            bm.reserved += seq.reserve_left
            queue.popleft()
            pending.t_admit = now
            rows += 1
        return units

    # ------------------------------------------------------------------ prefix-cache chain

    def register_prompt(self, unit: PrefillUnit) -> None:
        """After the prefill: enter the leader's full prompt blocks into the prefix cache;
        the followers share the same chain."""
        leader = unit.leader
        self.register_full(leader, leader.prompt_len)
        for seq in unit.followers:  # the same full blocks, so the same chain
            seq.hashed, seq.last_key = leader.hashed, leader.last_key

    def register_full(self, seq: Sequence, kv_tokens: int) -> None:
        """Register ``seq``'s blocks that are full once ``kv_tokens`` tokens have KV,
        unless the weights changed since it was admitted (its KV is of older weights)."""
        if seq.epoch != self.bm.epoch:
            return
        bs = self.bm.block_size
        while (seq.hashed + 1) * bs <= kv_tokens:
            i = seq.hashed
            seq.last_key = self.bm.register(seq.blocks[i], seq.last_key, seq.tokens[i * bs : (i + 1) * bs])
            seq.hashed += 1

    def finish(self, seq: Sequence) -> None:
        self.bm.reserved -= seq.reserve_left
        seq.reserve_left = 0
        self.bm.release(seq.blocks)
        seq.blocks = []


class DecodeRows:
    """Numpy mirrors of the running rows (aligned with ``Scheduler.running``), so a decode
    step's inputs are a few vectorised operations rather than a Python loop per row.
    Advanced when a step is launched: the host knows every row's position before it knows
    the sampled tokens."""

    def __init__(self, max_rows: int, block_size: int) -> None:
        self.block_size = block_size
        self.n = 0
        self.pos = np.zeros(max_rows, np.int64)  # position of the token fed next
        self.delta = np.zeros(max_rows, np.int64)  # its rotary position minus pos (VL prompts)
        self.src = np.zeros(max_rows, np.int64)  # where that token is in the last step's outputs
        self.nblk = np.zeros(max_rows, np.int64)
        self.n_out = np.zeros(max_rows, np.int64)  # tokens launched
        self.max_new = np.zeros(max_rows, np.int64)
        self.temp = np.zeros(max_rows, np.float32)
        self.top_p = np.ones(max_rows, np.float32)
        self.top_k = np.zeros(max_rows, np.int64)
        self.filtered = np.zeros(max_rows, bool)
        self.seed = np.zeros(max_rows, np.int64)  # the request's sampling seed
        self.bt = np.zeros((max_rows, 8), np.int32)

    def fit_width(self, width: int) -> None:
        if width > self.bt.shape[1]:
            new = np.zeros((self.bt.shape[0], max(width, 2 * self.bt.shape[1])), np.int32)
            new[:, : self.bt.shape[1]] = self.bt
            self.bt = new

    def append(self, seqs: list[Sequence], src: list[int]) -> None:
        """Add ``seqs``, just prefilled (their first token launched; ``src[i]``: where seq
        i's is in the step's outputs), as the next rows, one vectorised write per array."""
        if not seqs:
            return
        k = len(seqs)
        rows = slice(self.n, self.n + k)
        sps = [s.pending.request.sampling for s in seqs]
        self.pos[rows] = [s.prompt_len for s in seqs]  # their first sampled token is fed next
        self.delta[rows] = [s.rope_delta for s in seqs]
        self.src[rows] = src
        self.nblk[rows] = [len(s.blocks) for s in seqs]
        self.n_out[rows] = 1
        self.max_new[rows] = [s.max_new for s in seqs]
        self.temp[rows] = [sp.temperature for sp in sps]
        self.top_p[rows] = [sp.top_p for sp in sps]
        self.top_k[rows] = [sp.top_k for sp in sps]
        self.filtered[rows] = [sp.filtered for sp in sps]
        self.seed[rows] = [s.seed for s in seqs]
        width = max(len(s.blocks) for s in seqs)
        self.fit_width(max(blocks_for(s.prompt_len + s.max_new, self.block_size) for s in seqs))
        self.bt[rows, :width] = [s.blocks + [0] * (width - len(s.blocks)) for s in seqs]
        self.n += k

    def keep(self, idx: np.ndarray) -> None:
        """Keep rows ``idx`` (in that order) as rows ``0..len(idx)-1``."""
        k = len(idx)
        width = int(self.nblk[idx].max()) if k else 0
        for name in ("pos", "delta", "src", "nblk", "n_out", "max_new", "temp", "top_p", "top_k", "filtered",
                     "seed"):
            arr = getattr(self, name)
            arr[:k] = arr[idx]
        self.bt[:k, :width] = self.bt[idx, :width]  # columns past a row's blocks are never read
        self.n = k

    def width(self) -> int:
        """Blocks of the longest row after this step's allocations."""
        return int(self.nblk[: self.n].max()) if self.n else 0
