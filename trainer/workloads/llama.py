"""Hugging Face Llama (``transformers.LlamaForCausalLM``) as a workload, the model family of the
AWS sample: ``llama-tiny`` (CPU tests), ``llama-1b`` (Llama-3.2-1B shape, one GPU) and
``llama3-8b`` (Llama-3.1-8B shape, p5 nodes).

The model is always built from a ``LlamaConfig`` (never fetched from a hub); initial weights may
come from an HF-format directory (``config.json`` + ``*.safetensors``) on the shared filesystem,
e.g. hydrated from S3 beside the dataset. FSDP2 shards each ``LlamaDecoderLayer``. The export is
an HF-layout directory that ``LlamaForCausalLM.from_pretrained(dir)`` loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from trainer.errors import ConfigError
from trainer.workload import WorkloadSpec

# Named shapes: plain data. Llama-3.2-1B (1.24B parameters, tied embeddings), and Llama-3.1-8B
# (8.03B parameters) changed from it.
_1B = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "seq_len": 2048,
}
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        **_1B,
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "seq_len": 64,
    },
    "1b": _1B,
    "8b": {
        **_1B,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "tie_word_embeddings": False,
        "seq_len": 8192,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
}


class LlamaOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: Literal["tiny", "1b", "8b"] = Field("tiny", description="named Llama shape")
    seq_len: int | None = Field(None, ge=8, le=131072, description="training sequence length")
    mixed_precision: Literal["none", "bf16"] = Field(
        "none", description="bf16 parameters/activations with fp32 reductions (CUDA only)"
    )
    activation_checkpointing: bool = Field(False, description="recompute each decoder layer")
    init_weights: str | None = Field(
        None,
        description="HF-format directory (config.json + safetensors) with initial weights, on "
        "the shared filesystem or s3://bucket/prefix (the pipeline hydrates it beside the "
        "dataset); its config must match the named shape",
    )
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa")


def hf_config(o: LlamaOptions) -> Any:
    from transformers import LlamaConfig

    shape = {k: v for k, v in SIZES[o.size].items() if k != "seq_len"}
    return LlamaConfig(**shape, attn_implementation=o.attn_implementation)  # type: ignore[call-arg]


def _seq_len(o: LlamaOptions) -> int:
    return o.seq_len or int(SIZES[o.size]["seq_len"])


def build_model(o: LlamaOptions, device: torch.device) -> nn.Module:
    from transformers import LlamaForCausalLM

    with device:
        model = LlamaForCausalLM(hf_config(o))
    if o.init_weights and device.type != "meta":
        if o.init_weights.startswith("s3://"):
            raise ConfigError(
                "workload_options.init_weights",
                f"{o.init_weights} is not hydrated: run through the pipeline (it copies the "
                "weights to the shared filesystem) or give a local directory",
            )
        _load_initial_weights(model, Path(o.init_weights))
    return model


def _load_initial_weights(model: nn.Module, directory: Path) -> None:
    """Initial weights from an HF directory; a checkpoint resume overwrites them anyway."""
    import json

    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            "workload_options.init_weights", f"{directory} has no *.safetensors files"
        )
    theirs = json.loads((directory / "config.json").read_text())
    ours = model.config.to_dict()  # type: ignore[union-attr,operator]
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads"):
        if theirs.get(key) != ours.get(key):
            raise ConfigError(
                "workload_options.init_weights",
                f"{directory}/config.json has {key}={theirs.get(key)}, the workload's shape "
                f"has {ours.get(key)}: pick the matching workload_options.size",
            )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and ours["tie_word_embeddings"])]
    if missing or unexpected:
        raise ConfigError(
            "workload_options.init_weights",
            f"{directory}: missing {missing[:5]}, unexpected {unexpected[:5]}",
        )


def block_classes(o: LlamaOptions) -> tuple[type[nn.Module], ...]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return (LlamaDecoderLayer,)


def loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # Targets are already shifted by the data source: no `labels=` (HF would shift again).
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def export_pretrained(o: LlamaOptions, model: nn.Module, out: Path) -> None:
    """``config.json`` + safetensors with HF parameter names (the model *is* the HF model)."""
    model.save_pretrained(str(out), safe_serialization=True)  # type: ignore[operator]


SPEC = WorkloadSpec(
    name="llama",
    options=LlamaOptions,
    build_model=build_model,
    block_classes=block_classes,
    loss=loss,
    vocab_size=lambda o: int(SIZES[o.size]["vocab_size"]),
    seq_len=_seq_len,
    export_pretrained=export_pretrained,
    description="Hugging Face LlamaForCausalLM built from a LlamaConfig",
)
