"""Variant effect scores by streamed prefill: the reference prefix once per block, two windows per variant.

A variant replaces the reference interval ``[pos, end)`` by its ALT bases. The score of an allele
``a`` is the log-probability the model gives the haplotype's bases from ``pos`` on::

    score(a) = sum of log p(x_t | x_<t) over the tokens of a and the `window` reference bases after
               `end` (fewer at the contig end, the same for both alleles)

each conditioned on everything before it in that haplotype (the reference from the block's start
``s``, then the allele). ``LLR = score(alt) - score(ref)``; N targets count in neither (the
model's loss never counts them, :func:`genolong.model.loss.next_token_nll`); the first base of a
contig has no prediction and counts in neither. ``REF == ALT`` scores exactly 0.

Cost. A naive score runs two forwards of the whole haplotype per variant (``2 (L + window)``
tokens). Here the variants of one contig are grouped into blocks on a fixed grid of the genome
(:func:`plan_blocks`, :func:`block_start`): cells of ``span`` bases (default ``span = L``) from
the contig's first base; the block of cell ``k`` starts one
:class:`~genolong.model.stream.PrefillStream` at ``s = max(0, k span - L)`` and takes every variant
with ``pos // span = k``, so every variant sees between ``L`` and ``L + span - 1`` bases of
reference before it (fewer only near a contig start; reported as ``context_used``), and which,
depends on its position alone: a variant scores the same alone, in its whole file or in any shard
of it (bitwise under one thread away from N runs, see below). ``span = 0``: each position its own
stream from ``max(0, pos - L)``, exactly ``L`` bases. The stream runs the reference from ``s`` up to
each variant in turn; at each variant it takes a
:meth:`~genolong.model.stream.PrefillStream.snapshot`, runs one allele's tokens and window,
restores the snapshot, runs the other allele's, restores again and continues. A block of ``k``
variants costs at most ``L + span`` prefix tokens plus ``2 k (window + allele)`` branch tokens.

The first allele token is predicted by the last prefix token's hidden row (kept from the prefix
segment). Each variant is scored alone against the reference: other variants, overlapping or
near, are not applied.

Reverse strand (``strands="both"``): the same engine on the reverse complement of the contig
(:class:`ReverseComplement`, coordinates mirrored ``pos' = length - end``, alleles reverse
complemented), so the minus strand's prefix is the plus strand's sequence after the variant.

:func:`brute_force_llr` is the oracle: per allele one one-shot forward
(:meth:`GenoLM.token_nll <genolong.model.lm.GenoLM.token_nll>`) of the whole haplotype from the
same ``s``. The two agree up to float rounding (the stream splits the KDA recurrence and the
matrix products at other rows; see :mod:`genolong.model.stream`).

Context parallelism (``score_block(cp_group=...)``): the ranks of a CP group run the block's prefix
split between them (:func:`~genolong.parallel.cp_prefill.cp_prefill`), each ending with the whole
stream state, then each scores its share of the block's variants from its own copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from ..config import kernel_multiple
from ..data.alphabet import BASE_MASK, encode, reverse_complement
from ..defaults import VARIANT_WINDOW
from ..errors import InputError
from ..model.loss import model_inputs, next_token_nll
from ..model.stream import PrefillStream, check_segment_tokens
from ..model.vocab import VocabMap
from ..parallel.cp_prefill import cp_prefill
from .vcf import Variant

__all__ = [
    "DEFAULT_WINDOW",
    "STRANDS",
    "Block",
    "ReferenceLike",
    "ReverseComplement",
    "AlleleScores",
    "block_start",
    "layout_rule",
    "plan_blocks",
    "score_block",
    "score_variants_streamed",
    "brute_force_llr",
    "haplotype_window",
]

#: Reference bases scored after the variant's end (both alleles), unless told otherwise (one home:
#: :data:`genolong.defaults.VARIANT_WINDOW`, which the CLI's help reads without importing torch).
DEFAULT_WINDOW = VARIANT_WINDOW
#: ``strands`` values: the plus strand only, or the plus and minus strands averaged.
STRANDS = ("forward", "both")


class ReferenceLike(Protocol):
    """What the scorer reads of a reference (:class:`genolong.evaluation.vcf.Reference`'s duck type)."""

    def length(self, contig: str) -> int:
        """Bases of ``contig``."""
        ...

    def tokens(self, contig: str, start: int, end: int) -> np.ndarray:
        """Store tokens ``[end - start]`` uint8 of ``contig[start:end]`` (case kept)."""
        ...


class ReverseComplement:
    """The minus strand of a reference: ``tokens(c, s, e)`` are the reverse complement of the plus
    strand's ``[length - e, length - s)`` (case kept).

    Args:
        reference: the plus strand (:class:`ReferenceLike`).
    """

    def __init__(self, reference: ReferenceLike):
        self.reference = reference

    def length(self, contig: str) -> int:
        """Bases of ``contig`` (as the plus strand)."""
        return self.reference.length(contig)

    def tokens(self, contig: str, start: int, end: int) -> np.ndarray:
        """Minus-strand store tokens ``[end - start]`` uint8 of positions ``[start, end)``."""
        n = self.reference.length(contig)
        return reverse_complement(self.reference.tokens(contig, n - end, n - start))

    @staticmethod
    def mirror(variant: Variant, length: int) -> Variant:
        """``variant`` on the minus strand of a contig of ``length`` bases (alleles reverse complemented)."""
        rc = {"A": "T", "C": "G", "G": "C", "T": "A", "N": "N"}
        flip = "".join(rc[b] for b in reversed(variant.ref)), "".join(rc[b] for b in reversed(variant.alt))
        return dataclasses.replace(variant, pos=length - variant.end, ref=flip[0], alt=flip[1])


@dataclass(frozen=True)
class Block:
    """Variants scored from one stream: ``indices`` into the sorted input, ``start`` the stream's first base.

    Attributes:
        contig: the contig.
        start: the stream's first reference base (:func:`block_start` of its variants' positions).
        indices: positions of the block's variants in the list given to :func:`plan_blocks`,
            by ``(pos, end)`` then input order.
    """

    contig: str
    start: int
    indices: tuple[int, ...]


@dataclass(frozen=True)
class AlleleScores:
    """The scores of one variant (one strand).

    Attributes:
        logp_ref: log p of the reference haplotype's scored tokens (nats, float64 sum of fp32 terms).
        logp_alt: the same for the alternate haplotype.
        context_used: reference bases before ``pos`` the model read (``pos - s``).
        window: reference bases after ``end`` scored (``window``, fewer at the contig end).
    """

    logp_ref: float
    logp_alt: float
    context_used: int
    window: int

    @property
    def llr(self) -> float:
        """``logp_alt - logp_ref`` (nats)."""
        return self.logp_alt - self.logp_ref


def block_start(pos: int, context: int, span: int) -> int:
    """The first reference base of the block a variant at 0-based ``pos`` belongs to (the layout rule).

    The genome is cut into a fixed grid of cells of ``span`` bases counted from each contig's first
    base; the block of cell ``k = pos // span`` starts ``context`` bases before the cell:
    ``s = max(0, (pos // span) * span - context)``, so a variant sees ``pos - s`` in
    ``[context, context + span)`` bases before it (fewer only near the contig start), a function of
    its own position: the same whatever other variants the file holds. ``span = 0``: every variant
    its own exact context, ``s = max(0, pos - context)``.
    """
    if span == 0:
        return max(0, pos - context)
    return max(0, pos // span * span - context)


def layout_rule(context: int | None = None, span: int | None = None) -> str:
    """The block layout in words (for the VCF header and ``meta.json``): how ``context_used`` follows
    from a variant's position (:func:`block_start`).

    Args:
        context: ``L`` (default None: written as the letter L, for several contexts).
        span: the grid's cell (default None: ``L``; 0: each variant its own stream).
    """
    ell = "L" if context is None else str(context)
    if span == 0:
        return (
            f"each variant its own stream from max(0, pos0 - {ell}), pos0 the 0-based normalised POS (minus "
            f"strand: mirrored): context_used = {ell}, less within {ell} of the contig start"
        )
    cell = ell if span is None else str(span)
    top = f"{context + (context if span is None else span) - 1}" if context is not None else f"{ell} + {cell} - 1"
    return (
        f"fixed grid of {cell}-base cells from each contig start: a variant at 0-based normalised POS pos0 "
        f"(minus strand: mirrored) reads from max(0, floor(pos0 / {cell}) * {cell} - {ell}), so context_used = "
        f"{ell} to {top} by its position alone (less near the contig start)"
    )


def plan_blocks(variants: Sequence[Variant], context: int, span: int | None = None) -> list[Block]:
    """Group variants into prefix-sharing blocks on a fixed grid of each contig (:func:`block_start`).

    A variant's block, and so the reference it reads, depends only on its own position (not on
    which other variants are in the list): a variant scored alone, in a whole file or in a shard of
    it gets the same stream start.

    Args:
        variants: the variants (any order; several contigs allowed).
        context: ``L``, reference bases before a block's grid cell (>= 1).
        span: the grid's cell, in bases (default None: ``L``); 0: one block per position, exactly
            ``L`` bases before each variant.

    Returns:
        Blocks in order of contig (first appearance) then position; every variant in exactly one;
        only cells that hold variants.

    Raises:
        InputError: ``context < 1`` or ``span < 0``.
    """
    if context < 1:
        raise InputError(f"--context must be at least 1 base, got {context}")
    span = context if span is None else span
    if span < 0:
        raise InputError(f"the block span must be >= 0 bases, got {span}")
    cells: dict[tuple[str, int], list[int]] = {}
    for i, v in enumerate(variants):
        cells.setdefault((v.contig, block_start(v.pos, context, span)), []).append(i)
    contig_order = {c: k for k, c in enumerate(dict.fromkeys(v.contig for v in variants))}
    blocks = []
    for (contig, start), idx in sorted(cells.items(), key=lambda kv: (contig_order[kv[0][0]], kv[0][1])):
        idx.sort(key=lambda i: (variants[i].pos, variants[i].end, i))
        blocks.append(Block(contig, start, tuple(idx)))
    return blocks


def _allele_tokens(allele: str, what: str, variant: Variant) -> np.ndarray:
    try:
        return encode(allele)
    except ValueError as err:
        raise InputError(
            f"variant {variant.contig}:{variant.input_pos} ({variant.id}): {what} {allele!r} is not DNA ({err})"
        ) from err


def haplotype_window(
    reference: ReferenceLike, variant: Variant, window: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The store tokens a variant's two haplotypes score: ``(ref [len(ref) + w], alt [len(alt) + w],
    window [w])`` with ``w = min(window, length - end)``; the ref allele is checked against the reference.

    Raises:
        InputError: the variant runs past the contig or its REF differs from the reference there.
    """
    n = reference.length(variant.contig)
    if variant.pos < 0 or variant.end > n:
        raise InputError(
            f"variant {variant.contig}:{variant.input_pos} ({variant.id}) lies outside the "
            f"reference contig ({n} bases): check that the VCF and the FASTA are of one assembly"
        )
    here = reference.tokens(variant.contig, variant.pos, variant.end) & BASE_MASK
    ref = _allele_tokens(variant.ref, "REF", variant)
    if not np.array_equal(here, ref & BASE_MASK):
        raise InputError(
            f"variant {variant.contig}:{variant.input_pos} ({variant.id}): REF {variant.ref} differs "
            f"from the reference at {variant.pos + 1} (normalise the VCF against this FASTA)"
        )
    alt = _allele_tokens(variant.alt, "ALT", variant)
    after = reference.tokens(variant.contig, variant.end, min(n, variant.end + window))
    return np.concatenate([ref, after]), np.concatenate([alt, after]), after


def _logp(nll: torch.Tensor) -> float:
    """Sum of log p over the counted targets of an NLL row (NaN = not counted), float64."""
    x = nll.double()
    return -float(x.nan_to_num(0.0).sum())


@torch.no_grad()
def score_block(
    model: torch.nn.Module,
    reference: ReferenceLike,
    variants: Sequence[Variant],
    block: Block,
    window: int = DEFAULT_WINDOW,
    segment_tokens: int = 65536,
    vocab: VocabMap | None = None,
    chunk_size: int = 4096,
    cp_group: Any = None,
) -> list[AlleleScores | None]:
    """Score one block's variants from one stream of the reference.

    Args:
        model: a GenoLM in eval mode (its device and dtype are used).
        reference: the reference (:class:`ReferenceLike`).
        variants: the list the block indexes.
        block: from :func:`plan_blocks`.
        window: reference bases scored after each variant's end (default 128).
        segment_tokens: reference tokens per prefill segment (default 65536; memory of one
            segment), rounded down to whole KDA chunks and DSA pools (at least one).
        vocab: base ids -> model ids (default None: nucleotide ids).
        chunk_size: LM-head rows per chunk (default 4096).
        cp_group: a context-parallel process group of ``W`` ranks (every rank calls this with the
            same block): the reference before the first variant, cut to a multiple of
            :func:`~genolong.config.kernel_multiple` ``(config, W)``, runs split over the group
            in stretches of about ``segment_tokens`` per rank
            (:func:`~genolong.parallel.cp_prefill.cp_prefill`), then rank ``r`` scores the block's
            variants ``j`` with ``j mod W = r`` from its own copy of the stream (equal to the
            one-process scores up to float rounding). Default None: one process, every variant.

    Returns:
        One :class:`AlleleScores` per ``block.indices`` entry, in that order (with ``cp_group``,
        None for the variants of the other ranks of the group).
    """
    check_segment_tokens(segment_tokens)
    if window < 0:
        raise InputError(f"--window must be >= 0 bases, got {window}")
    device = next(model.parameters()).device
    head = model.lm_head.weight
    s = block.start
    chosen = [variants[i] for i in block.indices]
    haplotypes = [haplotype_window(reference, v, window) for v in chosen]
    last = max(v.pos for v in chosen)
    longest = max(max(len(r), len(a)) for r, a, _ in haplotypes)
    stream = PrefillStream(model, 1, capacity=last - s + longest)

    def ids(tokens: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(tokens)).to(device)[None]
        return model_inputs(t) if vocab is None else vocab.to_model(t)

    # the last prefix token and its hidden row: they predict each allele's first token
    prev_token: np.ndarray | None = None
    prev_hidden: torch.Tensor | None = None
    world, rank = 1, 0
    if cp_group is not None:
        world, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
        multiple = kernel_multiple(model.config, world)  # whole KDA chunks and DSA pools per rank
        aligned = (chosen[0].pos - s) // multiple * multiple
        # stretches of about segment_tokens per rank: one segment's memory, as in one process
        step = max(multiple, segment_tokens * world // multiple * multiple)
        for a in range(0, aligned, step):
            b = min(aligned, a + step)
            n = (b - a) // world
            chunk = reference.tokens(block.contig, s + a, s + b)
            prev_hidden = cp_prefill(stream, ids(chunk[rank * n : (rank + 1) * n]), cp_group)
            prev_token = chunk[-1:]
    # The main stream stops on the one-shot forward's grid (whole KDA chunks and DSA pools counted
    # from the block's start), and each allele branch runs the few reference bases from the grid
    # point to the variant first: every chunk the stream computes is then a chunk of the brute
    # force's one-shot forward, so the two agree to BLAS rounding of matrices of other row counts
    # (bitwise here) instead of by a recurrence walked over other chunks (~1e-5 nats per LLR).
    # Costs up to grid - 1 extra tokens per branch (on average 31 of ~130 for the small presets).
    grid = kernel_multiple(model.config, 1)
    segment = max(grid, segment_tokens // grid * grid)
    out: list[AlleleScores | None] = []
    for j, (v, (ref_hap, alt_hap, after)) in enumerate(zip(chosen, haplotypes)):
        if j % world != rank:  # another rank of the CP group scores it
            out.append(None)
            continue
        g = s + (v.pos - s) // grid * grid  # the last grid point at or before the variant
        while s + stream.position < g:  # the reference up to that point, a segment at a time
            a = s + stream.position
            b = min(g, a + segment)
            chunk = reference.tokens(v.contig, a, b)
            hidden = stream.extend(ids(chunk))
            prev_token, prev_hidden = chunk[-1:], hidden[:, -1:]
        lead = reference.tokens(v.contig, g, v.pos)  # [0, grid) reference bases before the variant
        snap = stream.snapshot()
        scores = []
        for hap in (ref_hap, alt_hap) if v.alt != v.ref else (ref_hap,):
            branch = np.concatenate([lead, hap])
            hidden = stream.extend(ids(branch))
            tokens = torch.from_numpy(branch).to(device)[None]
            if prev_hidden is not None:  # the stream's last row predicts the branch's first token
                hidden = torch.cat([prev_hidden, hidden], dim=1)
                tokens = torch.cat([torch.from_numpy(prev_token).to(device)[None], tokens], dim=1)
            # the rows that predict the allele and the window (the row before each of their tokens)
            # and, at a contig's first base, nothing predicts it: next_token_nll scores rows[:-1]
            keep = min(len(hap) + 1, hidden.shape[1])
            nll = next_token_nll(hidden[:, -keep:], head, tokens[:, -keep:], chunk_size, vocab)
            scores.append(_logp(nll))
            stream.restore(snap)
        logp_ref = scores[0]
        logp_alt = scores[-1]  # REF == ALT: the same number, so the LLR is exactly 0
        out.append(AlleleScores(logp_ref, logp_alt, v.pos - s, len(after)))
    return out


def score_variants_streamed(
    model: torch.nn.Module,
    reference: ReferenceLike,
    variants: Sequence[Variant],
    context: int,
    window: int = DEFAULT_WINDOW,
    strand: str = "forward",
    span: int | None = None,
    segment_tokens: int = 65536,
    vocab: VocabMap | None = None,
    cp_group: Any = None,
) -> Iterator[tuple[Block, list[AlleleScores | None]]]:
    """Score ``variants`` on one strand, block by block.

    Args:
        model, reference, window, segment_tokens, vocab: as :func:`score_block`.
        variants: the variants (plus-strand coordinates).
        context: ``L`` (see :func:`plan_blocks`).
        strand: ``"forward"`` (default) or ``"reverse"``: the minus strand (the blocks are then
            planned on mirrored coordinates; indices still refer to ``variants``).
        span: block span (default None: ``L``).
        cp_group: as :func:`score_block` (default None: one process).

    Yields:
        ``(block, scores)`` per block (``scores[j]`` for ``variants[block.indices[j]]``).
    """
    if strand not in ("forward", "reverse"):
        raise InputError(f"strand must be 'forward' or 'reverse', got {strand!r}")
    if strand == "reverse":
        rc = ReverseComplement(reference)
        lengths = {c: reference.length(c) for c in {v.contig for v in variants}}
        variants = [ReverseComplement.mirror(v, lengths[v.contig]) for v in variants]
        reference = rc
    for block in plan_blocks(variants, context, span):
        yield block, score_block(model, reference, variants, block, window, segment_tokens, vocab, cp_group=cp_group)


@torch.no_grad()
def brute_force_llr(
    model: torch.nn.Module,
    reference: ReferenceLike,
    variant: Variant,
    start: int,
    window: int = DEFAULT_WINDOW,
    vocab: VocabMap | None = None,
    strand: str = "forward",
) -> AlleleScores:
    """The oracle: per allele one one-shot forward of the whole haplotype ``reference[start:pos] +
    allele + window`` (:meth:`GenoLM.token_nll <genolong.model.lm.GenoLM.token_nll>`).

    Args:
        model, reference, window, vocab: as :func:`score_block`.
        variant: the variant (plus-strand coordinates).
        start: the haplotype's first base (the streamed block's ``start``; on the minus strand in
            minus-strand coordinates).
        strand: ``"forward"`` or ``"reverse"`` (the minus strand, as :func:`score_variants_streamed`).

    Returns:
        The variant's :class:`AlleleScores` (2 forwards of ``pos - start + allele + window`` tokens).
    """
    if strand == "reverse":
        variant = ReverseComplement.mirror(variant, reference.length(variant.contig))
        reference = ReverseComplement(reference)
    device = next(model.parameters()).device
    ref_hap, alt_hap, after = haplotype_window(reference, variant, window)
    prefix = reference.tokens(variant.contig, start, variant.pos)
    scores = []
    for hap in (ref_hap, alt_hap):
        tokens = torch.from_numpy(np.concatenate([prefix, hap])).to(device)[None]
        nll = model.token_nll(tokens, vocab=vocab)  # [1, T - 1]; entry t scores token t + 1
        scores.append(_logp(nll[:, max(len(prefix) - 1, 0) :]))
    return AlleleScores(scores[0], scores[1], variant.pos - start, len(after))
