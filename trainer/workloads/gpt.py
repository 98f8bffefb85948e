"""The built-in GPT (``trainer.model.GPT``) as a workload: gpt-tiny, gpt-100m and gpt-8b."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from trainer.model_config import ModelConfig, model_config
from trainer.workload import WorkloadSpec


class GptOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: Literal["tiny", "100m", "8b"] = Field("tiny", description="named model size")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout probability")
    seq_len: int | None = Field(
        None,
        ge=8,
        le=131072,
        description="training sequence length (the learned position table has this many "
        "rows); empty: the size's own (tiny 64, 100m 1024, 8b 8192)",
    )


def config_of(o: GptOptions) -> ModelConfig:
    base = model_config(o.size)
    return dataclasses.replace(base, dropout=o.dropout, seq_len=o.seq_len or base.seq_len)


def build_model(o: GptOptions, device: torch.device) -> nn.Module:
    from trainer.model import GPT

    with device:
        return GPT(config_of(o))


def block_classes(o: GptOptions) -> tuple[type[nn.Module], ...]:
    from trainer.model import Block

    return (Block,)


def loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(inputs, targets)  # type: ignore[no-any-return]


SPEC = WorkloadSpec(
    name="gpt",
    options=GptOptions,
    build_model=build_model,
    block_classes=block_classes,
    loss=loss,
    vocab_size=lambda o: config_of(o).vocab_size,
    seq_len=lambda o: config_of(o).seq_len,
    description="GPT-style decoder (pre-LayerNorm, causal SDPA, GELU MLP, untied head)",
)
