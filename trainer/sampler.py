"""The deterministic, resumable sampler over a dataset's token stream (:mod:`trainer.data`).

Sample ``i`` is the window of ``seq_len + 1`` tokens starting at token ``i * seq_len`` of the stream
(inputs are the first ``seq_len``, targets the last ``seq_len``). The sampler visits samples in a
seeded permutation per epoch; the global batch of step ``s`` (1-based) is the samples
``(s-1)*G ... s*G-1`` of that order and rank ``r`` of ``W`` takes its contiguous slice of
``G/W``. So the data of a step depends only on (seed, step), not on the world size or on restarts:
the sampler's position *is* the step, and it is saved (and checked) in every checkpoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data import DTYPES, DataError, DatasetManifest, verify_dataset


class TokenStream:
    """The concatenated shards, memory-mapped."""

    def __init__(self, data_dir: Path, manifest: DatasetManifest) -> None:
        dtype = DTYPES[manifest.dtype]
        self.maps = [np.memmap(Path(data_dir) / e.name, dtype, "r") for e in manifest.files]
        self.offsets = np.cumsum([0] + [m.size for m in self.maps])
        self.total = int(self.offsets[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        out = np.empty(length, dtype=np.int64)
        filled = 0
        shard = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while filled < length:
            local = start + filled - int(self.offsets[shard])
            take = min(length - filled, self.maps[shard].size - local)
            out[filled : filled + take] = self.maps[shard][local : local + take]
            filled += take
            shard += 1
        return out


@dataclass
class SamplerState:
    consumed_samples: int
    seed: int
    num_samples: int

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class StepSampler:
    """Maps (step, rank) to a batch of token windows, deterministically."""

    def __init__(
        self,
        data_dir: Path,
        *,
        seq_len: int,
        global_batch: int,
        seed: int,
        verify: bool = True,
        verified_manifest: str | None = None,
    ) -> None:
        manifest = verify_dataset(
            data_dir, digests=verify, manifest_sha256=verified_manifest if verify else None
        )
        self.vocab_size = manifest.vocab_size
        self.stream = TokenStream(data_dir, manifest)
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.num_samples = (self.stream.total - 1) // seq_len
        if self.num_samples < global_batch:
            raise DataError(
                f"dataset in {data_dir} is too small: {self.stream.total} tokens give "
                f"{self.num_samples} samples of seq_len {seq_len}, fewer than one global batch "
                f"({global_batch})"
            )
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def sample_ids(self, step: int, rank: int, world_size: int) -> list[int]:
        per_rank = self.global_batch // world_size
        first = (step - 1) * self.global_batch + rank * per_rank
        ids = []
        for g in range(first, first + per_rank):
            epoch, pos = divmod(g, self.num_samples)
            ids.append(int(self._order(epoch)[pos]))
        return ids

    def batch(self, step: int, rank: int, world_size: int) -> tuple[np.ndarray, np.ndarray]:
        rows = [
            self.stream.window(i * self.seq_len, self.seq_len + 1)
            for i in self.sample_ids(step, rank, world_size)
        ]
        arr = np.stack(rows)
        return arr[:, :-1], arr[:, 1:]

    def state_at(self, step: int) -> SamplerState:
        return SamplerState(step * self.global_batch, self.seed, self.num_samples)

    def check_state(self, state: Mapping[str, object], step: int) -> None:
        """A checkpoint's sampler position must be where this sampler would be at its step."""
        expected = self.state_at(step).to_dict()
        if {k: state.get(k) for k in expected} != expected:
            raise DataError(
                f"checkpoint data-loader state {state} does not match this dataset/config at step "
                f"{step} (expected {expected}): resuming would change the data order"
            )
