"""``train_plain.py`` converted to run under the NVRx layers (script mode, ``trainer.script``).

Under the pipeline (``workload: "script:examples/fsdp_script/train.py"``, script_args
``["--data-dir", "{data_dir}", "--steps", "{steps}", "--batch", "{global_batch}"]``), or alone:

    python -m trainer.launch --nproc-per-node 2 ... (see docs/trainer.md) or
    ft_launcher --nproc-per-node 2 ... examples/fsdp_script/train.py --data-dir D --run-root R

Changes from the plain script (``diff train_plain.py train.py``): the import, ``--run-root``,
``session`` calls around the loop, the step check before ``optim.step()`` (a rejected step is
computed again in place), and ``nvrx.launch`` at the bottom.
"""

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainer import script as nvrx


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--run-root", type=Path, help="checkpoints and events (standalone runs)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(x)


def load_tokens(data_dir: Path) -> tuple[np.ndarray, int]:
    manifest = json.loads((data_dir / "dataset.json").read_text())
    dtype = np.dtype("<u4" if manifest.get("dtype") == "uint32" else "<u2")
    shards = [np.fromfile(data_dir / f["name"], dtype=dtype) for f in manifest["files"]]
    return np.concatenate(shards), int(manifest["vocab_size"])


def get_batch(tokens, step, rank, world, args) -> tuple[torch.Tensor, torch.Tensor]:
    starts = np.random.default_rng([args.seed, step]).integers(
        0, len(tokens) - args.seq_len - 1, size=args.batch
    )
    per_rank = args.batch // world
    rows = [tokens[s : s + args.seq_len + 1] for s in starts[rank * per_rank :][:per_rank]]
    batch = torch.from_numpy(np.stack(rows).astype(np.int64))
    return batch[:, :-1], batch[:, 1:]


def train(session: nvrx.Session, args: argparse.Namespace) -> None:
    # CUDA + NCCL with a GPU per rank (LOCAL_RANK), else CPU + gloo
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    session.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, vocab = load_tokens(args.data_dir)
    torch.manual_seed(args.seed)
    model = TinyLM(vocab).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = session.resume(model, optim)
    for step in range(start, args.steps + 1):
        session.step_start(step)
        x, y = (t.to(device) for t in get_batch(tokens, step, rank, world, args))
        applied = False
        while not applied:  # a step the check rejects (grads cleared, no update) runs again
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            applied = session.before_optimizer_step(model, loss)
        optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        session.step_end(step, loss, model, optim, tokens=args.batch * args.seq_len)
    session.finish(model)


if __name__ == "__main__":
    args = parse_args()
    train_fn = functools.partial(train, args=args)
    sys.exit(
        nvrx.launch(train_fn, run_root=args.run_root, data_dir=args.data_dir, steps=args.steps)
    )
