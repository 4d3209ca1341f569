"""Kimi Delta Attention (KDA) token mixing: plain torch reference and chunked CPU form.

- :func:`recurrent_kda`: token-by-token reference (and the decoding form); matches fla's
  ``naive_recurrent_kda``.
- :func:`chunk_kda`: chunked UT-transform / WY form for training on CPU; equal to the recurrent form,
  numerically safe for any decay strength.

Both take fla's layout and argument order: q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``,
beta ``[B, T, H]``, state ``[B, H, K, V]``.
"""

from __future__ import annotations

from .chunk import chunk_kda
from .recurrent import recurrent_kda

__all__ = ["chunk_kda", "recurrent_kda"]
