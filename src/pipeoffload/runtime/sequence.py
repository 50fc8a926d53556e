"""Sequences cut over context-parallel ranks: which tokens a rank holds, their positions,
the K/V all-gather attention reads (``Pipeline(context=)``, parallel/context.py) and, with
--document-mask, the documents of the whole sequence and this rank's rows of their mask.

Note: [causal split] With cp ranks each sequence is cut into 2 * cp equal chunks and rank i
holds chunks i and 2 * cp - 1 - i, side by side (Megatron-LM's and Llama 3's load balancing):
under a causal mask chunk j's queries see j + 1 chunks of keys, so every rank does the same
attention work ((i + 1) + (2 * cp - i) = 2 * cp + 1 chunk pairs). The sequence length must be
a multiple of 2 * cp. The all-gather of K and V puts the ranks' local sequences one after the
other (rank 0's two chunks, then rank 1's, ...); ``gather`` puts the chunks back in sequence
order, so the keys' positions are 0 .. seq - 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeoffload.errors import ConfigError
from pipeoffload.runtime.inputs import document_segments


@dataclass(frozen=True)
class SequenceSplit:
    """This process's share of every sequence: rank ``index`` of ``cp`` context-parallel
    ranks (``group``: their process group; None only with cp = 1)."""

    cp: int
    index: int = 0
    group: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.cp, int) or self.cp < 1 or not 0 <= self.index < self.cp:
            raise ConfigError(f"context parallelism: rank {self.index!r} of cp={self.cp!r}; "
                              "cp must be >= 1 and the rank in [0, cp)")

    def chunks(self, rank: int | None = None) -> tuple[int, int]:
        """The two chunks (of 2 * cp) that ``rank`` (default: this one) holds."""
        i = self.index if rank is None else rank
        return i, 2 * self.cp - 1 - i

    def check_length(self, seq: int, what: str = "sequence length") -> None:
        if seq % (2 * self.cp):
            raise ConfigError(f"{what} {seq} must be a multiple of 2 * cp = {2 * self.cp} "
                              "(context parallelism cuts each sequence into 2 * cp chunks)")

    def positions(self, seq: int, device: torch.device | str = "cpu",
                  rank: int | None = None) -> torch.Tensor:
        """Global positions of ``rank``'s tokens (default: this one's) in a sequence of
        ``seq`` tokens, in its local order: [seq / cp] int64."""
        self.check_length(seq)
        size = seq // (2 * self.cp)
        return torch.cat([torch.arange(c * size, (c + 1) * size, device=device)
                          for c in self.chunks(rank)])

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``tensor`` along ``dim`` (its two chunks, concatenated)."""
        seq = tensor.shape[dim]
        self.check_length(seq, f"dimension {dim} of a {list(tensor.shape)} tensor")
        pieces = tensor.chunk(2 * self.cp, dim=dim)
        return torch.cat([pieces[c] for c in self.chunks()], dim=dim)

    def join(self, shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's shard (in rank order): ``shard``'s inverse."""
        pieces: list[torch.Tensor | None] = [None] * (2 * self.cp)
        for rank, part in enumerate(shards):
            first, second = part.chunk(2, dim=dim)
            low, high = self.chunks(rank)
            pieces[low], pieces[high] = first, second
        return torch.cat([p for p in pieces if p is not None], dim=dim)

    def gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole sequence along ``dim`` from every rank's ``tensor`` (an all-gather, then
        ``join``); its backward reduce-scatters the gradient: each rank gets the sum over
        ranks of its own tokens' gradient."""
        if self.cp == 1:
            return tensor
        out = _GatherSequence.apply(tensor, dim, self)
        assert isinstance(out, torch.Tensor)
        return out

    def mean_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over the context-parallel ranks (e.g. each one's mean loss
        over its equal share of tokens: the whole sequence's mean), detached."""
        if self.cp == 1:
            return value
        total = value.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total / self.cp


def document_segments_of(ids: torch.Tensor, eos: int, split: SequenceSplit | None
                         ) -> torch.Tensor:
    """[batch, seq] int64: runtime/inputs.py ``document_segments`` of the whole sequence, from
    this rank's token ids [batch, seq / cp] (all-gathered over the context-parallel group: a
    token's document counts the ends of documents on the ranks holding earlier chunks)."""
    if split is not None:
        with torch.no_grad():
            ids = split.gather(ids, 1)
    return document_segments(ids, eos)


def document_rows(segments: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """[batch, 1, seq / cp, seq] bool: the rows of the whole sequence's document mask for
    this rank's queries (``segments``: the whole sequence's, ``document_segments_of``): a
    query may attend a key at or before it in its own document (--document-mask)."""
    seq = segments.shape[1]
    mine = split.shard(segments, 1)
    causal = (split.positions(seq, segments.device)[:, None]
              >= torch.arange(seq, device=segments.device)[None, :])
    return (mine[:, None, :, None] == segments[:, None, None, :]) & causal


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` over ``group``; backward: reduce-scatter (sum) of the
    gradient. Gloo has no reduce-scatter: there an all-reduce and this rank's slice."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dim: int, split: SequenceSplit) -> torch.Tensor:
        ctx.dim, ctx.split = dim, split
        local = tensor.contiguous()
        parts = [torch.empty_like(local) for _ in range(split.cp)]
        dist.all_gather(parts, local, group=split.group)
        return split.join(parts, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        split: SequenceSplit = ctx.split
        if dist.get_backend(split.group) == "gloo":
            whole = grad.contiguous()
            dist.all_reduce(whole, group=split.group)
            return split.shard(whole, ctx.dim).contiguous(), None, None
        parts = [SequenceSplit(split.cp, r).shard(grad, ctx.dim).contiguous()
                 for r in range(split.cp)]
        mine = torch.empty_like(parts[split.index])
        dist.reduce_scatter(mine, parts, group=split.group)
        return mine, None, None
