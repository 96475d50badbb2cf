"""Decode steps with static buffers, replayed as CUDA graphs per batch-size bucket.

Consumes the host arrays of one decode step (token fed, position, slot, context length,
block table, temperature, sampling seed and counter per row); emits the sampled tokens
and their fp32 logprobs (or the logits, for batches that need top-k / top-p). Keyed by
``(rows bucket, block-table width bucket, sampling in the graph)``.

Every input lives in a static device buffer of ``max_rows`` rows per block-table width;
a step stages its rows in pinned host memory and copies them in (padding rows up to the
bucket get slot -1 and context 0: they write nowhere and read nothing). The graph holds
the whole step: the decoder's forward and :func:`kernels.sample_tokens` keyed per row by
the static seed and counter buffers (the request's seed, the position of the token
sampled: no RNG state to advance), so a replay is one launch and nothing in it reads the
host. Graphs are captured lazily the first time a key is used (the first steps of a
run pay ~tens of ms per key); all share one memory pool. Weight updates copy into the
captured parameters in place, so no graph is ever re-captured.

Without CUDA (or with ``cuda_graphs`` off) the same buffers feed an eager forward.
"""

from __future__ import annotations

import numpy as np
import torch

from . import kernels
from .model_runner import DecodeInputs, PagedDecoder

# Block-table widths are powers of two from this many blocks: few captures per rows bucket.
MIN_WIDTH_BLOCKS = 4


def row_buckets(max_rows: int) -> list[int]:
    """Batch sizes a graph is captured for: fine steps where batches are small."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 129, 16)) + list(range(160, 257, 32))
    n = 320
    while n < max_rows:
        sizes.append(n)
        n += 64
    return sorted({s for s in sizes if s < max_rows} | {max_rows})


def width_bucket(blocks: int) -> int:
    w = MIN_WIDTH_BLOCKS
    while w < blocks:
        w *= 2
    return w


class _Staging:
    """Host arrays of one step's inputs (pinned on CUDA, so the copies are asynchronous)."""

    def __init__(self, max_rows: int, width: int, pin: bool) -> None:
        # ids, positions, slots, sampling seeds, sampling counters (the position sampled)
        self.i64 = torch.zeros((5, max_rows), dtype=torch.int64, pin_memory=pin)
        self.ctx = torch.zeros((max_rows,), dtype=torch.int32, pin_memory=pin)
        self.bt = torch.zeros((max_rows, width), dtype=torch.int32, pin_memory=pin)
        self.temp = torch.ones((max_rows,), dtype=torch.float32, pin_memory=pin)
        self.np = [t.numpy() for t in (self.i64, self.ctx, self.bt, self.temp)]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.i64, self.ctx, self.bt, self.temp


class DecodeBuffers:
    """Static decode inputs for one block-table ``width``, with host staging.

    On CUDA the staging is double-buffered: with overlapped steps the host stages step
    t+1 while step t's copies may still be queued, so consecutive steps never write the
    same pinned memory (a set is reused two steps later, after the host has waited for
    the step that read it). On CPU the staging arrays are the inputs themselves.
    """

    def __init__(self, max_rows: int, width: int, device: torch.device) -> None:
        self.width = width
        self.on_cuda = device.type == "cuda"
        self._staging = [_Staging(max_rows, width, self.on_cuda) for _ in range(2 if self.on_cuda else 1)]
        self._turn = 0
        if self.on_cuda:
            self.i64, self.ctx, self.bt, self.temp = (t.to(device) for t in self._staging[0].tensors())
        else:
            self.i64, self.ctx, self.bt, self.temp = self._staging[0].tensors()

    def load(self, n: int, rows: int, ids: np.ndarray, pos: np.ndarray, slots: np.ndarray,
             bt: np.ndarray, temp: np.ndarray, rope_pos: np.ndarray | None = None,
             seed: np.ndarray | int = 0) -> None:
        """Stage ``n`` real rows, pad to ``rows``, and copy the first ``rows`` rows in.
        ``rope_pos``: the rotary positions when they are not ``pos`` (VL prompts).
        ``seed``: each row's sampling seed; its counter is ``pos + 1``, the position of the
        token the step samples."""
        stage = self._staging[self._turn]
        self._turn = (self._turn + 1) % len(self._staging)
        i64, ctx, bt_h, temp_h = stage.np
        i64[0, :n], i64[1, :n], i64[2, :n] = ids, (pos if rope_pos is None else rope_pos), slots
        i64[3, :n], i64[4, :n] = seed, pos + 1
        ctx[:n] = pos + 1
        bt_h[:n] = bt
        temp_h[:n] = temp
        if rows > n:  # padding rows: no write (slot -1), no read (context 0)
            i64[:2, n:rows] = 0
            i64[2, n:rows] = -1
            i64[3:, n:rows] = 0
            ctx[n:rows] = 0
            bt_h[n:rows] = 0
            temp_h[n:rows] = 1.0
        if self.on_cuda:
            self.i64[:, :rows].copy_(stage.i64[:, :rows], non_blocking=True)
            self.ctx[:rows].copy_(stage.ctx[:rows], non_blocking=True)
            self.bt[:rows].copy_(stage.bt[:rows], non_blocking=True)
            self.temp[:rows].copy_(stage.temp[:rows], non_blocking=True)

    def pad_all(self) -> None:
        """Every row padding (the content a capture's warm-up runs on); synchronous."""
        for dev, fill in ((self.i64[:2], 0), (self.i64[2], -1), (self.i64[3:], 0), (self.ctx, 0), (self.bt, 0),
                          (self.temp, 1.0)):
            dev.fill_(fill)

    def sampling_keys(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seed_B, counter_B)`` of the first ``rows`` rows (device views)."""
        return self.i64[3, :rows], self.i64[4, :rows]

    def inputs(self, rows: int) -> DecodeInputs:
        return DecodeInputs(self.i64[0, :rows], self.i64[1, :rows], self.i64[2, :rows],
                            self.bt[:rows], self.ctx[:rows])


class DecodeGraphs:
    """The decode step, eager or as lazily captured CUDA graphs (see module docstring)."""

    def __init__(self, decoder: PagedDecoder, *, max_rows: int, device: torch.device,
                 use_graphs: bool) -> None:
        self.decoder = decoder
        self.max_rows = max_rows
        self.device = device
        self.use_graphs = use_graphs and device.type == "cuda"
        # Pad steps to rows / width buckets: always with graphs; a CPU test turns it on to
        # run the graphs' padding eagerly.
        self.bucketed = self.use_graphs
        self.buckets = row_buckets(max_rows)
        self._buffers: dict[int, DecodeBuffers] = {}
        self._graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def clear(self) -> None:
        """Forget every captured graph (they replay addresses that are gone, e.g. a KV
        cache reallocated after sleep mode without virtual memory): captured again on
        their next use."""
        self._graphs.clear()

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def buffers(self, width: int) -> DecodeBuffers:
        if width not in self._buffers:
            self._buffers[width] = DecodeBuffers(self.max_rows, width, self.device)
        return self._buffers[width]

    def rows_for(self, n: int) -> int:
        """The rows a step of ``n`` runs with: its graph bucket, or exactly n eagerly."""
        if not self.bucketed:
            return n
        return next(b for b in self.buckets if b >= n)

    def width_for(self, blocks: int) -> int:
        """The block-table width of a step whose longest row holds ``blocks`` blocks."""
        return width_bucket(blocks) if self.bucketed else max(1, blocks)

    def keys(self) -> list[tuple[int, int, bool]]:
        """``(rows, width, sample)`` of every captured graph."""
        return list(self._graphs)

    def replay(self, key: tuple[int, int, bool]) -> tuple:
        """Replay a captured graph on whatever its buffers hold (benchmarks, profiling)."""
        graph, outputs = self._graphs[key]
        graph.replay()
        return outputs

    def eager_step(self, rows: int, width: int, sample: bool = True) -> tuple:
        """The same step without the graph, on the same buffers (benchmarks)."""
        return self._body(self.buffers(width), rows, sample, eager=True)

    def _body(self, buf: DecodeBuffers, rows: int, sample: bool, eager: bool = False):
        # Eagerly, a module call (forward hooks fire); in a capture, the forward itself.
        forward = self.decoder if eager else self.decoder.forward_decode
        logits_BV = forward(buf.inputs(rows))
        if not sample:
            return (logits_BV,)
        # Each row keyed by its request's seed and the position it samples: a replay draws
        # fresh noise because the counters moved, and a row's draw ignores the other rows.
        tok_B, logp_B = kernels.sample_tokens(logits_BV, buf.temp[:rows], *buf.sampling_keys(rows))
        return tok_B, logp_B

    def run(self, buf: DecodeBuffers, rows: int, sample: bool) -> tuple:
        """One step over the first ``rows`` rows of ``buf`` (already loaded):
        ``(tokens, logprobs)`` when ``sample``, else ``(logits,)``; rows past the real ones
        are padding."""
        if not self.use_graphs:
            return self._body(buf, rows, sample, eager=True)
        key = (rows, buf.width, sample)
        if key not in self._graphs:
            self._graphs[key] = self._capture(buf, rows, sample)
        graph, outputs = self._graphs[key]
        graph.replay()
        return outputs

    def _capture(self, buf: DecodeBuffers, rows: int, sample: bool):
        # The inputs of the step being run are staged already; the warm-up runs on all-padding
        # rows instead (no cache writes, no reads), then the real rows are staged back.
        saved = [t.clone() for t in (buf.i64, buf.ctx, buf.bt, buf.temp)]  # after the staged copies
        buf.pad_all()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # first run outside capture: lazy inits, Triton autotune
            self._body(buf, rows, sample)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = self._body(buf, rows, sample)
        for dst, src in zip((buf.i64, buf.ctx, buf.bt, buf.temp), saved):
            dst.copy_(src)
        return graph, outputs
