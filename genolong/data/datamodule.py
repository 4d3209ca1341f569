"""Torch datasets and the Lightning data module over a :class:`~genolong.data.store.GenomeStore`.

* :class:`TrainWindowDataset` (iterable): this data-parallel rank's share of the
  :class:`~genolong.data.windows.TrainWindows` stream. With ``W`` DataLoader workers, worker ``w``
  reads the rank's batches ``w, w + W, ...`` (a batch is ``batch_size`` consecutive windows of the
  rank); the DataLoader collects batches from its workers in that same round-robin order, so the
  batches come out identical, in the same order, whatever ``num_workers`` is.
* :class:`EvalTileDataset` (map-style): :class:`~genolong.data.windows.EvalTiles`, the short last
  tile of a segment padded with ``alphabet.PAD``; ``length`` gives the true length.
* :class:`GenomeDataModule`: opens the store in :meth:`~GenomeDataModule.setup` and builds both.
  It follows the train windows the training loop actually used (its ``on_before_batch_transfer``
  hook sees every consumed batch, not the ones read ahead) and carries that position in its
  ``state_dict``, which Lightning writes into checkpoints; a resumed run continues the stream
  exactly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate, get_worker_info

from ..errors import InputError
from .alphabet import PAD
from .repeats import RepeatPlanting
from .store import GenomeStore
from .windows import EvalTiles, TrainWindows, Window

__all__ = ["TrainWindowDataset", "EvalTileDataset", "GenomeDataModule", "window_to_item", "collate_windows"]


def _shared_empty(*shape: int) -> torch.Tensor:
    """An uninitialised torch.long tensor in shared memory: a DataLoader worker hands it to the
    main process by file descriptor instead of copying it (1M tokens: 8 MB) once more."""
    numel = int(np.prod(shape))
    try:
        storage = torch.UntypedStorage._new_shared(numel * 8)
    except AttributeError:  # private API (default_collate uses it too); public route: one extra copy
        return torch.empty(shape, dtype=torch.long).share_memory_()
    return torch.empty(0, dtype=torch.long).set_(storage, 0, shape)


def window_to_item(window: Window, shared: bool = False) -> dict[str, Any]:
    """A training window as a sample dict.

    Args:
        window: the window.
        shared: put ``tokens`` in shared memory (for DataLoader workers; default False).

    Returns:
        ``tokens`` torch.long ``[L]`` (case kept: ``tokens & BASE_MASK`` is the base), ``contig``
        (str), ``start`` (int, 0-based genomic start on the forward strand), ``strand`` (``"+"`` or
        ``"-"``) and ``window_index`` (int, the window's number in the global stream).
    """
    tokens = torch.from_numpy(window.tokens)
    return {
        "tokens": _shared_empty(tokens.numel()).copy_(tokens) if shared else tokens.long(),
        "contig": window.contig,
        "start": window.start,
        "strand": window.strand,
        "window_index": window.index,
    }


def collate_windows(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Collate :func:`window_to_item` dicts: ``tokens`` ``[B, L]`` (for ``B == 1`` a view of the
    item's tensor, no copy), ``start``/``window_index`` ``[B]`` int64, ``contig``/``strand`` lists."""
    meta = default_collate([{k: v for k, v in item.items() if k != "tokens"} for item in items])
    tokens = [item["tokens"] for item in items]
    if len(tokens) == 1:
        meta["tokens"] = tokens[0].unsqueeze(0)
    else:
        out = _shared_empty(len(tokens), *tokens[0].shape) if get_worker_info() is not None else None
        meta["tokens"] = torch.stack(tokens, out=out)
    return meta


class TrainWindowDataset(IterableDataset):
    """This data-parallel rank's training windows, sharded over DataLoader workers by batch.

    Each iteration starts at the windows' current position (``windows.position``, which the data
    module advances as batches are consumed) and does not move it. Worker ``w`` of ``W`` yields the
    rank's windows ``[p + b * batch_size, p + (b + 1) * batch_size)`` for ``b = w, w + W, ...``,
    which a ``DataLoader(batch_size=batch_size)`` turns back into the single-worker order.

    Args:
        windows: the window stream (its ``rank``/``world_size`` select this rank's share).
        batch_size: windows per DataLoader batch; must equal the DataLoader's ``batch_size``
            (default 1).
        windows_per_epoch: windows per epoch for this rank, or ``None`` (default) for an endless
            stream (train with ``max_steps``). Epochs are consecutive blocks of the rank's stream,
            so a run resumed mid-epoch finishes that epoch's block.

    Iterating it yields dicts from :func:`window_to_item` (collate them with
    :func:`collate_windows`).
    """

    def __init__(self, windows: TrainWindows, batch_size: int = 1, windows_per_epoch: int | None = None):
        super().__init__()
        if batch_size < 1:
            raise InputError(f"batch_size must be at least 1, got {batch_size}")
        if windows_per_epoch is not None and windows_per_epoch < 1:
            raise InputError(f"windows_per_epoch must be at least 1 (or None for endless), got {windows_per_epoch}")
        self.windows = windows
        self.batch_size = int(batch_size)
        self.windows_per_epoch = windows_per_epoch

    def _bounds(self) -> tuple[int, int | None]:
        """Local positions ``[first, stop)`` this iteration covers (``stop`` None: endless)."""
        first = self.windows.position
        if self.windows_per_epoch is None:
            return first, None
        # count windows of this rank from the start of the global stream, so that epoch blocks
        # stay put when a run resumes from a state
        done = self.windows.next_index // self.windows.world_size
        epoch_left = self.windows_per_epoch - done % self.windows_per_epoch
        return first, first + epoch_left

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        first, stop = self._bounds()
        # batch 1 (the usual case at long L): items go to shared memory and collate_windows passes
        # them on without a copy; larger batches are stacked into shared memory by the collate
        shared = info is not None and self.batch_size == 1
        batch = worker
        while True:
            lo = first + batch * self.batch_size
            hi = lo + self.batch_size if stop is None else min(lo + self.batch_size, stop)
            if lo >= hi:
                return
            for local in range(lo, hi):
                yield window_to_item(self.windows.window(self.windows.global_index(local)), shared)
            batch += workers

    def __len__(self) -> int:
        """Windows per epoch of this rank; ``TypeError`` for an endless stream (no length)."""
        if self.windows_per_epoch is None:
            raise TypeError("an endless TrainWindowDataset has no length; set windows_per_epoch")
        return int(self.windows_per_epoch)


class EvalTileDataset(Dataset):
    """Evaluation tiles as padded samples.

    Args:
        tiles: the tiles of the eval split.
        indices: the tiles this dataset serves, in order (default None: all); ``-1`` is an empty
            tile (all PAD, ``length`` 0, ``tile_index`` -1), which evens out the data-parallel
            ranks' shares (every rank must run the same number of steps under FSDP2).

    Items are dicts: ``tokens`` torch.long ``[L]`` (positions ``>= length`` are ``alphabet.PAD``),
    ``length`` (int, true tile length), ``contig`` (str), ``start`` (int, 0-based genomic),
    ``offset`` (int, into ``split.tokens``) and ``tile_index`` (int).
    """

    def __init__(self, tiles: EvalTiles, indices: Sequence[int] | None = None):
        self.tiles = tiles
        self.indices = list(range(len(tiles))) if indices is None else [int(i) for i in indices]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.indices[index] < 0:
            tokens = torch.full((self.tiles.length,), PAD, dtype=torch.long)
            return {"tokens": tokens, "length": 0, "contig": "", "start": 0, "offset": 0, "tile_index": -1}
        tile = self.tiles[self.indices[index]]
        tokens = torch.full((self.tiles.length,), PAD, dtype=torch.long)
        tokens[: tile.length] = torch.from_numpy(tile.tokens)
        return {
            "tokens": tokens,
            "length": tile.length,
            "contig": tile.contig,
            "start": tile.start,
            "offset": tile.offset,
            "tile_index": tile.index,
        }


class GenomeDataModule(L.LightningDataModule):
    """Train windows and eval tiles of a prepared genome store.

    Args:
        store: the store directory made by ``genolong prepare``; opened with
            :meth:`GenomeStore.open` in :meth:`setup`.
        train_length: training window length ``L`` in tokens (keyword-only, required).
        eval_length: eval tile length (default: ``train_length``).
        train_split: split to draw training windows from (default ``"train"``).
        eval_split: split to tile for validation/test (default ``"eval"``; ``None`` for none).
        batch_size: windows per training batch (default 1).
        eval_batch_size: tiles per eval batch (default: ``batch_size``).
        seed: window seed (default 0).
        rc_prob: reverse-complement probability (default 0.5).
        num_workers: DataLoader worker processes (default 0: read in the main process).
        windows_per_epoch: training windows per epoch per data-parallel rank (default ``None``:
            endless, train with ``max_steps``).
        dp_rank, dp_size: data-parallel rank and size (default: the trainer strategy's
            data-parallel rank and size, ``distributed_sampler_kwargs``: under Lightning's
            ``ModelParallelStrategy`` the ranks of one context-parallel group share them, so they
            get the same windows and tiles).
        eval_max_tiles: validate on the first this many tiles of the eval split (default None:
            all). The tiles are dealt out to the data-parallel ranks (tile ``i`` to rank
            ``i mod dp_size``), each rank's share padded with empty tiles to the same length.
        verify: check every store file's sha256 on open (default True).
        pin_memory: DataLoader ``pin_memory`` (default False).
        planting: plant diverged copies into the training windows
            (:class:`~genolong.data.repeats.RepeatPlanting`); default None: windows as stored.

    Batches: train ``tokens`` torch.long ``[B, L]`` with lists/tensors of the metadata of
    :func:`window_to_item`; eval as :class:`EvalTileDataset` items, collated.

    The data module overrides ``on_before_batch_transfer`` to follow the consumed training
    windows; if the LightningModule overrides it too, Lightning uses this one (and warns).
    """

    def __init__(
        self,
        store: str | os.PathLike[str],
        *,
        train_length: int,
        eval_length: int | None = None,
        train_split: str = "train",
        eval_split: str | None = "eval",
        batch_size: int = 1,
        eval_batch_size: int | None = None,
        seed: int = 0,
        rc_prob: float = 0.5,
        num_workers: int = 0,
        windows_per_epoch: int | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        verify: bool = True,
        pin_memory: bool = False,
        eval_max_tiles: int | None = None,
        planting: RepeatPlanting | None = None,
    ):
        super().__init__()
        if num_workers < 0:
            raise InputError(f"num_workers must be >= 0, got {num_workers}")
        if (dp_rank is None) != (dp_size is None):
            raise InputError("give both dp_rank and dp_size, or neither (to use the trainer's rank and world size)")
        self.store_path = Path(store)
        self.train_length = int(train_length)
        self.eval_length = int(eval_length) if eval_length is not None else self.train_length
        self.train_split = train_split
        self.eval_split = eval_split
        self.batch_size = int(batch_size)
        self.eval_batch_size = int(eval_batch_size) if eval_batch_size is not None else self.batch_size
        self.seed = int(seed)
        self.rc_prob = float(rc_prob)
        self.num_workers = int(num_workers)
        self.windows_per_epoch = windows_per_epoch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.verify = verify
        self.pin_memory = pin_memory
        if eval_max_tiles is not None and eval_max_tiles < 1:
            raise InputError(f"eval_max_tiles must be >= 1 or None, got {eval_max_tiles}")
        self.eval_max_tiles = eval_max_tiles
        self.planting = planting
        self.store: GenomeStore | None = None
        self.train_windows: TrainWindows | None = None
        self.eval_tiles: EvalTiles | None = None
        self._pending_state: Mapping[str, Any] | None = None

    def _data_parallel(self) -> tuple[int, int]:
        if self.dp_rank is not None and self.dp_size is not None:
            return self.dp_rank, self.dp_size
        trainer = self.trainer
        if trainer is not None:
            kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
            if "num_replicas" in kwargs:
                return int(kwargs["rank"]), int(kwargs["num_replicas"])
            return int(trainer.global_rank), int(trainer.world_size)
        return 0, 1

    def setup(self, stage: str | None = None) -> None:
        """Open the store (once) and build the train windows (``fit``) and eval tiles."""
        if self.store is None:
            self.store = GenomeStore.open(self.store_path, verify=self.verify)
        if stage in (None, "fit") and self.train_windows is None:
            rank, size = self._data_parallel()
            self.train_windows = TrainWindows(
                self.store.split(self.train_split),
                self.train_length,
                seed=self.seed,
                rc_prob=self.rc_prob,
                rank=rank,
                world_size=size,
                planting=self.planting,
            )
            if self._pending_state is not None:
                self.train_windows.load_state_dict(self._pending_state)
                self._pending_state = None
        if self.eval_split is not None and self.eval_tiles is None:
            self.eval_tiles = EvalTiles(self.store.split(self.eval_split), self.eval_length)

    def train_dataloader(self) -> DataLoader:
        """Endless (or ``windows_per_epoch``) training batches from the current position."""
        if self.train_windows is None:
            raise RuntimeError("call setup('fit') before train_dataloader()")
        dataset = TrainWindowDataset(self.train_windows, self.batch_size, self.windows_per_epoch)
        # no persistent workers: each epoch's workers must start from the consumed position
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            collate_fn=collate_windows,
            pin_memory=self.pin_memory,
            persistent_workers=False,
        )

    def _eval_dataloader(self) -> DataLoader:
        if self.eval_tiles is None:
            raise RuntimeError("no eval split: construct with eval_split=... and call setup() first")
        count = len(self.eval_tiles) if self.eval_max_tiles is None else min(self.eval_max_tiles, len(self.eval_tiles))
        rank, size = self._data_parallel()
        share = list(range(rank, count, size))
        share += [-1] * (-(-count // size) - len(share))  # even shares: empty tiles count nothing
        return DataLoader(
            EvalTileDataset(self.eval_tiles, share),
            batch_size=self.eval_batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )

    def val_dataloader(self) -> DataLoader | list[Any]:
        """This data-parallel rank's eval tiles in order (an empty list when ``eval_split`` is
        None: no validation)."""
        return [] if self.eval_split is None else self._eval_dataloader()

    def test_dataloader(self) -> DataLoader:
        """This data-parallel rank's eval tiles in order."""
        return self._eval_dataloader()

    def record_batch(self, batch: Mapping[str, Any]) -> None:
        """Mark a training batch as consumed (the position :meth:`state_dict` saves).

        Lightning calls this through ``on_before_batch_transfer``; call it yourself when you
        iterate :meth:`train_dataloader` outside a Trainer.
        """
        if self.train_windows is None or "window_index" not in batch:
            return
        index = batch["window_index"]
        last = int(index.max()) if isinstance(index, torch.Tensor) else int(max(index))
        self.train_windows.advance_past(last)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Record consumed training batches; returns ``batch`` unchanged."""
        if isinstance(batch, Mapping):
            self.record_batch(batch)
        return batch

    def state_dict(self) -> dict[str, Any]:
        """``{"train": TrainWindows.state_dict()}`` once set up (Lightning saves it in checkpoints)."""
        if self.train_windows is not None:
            return {"train": self.train_windows.state_dict()}
        if self._pending_state is not None:
            return {"train": dict(self._pending_state)}
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the train window position (before or after :meth:`setup`)."""
        train = state_dict.get("train")
        if train is None:
            return
        if self.train_windows is not None:
            self.train_windows.load_state_dict(train)
        else:
            self._pending_state = dict(train)
