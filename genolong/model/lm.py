"""GenoLM: the GLM-5.3-Flash language model as a plain ``nn.Module``, built from a ModelConfig.

Layout (names are the checkpoint's, without its ``model.language_model.`` prefix)::

    embed_tokens -> copy into hc_mult streams
    layers[i]: attn_hc -> input_layernorm -> self_attn (KDA or DSA) -> merge
               ffn_hc  -> post_attention_layernorm -> mlp (dense SwiGLU or MoE) -> merge
    mean of the streams -> norm -> lm_head (untied)

The model knows nothing about parallelism; ``genolong.parallel`` wraps it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from .config import INDEXED_ATTENTION, ModelConfig
from .dsa import DSAMixer
from .hf import load_checkpoint, save_checkpoint
from .kda import KDAMixer
from .layers import RMSNorm, SwiGLU
from .loss import model_inputs, next_token_loss, next_token_nll
from .mhc import HyperConnection, collapse_streams, expand_streams, merge_streams
from .moe import MoE
from .vocab import VocabMap

__all__ = ["Block", "GenoLM"]


class Block(nn.Module):
    """One decoder layer: mixer and feed-forward, each inside a hyper-connection.

    Args:
        config: the model config.
        layer_idx: the layer's index (selects KDA or DSA, dense or MoE, full or shared indexer).
        moe_chunk_tokens: MoE dispatch chunk (default None: whole batch).

    Shapes: ``streams [B, T, m, H] -> [B, T, m, H]``; DSA layers also pass top-k indices
    ``[B, T, k]`` to a following shared layer.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, moe_chunk_tokens: int | None = None):
        super().__init__()
        assert config.layer_types is not None and config.mlp_layer_types is not None
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == INDEXED_ATTENTION:
            self.self_attn: nn.Module = DSAMixer(config, layer_idx)
        else:
            self.self_attn = KDAMixer(config)
        self.mlp: nn.Module = (
            MoE(config, chunk_tokens=moe_chunk_tokens)
            if config.mlp_layer_types[layer_idx] == "sparse"
            else SwiGLU(config.hidden_size, config.intermediate_size, config.swiglu_limit)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(
        self, streams: torch.Tensor, prev_indices: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``streams [B, T, m, H]`` (and a shared DSA layer's ``prev_indices [B, T, k]``, default
        None) -> (new streams ``[B, T, m, H]``, this DSA layer's top-k indices or None): the
        attention half, then the feed-forward half."""
        streams, indices = self.attention_half(streams, prev_indices)
        return self.ffn_half(streams), indices

    def attention_half(
        self, streams: torch.Tensor, prev_indices: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The mixer inside its hyper-connection: ``attn_hc -> input_layernorm -> self_attn ->
        merge_streams``.

        Shapes: ``streams [B, T, m, H]``, ``prev_indices [B, T, k]`` or None (default; a shared
        DSA layer reuses its predecessor's) -> (``[B, T, m, H]``, DSA top-k indices ``[B, T, k]``
        or None on a KDA layer).
        """
        post, comb, x = self.attn_hc(streams)
        x = self.input_layernorm(x)
        indices = None
        if self.layer_type == INDEXED_ATTENTION:
            x, indices = self.self_attn(x, prev_indices)
        else:
            x = self.self_attn(x)
        return merge_streams(post, comb, x, streams), indices

    def ffn_half(self, streams: torch.Tensor) -> torch.Tensor:
        """The feed-forward inside its hyper-connection: ``ffn_hc -> post_attention_layernorm ->
        mlp -> merge_streams``; position-wise (each token's output depends on that token only).

        Shapes: ``streams [B, T, m, H] -> [B, T, m, H]``.
        """
        post, comb, x = self.ffn_hc(streams)
        x = self.mlp(self.post_attention_layernorm(x))
        return merge_streams(post, comb, x, streams)


class GenoLM(nn.Module):
    """The language model.

    Args:
        config: architecture (see :class:`ModelConfig` and its presets).
        moe_chunk_tokens: MoE dispatch chunk size (default None).

    ``forward(input_ids [B, T]) -> hidden [B, T, H]`` (after the final norm); :meth:`logits` and
    :meth:`loss` take it from there.
    """

    def __init__(self, config: ModelConfig, moe_chunk_tokens: int | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(Block(config, i, moe_chunk_tokens) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        nn.init.normal_(self.embed_tokens.weight, std=config.initializer_range)
        nn.init.normal_(self.lm_head.weight, std=config.initializer_range)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        streams = expand_streams(self.embed_tokens(input_ids), self.config.hc_mult)
        indices = None
        for layer in self.layers:
            streams, indices = layer(streams, indices)
        return self.norm(collapse_streams(streams))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [..., H] -> logits [..., V]`` (materialises them: for short inputs and decoding)."""
        return self.lm_head(hidden)

    def loss(
        self,
        tokens: torch.Tensor,
        softmask_weight: float = 1.0,
        chunk_size: int = 4096,
        vocab: VocabMap | None = None,
        next_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Next-base loss of store tokens ``[B, T]`` (case kept): (NLL sum in nats, weight sum).

        Model inputs are the tokens without case (through ``vocab`` for a text LLM checkpoint;
        default None: the nucleotide ids); N, padding and specials never count as targets.
        ``next_tokens [B, 1]``: the token after the window's last, predicted by its last position
        (a context-parallel slice: the next rank's first token); default None.
        """
        inputs = model_inputs(tokens) if vocab is None else vocab.to_model(tokens)
        hidden = self(inputs)
        return next_token_loss(hidden, self.lm_head.weight, tokens, softmask_weight, chunk_size, vocab, next_tokens)

    @torch.no_grad()
    def token_nll(
        self,
        tokens: torch.Tensor,
        chunk_size: int = 4096,
        vocab: VocabMap | None = None,
        segment_tokens: int | None = None,
    ) -> torch.Tensor:
        """Per-target NLL of store tokens ``[B, T]``: ``[B, T - 1]`` float32 nats, NaN where the
        target does not count (see :func:`genolong.model.loss.next_token_nll`); no gradient.

        ``segment_tokens``: stream the sequence through the model this many tokens at a time
        (:func:`genolong.model.stream.stream_token_nll`: peak memory of one segment plus the DSA
        caches; equal up to float rounding); default None, or ``>= T``: one forward of the whole.
        """
        from .stream import check_segment_tokens, stream_token_nll

        check_segment_tokens(segment_tokens)
        if segment_tokens is not None and segment_tokens < tokens.shape[1]:
            return stream_token_nll(self, tokens, segment_tokens, chunk_size, vocab)
        inputs = model_inputs(tokens) if vocab is None else vocab.to_model(tokens)
        return next_token_nll(self(inputs), self.lm_head.weight, tokens, chunk_size, vocab)

    # -- checkpoints (the GLM-5.3-Flash format; see genolong.model.hf) ------------------------------
    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike[str],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        moe_chunk_tokens: int | None = None,
        kernel_backend: str | None = None,
        config: ModelConfig | None = None,
    ) -> GenoLM:
        """Load a GLM-5.3-Flash-format checkpoint (config.json + safetensors shards), text tower only.

        The model is built on the meta device and filled shard by shard (one checkpoint tensor in
        flight), so a 313B checkpoint never needs two copies in memory; the vision tower and the MTP
        block are skipped with one log line.

        Args:
            directory: the checkpoint directory.
            dtype: parameter dtype (default float32; buffers keep theirs).
            device: where the parameters are allocated (default cpu).
            moe_chunk_tokens: MoE dispatch chunk size (default None).
            kernel_backend: ``genolong.kernels.backends`` name (default None: the config's own,
                ``"torch"`` unless ``config`` says otherwise, e.g. a recipe's ``model.overrides``).
            config: the architecture to build instead of ``directory/config.json``'s (e.g. that
                config with a larger ``index_topk``); the tensor shapes must still match.

        Raises:
            InputError: unsupported architecture, missing shard, a tensor of the wrong shape
                (named), missing or unexpected tensors.
        """
        from ..integrity import check_weights

        check_weights(directory)  # a damaged config.json or shard is named before anything is read
        config = config or ModelConfig.from_pretrained(directory)
        if kernel_backend is not None:
            config = config.replace(kernel_backend=kernel_backend)
        with torch.device("meta"):
            model = cls(config, moe_chunk_tokens=moe_chunk_tokens)
        load_checkpoint(model, directory, dtype=dtype, device=device)
        return model

    def save_pretrained(
        self,
        directory: str | os.PathLike[str],
        dtype: torch.dtype | None = None,
        max_shard_bytes: int = 5 * 10**9,
        copy_files: Sequence[str | os.PathLike[str]] = (),
    ) -> Path:
        """Write this model as a GLM-5.3-Flash-format checkpoint that transformers and the serving
        engines read (see :func:`genolong.model.hf.save_checkpoint` for the arguments)."""
        return save_checkpoint(self, directory, dtype=dtype, max_shard_bytes=max_shard_bytes, copy_files=copy_files)
