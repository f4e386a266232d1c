"""The head's training loss and its held-out evaluation (accuracies and a greedy chain estimate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedspec.engine.tools.train_eagle.batches import IGNORE


def final_features(batch: dict) -> torch.Tensor:
    """The target's final hidden states [B, L, H] (the last H of the stored features)."""
    return batch["features"][..., -batch["embeds"].shape[-1] :]


def head_loss(head, batch: dict, steps: int, noise: float, ce_weight: float, decay: float,
              soft_from: torch.Tensor | None = None,
              l1_weight: float = 1.0) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """Sum over unrolled steps s of decay^s * (l1_weight * SmoothL1(h, final feature)
    + ce_weight * CE).

    CE is against the next token's draft id (positions whose next token is outside the draft
    vocabulary are ignored), or, with ``soft_from`` (the target's LM-head rows of the draft
    vocabulary), against the target's own distribution over the draft vocabulary."""
    outs = head(batch["embeds"], batch["features"], steps=steps, noise=noise)
    positions = torch.arange(batch["mask"].shape[1])
    final = final_features(batch)
    total = torch.zeros(())
    metrics = {}
    for s, h in enumerate(outs):
        m = batch["mask"] & (positions >= s)
        target = final[m]
        reg = F.smooth_l1_loss(h[m], target)
        logits = head.lm_head(h[m])
        labels = batch["labels"][m]
        if soft_from is None:
            ce = F.cross_entropy(logits, labels, ignore_index=IGNORE)
        else:
            p = torch.softmax(target @ soft_from.T, dim=-1)
            ce = -(p * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        total = total + decay**s * (l1_weight * reg + ce_weight * ce)
        known = labels != IGNORE
        acc = (logits.argmax(-1)[known] == labels[known]).float().mean()
        metrics |= {f"l1_{s}": reg.item(), f"ce_{s}": ce.item(), f"acc_{s}": acc.item()}
    metrics["loss"] = total.item()
    return total, metrics


# min_draft_confidence values the evaluation reports (the default:
# pagedspec.engine.config.METHOD_DEFAULTS)
CHAIN_STOPS = (0.1, 0.2, 0.3, 0.4, 0.5)
# The temperature of sampled_accept (benchmarks/spec_decode.py's sampled runs).
SAMPLED_TEMPERATURE = 0.8


@torch.no_grad()
def evaluate(head, batches: list[dict], target_head: torch.Tensor, steps: int) -> dict:
    """Held-out metrics of the head run without noise for ``steps`` unrolled steps:

    - ``smooth_l1``, ``l1`` (mean |h - feature|), ``ce`` of step 0 (CE over known labels),
    - ``acc_next[s]``: step s's argmax equals the data's next token (step s at position i sees
      its own outputs for positions i-s..i-1, i.e. it is the (s+1)-th token of a chain draft),
    - ``acc_greedy[s]``: the same against the target's argmax (from its feature, full vocab),
    - ``sampled_accept``: the first draft's acceptance when drafts are sampled and verified at
      ``SAMPLED_TEMPERATURE``, sum_x min(p(x), q(x)) with p and q after that temperature,
    - on greedy conversations only, where the data is the target's own greedy chain:
      ``chain_accept[s]`` = share of draft rounds whose first s+1 drafts all match the target's
      argmax and ``tokens_per_round`` = 1 + sum of them (expected tokens per verification at
      k = steps, with chain drafts and greedy verification);
      ``chain_stop[tau]``: drafts and tokens per round when a chain stops once the product of
      its drafts' top-1 probabilities falls below tau (``min_draft_confidence``)."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}

    def add(key: str, value: torch.Tensor, count: int) -> None:
        sums[key] = sums.get(key, 0.0) + float(value)
        counts[key] = counts.get(key, 0.0) + count

    d2t = head.d2t
    for batch in batches:
        outs = head(batch["embeds"], batch["features"], steps=steps)
        mask, feats = batch["mask"], final_features(batch)
        n = int(mask.sum())
        h0 = outs[0][mask]
        add("smooth_l1", F.smooth_l1_loss(h0, feats[mask], reduction="mean") * n, n)
        add("l1", (h0 - feats[mask]).abs().mean() * n, n)
        labels = batch["labels"][mask]
        known = labels != IGNORE
        logits0 = head.lm_head(h0)
        ce = F.cross_entropy(logits0[known], labels[known], reduction="sum")
        add("ce", ce, int(known.sum()))
        target_logits = feats @ target_head.T
        target_argmax = target_logits.argmax(-1)
        p = torch.softmax(target_logits[mask] / SAMPLED_TEMPERATURE, -1)[:, d2t]
        q = torch.softmax(logits0 / SAMPLED_TEMPERATURE, -1)  # 0 outside d2t
        add("sampled_accept", torch.minimum(p, q).sum(), n)
        hits, confs = [], []
        for s, h in enumerate(outs):
            logits = head.lm_head(h)
            draft = d2t[logits.argmax(-1)]
            confs.append(logits.softmax(-1).amax(-1))
            ok = mask & (torch.arange(mask.shape[1]) >= s)
            add(f"acc_next_{s}", (draft == batch["next_tokens"])[ok].sum(), int(ok.sum()))
            add(f"acc_greedy_{s}", (draft == target_argmax)[ok].sum(), int(ok.sum()))
            hits.append(draft == target_argmax)
        # chain rounds start at position i (step 0 there, step s at i + s); keep rounds whose
        # every step lies on the mask, on greedy conversations only
        length = mask.shape[1] - steps + 1
        if length <= 0:
            continue
        start_ok = batch["greedy"].unsqueeze(1) & mask[:, :length]
        for s in range(steps):
            start_ok = start_ok & mask[:, s : s + length]
        run, path = start_ok.clone(), torch.ones(start_ok.shape)
        for s in range(steps):
            run = run & hits[s][:, s : s + length]
            add(f"chain_{s}", run.sum(), int(start_ok.sum()))
            for tau in CHAIN_STOPS:  # draft s is made while the path so far is >= tau
                made = start_ok & (path >= tau)
                add(f"stop_{tau}_drafts", made.sum(), int(start_ok.sum()) if s == 0 else 0)
                add(f"stop_{tau}_accepted", (run & made).sum(), 0)
            path = path * confs[s][:, s : s + length]
    res = {k: sums[k] / max(counts[k], 1) for k in ("smooth_l1", "l1", "ce", "sampled_accept")}
    res["positions"] = int(counts.get("l1", 0))
    res["acc_next"] = [
        sums[f"acc_next_{s}"] / max(counts[f"acc_next_{s}"], 1) for s in range(steps)
    ]
    res["acc_greedy"] = [
        sums[f"acc_greedy_{s}"] / max(counts[f"acc_greedy_{s}"], 1) for s in range(steps)
    ]
    if counts.get("chain_0"):
        res["chain_accept"] = [sums[f"chain_{s}"] / counts[f"chain_{s}"] for s in range(steps)]
        res["tokens_per_round"] = 1 + sum(res["chain_accept"])
        res["chain_rounds"] = int(counts["chain_0"])
        res["chain_stop"] = {
            str(tau): {
                "drafts_per_round": sums[f"stop_{tau}_drafts"] / counts[f"stop_{tau}_drafts"],
                "tokens_per_round": 1 + sums[f"stop_{tau}_accepted"] / counts["chain_0"],
            }
            for tau in CHAIN_STOPS
        }
    return res
