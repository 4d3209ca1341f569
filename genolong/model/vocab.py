"""Map genolong's base ids onto a checkpoint's vocabulary.

A nucleotide preset embeds genolong's ids directly (:meth:`VocabMap.identity`). A pretrained text
LLM such as GLM-5.3-Flash reads DNA through the single-letter tokens of its own tokenizer: ``A``,
``C``, ``G``, ``T`` and ``N`` map to those token ids (read from ``tokenizer.json`` with the
``tokenizers`` library, or given explicitly), padding to the config's ``pad_token_id``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..data.alphabet import BASE_MASK, BOS, EOS, PAD, VOCAB_SIZE
from ..errors import InputError

if TYPE_CHECKING:  # torch loads in to_model: the recipe loader imports this module without torch
    import torch

__all__ = ["VocabMap", "BASE_LETTERS"]

#: genolong base id -> the letter a text tokenizer must hold as one token.
BASE_LETTERS = {1: "A", 2: "C", 3: "G", 4: "T", 5: "N"}


@dataclass(frozen=True)
class VocabMap:
    """Model token id of each genolong base id (``ids[i]`` for base id ``i``; ``-1``: unmapped).

    Attributes:
        ids: ``VOCAB_SIZE`` (8) model ids for pad, A, C, G, T, N, bos, eos.
    """

    ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.ids) != VOCAB_SIZE:
            raise InputError(f"a vocab map needs {VOCAB_SIZE} ids (pad, A, C, G, T, N, bos, eos), got {len(self.ids)}")
        letters = [self.ids[i] for i in BASE_LETTERS]
        if min(letters) < 0 or len(set(letters)) != len(letters):
            raise InputError(f"the vocab map must give A, C, G, T and N distinct token ids, got {letters}")

    @classmethod
    def identity(cls) -> VocabMap:
        """The nucleotide presets: model id = genolong base id."""
        return cls(tuple(range(VOCAB_SIZE)))

    @classmethod
    def from_mapping(
        cls, letters: Mapping[str, int], pad: int | None = None, bos: int | None = None, eos: int | None = None
    ) -> VocabMap:
        """From explicit ids, e.g. ``{"A": 32, "C": 34, "G": 38, "T": 51, "N": 45}`` (a recipe)."""
        missing = [letter for letter in BASE_LETTERS.values() if letter not in letters]
        if missing:
            raise InputError(f"the vocab map lacks {', '.join(missing)}; give a token id for each of A, C, G, T, N")
        ids = [-1] * VOCAB_SIZE
        for base, letter in BASE_LETTERS.items():
            ids[base] = int(letters[letter])
        for base, value in ((PAD, pad), (BOS, bos), (EOS, eos)):
            ids[base] = -1 if value is None else int(value)
        return cls(tuple(ids))

    @classmethod
    def from_tokenizer(
        cls, directory: str | os.PathLike[str], pad: int | None = None, bos: int | None = None, eos: int | None = None
    ) -> VocabMap:
        """Read the single-letter tokens from ``directory/tokenizer.json``.

        Raises:
            InputError: no tokenizer.json, or a base letter that is not one token.
        """
        from tokenizers import Tokenizer

        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise InputError(
                f"{path} does not exist; give the checkpoint's tokenizer files or the base token ids in the recipe"
            )
        tokenizer = Tokenizer.from_file(str(path))
        letters: dict[str, int] = {}
        for letter in BASE_LETTERS.values():
            token_id = tokenizer.token_to_id(letter)
            if token_id is None:
                raise InputError(
                    f"{path}: {letter!r} is not a single token of this tokenizer; give the base token ids in the recipe"
                )
            letters[letter] = token_id
        return cls.from_mapping(letters, pad=pad, bos=bos, eos=eos)

    def to_model(self, tokens: torch.Tensor) -> torch.Tensor:
        """Store tokens ``[...]`` (case kept) -> model ids ``[...]`` int64.

        Raises:
            InputError: if a token has no model id (e.g. padding without ``pad_token_id``).
        """
        import torch

        table = torch.tensor(self.ids, dtype=torch.long, device=tokens.device)
        out = table[(tokens & BASE_MASK).long()]
        if bool((out < 0).any()):
            raise InputError("a token has no id in this vocab map (padding or a special token); set pad/bos/eos ids")
        return out
