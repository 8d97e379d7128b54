"""Data pipeline: corpora, tokenizers + caches, shards, resume, held-out split, argument checks."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import diloco_lightning.data.tokenizer as tokmod
from diloco_lightning.data import (
    ByteTokenizer,
    HeldOutDataset,
    ShardedTokenDataset,
    TextDataModule,
    build_token_file,
    load_or_train_bpe,
    stdlib_corpus,
    text_corpus,
    train_bpe,
)

TEXT = "def f(x):\n    return x + 1  # héllo wörld ✓\n\n\tclass Ä: pass\n"


def _write_texts(root: Path, n_files: int = 6, reps: int = 40) -> str:
    """Small real-looking corpus: slices of a stdlib module, one per file. Returns a glob."""
    src = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")
    root.mkdir(parents=True, exist_ok=True)
    chunk = len(src) // n_files
    for i in range(n_files):
        (root / f"doc{i}.txt").write_text(src[i * chunk : (i + 1) * chunk] + TEXT * (reps // 10), encoding="utf-8")
    return str(root / "*.txt")


def _arange_tokens(path: Path, n: int, dtype=np.uint32) -> Path:
    """Token file whose i-th token is i: a window's first token is its offset."""
    np.arange(n, dtype=dtype).tofile(path)
    return path


def _drain(ds, n):
    it = iter(ds)
    return [next(it) for _ in range(n)]


# ----------------------------------------------------------------------------- tokenizers


def test_bpe_trained_once_then_cached(tmp_path, monkeypatch):
    files = text_corpus(_write_texts(tmp_path / "t"))
    calls = []
    real = tokmod._train_bpe
    monkeypatch.setattr(tokmod, "_train_bpe", lambda texts, v: calls.append(v) or real(texts, v))
    tok = load_or_train_bpe(files, 400, tmp_path / "cache")
    assert calls == [400] and tok.path.exists() and tok.path.parent == tmp_path / "cache" / "tokenizers"
    mtime = tok.path.stat().st_mtime_ns
    again = load_or_train_bpe(files, 400, tmp_path / "cache")
    assert calls == [400], "second call must load the cache, not retrain"
    assert again.path == tok.path and again.path.stat().st_mtime_ns == mtime
    assert again.fingerprint == tok.fingerprint and again.vocab_size == tok.vocab_size <= 400
    assert not list((tmp_path / "cache" / "tokenizers").glob("*.tmp"))  # atomic write left no debris
    # A different vocab size or a changed corpus file is a different cache entry.
    load_or_train_bpe(files, 300, tmp_path / "cache")
    Path(files[0].path).write_text("changed", encoding="utf-8")
    load_or_train_bpe(text_corpus(str(tmp_path / "t" / "*.txt")), 400, tmp_path / "cache")
    assert calls == [400, 300, 400]


def test_bpe_round_trip_and_deterministic(tmp_path):
    files = text_corpus(_write_texts(tmp_path / "t"))
    texts = [f.path.read_text(encoding="utf-8") for f in files]
    a, b = train_bpe(texts, 350), train_bpe(texts, 350)
    assert a.fingerprint == b.fingerprint  # same corpus -> same vocabulary on every node
    ids = a.encode(TEXT)
    assert a.decode(ids) == TEXT and len(ids) < len(TEXT.encode())
    assert a.eos_id == a.backend.token_to_id("<|endoftext|>")
    assert a.encode_batch([TEXT, "x"]) == [ids, a.encode("x")]


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids + [tok.eos_id]) == TEXT  # the separator decodes to nothing
    assert (tok.vocab_size, tok.eos_id) == (257, 256)


# ----------------------------------------------------------------------------- token files


def test_token_cache_built_once(tmp_path):
    files = text_corpus(_write_texts(tmp_path / "t", n_files=3))
    tok = ByteTokenizer()
    path = build_token_file(files, tok, tmp_path / "cache")
    assert path.name.endswith(".uint16.bin")
    data = np.memmap(path, dtype=np.uint16, mode="r")
    assert int((data == tok.eos_id).sum()) == 3  # one separator after each document
    expected = [i for f in files for i in (*tok.encode(f.path.read_text(encoding="utf-8")), tok.eos_id)]
    assert data.tolist() == expected
    mtime = path.stat().st_mtime_ns
    assert build_token_file(files, tok, tmp_path / "cache") == path and path.stat().st_mtime_ns == mtime


def test_pretokenized_uint16_input(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, size=20_000).astype(np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    dm = TextDataModule(
        token_file=tmp_path / "train.bin", token_dtype="uint16", vocab_size=1000, seq_len=16, batch_size=4
    )
    assert dm.vocab_size == 1000 and dm.tokenizer is None
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (4, 17) and batch.dtype == torch.int64
    blocks = {tuple(tokens[i : i + 17]) for i in range(0, len(tokens) - 16, 17)}
    assert all(tuple(row.tolist()) in blocks for row in batch)  # contiguous, block-aligned slices
    val = next(iter(dm.val_dataloader()))
    split = dm.val_dataset().start
    assert np.array_equal(val[0].numpy(), tokens[split : split + 17])


def test_user_text_glob_input(tmp_path):
    pattern = _write_texts(tmp_path / "t")
    dm = TextDataModule(text_files=pattern, vocab_size=300, seq_len=32, batch_size=2, cache_dir=tmp_path / "c")
    assert dm.vocab_size == 300
    dm.prepare_data()
    dm.setup("fit")
    text = dm.tokenizer.decode(next(iter(dm.train_dataloader()))[0].tolist())
    corpus = "".join(Path(p).read_text(encoding="utf-8") for p in sorted((tmp_path / "t").glob("*.txt")))
    assert text.replace("<|endoftext|>", "")[:20] in corpus
    # The same tokenizer.json can be given back explicitly.
    dm2 = TextDataModule(text_files=pattern, tokenizer=dm.tokenizer.path, seq_len=32, cache_dir=tmp_path / "c")
    assert dm2.tokenizer.fingerprint == dm.tokenizer.fingerprint
    assert dm2.vocab_size == dm.tokenizer.vocab_size
    assert dm2.token_path == dm.token_path  # cache shared: same corpus, same tokenizer


def test_stdlib_corpus_default_source(tmp_path):
    files = stdlib_corpus(max_bytes=400_000)
    assert files == stdlib_corpus(max_bytes=400_000)  # deterministic
    assert 0 < sum(f.size for f in files) <= 400_000
    assert all(f.name.endswith((".py", ".txt", ".rst")) and not f.name.startswith(("site-packages", "test/"))
               for f in files)
    assert len({f.name.split("/")[0] for f in files}) > 5  # spread over the library, not one package
    dm = TextDataModule(max_bytes=400_000, vocab_size=512, seq_len=64, batch_size=2, cache_dir=tmp_path)
    dm.setup("fit")
    assert dm.tokenizer.vocab_size == 512 and dm.vocab_size == 512
    assert next(iter(dm.train_dataloader())).max() < 512


# ----------------------------------------------------------------------------- shards


def test_shards_disjoint_and_deterministic(tmp_path):
    T, n_nodes = 7, 3
    path = _arange_tokens(tmp_path / "a.bin", 2000)
    end = 1800
    streams = {}
    for seed in (0, 1):
        for r in range(n_nodes):
            ds = ShardedTokenDataset(path, "uint32", seq_len=T, node_rank=r, num_nodes=n_nodes, seed=seed, end=end)
            streams[seed, r] = [int(w[0]) for w in _drain(ds, 2 * ds.shard_size)]
            assert all(w % (T + 1) == 0 and w + T + 1 <= end for w in streams[seed, r])
    S = ds.shard_size
    assert S == (end // (T + 1)) // n_nodes
    for seed in (0, 1):
        epoch0 = [set(streams[seed, r][:S]) for r in range(n_nodes)]
        assert all(len(e) == S for e in epoch0)  # no repeats within an epoch
        assert not (epoch0[0] & epoch0[1] or epoch0[0] & epoch0[2] or epoch0[1] & epoch0[2])  # disjoint
        for r in range(n_nodes):
            assert set(streams[seed, r][S:]) == epoch0[r]  # epoch 2: same shard ...
            assert streams[seed, r][S:] != streams[seed, r][:S]  # ... reshuffled
    # Same (seed, node) -> same stream; another seed -> same shard, other order.
    again = ShardedTokenDataset(path, "uint32", seq_len=T, node_rank=1, num_nodes=n_nodes, seed=0, end=end)
    assert [int(w[0]) for w in _drain(again, 2 * S)] == streams[0, 1]
    assert streams[1, 1] != streams[0, 1] and set(streams[1, 1][:S]) == set(streams[0, 1][:S])
    # Windows are contiguous slices of the file.
    w = next(iter(again))
    assert torch.equal(w, torch.arange(int(w[0]), int(w[0]) + T + 1))


def test_held_out_identical_across_nodes_and_unseen(tmp_path):
    path = _arange_tokens(tmp_path / "a.bin", 5000)
    kw = dict(token_file=path, token_dtype="uint32", vocab_size=5000, seq_len=15, batch_size=4, val_fraction=0.05)
    dms = [TextDataModule(node_rank=r, num_nodes=3, seed=r, **kw) for r in range(3)]
    vals = []
    for dm in dms:
        dm.setup("fit")
        vals.append(torch.cat(list(dm.val_dataloader())))
    assert all(torch.equal(v, vals[0]) for v in vals)
    assert vals[0].shape == (len(dms[0].val_dataset()), 16) and int(vals[0].min()) == 5000 - 250
    for dm in dms:  # no training window reaches into the held-out tokens
        ds = dm.train_dataset()
        assert max(int(w[-1]) for w in _drain(ds, ds.shard_size)) < 5000 - 250


# ----------------------------------------------------------------------------- resume


def test_dataset_state_dict_resume(tmp_path):
    path = _arange_tokens(tmp_path / "a.bin", 3000)

    def make():
        return ShardedTokenDataset(path, "uint32", seq_len=9, node_rank=1, num_nodes=2, seed=5, batch_size=4)

    full = [b for b, _ in zip(DataLoader(make(), batch_size=4), range(12))]  # 12 batches: crosses an epoch
    ds = make()
    it = iter(DataLoader(ds, batch_size=4))
    for i in range(7):
        assert torch.equal(next(it), full[i])
    state = ds.state_dict()
    assert state["position"] == 28
    resumed = make()
    resumed.load_state_dict(state)
    rest = [b for b, _ in zip(DataLoader(resumed, batch_size=4), range(5))]
    assert all(torch.equal(a, b) for a, b in zip(rest, full[7:]))


def test_datamodule_state_dict_resume_without_trainer(tmp_path):
    path = _arange_tokens(tmp_path / "a.bin", 3000)
    kw = dict(token_file=path, token_dtype="uint32", vocab_size=3000, seq_len=9, batch_size=4, node_rank=0, num_nodes=2)
    dm = TextDataModule(**kw)
    it = iter(dm.train_dataloader())
    seen = [next(it) for _ in range(3)]
    state = dm.state_dict()
    assert state["position"] == 12
    expected = next(it)
    dm2 = TextDataModule(**kw)
    dm2.load_state_dict(state)
    assert torch.equal(next(iter(dm2.train_dataloader())), expected)
    assert not any(torch.equal(expected, s) for s in seen)


def test_num_workers_match_single_process(tmp_path):
    path = _arange_tokens(tmp_path / "a.bin", 3000)

    def make():
        return ShardedTokenDataset(path, "uint32", seq_len=9, seed=1, batch_size=3)

    ref = [b for b, _ in zip(DataLoader(make(), batch_size=3), range(8))]
    ds = make()
    ds.position = 5  # resuming mid-stream works with workers too
    ref_from_5 = torch.stack([make().sample(p) for p in range(5, 5 + 18)]).view(6, 3, -1)
    par = [b for b, _ in zip(DataLoader(ds, batch_size=3, num_workers=2), range(6))]
    assert all(torch.equal(a, b) for a, b in zip(par, ref_from_5))
    assert torch.equal(torch.stack(ref).view(-1, 10)[5:23], ref_from_5.view(-1, 10))


class _BatchRecorder(L.Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch.clone())


def test_trainer_checkpoint_resume_continues_at_next_batch(tmp_path):
    """Lightning prefetches one batch; the resumed run must still start at the first unseen one."""
    from diloco_lightning.models.lit_module import LlamaLightningModule

    rng = np.random.default_rng(0)
    rng.integers(0, 97, size=6000).astype(np.uint16).tofile(tmp_path / "t.bin")
    kw = dict(token_file=tmp_path / "t.bin", token_dtype="uint16", vocab_size=97, seq_len=16, batch_size=4)
    model_cfg = dict(vocab_size=97, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=32, max_seq_len=16)

    def fit(max_steps, ckpt=None):
        rec = _BatchRecorder()
        trainer = L.Trainer(
            max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            callbacks=[rec],
        )
        dm = TextDataModule(**kw)
        trainer.fit(LlamaLightningModule(model_cfg, warmup_steps=1), dm, ckpt_path=ckpt)
        return trainer, dm, rec.batches

    _, _, reference = fit(6)
    trainer, dm, first = fit(3)
    assert dm.state_dict()["position"] == 12  # consumed, not prefetched
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    _, dm2, rest = fit(6, ckpt=tmp_path / "mid.ckpt")
    got = first + rest
    assert len(got) == 6 and all(torch.equal(a, b) for a, b in zip(got, reference))
    assert dm2.state_dict()["position"] == 24
    assert trainer.train_dataloader.dataset.position == 16  # the stream itself ran one batch ahead
    ckpt = torch.load(tmp_path / "mid.ckpt", weights_only=True)  # only plain types inside
    assert ckpt["TextDataModule"]["position"] == 12 and ckpt["tokens_seen"] == 3 * 4 * 16
    restored = LlamaLightningModule.load_from_checkpoint(tmp_path / "mid.ckpt")
    assert restored.tokens_seen == 3 * 4 * 16 and restored.model.config.vocab_size == 97
    assert torch.equal(restored.model.layers[0].attention.wq.weight, trainer.model.model.layers[0].attention.wq.weight)


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(seq_len=0), "seq_len"),
        (dict(batch_size=-1), "batch_size"),
        (dict(node_rank=2, num_nodes=2), "node_rank"),
        (dict(num_nodes=0), "num_nodes"),
        (dict(val_fraction=1.5), "val_fraction"),
        (dict(max_bytes=0), "max_bytes"),
        (dict(vocab_size=100), "vocab_size"),
        (dict(tokenizer="/nonexistent/tokenizer.json"), "tokenizer"),
        (dict(text_files="a*.txt", token_file="b.bin", token_dtype="uint16"), "text_files"),
        (dict(token_file="b.bin"), "token_dtype"),
        (dict(token_file="b.bin", token_dtype="int8", vocab_size=10), "token_dtype"),
        (dict(token_file="b.bin", token_dtype="uint16"), "vocab_size"),
        (dict(token_file="b.bin", token_dtype="uint16", tokenizer="bpe"), "tokenizer"),
        (dict(token_dtype="uint16"), "token_dtype"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        TextDataModule(**kwargs)


def test_bad_data_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="text_files"):
        TextDataModule(text_files=str(tmp_path / "nothing*.txt"), cache_dir=tmp_path).setup()
    (tmp_path / "ragged.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="token_file"):
        TextDataModule(token_file=tmp_path / "ragged.bin", token_dtype="uint16", vocab_size=9).setup()
    _arange_tokens(tmp_path / "small.bin", 40)
    with pytest.raises(ValueError, match="seq_len"):
        TextDataModule(token_file=tmp_path / "small.bin", token_dtype="uint32", vocab_size=40, seq_len=32).setup()
    with pytest.raises(ValueError, match="num_nodes"):
        ShardedTokenDataset(tmp_path / "small.bin", "uint32", seq_len=4, node_rank=0, num_nodes=9)
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(["abc"], 100)
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_corpus(max_bytes=1)
    with pytest.raises(ValueError, match="seq_len"):
        HeldOutDataset(tmp_path / "small.bin", "uint32", seq_len=39, start=10)


def test_construction_is_cheap(tmp_path):
    dm = TextDataModule(cache_dir=tmp_path / "never")
    assert dm.vocab_size == 4096
    assert not (tmp_path / "never").exists()  # nothing built until prepare_data/setup
    assert os.fspath(dm.hparams["cache_dir"]) == os.fspath(tmp_path / "never")
