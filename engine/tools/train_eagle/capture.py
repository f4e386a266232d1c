"""Stage 1's features, captured while the target answers: every step's forward already computes
the hidden states of each position it feeds (the prompt, in chunks, then each sampled token), so
a recorder in the proposer's seat keeps them instead of stage 2 running the target again over
every finished conversation (~45 of the ~110 minutes of stages 1 and 2 for the shipped head's
data on the 2-core CPU).

A conversation of L tokens gets the features of positions 0 .. L - 2: its last token is sampled
but never fed, and no trained position reads its features (``data.write_features``).
"""

from __future__ import annotations

import dataclasses
import uuid

import torch

from pagedspec.engine.request import SampleState
from pagedspec.engine.sample.round import NoSpeculation, Round, Verified
from pagedspec.engine.sample.step_sampler import StepSampler
from pagedspec.engine.sampling_params import SamplingParams
from pagedspec.engine.worker.model_runner import ForwardOutput
from pagedspec.scheduler import SchedulerOutput


class FeatureCapture(NoSpeculation):
    """A round that never drafts and keeps, per sequence, the target's features of the
    positions each step computed (``ModelRunner.forward``'s ``hidden_layers`` hidden states,
    then the final ones), as bfloat16 (what stage 2 stores). A preempted sequence recomputes
    its positions and the later rows win (``features``)."""

    def __init__(self, sampler: StepSampler, layers: tuple[int, ...]) -> None:
        super().__init__(sampler)
        self.layers = layers
        self._rows: dict[int, list[tuple[int, torch.Tensor]]] = {}  # seq_id → (first pos, rows)

    def prepare(self, sched: SchedulerOutput) -> Round:
        round = super().prepare(sched)
        return dataclasses.replace(round, return_hidden=True, hidden_layers=self.layers)

    def verify(self, round: Round, output: ForwardOutput) -> Verified:
        sizes = [len(span.token_ids) for span in round.spans]
        features = list(output.hidden.to(torch.bfloat16).split(sizes))  # once per step
        return dataclasses.replace(super().verify(round, output), features=features)

    def commit(
        self,
        round: Round,
        verified: Verified,
        i: int,
        record: SampleState,
        emitted: int,
        kept: list[int],
    ) -> None:
        s = round.scheduled[i]
        num_computed = s.end + max(len(kept) - 1, 0)
        rows = verified.features[i][: num_computed - s.start]
        self._rows.setdefault(record.seq.seq_id, []).append((s.start, rows))

    def features(self, seq_id: int, length: int) -> torch.Tensor | None:
        """The features of positions 0 .. length - 1 of ``seq_id`` (forgotten here), None if
        some position was never computed (the request was aborted)."""
        parts = self._rows.pop(seq_id, [])
        if not parts:
            return None
        out = parts[0][1].new_empty(length, parts[0][1].shape[1])
        covered = torch.zeros(length, dtype=torch.bool)
        for first, rows in parts:  # in step order: a recomputation overwrites
            n = min(len(rows), length - first)
            out[first : first + n] = rows[:n]
            covered[first : first + n] = True
        return out if bool(covered.all()) else None


def generate_with_features(
    llm, prompts: list[list[int]], params: list[SamplingParams], layers: tuple[int, ...]
) -> tuple[list, list[torch.Tensor | None]]:
    """``llm`` (an ``engine.LLM``) answers the token-id ``prompts``; returns its outputs, in
    order, and each conversation's features (``FeatureCapture.features`` of prompt + answer
    but its last token). The engine must not use its prefix cache (a cached position is never
    computed) and runs no speculation while this runs."""
    engine = llm.llm_engine
    if engine.config.enable_prefix_caching:
        raise ValueError("feature capture needs an engine without prefix caching")
    if engine.requests:
        raise ValueError("feature capture needs an engine with no request in flight")
    if any(p.n != 1 for p in params):
        raise ValueError("feature capture answers with n = 1")
    recorder, run = FeatureCapture(engine.step_sampler, layers), uuid.uuid4().hex  # run: new ids
    saved, engine.spec = engine.spec, recorder
    seq_ids, finished = {}, {}  # request id → its sequence's, in prompt order
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            request_id = f"capture-{run}-{i}"
            engine.add_request(request_id, {"prompt_token_ids": prompt}, p)
            seq_ids[request_id] = engine.requests[request_id].samples[0].seq.seq_id
        while len(finished) < len(seq_ids):
            for out in engine.step():  # (also an earlier call's aborts: not ours)
                if out.finished and out.request_id in seq_ids:
                    finished[out.request_id] = out
    finally:
        for request_id in seq_ids:
            engine.abort_request(request_id)  # False for those already finished
        engine.spec = saved
    outputs = [finished[r] for r in seq_ids]
    feats = [
        recorder.features(seq_id, len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1)
        for seq_id, o in zip(seq_ids.values(), outputs, strict=True)
    ]
    return outputs, feats
