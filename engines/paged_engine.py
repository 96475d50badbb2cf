"""The paged engine: continuous batching over a paged KV cache, decode in CUDA graphs.

Consumes :class:`~tapioca.engines.base.GenRequest` (``submit`` / ``generate``) and weight
updates (HF state dicts or safetensors files, each with a policy version); emits one
:class:`~tapioca.engines.base.GenResult` per request, keyed by ``request_id``. The same
semantics as :class:`~tapioca.engines.torch_engine.TorchEngine` (the control protocol
is :mod:`tapioca.engines.engine_loop`), for Qwen2 / Qwen3 / Llama models
(:func:`~tapioca.engines.model_runner.unsupported_reason` says why another model is not;
use TorchEngine for it).

A step (engine thread):
    1. launch the decode of every running row -- host arrays from
       :class:`~tapioca.engines.scheduler.DecodeRows`, the fed tokens gathered on the
       device from the last step's samples, one CUDA-graph replay (forward + sampling +
       the RNG advance; :mod:`tapioca.engines.cuda_graphs`), or the eager forward on CPU;
    2. launch the prefill of the units admitted before the step
       (:mod:`tapioca.engines.scheduler`), packed with no padding into one forward; the
       samples of a group copy its partial last block and sample from its logits; then
       an asynchronous copy of the step's tokens and logprobs to the host;
    3. process the PREVIOUS step's results while the GPU runs this one (SGLang's
       overlap; ``overlap=False`` processes this step's instead): ONE host sync (its
       event), then the host appends tokens, checks stop tokens / strings / lengths,
       enters newly full blocks in the prefix cache, and retires finished rows (their
       blocks go back to the free list). A stop seen one step late drops the row's extra
       token; before the thread parks (pause, update, shutdown) the launched step is
       finished, so versions and step boundaries are those of the synchronous order.

Vision-language models (Qwen2.5-VL, Qwen3-VL): the prefill runs the vision tower on the
images of the units admitted (one tower forward for all of them), writes its embeddings
over the placeholder tokens, rotates by the 3-D positions (models/vision.py), and records
each sequence's rope delta; decode steps feed text positions plus that delta. A prompt's
images key its prefix-cache chain and its group (block_manager.images_root): the same
tokens with another image share nothing.

Routed experts (``record_routes``, MoE models): the decoder writes every computed
token's top-k expert ids per MoE layer into a route cache beside the KV cache, at the
token's slot (in the decode graph too); a finished sequence's routes are gathered from
its slots (prompt + output but the last sampled token, whose KV is never written) onto
its :class:`~tapioca.engines.base.GenResult`. The group's copied partial block carries
its routes too. That gather, for all rows finishing in a step, is the one host wait it
adds, on a side stream (:meth:`~tapioca.engines.model_runner.PagedDecoder.read_routes`).

Sampling: :func:`kernels.sample_tokens` (Gumbel-max over the full vocabulary) unless a
row of the batch needs top-k / top-p: then the whole batch takes
:func:`~tapioca.engines.sampling.sample_next` (torch, inverse CDF) on the logits. Either
way the logprob follows the convention of :mod:`tapioca.engines.base`, and every row's
noise is keyed by its own request's seed (``SamplingParams.seed``; drawn from the
engine's ``seed`` when a request has none, and reported on ``GenResult.seed``) and the
position of the token it samples: a counter-based hash computed on the device, so a
row's draw never depends on what it is batched with, and regenerating a logged
trajectory needs only its prompt, seed and weights (docs/provenance.md says exactly what
is reproducible: the logits themselves may still depend on the batch). With ``seed``
set, the same requests submitted the same way give the same outputs on the same device
(sampled values differ from TorchEngine's: another noise source).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np
import torch

from ..models.lora import LoraAdapter, adapter_pairs
from ..schemas.errors import EngineError
from . import kernels
from .base import Decode, GenRequest, GenResult
from .block_manager import (
    BlockManager,
    allocate_kv_cache,
    bytes_per_block,
    plan_num_blocks,
)
from .cuda_graphs import DecodeGraphs
from .engine_loop import Delivered, EngineLoop, engine_device, stop_string_in_tail
from .kv_memory import sleepable_buffer
from .model_runner import PagedDecoder, PrefillImages, PrefillInputs
from .sampling import RowParams, sample_next
from .scheduler import DecodeRows, PrefillUnit, Scheduler, Sequence

# CPU cache when no size is given: this many tokens, at most this many bytes.
_CPU_CACHE_TOKENS = 65536
_CPU_CACHE_BYTES = 1 << 30


@dataclass
class _Launched:
    """A step queued on the device whose results the host has not processed yet."""

    rows: list[Sequence]  # decode rows, then prefilled rows: the order of the outputs
    version: int
    host: torch.Tensor  # [2, rows] float64: tokens, logprobs (filled asynchronously on CUDA)
    event: torch.cuda.Event | None  # recorded after the copy (CUDA)


class PagedEngine(EngineLoop):
    """Batched, interruptible generation for Qwen2 / Qwen3 / Llama over a paged KV cache.

    ``model``: a transformers causal LM; its tensors are taken (moved to ``device``; not
    copied when already there), q/k/v and gate/up are fused into new tensors, and the
    model object itself is not kept. ``max_batch_size``: running rows.
    ``max_prefill_tokens``: prompt tokens computed by one prefill forward (one prompt
    always goes). KV cache: ``kv_block_size_tokens`` tokens per block; ``kv_cache_tokens``
    fixes its size, else ``kv_cache_memory_fraction`` of the GPU's memory (CUDA) or 64k
    tokens (CPU). ``cuda_graphs``: replay decode steps as CUDA graphs (CUDA only).
    ``prefix_caching``: reuse cached full blocks across requests. ``record_routes``: each
    result carries its routed experts (MoE models; see the module docstring).
    ``eos_token_id``, ``decode``, ``seed``, ``version``, ``interruptible``: as
    :class:`TorchEngine`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        device: str | torch.device = "cpu",
        max_batch_size: int = 64,
        interruptible: bool = True,
        seed: int | None = None,
        decode: Decode | None = None,
        eos_token_id: int | Seq[int] | None = None,
        pad_token_id: int = 0,
        version: int = 0,
        max_prefill_tokens: int = 16384,
        kv_block_size_tokens: int = 16,
        kv_cache_tokens: int = 0,
        kv_cache_memory_fraction: float = 0.25,
        kv_cache_need_tokens: int = 0,
        sleep_mode: bool = False,
        cuda_graphs: bool = True,
        prefix_caching: bool = True,
        overlap: bool = True,
        record_routes: bool = False,
    ) -> None:
        del pad_token_id  # no padding anywhere; accepted for TorchEngine's signature
        device = engine_device(device)
        if kv_block_size_tokens < 1 or max_prefill_tokens < 1:
            raise EngineError("kv_block_size_tokens and max_prefill_tokens must be >= 1")
        self.decoder = PagedDecoder(model, device)
        dec = self.decoder
        super().__init__(device=device, max_batch_size=max_batch_size, interruptible=interruptible,
                         decode=decode, eos_token_id=eos_token_id, version=version,
                         vocab_size=dec.vocab_size, max_positions=dec.max_positions, name="paged-engine")
        self._vision = dec.vision
        block_bytes = bytes_per_block(dec.num_layers, kv_block_size_tokens, dec.num_kv_heads,
                                      dec.head_dim, dec.dtype)
        num_blocks = plan_num_blocks(
            device, block_bytes=block_bytes, block_size=kv_block_size_tokens,
            cache_tokens=kv_cache_tokens, memory_fraction=kv_cache_memory_fraction,
            need_tokens=kv_cache_need_tokens,
            cpu_default_tokens=min(_CPU_CACHE_TOKENS, _CPU_CACHE_BYTES * kv_block_size_tokens // block_bytes))
        shape = (dec.num_layers, 2, num_blocks, kv_block_size_tokens, dec.num_kv_heads, dec.head_dim)
        # Sleep mode: memory the idle engine gives back (engines/kv_memory.py).
        self._kv_mem = sleepable_buffer(num_blocks * block_bytes, device) if sleep_mode else None
        if self._kv_mem is not None:
            # the buffer is rounded up to the allocation granularity: its first bytes
            self.kv_cache = self._kv_mem.tensor[: num_blocks * block_bytes].view(dec.dtype).view(shape)
        else:
            self.kv_cache = allocate_kv_cache(dec.num_layers, num_blocks, kv_block_size_tokens,
                                              dec.num_kv_heads, dec.head_dim, dec.dtype, device)
        dec.attach_kv_cache(self.kv_cache)
        self.sleeps = 0
        self.sleep_s = 0.0  # time spent giving memory back and taking it again
        if record_routes:  # before any graph is captured: the graphs write into it
            dec.attach_route_cache(num_blocks * kv_block_size_tokens)
        self.block_size = int(kv_block_size_tokens)
        self.bm = BlockManager(num_blocks, self.block_size, prefix_caching)
        self.scheduler = Scheduler(self.bm, max_rows=self.max_batch_size,
                                   max_prefill_tokens=int(max_prefill_tokens), eos=self._eos)
        self.rows = DecodeRows(self.max_batch_size, self.block_size)
        # The seeds of requests that come without one (SamplingParams.seed), in submission order.
        self._request_seeds = random.Random(seed)
        self.graphs = DecodeGraphs(dec, max_rows=self.max_batch_size, device=device,
                                   use_graphs=cuda_graphs)
        if device.type == "cuda":
            # MoE kernels tune their tiles at a shape's first call; a decode graph's first
            # call is its capture's warm-up, on padding rows that all route alike: tune on
            # spread-out routes first.
            dec.warm_moe_kernels(self.graphs.buckets)
        self.overlap = bool(overlap)
        self._inflight: _Launched | None = None
        self._last_tokens = torch.zeros(1, dtype=torch.int64, device=device)
        # Every admitted sequence (by its future) until its result is in ``_handover``: what
        # a failed step fails, wherever the sequence was (prefilling, running, in flight).
        self._unfinished: dict[concurrent.futures.Future, Sequence] = {}
        # Results ready to deliver, kept here so that a step failing after computing them
        # still delivers them (the engine loop delivers what a step or _fail_step returns).
        self._handover: Delivered = []
        self._stopped_since_compact = False
        self._decode_only_steps = 0
        self._decode_only_s = 0.0
        self._start()

    # ------------------------------------------------------------------ introspection

    def stats(self) -> dict[str, float]:
        """Counters for tests and benchmarks (engine thread's view; read when idle)."""
        s = self.scheduler
        return {"prefill_tokens_computed": s.prefill_tokens_computed,
                "prefill_tokens_requested": s.prefill_tokens_requested,
                "prefix_cache_hit_blocks": self.bm.hit_blocks, "cached_blocks": self.bm.cached_blocks(),
                "free_blocks": len(self.bm.free), "reserved_blocks": self.bm.reserved,
                "num_blocks": self.bm.num_blocks, "cuda_graphs": self.graphs.num_graphs,
                "decode_only_steps": self._decode_only_steps,
                "decode_only_step_ms": round(1000 * self._decode_only_s / max(1, self._decode_only_steps), 3)}

    def describe(self) -> dict[str, float]:
        """Sleep mode's numbers for the role's status (fleet.v1 / metrics.v1)."""
        if self._kv_mem is None:
            return {}
        return {"engine/sleeps": float(self.sleeps), "engine/sleep_s": round(self.sleep_s, 4),
                "engine/asleep": float(self._kv_mem.asleep),
                "engine/kv_cache_gib": round(self._kv_mem.nbytes / 2**30, 3)}

    # ------------------------------------------------------------------ EngineLoop hooks

    def _can_sleep(self) -> bool:
        return self._kv_mem is not None and not self._kv_mem.asleep

    def _sleep(self) -> None:
        # Nothing runs: the cached prefixes go with the memory (a weight update drops them
        # anyway), and every block is free again.
        t0 = time.perf_counter()
        self.bm.drop_prefix_cache()
        self._kv_mem.release()
        self.sleeps += 1
        self.sleep_s += time.perf_counter() - t0

    def _wake(self) -> None:
        if self._kv_mem is None or not self._kv_mem.asleep:
            return
        t0 = time.perf_counter()
        self._kv_mem.restore()
        if not self._kv_mem.keeps_address:
            self.graphs.clear()  # they replay the old address: captured again on demand
        self.sleep_s += time.perf_counter() - t0

    def _enqueue(self, requests: list[GenRequest]) -> list[concurrent.futures.Future]:
        # Every request draws from a seed of its own (reported on its result).
        seeded = [r if r.sampling.seed is not None else dataclasses.replace(
            r, sampling=dataclasses.replace(r.sampling, seed=self._request_seeds.getrandbits(63)))
            for r in requests]
        return super()._enqueue(seeded)

    def _validate_more(self, request: GenRequest) -> None:
        need = self.scheduler.total_blocks(len(request.prompt_ids), request.sampling.max_new_tokens)
        if need > self.bm.usable:
            raise EngineError(
                f"request {request.request_id!r}: prompt ({len(request.prompt_ids)}) + max_new_tokens "
                f"({request.sampling.max_new_tokens}) needs {need} KV-cache blocks of {self.block_size} "
                f"tokens, the cache has {self.bm.usable}; raise rollout.kv_cache_tokens (or "
                "kv_cache_memory_fraction on a GPU), or lower max_new_tokens")

    def _admit_locked(self, now: float) -> list[PrefillUnit]:
        if not self._admission_room_locked():  # the scheduler counts the free rows itself
            return []
        units = self.scheduler.admit(self._queue, now)
        self._unfinished.update((seq.pending.future, seq) for u in units for seq in u.rows)
        if not units and self._live == 0 and self._queue:
            # Nothing runs, so nothing will free room: waiting would stall for good. validate()
            # makes this unreachable; if it is reached, fail the request loudly instead.
            p = self._queue.popleft()
            p.future.set_exception(EngineError(
                f"request {p.request.request_id!r} cannot be admitted although nothing runs (free "
                f"KV blocks {len(self.bm.free)}, reserved {self.bm.reserved}, running rows "
                f"{len(self.scheduler.running)}), so it is failed rather than left waiting "
                "forever; the other requests go on. Retry it; if it fails again, lower its prompt length or "
                "max_new_tokens, or raise rollout.kv_cache_tokens, and please report it (admission "
                "should have rejected it: an engine bug)"))
        return units

    def _running_rows(self) -> int:
        return len(self._unfinished)

    def _load_state_dict(self, state_dict) -> None:
        # The engine thread is parked at a step boundary (no step in flight), so the block
        # manager is ours until the update hands it back (the condition orders the two).
        # Cached KV was computed with the old weights: drop it, and stop the rows admitted
        # before (which continue with these weights) from registering their blocks.
        self.bm.drop_prefix_cache()
        self.decoder.load_hf_state_dict(state_dict)

    def _check_adapter(self, adapter: LoraAdapter) -> None:
        self.decoder.check_adapter(adapter_pairs(adapter.tensors))

    def _load_adapter(self, adapter: LoraAdapter) -> None:
        # As for whole weights: cached KV was computed with the old adapter.
        self.bm.drop_prefix_cache()
        self.decoder.load_adapter(adapter_pairs(adapter.tensors), adapter.scale)

    def _fail_step(self, admitted: list[PrefillUnit], exc: BaseException) -> Delivered:
        # Results computed before the failure are delivered; every other admitted sequence
        # (a half-processed step's finished rows included) gets the error.
        delivered = self._take_handover()
        handed = {future for future, _ in delivered}
        seqs = list(self._unfinished.values()) + [s for unit in admitted for s in unit.rows]
        seqs = [s for s in {id(s): s for s in seqs}.values()
                if not s.pending.future.done() and s.pending.future not in handed]
        self._unfinished.clear()
        self.scheduler.running = []
        self.rows.n = 0
        self._inflight = None
        self._stopped_since_compact = False
        self.bm.reset()
        err = EngineError(
            f"a generation step failed ({type(exc).__name__}: {exc}); the {len(seqs)} request(s) "
            "in the batch are failed and the engine goes on with the next ones. Retry them; if it "
            "happens again, the cause above says what to fix (out of GPU memory: lower "
            "max_batch_size or rollout.kv_cache_memory_fraction)")
        err.__cause__ = exc
        return delivered + [(s.pending.future, err) for s in seqs]

    def _admitted_futures(self) -> list:
        return list(self._unfinished) + [future for future, _ in self._handover]

    def _abort_running(self, now: float) -> Delivered:
        # After _flush: every unfinished sequence is a running row.
        delivered = []
        for s in self._unfinished.values():
            if not s.pending.future.done():
                s.done = True
                self.scheduler.finish(s)
                delivered.append((s.pending.future, s.result("abort", now)))
        self._unfinished.clear()
        self.scheduler.running = []
        self.rows.n = 0
        return delivered

    def _has_inflight(self) -> bool:
        return self._inflight is not None

    def _flush(self) -> Delivered:
        self._flush_inflight()
        return self._take_handover()

    def _flush_inflight(self) -> None:
        """Process the launched step's results into ``_handover``."""
        launched, self._inflight = self._inflight, None
        if launched is None:
            return
        delivered = self._process(launched)
        for future, _ in delivered:  # handed over: no longer this engine's to fail
            self._unfinished.pop(future, None)
        self._handover += delivered
        # Finished rows leave now, not at the next launch: admission counts rows, and when
        # every row has finished no next launch comes (a stall the demo hit at step 335).
        self._compact()

    def _take_handover(self) -> Delivered:
        taken, self._handover = self._handover, []
        return taken

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def _step(self, units: list[PrefillUnit], version: int) -> Delivered:
        """Launch step t, then process step t-1's results while the GPU runs step t
        (SGLang's overlap: the host work hides behind the GPU's). Without overlap, step
        t's own results are processed before returning."""
        t0 = time.perf_counter()
        launched = self._launch(units, version)
        self._flush_inflight()
        self._inflight = launched
        if not self.overlap:
            self._flush_inflight()
        if not units:  # the period of a decode step, host work included
            self._decode_only_steps += 1
            self._decode_only_s += time.perf_counter() - t0
        return self._take_handover()

    def _launch(self, units: list[PrefillUnit], version: int) -> _Launched | None:
        """Queue one decode step of the running rows and the prefill of ``units`` on the
        device, and an asynchronous copy of their sampled tokens / logprobs to the host."""
        self._compact()
        rows: list[Sequence] = []
        toks: list[torch.Tensor] = []
        lps: list[torch.Tensor] = []
        n_dec = self.rows.n
        if n_dec:
            tok_B, logp_B = self._decode()
            toks.append(tok_B[:n_dec])
            lps.append(logp_B[:n_dec])
            rows += self.scheduler.running
            r = self.rows
            r.pos[:n_dec] += 1
            r.n_out[:n_dec] += 1
            r.src[:n_dec] = np.arange(n_dec)
        if units:
            tok_R, logp_R, new_rows = self._prefill(units)
            toks.append(tok_R)
            lps.append(logp_R)
            rows += new_rows
            # They decode from the next step on (max_new_tokens 1: done once sampled).
            joining = [(n_dec + i, seq) for i, seq in enumerate(new_rows) if seq.max_new > 1]
            self.scheduler.running += [seq for _, seq in joining]
            self.rows.append([seq for _, seq in joining], [i for i, _ in joining])
        if not rows:
            return None
        tok_R = torch.cat(toks) if len(toks) > 1 else toks[0]
        self._last_tokens = tok_R  # the next decode step's inputs are gathered from here
        out = torch.stack([tok_R.double(), torch.cat(lps).double() if len(lps) > 1 else lps[0].double()])
        event = None
        if self.device.type == "cuda":
            out = out.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return _Launched(rows, version, out, event)

    def _compact(self) -> None:
        """Drop rows that finished: by a stop (seen in results) or by length (all their
        tokens launched), before the next step is planned."""
        r, n = self.rows, self.rows.n
        if not n:
            return
        running = self.scheduler.running
        keep_mask = r.n_out[:n] < r.max_new[:n]
        if self._stopped_since_compact:
            keep_mask &= np.fromiter((not s.done for s in running), bool, n)
            self._stopped_since_compact = False
        if keep_mask.all():
            return
        keep = np.flatnonzero(keep_mask)
        self.scheduler.running = [running[i] for i in keep.tolist()]
        r.keep(keep)

    def _decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch one decode step for every running row; device ``(tokens, logprobs)``."""
        r, bs, n = self.rows, self.block_size, self.rows.n
        pos = r.pos[:n]
        # A row whose next token opens a block takes one of its reserved blocks.
        for i in np.flatnonzero(pos // bs >= r.nblk[:n]).tolist():
            seq = self.scheduler.running[i]
            block = self.bm.take_reserved()
            seq.reserve_left -= 1
            seq.blocks.append(block)
            r.fit_width(len(seq.blocks))
            r.bt[i, len(seq.blocks) - 1] = block
            r.nblk[i] += 1
        # Graphs: a few widths (one capture each). Eager: the exact width (less attention work).
        width = self.graphs.width_for(r.width())
        r.fit_width(width)
        slots = r.bt[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        buf = self.graphs.buffers(width)
        rows = self.graphs.rows_for(n)
        # The tokens fed are the last step's samples, still on the device: the ids buffer is
        # staged with their indices in the last step's outputs and gathered in place.
        rope_pos = pos + r.delta[:n] if self._vision is not None else None
        buf.load(n, rows, r.src[:n], pos, slots, r.bt[:n, :width], r.temp[:n], rope_pos, seed=r.seed[:n])
        ids_B = buf.i64[0, :n]
        ids_B.copy_(self._last_tokens.index_select(0, ids_B))
        if not r.filtered[:n].any():
            return self.graphs.run(buf, rows, sample=True)
        (logits_BV,) = self.graphs.run(buf, rows, sample=False)
        t, p, k = r.temp[:n], r.top_p[:n], r.top_k[:n]
        params = RowParams(self._to_device(t), self._to_device(p), self._to_device(k), all_greedy=False,
                           any_filter=True)
        seed_B, counter_B = buf.sampling_keys(n)
        return sample_next(logits_BV[:n], params, seed_B=seed_B, counter_B=counter_B)

    def _to_device(self, x) -> torch.Tensor:
        """A host array on the device without waiting for the device (pinned, asynchronous)."""
        t = torch.from_numpy(np.ascontiguousarray(x))
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _process(self, launched: _Launched) -> Delivered:
        """Append a launched step's tokens to their sequences; deliver the finished ones."""
        if launched.event is not None:
            # THE host sync of a step: step t-1's results, while the GPU runs step t.
            launched.event.synchronize()
        host = launched.host.numpy()
        toks = host[0].astype(np.int64).tolist()
        lps = host[1].tolist()
        version, bs = launched.version, self.block_size
        now = time.monotonic()
        delivered: Delivered = []
        routed: list[tuple[GenResult, np.ndarray]] = []  # results whose routes are read below
        for seq, tok, lp in zip(launched.rows, toks, lps):
            if seq.done:  # stopped at an earlier step; this token was sampled past its end
                continue
            runs = seq.version_runs
            n_out = len(seq.tokens) - seq.prompt_len
            if not runs or runs[-1][1] != version:
                runs.append((n_out, version))
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            # Every token but this one has its KV written: a block that just filled is cached.
            if (len(seq.tokens) - 1) % bs == 0:
                self.scheduler.register_full(seq, len(seq.tokens) - 1)
            if tok in seq.stops or (seq.stop_strings and self._hit_stop_string(seq)):
                reason = "stop"
            elif n_out + 1 >= seq.max_new:
                reason = "length"
            else:
                continue
            if reason == "stop" and n_out + 1 < seq.max_new:
                self._stopped_since_compact = True  # still a running row: _compact drops it
            seq.done = True
            result = seq.result(reason, now)
            if self.decoder.route_cache is not None:  # slots before finish() frees the blocks
                pos = np.arange(len(seq.tokens) - 1)
                routed.append((result, np.asarray(seq.blocks, np.int64)[pos // bs] * bs + pos % bs))
            self.scheduler.finish(seq)
            delivered.append((seq.pending.future, result))
        if routed:
            ids_SLK = self.decoder.read_routes(np.concatenate([slots for _, slots in routed]))
            start = 0
            for result, slots in routed:
                result.routed_experts = ids_SLK[start:start + len(slots)]
                start += len(slots)
        return delivered

    def _hit_stop_string(self, seq: Sequence) -> bool:
        return stop_string_in_tail(self.decode, seq.tokens, seq.prompt_len, len(seq.tokens),
                                   seq.stop_strings)

    # ------------------------------------------------------------------ prefill

    def _prefill(self, units: list[PrefillUnit]) -> tuple[torch.Tensor, torch.Tensor, list[Sequence]]:
        """One packed forward over every unit's uncached prompt tokens; samples every row's
        first token (a group's samples from their shared logits)."""
        bs = self.block_size
        ids, positions, slots = [], [], []
        cu = [0]
        for unit in units:
            seq = unit.leader
            pos = np.arange(unit.start, seq.prompt_len)
            blocks = np.asarray(seq.blocks, dtype=np.int64)
            ids.append(np.asarray(seq.tokens[unit.start : seq.prompt_len], dtype=np.int64))
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            cu.append(cu[-1] + len(pos))
        width = max(len(u.leader.blocks) for u in units)
        bt = np.zeros((len(units), width), np.int32)
        for i, unit in enumerate(units):
            bt[i, : len(unit.leader.blocks)] = unit.leader.blocks

        t = self._to_device
        cu_np = np.asarray(cu, dtype=np.int64)
        rope_table, images = None, None
        if self._vision is not None:
            rope_table, images = self._prefill_vision(units, cu_np)
        inputs = PrefillInputs(
            input_ids_T=t(np.concatenate(ids)),
            positions_T=t(np.concatenate(positions)),
            slot_mapping_T=t(np.concatenate(slots)),
            block_tables_SM=t(bt),
            cu_seqlens_q_S1=t(cu_np.astype(np.int32)),
            context_lens_S=t(np.asarray([u.leader.prompt_len for u in units], dtype=np.int32)),
            last_index_S=t(cu_np[1:] - 1),
            max_q_len=int(np.diff(cu_np).max()),
            rope_table_TD=rope_table,
            images=images,
        )
        if rope_table is not None:  # a per-token table: token i reads row i
            inputs.positions_T = torch.arange(int(cu_np[-1]), device=self.device)
        logits_UV = self.decoder(inputs)  # a module call: forward hooks fire
        self._copy_partial_blocks(units)
        for unit in units:
            self.scheduler.register_prompt(unit)
        rows = [seq for unit in units for seq in unit.rows]
        if len(rows) > len(units):
            unit_of_row = [u for u, unit in enumerate(units) for _ in unit.rows]
            logits_RV = logits_UV[self._to_device(np.asarray(unit_of_row, dtype=np.int64))]
        else:
            logits_RV = logits_UV
        sps = [seq.pending.request.sampling for seq in rows]
        temps = [sp.temperature for sp in sps]
        params = RowParams(
            t(np.asarray(temps, dtype=np.float32)), t(np.asarray([sp.top_p for sp in sps], dtype=np.float32)),
            t(np.asarray([sp.top_k for sp in sps], dtype=np.int64)), all_greedy=all(x == 0 for x in temps),
            any_filter=any(sp.filtered for sp in sps))
        # Each row keyed by its request's seed and the position of its first token.
        seed_R = t(np.asarray([seq.seed for seq in rows], dtype=np.int64))
        counter_R = t(np.asarray([seq.prompt_len for seq in rows], dtype=np.int64))
        if params.any_filter:
            tok_R, logp_R = sample_next(logits_RV, params, seed_B=seed_R, counter_B=counter_R)
        else:
            tok_R, logp_R = kernels.sample_tokens(logits_RV, params.temperature_B, seed_R, counter_R)
        return tok_R, logp_R, rows

    def _prefill_vision(self, units: list[PrefillUnit], cu: np.ndarray):
        """``(rope_table_TD, images)`` of a VL prefill: the 3-D positions of each unit's
        new tokens as a per-token rotary table, each sequence's rope delta, and the tower's
        embeddings of the placeholders among the new tokens (None when there are none). A
        cached prefix may hold part of an image: its features are computed whole and the
        tail after the prefix is used."""
        from ..models.vision import mrope_positions, placeholder_mask

        spec = self._vision
        tables, index, pixels, grids, take = [], [], [], [], []
        for k, unit in enumerate(units):
            seq, req = unit.leader, unit.leader.pending.request
            ids = seq.tokens[: seq.prompt_len]
            grid = list(req.images.grid_thw) if req.images else []
            mask = placeholder_mask(ids, spec)
            pos_3L, delta = mrope_positions(ids, mask, grid, spec)
            for s in unit.rows:
                s.rope_delta = delta
            tables.append(pos_3L[:, unit.start:])
            new = np.flatnonzero(mask[unit.start:])
            index.append(new + cu[k])
            if req.images:
                pixels.append(req.images.pixel_values)
                grids += grid
                take.append((int(mask.sum()), len(new)))
        table = self.decoder.rope_table(torch.from_numpy(np.concatenate(tables, axis=1)))
        if not pixels:
            return table, None
        embeds, deep = self.decoder.encode_images(torch.cat(pixels).to(self.decoder.dtype),
                                                  torch.tensor(grids, dtype=torch.long))
        # Per unit: its images' features are its `total` placeholders; keep the last `new`.
        keep, start = [], 0
        for total, new in take:
            keep.append(np.arange(start + total - new, start + total))
            start += total
        rows = self._to_device(np.concatenate(keep))
        images = PrefillImages(index_I=self._to_device(np.concatenate(index)),
                               embeds_ID=embeds.index_select(0, rows),
                               deepstack=[d.index_select(0, rows) for d in deep] if deep else None)
        return table, images

    def _copy_partial_blocks(self, units: list[PrefillUnit]) -> None:
        """Each sample of a group gets its own copy of the prompt's partial last block
        (every layer, k and v, in one indexed copy)."""
        src, dst = [], []
        for unit in units:
            if unit.leader.prompt_len % self.block_size:
                for seq in unit.followers:
                    src.append(unit.leader.blocks[-1])
                    dst.append(seq.blocks[-1])
        if src:
            kv = self.kv_cache.view(-1, self.bm.num_blocks, self.kv_cache[0, 0, 0].numel())
            src_t = self._to_device(np.asarray(src, dtype=np.int64))
            dst_t = self._to_device(np.asarray(dst, dtype=np.int64))
            kv.index_copy_(1, dst_t, kv.index_select(1, src_t))
            self.decoder.copy_route_blocks(src_t, dst_t, self.block_size)
