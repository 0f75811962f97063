import pytest
import torch

from experiments.workloads.data import CharCorpusConfig, DigitsConfig, SparseConfig
from experiments.workloads.datasets import (BatchFeeder, Dataset, decode, encode, shard_indices, stdlib_source_text,
                                            test_batches)
from experiments.workloads.vocab import VOCAB, VOCAB_SIZE


def _toy(n: int = 40) -> Dataset:
    """A float input, an int64 input and int64 targets, each row tagged by its index."""
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1).repeat(1, 3)
    ids = torch.arange(n, dtype=torch.int64)
    return Dataset((x, ids), ids.clone(), (x[:7], ids[:7]), ids[:7].clone(), "classify")


@pytest.mark.parametrize("n, world", [(10, 1), (10, 2), (10, 3), (11, 4), (3, 5), (0, 2), (1797, 7)])
def test_shard_indices_disjoint_and_covering(n, world):
    parts = [shard_indices(n, r, world, seed=3) for r in range(world)]
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert sorted(torch.cat(parts).tolist()) == list(range(n))


def test_shard_indices_deterministic_and_seeded():
    assert torch.equal(shard_indices(100, 1, 3, seed=5), shard_indices(100, 1, 3, seed=5))
    assert not torch.equal(shard_indices(100, 1, 3, seed=5), shard_indices(100, 1, 3, seed=6))


@pytest.mark.parametrize("rank, world", [(-1, 2), (2, 2), (0, 0), (0, -1)])
def test_shard_indices_rejects_bad_rank_or_world(rank, world):
    with pytest.raises(ValueError, match="rank|world"):
        shard_indices(10, rank, world, seed=0)


def test_feeder_same_batch_across_instances():
    a, b = BatchFeeder(_toy(), 0, 2, 4, seed=1), BatchFeeder(_toy(), 0, 2, 4, seed=1)
    for step in (0, 3, 5, 17, 2):  # out of order: the answer must not depend on call history
        (xa, ia), ya = a.batch(step)
        (xb, ib), yb = b.batch(step)
        assert torch.equal(xa, xb) and torch.equal(ia, ib) and torch.equal(ya, yb)


def test_feeder_ranks_disjoint_within_epoch():
    world, bs = 3, 4
    feeders = [BatchFeeder(_toy(), r, world, bs, seed=2) for r in range(world)]
    seen = [set() for _ in range(world)]
    for r, f in enumerate(feeders):
        for step in range(f.batches_per_epoch):
            seen[r] |= set(f.batch(step)[1].tolist())
        assert len(seen[r]) == f.batches_per_epoch * bs  # no repeats within an epoch
    assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])


def test_feeder_reshuffles_each_epoch():
    f = BatchFeeder(_toy(), 0, 1, 8, seed=0)
    epochs = [torch.cat([f.batch(e * f.batches_per_epoch + b)[1] for b in range(f.batches_per_epoch)]) for e in (0, 1)]
    assert sorted(epochs[0].tolist()) == sorted(epochs[1].tolist())  # same shard...
    assert not torch.equal(epochs[0], epochs[1])  # ...in another order


def test_feeder_casts_floats_only():
    (x, ids), y = BatchFeeder(_toy(), 0, 1, 4, seed=0, dtype=torch.float64).batch(0)
    assert x.dtype == torch.float64 and ids.dtype == torch.int64 and y.dtype == torch.int64
    assert torch.equal(x[:, 0].long(), ids)  # inputs and targets stay aligned
    assert torch.equal(ids, y)


def test_feeder_rejects_small_shard():
    with pytest.raises(ValueError, match="20 examples.*batch_size=21"):
        BatchFeeder(_toy(40), 1, 2, 21, seed=0)


def test_test_batches_cover_test_split_in_order():
    batches = list(test_batches(_toy(), 3, torch.float64))
    assert [len(y) for _, y in batches] == [3, 3, 1]
    assert torch.cat([y for _, y in batches]).tolist() == list(range(7))
    assert batches[0][0][0].dtype == torch.float64


@pytest.mark.parametrize(
    "config, task, input_specs, target_dtype",
    [
        (DigitsConfig(), "classify", [((1, 8, 8), torch.float32)], torch.int64),
        (DigitsConfig(size=28), "classify", [((1, 28, 28), torch.float32)], torch.int64),
        (CharCorpusConfig(block_size=32, max_chars=20_000), "lm", [((32,), torch.int64)], torch.int64),
        (SparseConfig(samples=500, features=1000, nnz=5), "binary", [((5,), torch.int64), ((5,), torch.float32)],
         torch.float32),
    ],
    ids=["digits8", "digits28", "chars", "sparse"],
)
def test_data_config_builds_deterministically(config, task, input_specs, target_dtype):
    a, b = config.build(seed=4), config.build(seed=4)
    assert a.task == task
    for split_a, split_b, ta, tb in ((a.train, b.train, a.train_targets, b.train_targets),
                                     (a.test, b.test, a.test_targets, b.test_targets)):
        assert torch.equal(ta, tb) and ta.dtype == target_dtype
        assert len(split_a) == len(input_specs)
        for x, y, (shape, dtype) in zip(split_a, split_b, input_specs):
            assert torch.equal(x, y)
            assert x.shape[1:] == shape and x.dtype == dtype and len(x) == len(ta)
    assert a.n_train > 0 and a.n_test > 0


def test_digits_range_and_split():
    d = DigitsConfig(size=28).build(seed=0)
    assert d.n_train + d.n_test == 1797 and d.n_test == round(1797 * 0.2)
    assert 0.0 <= d.train[0].min() and d.train[0].max() <= 1.0
    assert not torch.equal(d.test_targets, DigitsConfig(size=28).build(seed=1).test_targets)


def test_char_corpus_windows_and_vocab():
    d = CharCorpusConfig(block_size=16, max_chars=5_000, test_fraction=0.1).build(seed=0)
    assert d.n_train + d.n_test == 5_000 // 17 and d.n_test == round(5_000 // 17 * 0.1)
    for x, y in ((d.train[0], d.train_targets), (d.test[0], d.test_targets)):
        assert 0 <= x.min() and x.max() < VOCAB_SIZE
        assert torch.equal(x[:, 1:], y[:, :-1])  # the target is the input shifted by one
    # Non-overlapping windows in corpus order, the test windows last.
    ids = encode(stdlib_source_text(5_000))
    windows = torch.cat([torch.cat([d.train[0], d.train_targets[:, -1:]], 1),
                         torch.cat([d.test[0], d.test_targets[:, -1:]], 1)])
    assert torch.equal(windows.flatten(), ids[: len(windows) * 17])


def test_vocab_encoding():
    assert VOCAB_SIZE == len(VOCAB) + 1 == 98
    assert decode(encode("def f():\n\treturn 'x'")) == "def f():\n\treturn 'x'"
    assert encode("é€\r").tolist() == [len(VOCAB)] * 3


def test_char_corpus_too_small_raises():
    with pytest.raises(ValueError, match="windows"):
        CharCorpusConfig(block_size=64, max_chars=100).build(seed=0)


def test_sparse_indices_in_range_and_labels_binary():
    cfg = SparseConfig(samples=400, features=50, nnz=4)
    d = cfg.build(seed=0)
    idx, val = d.train
    assert 0 <= idx.min() and idx.max() < cfg.features
    assert (val >= 0).all()
    assert set(d.train_targets.unique().tolist()) <= {0.0, 1.0}
    assert 0.2 < d.train_targets.mean() < 0.8  # noisy labels from a symmetric w*: both classes occur


@pytest.mark.parametrize(
    "make",
    [lambda: DigitsConfig(size=7), lambda: DigitsConfig(test_fraction=1.0), lambda: SparseConfig(nnz=0),
     lambda: CharCorpusConfig(block_size=0)],
)
def test_data_config_validation(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.timeout(30)
def test_the_digits_are_read_once_a_process_and_each_caller_gets_its_own_copy():
    from experiments.workloads.datasets import load_digits_arrays

    pixels, labels = load_digits_arrays()
    assert pixels.shape == (1797, 64) and labels.shape == (1797,) and 0 <= pixels.min() and pixels.max() <= 16
    pixels[:] = -1.0  # a caller that writes into its arrays
    labels[:] = -1
    again, again_labels = load_digits_arrays()
    assert again.min() >= 0 and again_labels.min() >= 0
