"""Per-sample augmentation RNGs: a sample's draws depend on (seed, epoch, index) only."""

from __future__ import annotations

import torch

from pimm_core.data.rng import EpochSeeded, sample_generator, sample_numpy, sample_random, sample_seed, set_epoch


class Noisy(EpochSeeded, torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 0):
        super().__init__(seed)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.rand(3, generator=self.generator(i))


def test_same_triple_same_draws_any_change_new_draws():
    a = torch.rand(4, generator=sample_generator(1, 2, 3))
    assert torch.equal(a, torch.rand(4, generator=sample_generator(1, 2, 3)))
    for other in [(0, 2, 3), (1, 3, 3), (1, 2, 4), (1, 2, 3, 1)]:
        assert not torch.equal(a, torch.rand(4, generator=sample_generator(*other)))
    assert sample_numpy(1, 2, 3).random() == sample_numpy(1, 2, 3).random()
    assert sample_random(1, 2, 3).random() == sample_random(1, 2, 3).random()
    assert 0 <= sample_seed(-5, 0, 10**30) < 2**64  # any integers


def test_a_samples_augmentation_does_not_depend_on_which_worker_draws_it():
    """Split the indices among 1 or 3 simulated workers, each with its own global RNG state
    and its own order of draws: every sample comes out the same."""
    ds = Noisy(10, seed=7)
    ds.set_epoch(2)

    def load(workers: int) -> dict[int, torch.Tensor]:
        out = {}
        for w in range(workers):
            torch.manual_seed(1000 + w)  # what a DataLoader worker's base seed would be
            torch.rand(w + 1)  # and draws it made before
            for i in reversed(range(w, len(ds), workers)):
                out[i] = ds[i]
        return out

    one, three = load(1), load(3)
    assert all(torch.equal(one[i], three[i]) for i in range(len(ds)))
    assert len({tuple(v.tolist()) for v in one.values()}) == len(ds)  # and samples differ from each other


def test_set_epoch_changes_the_draws_and_is_called_only_when_present():
    ds = Noisy(2)
    before = ds[0]
    assert set_epoch(ds, 1) and ds.epoch == 1
    assert not torch.equal(before, ds[0])
    ds.set_epoch(0)
    assert torch.equal(before, ds[0])
    assert set_epoch(torch.utils.data.TensorDataset(torch.zeros(2)), 3) is False
