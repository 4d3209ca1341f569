"""Tests for genolong.data.datamodule on small stores built with prepare_genome."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

import genolong.data.datamodule as datamodule_module
from genolong.data import alphabet
from genolong.data.datamodule import EvalTileDataset, GenomeDataModule, TrainWindowDataset
from genolong.data.prepare import prepare_genome
from genolong.data.store import GenomeStore
from genolong.data.windows import EvalTiles, TrainWindows
from genolong.errors import InputError

MIN_GAP = 50


def random_bases(rng: np.random.Generator, n: int) -> str:
    """Upper- and lowercase bases, with lowercase runs like soft-masked repeats."""
    letters = rng.choice(list("ACGT"), size=n)
    lower = np.repeat(rng.random(-(-n // 40)) < 0.3, 40)[:n]
    return "".join(np.where(lower, np.char.lower(letters), letters))


def genome_text(seed: int = 0) -> dict[str, str]:
    """Chromosome sequences with N runs: >= MIN_GAP splits a segment, shorter ones stay inside."""
    rng = np.random.default_rng(seed)
    b = lambda n: random_bases(rng, n)  # noqa: E731
    return {
        # leading/trailing N are trimmed; 60 N splits; 20 N stays inside a segment
        "chr1": "N" * 10 + b(1500) + "N" * 60 + b(700) + "N" * 20 + b(600) + "N" * 80 + b(150) + "N" * 7,
        "chr2": b(1100),
        "chr22": b(900) + "N" * 55 + b(333),
    }


def write_fasta(path: Path, records: dict[str, str], width: int = 60) -> Path:
    with open(path, "w") as handle:
        for name, seq in records.items():
            handle.write(f">{name}\n")
            for i in range(0, len(seq), width):
                handle.write(seq[i : i + width] + "\n")
    return path


def reverse_complement_text(text: str) -> str:
    return text.translate(str.maketrans("ACGTNacgtn", "TGCANtgcan"))[::-1]


@pytest.fixture(scope="module")
def genome(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("genome")
    text = genome_text()
    fasta = write_fasta(root / "toy.fa", text)
    out = root / "store"
    prepare_genome([fasta], out, train=("chr1", "chr2"), eval=("chr22",), min_gap=MIN_GAP, progress=False)
    return SimpleNamespace(path=out, text=text)


def make_dm(genome: SimpleNamespace, **kwargs) -> GenomeDataModule:
    args = dict(train_length=256, eval_length=200, batch_size=4, seed=1) | kwargs
    dm = GenomeDataModule(genome.path, **args)
    dm.setup("fit")
    return dm


def take_batches(loader, n: int, dm: GenomeDataModule | None = None) -> list[dict]:
    out = []
    for batch in loader:
        if dm is not None:
            dm.record_batch(batch)
        out.append(batch)
        if len(out) == n:
            break
    return out


def batch_key(batch: dict) -> tuple:
    return (
        batch["window_index"].tolist(),
        batch["start"].tolist(),
        list(batch["contig"]),
        list(batch["strand"]),
        batch["tokens"].numpy().tobytes(),
    )


def test_store_segments_are_what_the_fasta_says(genome):
    # guards the assumptions of the other tests about the toy store
    split = GenomeStore.open(genome.path).split("train")
    assert list(split.segments.itertuples(index=False, name=None)) == [
        ("chr1", 10, 1510, 0),
        ("chr1", 1570, 2890, 1500),
        ("chr1", 2970, 3120, 2820),
        ("chr2", 0, 1100, 2970),
    ]


def test_train_batches_match_the_fasta(genome):
    dm = make_dm(genome)
    assert dm.train_windows.unreachable_bases == 150  # the 150-base segment is shorter than 256
    batches = take_batches(dm.train_dataloader(), 6)
    strands = set()
    for b, batch in enumerate(batches):
        assert batch["tokens"].dtype == torch.long and batch["tokens"].shape == (4, 256)
        assert batch["window_index"].tolist() == list(range(4 * b, 4 * b + 4))
        for row in range(4):
            contig, start, strand = batch["contig"][row], int(batch["start"][row]), batch["strand"][row]
            forward = genome.text[contig][start : start + 256]
            assert "N" * MIN_GAP not in forward  # never across a segment boundary
            expected = forward if strand == "+" else reverse_complement_text(forward)
            assert alphabet.decode(batch["tokens"][row].numpy()) == expected
            strands.add(strand)
    assert strands == {"+", "-"}


@pytest.mark.parametrize("batch_size", [1, 4])
def test_workers_give_the_same_batches_as_one_process(genome, batch_size):
    single = take_batches(make_dm(genome, batch_size=batch_size).train_dataloader(), 6)
    workers = take_batches(make_dm(genome, batch_size=batch_size, num_workers=2).train_dataloader(), 6)
    assert [batch_key(b) for b in single] == [batch_key(b) for b in workers]
    assert all(b["tokens"].shape == (batch_size, 256) and b["tokens"].dtype == torch.long for b in workers)


def test_rank_and_worker_shards_are_disjoint_and_complete(genome, monkeypatch):
    split = GenomeStore.open(genome.path).split("train")
    world, workers, batch_size, per_epoch = 2, 3, 2, 10

    def items(rank: int, worker: int | None) -> list[int]:
        info = None if worker is None else SimpleNamespace(id=worker, num_workers=workers)
        monkeypatch.setattr(datamodule_module, "get_worker_info", lambda: info)
        windows = TrainWindows(split, 128, seed=3, rank=rank, world_size=world)
        return [item["window_index"] for item in TrainWindowDataset(windows, batch_size, per_epoch)]

    everything: list[int] = []
    for rank in range(world):
        rank_stream = items(rank, None)
        assert rank_stream == list(range(rank, world * per_epoch, world))
        shards = [items(rank, w) for w in range(workers)]
        assert sorted(i for s in shards for i in s) == rank_stream  # disjoint, union = rank stream
        # the DataLoader takes one batch from each worker in turn: that is the rank's order
        batches = [[s[i : i + batch_size] for i in range(0, len(s), batch_size)] for s in shards]
        interleaved = [i for b in range(math.ceil(per_epoch / batch_size)) for i in batches[b % workers][b // workers]]
        assert interleaved == rank_stream
        everything += rank_stream
    assert sorted(everything) == list(range(world * per_epoch))


def test_data_parallel_ranks_with_workers_union_to_the_single_rank_stream(genome):
    single = take_batches(make_dm(genome, batch_size=2).train_dataloader(), 6)
    expected = {i: row for b in single for i, row in zip(b["window_index"].tolist(), b["tokens"])}
    seen = {}
    for rank in range(2):
        dm = make_dm(genome, batch_size=2, dp_rank=rank, dp_size=2, num_workers=2 if rank else 0)
        for batch in take_batches(dm.train_dataloader(), 3):
            for i, row in zip(batch["window_index"].tolist(), batch["tokens"]):
                assert i % 2 == rank and i not in seen
                seen[i] = row
    assert sorted(seen) == sorted(expected)
    assert all(torch.equal(seen[i], expected[i]) for i in expected)  # exact: token rows


def test_eval_tiles_are_padded_and_cover_the_eval_split(genome):
    dm = make_dm(genome, eval_batch_size=3)
    dm.setup("validate")
    rebuilt = {}
    for batch in dm.val_dataloader():
        assert batch["tokens"].dtype == torch.long and batch["tokens"].shape[1] == 200
        for row, length in enumerate(batch["length"].tolist()):
            tokens = batch["tokens"][row]
            assert (tokens[length:] == alphabet.PAD).all() and (tokens[:length] != alphabet.PAD).all()
            start = int(batch["start"][row])
            rebuilt[start] = alphabet.decode(tokens[:length].numpy())
    text = genome.text["chr22"]
    assert "".join(rebuilt[s] for s in sorted(rebuilt)) == text[:900] + text[955:]
    assert sorted(rebuilt) == [0, 200, 400, 600, 800, 955, 1155]
    tiles = EvalTileDataset(EvalTiles(GenomeStore.open(genome.path).split("eval"), 200))
    assert tiles[4]["length"] == 100 and tiles[6]["length"] == 133 and len(tiles) == 7


@pytest.mark.parametrize(("dp_size", "max_tiles"), [(2, None), (3, None), (3, 5), (4, 2)])
def test_eval_tiles_are_dealt_out_to_data_parallel_ranks(genome, dp_size, max_tiles):
    """Tile i goes to rank i mod dp_size; every rank gets the same number of items (FSDP2 needs the
    same steps everywhere), the short shares padded with empty tiles that count nothing."""
    count = 7 if max_tiles is None else max_tiles
    shares = []
    for rank in range(dp_size):
        dm = make_dm(genome, eval_batch_size=1, dp_rank=rank, dp_size=dp_size, eval_max_tiles=max_tiles)
        dm.setup("validate")
        shares.append([(int(b["tile_index"]), int(b["length"]), b["tokens"]) for b in dm.val_dataloader()])
    assert {len(share) for share in shares} == {math.ceil(count / dp_size)}
    real = sorted(index for share in shares for index, _, _ in share if index >= 0)
    assert real == list(range(count))
    for rank, share in enumerate(shares):
        assert [i for i, _, _ in share if i >= 0] == list(range(rank, count, dp_size))
        for index, length, tokens in share:
            if index < 0:
                assert length == 0 and (tokens == alphabet.PAD).all()
    with pytest.raises(InputError, match="eval_max_tiles"):
        GenomeDataModule(genome.path, train_length=256, eval_max_tiles=0)


def test_state_dict_resume_continues_the_stream(genome):
    straight = take_batches(make_dm(genome).train_dataloader(), 6)
    first = make_dm(genome, num_workers=2)
    take_batches(first.train_dataloader(), 3, dm=first)  # workers read ahead; only 3 are consumed
    state = first.state_dict()
    assert state == {"train": {"next_index": 12, "seed": 1, "length": 256}}
    second = GenomeDataModule(genome.path, train_length=256, eval_length=200, batch_size=4, seed=1)
    second.load_state_dict(state)  # before setup, as Lightning may do
    second.setup("fit")
    resumed = take_batches(second.train_dataloader(), 3)
    assert [batch_key(b) for b in resumed] == [batch_key(b) for b in straight[3:]]


def test_windows_per_epoch_blocks_continue_across_epochs(genome):
    dm = make_dm(genome, batch_size=4, windows_per_epoch=10)
    loader = dm.train_dataloader()
    assert len(loader) == 3
    epoch1 = take_batches(loader, 100, dm=dm)
    assert [b["window_index"].tolist() for b in epoch1] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    epoch2 = take_batches(dm.train_dataloader(), 1, dm=dm)  # interrupted after one batch
    assert epoch2[0]["window_index"].tolist() == [10, 11, 12, 13]
    resumed = make_dm(genome, batch_size=4, windows_per_epoch=10)
    resumed.load_state_dict(dm.state_dict())
    rest = take_batches(resumed.train_dataloader(), 100)
    assert [b["window_index"].tolist() for b in rest] == [[14, 15, 16, 17], [18, 19]]


def test_too_long_train_length_fails_in_setup(genome):
    dm = GenomeDataModule(genome.path, train_length=5000)
    with pytest.raises(InputError, match="L=5,000"):
        dm.setup("fit")


class TinyLM(L.LightningModule):
    """Records which windows and tiles it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 1)
        self.seen: list[int] = []
        self.tiles: list[int] = []

    def training_step(self, batch, batch_idx):
        self.seen += batch["window_index"].tolist()
        return self.embed(batch["tokens"]).mean()

    def validation_step(self, batch, batch_idx):
        self.tiles += batch["tile_index"].tolist()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(genome, steps: int, ckpt: Path | None = None, save: Path | None = None, **dm_kwargs) -> TinyLM:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=2,
        limit_val_batches=2,
    )
    model = TinyLM()
    dm = GenomeDataModule(genome.path, train_length=128, eval_length=300, batch_size=2, seed=5, **dm_kwargs)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    return model


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore:.*LeafSpec")
def test_lightning_checkpoint_resume_sees_the_same_windows(genome, tmp_path):
    straight = fit(genome, 6)
    assert straight.seen == list(range(12))
    assert straight.tiles[:2] == [0, 1]
    first = fit(genome, 3, save=tmp_path / "step3.ckpt", num_workers=2)
    assert first.seen == list(range(6))
    resumed = fit(genome, 6, ckpt=tmp_path / "step3.ckpt", num_workers=2)
    assert resumed.seen == list(range(6, 12))
