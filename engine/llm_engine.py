"""The embedded engine loop: ``add_request`` / ``step``.

One step, each job with one owner:

1. ``Scheduler.schedule`` picks sequences and token counts and reserves their KV slots; its
   output carries each sequence's block table (k draft slots per sequence from the
   ``SpeculationManager``).
2. ``_execute`` computes without moving any sequence: the manager drafts, the ``ModelRunner``
   runs every span in one packed forward, the ``StepSampler`` samples and verifies.
3. ``_commit`` moves them: the ``OutputProcessor`` keeps tokens up to a stop, then
   ``Scheduler.update`` commits them, advances ``num_computed_tokens`` and rolls the block table
   back past rejected drafts (a kept draft-tree leaf's K/V is first copied to its position's
   slot, ``engine.spec_decode.tree``); finished samples are retired.

If step 2 raises, no sequence has moved: the engine finds the request(s) that fail on their
own, aborts them (their outputs carry the error) and the others run next step as if nothing
happened.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref

import torch

from engine.build import EngineParts, build_engine_parts
from engine.config import EngineConfig
from engine.distributed.group import WorkerError
from engine.model_runner import Span
from engine.outputs import EngineStats, RequestOutput
from engine.processor import PromptType
from engine.request import Request, SampleState
from engine.sampling_params import SamplingParams
from engine.spec_decode.proposers import Proposal, TargetStep
from engine.step_sampler import SampleJob, SampleResult
from scheduler import ScheduledSequence, SchedulerOutput, Sequence

# Per scheduled sequence: one result per sample it feeds (n of them when its prompt forks),
# and the target's hidden states of its span (None unless the proposer reads them); then, per
# scheduled index whose draft tree gave a token at a leaf, that leaf's index in the span.
StepResult = tuple[Proposal, list[list[SampleResult]], list[torch.Tensor | None], dict[int, int]]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        parts: EngineParts = build_engine_parts(config)
        self.config, self.tokenizer, self.model_config = config, parts.tokenizer, parts.model_config
        self.processor, self.block_manager = parts.processor, parts.block_manager
        self.vocab_size = parts.processor.vocab_size
        self.max_model_len = parts.processor.max_model_len
        self.scheduler, self.runner, self.spec = parts.scheduler, parts.runner, parts.spec
        self.step_sampler, self.outputs = parts.step_sampler, parts.output_processor
        self.requests: dict[str, Request] = {}
        self._owner: dict[int, tuple[Request, SampleState]] = {}  # seq_id → its request, sample
        self._aborted: list[RequestOutput] = []
        self._seq_ids = itertools.count(1)
        # Tensor-parallel workers stop when the engine is collected, shut down, or at exit.
        self._tp = parts.tp
        if self._tp is not None:
            weakref.finalize(self, self._tp.shutdown)

    # --- public API ---------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None
    ) -> None:
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        p = self.processor.process(prompt, params)
        request = Request(request_id, p.prompt, p.prompt_token_ids, p.params)
        seq = Sequence(next(self._seq_ids), p.prompt_token_ids)
        seq.seats = p.params.n  # its forks take their seats when the prompt is done
        self._add_sample(request, seq, 0)
        self.requests[request_id] = request
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.get(request_id) if isinstance(request_id, str) else None
        if request is None:
            return False
        self._aborted.append(self._abort(request))
        return True

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is collected)."""
        if self._tp is not None:
            self._tp.shutdown()

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or an abort's final output has not been returned yet."""
        return bool(self.requests or self._aborted)

    def get_stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            num_total_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks(),
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_preemptions=sched.num_preemptions,
            num_prefix_cache_hit_tokens=sched.num_prefix_cache_hit_tokens,
            num_prefix_cache_query_tokens=sched.num_prefix_cache_query_tokens,
            **self.spec.stats(),
        )

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that progressed (and aborts since the last).
        A step that raises leaves the aborts' outputs to the next one."""
        outputs, self._aborted = self._aborted, []
        try:
            return outputs + self._step()
        except BaseException:
            self._aborted = outputs + self._aborted
            raise

    def _step(self) -> list[RequestOutput]:
        if not self.scheduler.has_unfinished():
            return []
        busy = len(self.scheduler.running) + len(self.scheduler.waiting)
        sched = self.scheduler.schedule(self.spec.lookahead(busy, self._params))
        for seq in sched.preempted:
            self.spec.release(seq.seq_id)  # its draft KV went with its blocks
        if sched.is_empty:
            return []
        try:
            result = self._execute(sched)
        except WorkerError:  # no request is at fault: the engine itself is gone
            raise
        except Exception as error:  # noqa: BLE001 - isolated below, or re-raised
            return self._isolate_failure(sched, error)
        return self._commit(sched, result)

    def _execute(self, sched: SchedulerOutput) -> StepResult:
        """Draft, forward, sample and verify; changes no sequence, request or proposer state."""
        self.runner.copy_blocks(sched.blocks_to_copy)
        self.spec.copy_blocks(sched.blocks_to_copy)
        proposal = self.spec.propose(sched.scheduled, self._draft_params)
        spans = [
            Span(
                s.seq.token_ids[s.start : s.start + s.num_new_tokens] + drafts,
                s.start,
                1 + len(drafts) if s.samples else 0,
                s.block_table,
                tree.parents if (tree := proposal.trees.get(i)) else None,
            )
            for i, (s, drafts) in enumerate(zip(sched.scheduled, proposal.drafts, strict=True))
        ]
        hidden = None
        if self.spec.needs_target_hidden:
            logits, hidden = self.runner.forward(
                spans, return_hidden=True, hidden_layers=self.spec.hidden_layers
            )
            hidden = self.spec.target_features(hidden)
        else:
            logits = self.runner.forward(spans)
        jobs, owners, span_rows, row = [], [], {}, 0
        for i, (s, span) in enumerate(zip(sched.scheduled, spans, strict=True)):
            if not s.samples:
                continue
            request, sample = self._owner[s.seq.seq_id]
            rows = span_rows[i] = logits[row : row + span.num_logits]
            row += span.num_logits
            outputs = s.seq.num_output_tokens
            drafts, q = proposal.drafts[i], proposal.draft_probs[i]
            if (tree := proposal.trees.get(i)) is not None:  # the chain is verified as one
                rows, drafts = rows[: 1 + tree.chain], drafts[: tree.chain]
            for index in [sample.index] if outputs else range(request.params.n):
                # (a finished prompt feeds all n samples at once)
                jobs.append(
                    SampleJob(request.params, index, outputs, s.seq.token_ids, rows, drafts, q)
                )
                owners.append(i)
        results: list[list[SampleResult]] = [[] for _ in sched.scheduled]
        for i, result in zip(owners, self.step_sampler(jobs), strict=True):
            results[i].append(result)
        leaf_hits = self._sample_at_leaves(proposal, jobs, owners, results, span_rows)
        return proposal, results, _split_rows(hidden, spans), leaf_hits

    def _sample_at_leaves(
        self,
        proposal: Proposal,
        jobs: list[SampleJob],
        owners: list[int],
        results: list[list[SampleResult]],
        span_rows: dict[int, torch.Tensor],
    ) -> dict[int, int]:
        """Where a draft tree's chain emitted the token a leaf holds, one more token from the
        leaf's row (engine.spec_decode.tree: the target's p after the emitted tokens); returns
        the leaves used, by scheduled index."""
        follow, used = [], {}
        for job, i in zip(jobs, owners, strict=True):
            tree = proposal.trees.get(i)
            if tree is None:
                continue
            emitted = results[i][0].token_ids  # a sequence with drafts feeds one sample
            leaf = tree.leaf_hit(proposal.drafts[i], emitted)
            if leaf is not None:
                used[i] = leaf
                follow.append(dataclasses.replace(
                    job, num_outputs=job.num_outputs + len(emitted),
                    token_ids=[*job.token_ids, *emitted], rows=span_rows[i][leaf : leaf + 1],
                    drafts=(), draft_probs=None,
                ))  # fmt: skip
        for i, more in zip(used, self.step_sampler(follow), strict=True):
            first = results[i][0]
            logprobs = None if first.logprobs is None else first.logprobs + (more.logprobs or [])
            results[i][0] = SampleResult(first.token_ids + more.token_ids, logprobs)
        return used

    def _commit(self, sched: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        proposal, results, hidden, leaf_hits = result
        progressed: dict[str, Request] = {}
        for i, (s, drafts, samples, rows) in enumerate(
            zip(sched.scheduled, proposal.drafts, results, hidden, strict=True)
        ):
            owner = self._owner.get(s.seq.seq_id)
            if owner is None:  # its request was aborted earlier in this loop
                continue
            request = owner[0]
            try:
                self._commit_sequence(request, s, drafts, samples, proposal, rows, leaf_hits.get(i))
            except Exception as error:  # noqa: BLE001 - this request alone is aborted
                self._abort(request, error)
                progressed[request.request_id] = request
            if s.samples:
                progressed[request.request_id] = request
        return [self.outputs.output(r) for r in progressed.values()]

    def _commit_sequence(
        self,
        request: Request,
        s: ScheduledSequence,
        drafts: list[int],
        results: list[SampleResult],
        proposal: Proposal,
        hidden: torch.Tensor | None,
        leaf: int | None,
    ) -> None:
        parent, end = s.seq, s.start + s.num_new_tokens
        seqs = [parent]
        for index in range(1, len(results)):  # n > 1: the samples share the prompt's blocks
            child = Sequence(next(self._seq_ids), parent.token_ids)
            self.scheduler.fork(parent, child)
            self.spec.fork(parent.seq_id, child.seq_id)
            self._add_sample(request, child, index)
            seqs.append(child)
        for seq, res in zip(seqs, results or [SampleResult([], None)], strict=True):
            sample = self._owner[seq.seq_id][1]
            kept = self.outputs.append(request, sample, res.token_ids, res.logprobs)
            num_computed = end + max(len(kept) - 1, 0)  # accepted drafts' KV is written
            if leaf is not None and len(kept) == len(res.token_ids):  # the leaf's KV is kept
                depth = len(kept) - 1  # the leaf's token is the last but one
                self.runner.move_kv(list(s.block_table), [(s.start + leaf, s.start + depth)])
                if hidden is not None:  # its rows by position, as the proposer reads them
                    hidden = torch.cat([hidden[:depth], hidden[leaf : leaf + 1]])
            target = TargetStep(s.start, hidden, num_computed)
            covered = self.spec.commit(
                seq, kept, len(drafts), len(res.token_ids), proposal, parent, target,
                leaf is not None,
            )  # fmt: skip
            cacheable = num_computed if covered is None else min(num_computed, covered)
            self.scheduler.update(seq, num_computed, kept, cacheable)
            if sample.finished:
                self._retire(sample)
        if request.finished:
            del self.requests[request.request_id]

    def _isolate_failure(self, sched: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """Re-run each request's part of the failed step on its own (committing nothing) and
        abort those that fail alone; if none does, re-raise: every request is as it was."""
        by_request: dict[str, list[ScheduledSequence]] = {}
        for s in sched.scheduled:
            by_request.setdefault(self._owner[s.seq.seq_id][0].request_id, []).append(s)
        outputs = []
        for request_id, scheduled in by_request.items():
            try:
                self._execute(SchedulerOutput(scheduled))
            except WorkerError:
                raise
            except Exception as own_error:  # noqa: BLE001 - this request is the culprit
                outputs.append(self._abort(self.requests[request_id], own_error))
        if not outputs:
            raise error
        return outputs

    # --- requests -----------------------------------------------------------------------------
    def _add_sample(self, request: Request, seq: Sequence, index: int) -> None:
        self._owner[seq.seq_id] = (request, self.outputs.new_sample(request, seq, index))

    def _params(self, seq: Sequence) -> SamplingParams:
        return self._owner[seq.seq_id][0].params

    def _draft_params(self, seq: Sequence) -> SamplingParams:
        """What a drafter samples ``seq``'s drafts with: its request's params, the seed of a
        seeded request's sample i > 0 mixed with i (drafters seed by (seed, position), and n
        samples sharing one seed would share their drafts: the same tokens wherever their
        histories meet)."""
        request, sample = self._owner[seq.seq_id]
        params = request.params
        if params.seed is None or sample.index == 0:
            return params
        return dataclasses.replace(
            params, seed=hash((params.seed, sample.index)) & 0x7FFF_FFFF_FFFF_FFFF
        )

    def _retire(self, sample: SampleState) -> None:
        self.scheduler.finish(sample.seq)
        self.spec.release(sample.seq.seq_id)
        del self._owner[sample.seq.seq_id]

    def _abort(self, request: Request, error: Exception | None = None) -> RequestOutput:
        """Finish every sample not yet retired with "abort" and free its blocks (one that a
        failed commit had just finished is not retired yet: it would hold its blocks forever)."""
        if error is not None:
            request.error = f"{type(error).__name__}: {error}"
        for sample in request.samples:
            if sample.seq.seq_id in self._owner:
                sample.finish_reason = "abort"
                self._retire(sample)
        for index in range(len(request.samples), request.params.n):  # forks never made
            seq = Sequence(next(self._seq_ids), request.prompt_token_ids)
            self.outputs.new_sample(request, seq, index).finish_reason = "abort"
        self.requests.pop(request.request_id, None)
        return self.outputs.output(request)


def _split_rows(hidden: torch.Tensor | None, spans: list[Span]) -> list[torch.Tensor | None]:
    if hidden is None:
        return [None] * len(spans)
    return list(hidden.split([len(span.token_ids) for span in spans]))
