"""Prefix-shared packed micro-batches (tree training): every shared prefix computed once.

Consumes :class:`~tapioca.trainers.batching.SeqItem` lists (``actor.enable_tree_training``);
emits :class:`~tapioca.trainers.packing.PackedBatch` es whose token stream is a prefix
tree of the micro-batch's sequences instead of their concatenation: a GRPO group's
prompt appears once, followed by each sample's answer; an agent session's turns that
extend the same history share it; identical sequences share everything. The
``[B, T-1]`` per-token tensors, ``labels_M`` and ``padded_index_M`` are exactly those of
:func:`~tapioca.trainers.packing.to_packed` (the loss code does not change); only
``input_ids_N``, ``position_ids_N`` (depth in the tree), ``seqs`` (a
:class:`~tapioca.models.prefix_attention.TreeSeqs`) and ``rows_M`` differ. A row may be
scored more than once (the last prompt token predicts every sample's first token):
the LM head gathers it once per label and its gradient sums over them, so nothing is
left unsupervised at a branch point.

The tree is the compressed trie of the token sequences: sort them, take the longest
common prefix (LCP) of neighbours, split ranges at their minimum LCP. Its size is the
number of distinct prefixes, ``sum(L_i) - sum(LCP of sorted neighbours)``, which is what
:func:`tree_tokens` returns and what the micro-batch budget counts. Host work per
micro-batch: one sort of the token lists, one vector compare per neighbour pair, and
vector index building (no Python per token).
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..models.prefix_attention import TreeSeqs, check_tree_backend, tree_seqs
from .batching import SeqItem, pack
from .packing import PackedBatch, to_packed


@dataclass(frozen=True)
class PrefixTree:
    """The compressed trie of ``S`` sequences: ``G`` nodes, each a run of tokens at depths
    ``[start_G[g], end_G[g])`` that every sequence below it holds; ``seq_G[g]``: a
    sequence holding it; ``parent_G[g]``: -1 at a root. ``leaf_S[s]``: the deepest node
    of sequence ``s``'s path (its ``end`` is ``len(s)``). ``flat_N``: the sequences'
    tokens concatenated, ``offset_S`` where each starts."""

    start_G: np.ndarray
    end_G: np.ndarray
    seq_G: np.ndarray
    parent_G: np.ndarray
    leaf_S: np.ndarray
    flat_N: np.ndarray
    offset_S: np.ndarray

    @property
    def n_tokens(self) -> int:
        return int((self.end_G - self.start_G).sum())

    def paths(self) -> list[list[int]]:
        """Per node, its nodes from the root down (itself last)."""
        out: list[list[int]] = []
        for g, p in enumerate(self.parent_G.tolist()):  # parents come before children
            out.append((out[p] if p >= 0 else []) + [g])
        return out


def _sorted_lcp(seqs: list[list[int]], flat: np.ndarray, offset: np.ndarray,
                length: np.ndarray) -> tuple[list[int], np.ndarray]:
    """Sequence indices in lexicographic order and the LCP of each sorted neighbour pair."""
    order = sorted(range(len(seqs)), key=seqs.__getitem__)
    lcp = np.zeros(max(len(order) - 1, 0), dtype=np.int64)
    for k, (a, b) in enumerate(zip(order, order[1:])):
        m = int(min(length[a], length[b]))
        diff = np.flatnonzero(flat[offset[a]:offset[a] + m] != flat[offset[b]:offset[b] + m])
        lcp[k] = diff[0] if diff.size else m
    return order, lcp


def _flatten(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    length = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    flat = np.frombuffer(array("q", itertools.chain.from_iterable(seqs)), dtype=np.int64) \
        if length.sum() else np.zeros(0, dtype=np.int64)
    return flat, np.cumsum(length) - length, length


def tree_tokens(seqs: list[list[int]]) -> int:
    """Tokens of the prefix tree of ``seqs`` (distinct prefixes); the packed size unshared
    is ``sum(len)``."""
    if not seqs:
        return 0
    flat, offset, length = _flatten(seqs)
    _, lcp = _sorted_lcp(seqs, flat, offset, length)
    return int(length.sum() - lcp.sum())


def build_prefix_tree(seqs: list[list[int]]) -> PrefixTree:
    """The compressed trie of ``seqs`` (each non-empty). A range of sorted sequences at
    depth ``d`` shares tokens up to ``e = min LCP`` of the range: one node ``[d, e)``, then
    the range splits where neighbours' LCP is exactly ``e``; a sequence of length ``e``
    ends at that node."""
    if not seqs or min(len(s) for s in seqs) < 1:
        raise ValueError("build_prefix_tree: need at least one sequence, each non-empty")
    flat, offset, length = _flatten(seqs)
    order, lcp = _sorted_lcp(seqs, flat, offset, length)
    start: list[int] = []
    end: list[int] = []
    rep: list[int] = []
    parent: list[int] = []
    leaf = np.full(len(seqs), -1, dtype=np.int64)

    def node(d: int, e: int, s: int, p: int) -> int:
        start.append(d)
        end.append(e)
        rep.append(s)
        parent.append(p)
        return len(start) - 1

    stack = [(0, len(order), 0, -1)]  # (lo, hi) in sorted order, depth shared so far, parent
    while stack:
        lo, hi, d, p = stack.pop()
        if hi - lo == 1:
            s = order[lo]
            leaf[s] = node(d, int(length[s]), s, p) if length[s] > d else p
            continue
        seg = lcp[lo:hi - 1]
        e = int(seg.min())
        if e > d:
            p = node(d, e, order[lo], p)
        cuts = [lo] + (np.flatnonzero(seg == e) + lo + 1).tolist() + [hi]
        # Children pushed last-first, so they are laid out in sorted order.
        stack.extend((a, b, e, p) for a, b in reversed(list(zip(cuts, cuts[1:]))))
    as_array = lambda xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
    return PrefixTree(as_array(start), as_array(end), as_array(rep), as_array(parent), leaf, flat, offset)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concat(arange(s, s + n) for s, n in zip(starts, lengths))``, vectorised."""
    before = np.cumsum(lengths) - lengths
    return np.repeat(starts - before, lengths) + np.arange(int(lengths.sum()))


@dataclass(frozen=True)
class TreeLayout:
    """Where the tree's tokens sit in the packed stream (host tensors): ``ids_N`` and
    ``positions_N`` (depth) of every tree token, ``flat_to_tree_F`` (token ``t`` of the
    sequences concatenated -> its tree row) and the attention's :class:`TreeSeqs` inputs."""

    ids_N: torch.Tensor
    positions_N: torch.Tensor
    flat_to_tree_F: torch.Tensor
    q_lengths: list[int]
    k_lengths: list[int]
    kv_index_K: torch.Tensor


def tree_layout(tree: PrefixTree) -> TreeLayout:
    """Nodes laid out in order (parents first); each node one attention segment whose keys
    are its path's rows."""
    q_len_G = tree.end_G - tree.start_G
    row_G = np.cumsum(q_len_G) - q_len_G  # first packed row of each node
    gather_N = _ranges(tree.offset_S[tree.seq_G] + tree.start_G, q_len_G)
    paths = tree.paths()

    def path_rows(nodes: list[int]) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(nodes, dtype=np.int64)
        return row_G[idx], q_len_G[idx]

    kv_parts = [path_rows(paths[g]) for g in range(len(paths))]
    kv_index_K = _ranges(np.concatenate([a for a, _ in kv_parts]), np.concatenate([n for _, n in kv_parts]))
    seq_parts = [path_rows(paths[g]) for g in tree.leaf_S.tolist()]
    flat_to_tree_F = _ranges(np.concatenate([a for a, _ in seq_parts]), np.concatenate([n for _, n in seq_parts]))
    return TreeLayout(
        ids_N=torch.from_numpy(tree.flat_N[gather_N].copy()),
        positions_N=torch.from_numpy(_ranges(tree.start_G, q_len_G)),
        flat_to_tree_F=torch.from_numpy(flat_to_tree_F),
        q_lengths=q_len_G.tolist(), k_lengths=tree.end_G.tolist(),
        kv_index_K=torch.from_numpy(kv_index_K))


def to_tree_packed(items: list[SeqItem], device: torch.device | str) -> PackedBatch:
    """:func:`~tapioca.trainers.packing.to_packed` of ``items`` with the token stream
    replaced by their prefix tree (see the module docstring)."""
    flat = to_packed(items, device)
    layout = tree_layout(build_prefix_tree([it.input_ids for it in items]))
    seqs: TreeSeqs = tree_seqs(layout.q_lengths, layout.k_lengths, layout.kv_index_K, device,
                               n_flat_tokens=flat.seqs.n_tokens)
    return replace(
        flat, input_ids_N=layout.ids_N.to(device), position_ids_N=layout.positions_N.to(device), seqs=seqs,
        # The scored rows of the concatenated layout, moved to their tree rows (on the device: no sync).
        rows_M=layout.flat_to_tree_F.to(device)[flat.rows_M])


def tree_micro_batches(items: list[SeqItem], max_tokens: int) -> list[list[SeqItem]]:
    """Micro-batches of at most ``max_tokens`` tree tokens that keep each group (its
    shared prompt) together: a group is one unit of :func:`~tapioca.trainers.batching.pack`
    costing its :func:`tree_tokens`; a group larger than the budget is cut, in sorted
    token order, into runs that fit (a single sequence longer than the budget gets a
    micro-batch of its own, as unshared). Sharing across groups (a common system
    prompt) only makes a micro-batch smaller than its budget."""
    groups: dict[str, list[SeqItem]] = {}
    for it in items:
        groups.setdefault(it.group_id, []).append(it)
    units: list[list[SeqItem]] = []
    costs: list[int] = []
    for members in groups.values():
        seqs = [it.input_ids for it in members]
        flat, offset, length = _flatten(seqs)
        order, lcp = _sorted_lcp(seqs, flat, offset, length)
        # Adding sorted member k to a run of its predecessors adds len_k - LCP(k-1, k) tokens.
        adds = [int(length[order[0]])] + [int(length[b] - lcp[k]) for k, b in enumerate(order[1:])]
        run: list[SeqItem] = []
        cost = 0
        for k, i in enumerate(order):
            add = adds[k] if run else int(length[i])
            if run and cost + add > max_tokens:
                units.append(run)
                costs.append(cost)
                run, cost, add = [], 0, int(length[i])
            run.append(members[i])
            cost += add
        units.append(run)
        costs.append(cost)
    return [[it for u in idx for it in units[u]] for idx in pack(costs, max_tokens, padded=False)]


def check_packed_tree_backend(packed) -> None:
    """Refuse tree training on an attention kernel that gets the tree mask wrong
    (:func:`~tapioca.models.prefix_attention.check_tree_backend`, on ``packed``'s shape)."""
    layer, weight = packed.layers[0], packed.embed_tokens.weight
    check_tree_backend(packed.attention_backend, weight.device, layer.attn_dtype or weight.dtype,
                       layer.n_heads, layer.n_kv_heads, layer.head_dim)
