from __future__ import annotations

from pathlib import Path

import pytest

from trainer.data import write_synthetic_dataset


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data")
    write_synthetic_dataset(path, shards=4, tokens_per_shard=65536, vocab_size=512, seed=0)
    return path
