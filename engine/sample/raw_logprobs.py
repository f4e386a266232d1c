"""Logprobs as vLLM reports them: of the raw model distribution (log_softmax of the logits
before penalties, temperature, top-k/p, min-p or min_tokens masking), read on the host, or
kept on the device until a later read (async scheduling)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedspec.engine.outputs import Logprob


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: int
) -> list[dict[int, float]]:
    """Logprobs as vLLM reports them: of the raw model distribution (log_softmax of the logits
    before penalties, temperature, top-k/p, min-p or min_tokens masking), for ``token_ids[j]``
    at row j, plus the ``num_top`` most likely ids of each row. One dict per row:
    {token id: Logprob} (its rank: 1 + the tokens more likely; no decoded token yet)."""
    picked = torch.tensor(token_ids, device=logits.device)
    return logprob_entries(logprob_tensors(logits[: len(token_ids)], picked, num_top), token_ids)


LogprobTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobTensors:
    """``token_logprobs``' figures on the device, unread: each row's logprob of its token and
    its rank, and the ``num_top`` largest logprobs with their ids."""
    rows = logits.float().log_softmax(-1)
    picked = rows.gather(1, token_ids[:, None])[:, 0]
    ranks = (rows > picked[:, None]).sum(-1) + 1
    top = rows.topk(min(num_top, rows.shape[-1]), dim=-1)
    return picked, ranks, top.values, top.indices


def logprob_entries(tensors: LogprobTensors, token_ids: Sequence[int]) -> list[dict[int, float]]:
    """``logprob_tensors`` read into ``token_logprobs``' dicts."""
    picked, ranks, values, indices = (t.tolist() for t in tensors)
    result = [{t: Logprob(lp, rank)} for t, lp, rank in zip(token_ids, picked, ranks, strict=True)]
    for entry, ids, lps in zip(result, indices, values, strict=True):
        entry.update(
            (t, entry[t] if t in entry else Logprob(lp, rank))
            for rank, (t, lp) in enumerate(zip(ids, lps, strict=True), 1)
        )
    return result
