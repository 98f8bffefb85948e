"""The built-in ``gpt-tiny`` workload trained by a script (script mode, ``trainer.script``), with
its own loop over the session's micro-batches: what a user's script does to stay bitwise exact
when its world changes (``nodes=MIN:MAX``). ``tests/test_elastic_pipeline.py`` shrinks it
elastically and compares its parameters with the built-in loop's fault-free run."""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from trainer import script as nvrx
from trainer.workload import DataSettings, OptimSettings, load_workload, token_shards


def grown(run_root: Path) -> bool:
    """Has the world grown back in this run (a ``world_change`` event of cause ``grow``)?"""
    try:
        lines = (run_root / "events.jsonl").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("kind") == "world_change" and event.get("cause") == "grow":
            return True
    return False


def train(session: nvrx.Session) -> None:
    # A pace for drills (the same maths): from step --pace-from on, each step takes --pace-s
    # more, so that a returning node's start-up fits before the last step; with
    # --pace-until-grown, only until it has (the grown world's last steps need no time).
    p = argparse.ArgumentParser()
    p.add_argument("--pace-from", type=int, default=0)
    p.add_argument("--pace-s", type=float, default=0.0)
    p.add_argument("--pace-until-grown", action="store_true")
    pace, _ = p.parse_known_args()
    paced = True
    session.init_process_group()
    cfg, device = session.cfg, session.device
    wl = load_workload("gpt-tiny")
    data = token_shards(
        DataSettings(
            data_dir=cfg.data_dir,
            seq_len=wl.seq_len,
            global_batch=cfg.global_batch,
            seed=cfg.seed,
            verify=False,  # hydration verified it
        )
    )
    torch.manual_seed(cfg.seed)
    model = wl.shard(wl.build_model(device), device=device, world_size=session.world_size)
    optim = wl.build_optimizer(model, OptimSettings(lr=cfg.lr, weight_decay=cfg.weight_decay))
    start = session.resume(model, optim)
    for step in range(start, session.steps + 1):
        session.step_start(step)
        applied = False
        while not applied:  # a step the check rejects is computed again (nothing applied)
            for mb in session.micro_batches(step, model):
                x, y = data.batch(step, mb.index, mb.count)
                mb.backward(wl.loss(model, torch.from_numpy(x), torch.from_numpy(y)))
            applied = session.before_optimizer_step(model)
        optim.step()
        optim.zero_grad(set_to_none=True)
        session.step_end(step, None, model, optim, tokens=cfg.global_batch * wl.seq_len)
        if pace.pace_from and step >= pace.pace_from and paced:
            paced = not (pace.pace_until_grown and grown(cfg.run_root))
            if paced:
                time.sleep(pace.pace_s)
    session.finish(model)


if __name__ == "__main__":
    sys.exit(nvrx.launch(train))
