"""Base ids -> a checkpoint's token ids."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from genolong.data.alphabet import encode
from genolong.errors import InputError
from genolong.model.vocab import VocabMap


def test_identity_keeps_ids_and_drops_case() -> None:
    tokens = torch.from_numpy(encode("ACgtN")).long()
    assert VocabMap.identity().to_model(tokens).tolist() == [1, 2, 3, 4, 5]


def test_from_tokenizer(tmp_path: Path) -> None:
    vocab = {"[UNK]": 0, "hello": 1, "A": 32, "C": 34, "G": 38, "T": 51, "N": 45, "<pad>": 99}
    Tokenizer(WordLevel(vocab, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    mapping = VocabMap.from_tokenizer(tmp_path, pad=99)
    tokens = torch.from_numpy(encode("ACGTNacgtn")).long()
    assert mapping.to_model(tokens).tolist() == [32, 34, 38, 51, 45] * 2
    assert mapping.to_model(torch.tensor([0])).tolist() == [99]
    with pytest.raises(InputError, match="no id"):
        VocabMap.from_tokenizer(tmp_path).to_model(torch.tensor([0]))


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="tokenizer.json does not exist"):
        VocabMap.from_tokenizer(tmp_path)
    Tokenizer(WordLevel({"[UNK]": 0, "A": 1, "C": 2, "G": 3}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(InputError, match="'T' is not a single token"):
        VocabMap.from_tokenizer(tmp_path)
    with pytest.raises(InputError, match="distinct"):
        VocabMap.from_mapping({"A": 1, "C": 1, "G": 3, "T": 4, "N": 5})
    with pytest.raises(InputError, match="lacks N"):
        VocabMap.from_mapping({"A": 1, "C": 2, "G": 3, "T": 4})


def test_loss_through_a_text_vocabulary() -> None:
    """A text-LLM-sized vocabulary: GenoLM.loss(vocab=...) reads and predicts the mapped ids; N and
    padding targets do not count (and need no id), soft-masked ones count with their weight."""
    from genolong.data.alphabet import encode
    from genolong.model import PRESETS, GenoLM

    vocab = VocabMap.from_mapping({"A": 40, "C": 41, "G": 47, "T": 59, "N": 52}, pad=0)
    torch.manual_seed(1)
    model = GenoLM(PRESETS["tiny"].replace(vocab_size=64, num_hidden_layers=2, pattern="KK"))
    tokens = torch.from_numpy(encode("ACGTNacgtnACGTACGTAC")).long()[None]
    tokens[0, -2:] = 0  # padding at the end
    total, count = model.loss(tokens, softmask_weight=0.5, vocab=vocab)
    ids = vocab.to_model(tokens)
    logits = model.logits(model(ids))[0, :-1]
    targets = ids[0, 1:]
    # targets C G T N a c g t n A C G T A C G T pad pad
    weights = torch.tensor([1, 1, 1, 0, 0.5, 0.5, 0.5, 0.5, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0])
    expected = (torch.nn.functional.cross_entropy(logits, targets, reduction="none") * weights).sum()
    assert float(count) == float(weights.sum())
    assert torch.allclose(total, expected, rtol=1e-5, atol=1e-5)
