"""Stage 3: train the head on the cached features. AdamW, linear warm-up then cosine decay,
gradient clipping, a checkpoint every N steps under ``<work_dir>/train/`` that a re-run resumes
from (same data order: each epoch's shuffle is seeded by (seed, epoch))."""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from pagedspec.engine.tools.train_eagle.batches import epoch_batches, make_batch
from pagedspec.engine.tools.train_eagle.losses import evaluate, head_loss


@dataclass
class TrainConfig:
    steps: int
    batch_size: int = 8
    lr: float = 5e-4
    weight_decay: float = 0.0
    warmup: int = 50
    grad_clip: float = 0.5
    ttt_steps: int = 2
    ttt_decay: float = 0.8
    noise: float = 0.2
    ce_weight: float = 0.1
    l1_weight: float = 1.0
    feature_layers: tuple[int, ...] = ()  # an eagle3 head's (the head is built with them)
    init_from: str | None = None  # the head it started from (applied before training)
    soft_ce: bool = False
    bf16_autocast: bool = False  # matmuls in bfloat16, weights and optimizer state in float32
    max_len: int = 512
    checkpoint_every: int = 200
    log_every: int = 10
    seed: int = 0


def lr_factor(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _checkpoint_path(work_dir: str) -> str:
    return os.path.join(work_dir, "train", "checkpoint.pt")


def train_head(head, train: list[dict], embed: torch.Tensor, t2d: torch.Tensor,
               target_rows: torch.Tensor, cfg: TrainConfig, work_dir: str) -> dict:  # fmt: skip
    """Train ``head`` in place for ``cfg.steps`` steps, resuming from a compatible checkpoint.
    ``target_rows``: the target LM head's rows of the draft vocabulary (soft CE). Returns the
    history of logged metrics and timing."""
    torch.manual_seed(cfg.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    state = {"step": 0, "history": [], "seconds": 0.0}
    path = _checkpoint_path(work_dir)
    if os.path.isfile(path):
        ckpt = torch.load(path, weights_only=False)
        same = _compat(ckpt["config"]) == _compat(asdict(cfg)) | {"num_train": len(train)}
        if same and torch.equal(ckpt["head"]["d2t"], head.d2t):
            head.load_state_dict(ckpt["head"])
            opt.load_state_dict(ckpt["opt"])
            sched.load_state_dict(ckpt["sched"])
            torch.set_rng_state(ckpt["rng"])
            state = ckpt["state"]
            print(f"resuming from {path} at step {state['step']}")
        else:
            print(f"ignoring {path}: it was made with another configuration or vocabulary")
    lengths = [len(c["tokens"]) for c in train]
    per_epoch = math.ceil(len(train) / cfg.batch_size)
    soft = target_rows if cfg.soft_ce else None
    head.train()
    bar = tqdm(total=cfg.steps, initial=state["step"], desc="Stage 3: training", unit="step")
    start = time.perf_counter() - state["seconds"]
    tokens = 0
    while state["step"] < cfg.steps:
        step = state["step"]
        epoch, index = divmod(step, per_epoch)
        order = epoch_batches(len(train), cfg.batch_size, cfg.seed, epoch, lengths)[index]
        batch = make_batch([train[i] for i in order], embed, t2d, cfg.max_len)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
            loss, metrics = head_loss(head, batch, cfg.ttt_steps, cfg.noise, cfg.ce_weight,
                                      cfg.ttt_decay, soft, cfg.l1_weight)  # fmt: skip
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        tokens += int(batch["mask"].sum())
        state["step"] = step + 1
        state["seconds"] = time.perf_counter() - start
        if step % cfg.log_every == 0 or step + 1 == cfg.steps:
            state["history"].append({"step": step, "epoch": epoch} | metrics)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['acc_0']:.2f}",
                        tok_s=f"{tokens / max(state['seconds'], 1e-9):.0f}")  # fmt: skip
        if state["step"] % cfg.checkpoint_every == 0 or state["step"] == cfg.steps:
            _save_checkpoint(path, head, opt, sched, cfg, state, len(train))
    bar.close()
    head.eval()
    return state


def _compat(config: dict) -> dict:
    """The fields a checkpoint must share with this run to be resumed."""
    return {k: v for k, v in config.items() if k not in ("checkpoint_every", "log_every")}


def _save_checkpoint(path, head, opt, sched, cfg, state, num_train: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    ckpt = {
        "head": head.state_dict(),
        "opt": opt.state_dict(),
        "sched": sched.state_dict(),
        "rng": torch.get_rng_state(),
        "config": asdict(cfg) | {"num_train": num_train},
        "state": state,
    }
    torch.save(ckpt, path + ".tmp")
    os.replace(path + ".tmp", path)


def evaluate_convs(head, convs: list[dict], embed, t2d, target_head, steps: int, max_len: int,
                   batch_size: int = 8) -> dict:  # fmt: skip
    """``evaluate`` over conversations in batches of ``batch_size``."""
    order = sorted(range(len(convs)), key=lambda i: len(convs[i]["tokens"]))
    batches = (
        make_batch([convs[i] for i in order[b : b + batch_size]], embed, t2d, max_len)
        for b in range(0, len(order), batch_size)
    )
    head.eval()
    return evaluate(head, batches, target_head, steps)
