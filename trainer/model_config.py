"""The built-in GPT's shape (:class:`ModelConfig`), validated at construction, and its named
sizes (:func:`model_config` looks one up by name, for ``trainer.workloads.gpt``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainer.errors import ConfigError, require


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A GPT-style decoder-only transformer."""

    name: str
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
            value = getattr(self, name)
            require(
                isinstance(value, int) and value >= 1,
                f"model.{name}",
                f"must be a positive integer, got {value!r}",
            )
        require(
            self.d_model % self.n_heads == 0,
            "model.n_heads",
            f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})",
        )
        require(
            0.0 <= self.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {self.dropout}"
        )

    def num_params(self) -> int:
        """Exact parameter count of :class:`trainer.model.GPT` for this config."""
        d, f, v, s = self.d_model, self.d_ff, self.vocab_size, self.seq_len
        # Two LayerNorms (weight + bias), the qkv projection, the attention output, the MLP.
        per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f + f * d + d)
        return v * d + s * d + self.n_layers * per_block + 2 * d + d * v


def tiny() -> ModelConfig:
    """A few hundred thousand parameters: one training step in well under a second on one core."""
    return ModelConfig(
        name="tiny", vocab_size=512, seq_len=64, d_model=64, n_layers=2, n_heads=4, d_ff=256
    )


# Named sizes: 100m is the GPT-2 small shape with a 16k vocabulary (the single-GPU smoke size,
# ~110M parameters); 8b has Llama-3-8B's width, depth and vocabulary (~7.5B parameters: FSDP2
# over >= 2 p5.48xlarge nodes, not run on CPU machines).
MODEL_SIZES: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny,
    "100m": lambda: ModelConfig(
        name="100m", vocab_size=16384, seq_len=1024, d_model=768, n_layers=12, n_heads=12, d_ff=3072
    ),
    "8b": lambda: ModelConfig(
        name="8b",
        vocab_size=128256,
        seq_len=8192,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        d_ff=16384,
    ),
}


def model_config(name: str) -> ModelConfig:
    if name not in MODEL_SIZES:
        raise ConfigError(
            "model", f"unknown model size {name!r}; choose one of {sorted(MODEL_SIZES)}"
        )
    return MODEL_SIZES[name]()
