"""Chunked cross-entropy against the plain torch version, forward and backward."""

from __future__ import annotations

import pytest
import torch

from genolong.kernels.ce import chunked_cross_entropy, reference_cross_entropy
from genolong.kernels.testing import rms_ratio


@pytest.mark.parametrize(("n", "vocab", "chunk"), [(63, 8, 16), (500, 8, 64), (1000, 1543, 333), (37, 50, 1000)])
@pytest.mark.parametrize("masked", [False, True])
def test_matches_reference(n: int, vocab: int, chunk: int, masked: bool) -> None:
    torch.manual_seed(n + vocab)
    hidden = torch.randn(n, 24, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, 24, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (n,))
    token_weights = None
    if masked:
        token_weights = torch.rand(n, dtype=torch.float64).round() * torch.where(torch.rand(n) < 0.5, 0.1, 1.0)
        targets = torch.where(token_weights > 0, targets, torch.full_like(targets, -100))  # masked ids may be junk
    got, got_w = chunked_cross_entropy(hidden, weight, targets, token_weights, chunk_size=chunk)
    (got * 1.7).backward()
    g_hidden, g_weight = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    safe = targets.clamp_min(0)
    want, want_w = reference_cross_entropy(hidden, weight, safe, token_weights)
    (want * 1.7).backward()
    # the weights' sum is the same w.sum() of the same tensor on both sides: exact
    assert abs(float(got.detach() - want.detach())) <= 1e-6 * abs(float(want.detach())) and float(got_w) == float(
        want_w
    )
    # fp32 logits and log-sum-exp in both; gradients agree to fp32 precision
    assert rms_ratio(hidden.grad, g_hidden) < 1e-6
    assert rms_ratio(weight.grad, g_weight) < 1e-6


def test_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"\[N, H\]"):
        chunked_cross_entropy(torch.zeros(4, 3), torch.zeros(5, 2), torch.zeros(4, dtype=torch.long))


def test_next_token_loss_masks_n_specials_and_weights_softmask() -> None:
    from genolong.data.alphabet import encode
    from genolong.model.loss import bits_per_base, next_token_loss, target_weights

    tokens = torch.from_numpy(encode("ACgtNnAC")).long()[None]
    tokens[0, -1] = 0  # padding
    weights = target_weights(tokens, softmask_weight=0.1)
    # exact: 0/1 times fp32(0.1), elementwise
    assert torch.equal(weights, torch.tensor([[1.0, 1.0, 0.1, 0.1, 0.0, 0.0, 1.0, 0.0]]))
    torch.manual_seed(0)
    hidden = torch.randn(1, 8, 16)
    head = torch.randn(8, 16)
    total, count = next_token_loss(hidden, head, tokens, softmask_weight=0.1)
    logp = torch.log_softmax(hidden[0, :-1] @ head.t(), dim=-1)
    targets = tokens[0, 1:] & 7
    want = -(logp[torch.arange(7), targets] * weights[0, 1:]).sum()
    assert torch.allclose(total, want, rtol=1e-6) and float(count) == pytest.approx(2.2)
    assert bits_per_base(2 * 0.6931471805599453) == pytest.approx(2.0)


def test_next_token_loss_split_at_any_point_sums_to_the_whole() -> None:
    """Context parallelism: a slice that is given the next slice's first token (``next_tokens``)
    scores its last position too, so the slices' (NLL, weight) sums equal the whole window's."""
    from genolong.data.alphabet import encode
    from genolong.model.loss import next_token_loss

    tokens = torch.from_numpy(encode("ACgtNnACGTTAcgA")).long()[None].repeat(2, 1)
    tokens[1, 3] = 5  # N
    torch.manual_seed(1)
    hidden = torch.randn(2, tokens.shape[1], 16)
    head = torch.randn(8, 16)
    whole = next_token_loss(hidden, head, tokens, softmask_weight=0.3)
    for cut in (1, 4, 5, 9, 14):
        first = next_token_loss(hidden[:, :cut], head, tokens[:, :cut], 0.3, next_tokens=tokens[:, cut : cut + 1])
        second = next_token_loss(hidden[:, cut:], head, tokens[:, cut:], 0.3)
        assert torch.allclose(first[0] + second[0], whole[0], rtol=1e-6)
        assert float(first[1] + second[1]) == pytest.approx(float(whole[1]))
