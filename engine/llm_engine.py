"""The embedded engine loop: ``add_request`` / ``step``.

One step: schedule → (propose drafts) → one packed forward → sample or verify → commit
accepted tokens, roll back the rest by truncating block tables → stop checks → outputs.
"""

from __future__ import annotations

import os

import torch

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.model_loader import load_model, model_kv_shape
from engine.model_runner import ModelRunner, Span
from engine.outputs import EngineStats, RequestOutput
from engine.request import Request, SampleState
from engine.sampler import Sampler, SamplingBatch
from engine.sampling_params import SamplingParams
from engine.spec_decode import verify_deterministic_drafts
from engine.spec_decode.backoff import DraftBackoff
from engine.spec_decode.proposers import DraftModelProposer, NgramProposer, Proposer
from memory import BlockManager, kv_block_bytes
from scheduler import Scheduler, SchedulerConfig, Sequence

# On CPU, KV defaults to this fraction of available RAM (capped by what the limits can use).
_CPU_KV_MEMORY_FRACTION = 0.3


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        target = load_model(
            config.model, config.dtype, config.device, config.load_format, config.seed
        )
        self.model_config = target.config
        self.tokenizer = target.tokenizer
        self.vocab_size = int(target.config.vocab_size)
        param = next(target.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        model_max = target.model.max_model_len
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(
                f"max_model_len must be <= {model_max} for this model, got {config.max_model_len}"
            )
        self.max_model_len = config.max_model_len or model_max
        self.eos_token_ids = _eos_token_ids(target.config, self.tokenizer)

        spec = config.speculative_config
        draft = None
        if spec is not None and spec.method == "draft":
            draft = load_model(
                spec.draft_model, config.dtype, self.device, config.load_format, config.seed
            )
            if int(draft.config.vocab_size) != self.vocab_size:
                raise ValueError(
                    f"draft_model vocabulary ({draft.config.vocab_size} tokens) differs from the "
                    f"target's ({self.vocab_size}); speculation needs the same vocabulary"
                )
        models = [target] + ([draft] if draft else [])
        num_blocks = self._num_blocks([m.config for m in models])
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len),
            self.block_manager,
        )
        backend = config.attention_backend
        self.runner = ModelRunner(
            target.model,
            self._kv_caches(target.config, num_blocks),
            self.block_manager,
            backend,
            self.device,
        )
        self.num_lookahead = spec.num_speculative_tokens if spec else 0
        self.proposer: Proposer | None = None
        if draft is not None:
            draft_runner = ModelRunner(
                draft.model,
                self._kv_caches(draft.config, num_blocks),
                self.block_manager,
                backend,
                self.device,
            )
            self.proposer = DraftModelProposer(draft_runner)
        elif spec is not None:
            self.proposer = NgramProposer(spec.ngram_min, spec.ngram_max)
        self.backoff = DraftBackoff(spec.max_draft_skip if spec else 0)
        self.sampler = Sampler(config.seed, self.device)
        self.requests: dict[str, Request] = {}
        self._samples: dict[int, tuple[Request, SampleState]] = {}  # seq_id → owner
        self._aborted: list[RequestOutput] = []
        self._next_seq_id = 0
        self._num_draft_tokens = 0
        self._num_accepted_tokens = 0
        self._num_verifications = 0
        self._accepted_by_position = [0] * self.num_lookahead

    # --- set-up -----------------------------------------------------------------------------
    def _num_blocks(self, configs: list) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = sum(
            kv_block_bytes(*model_kv_shape(c), cfg.block_size, self.dtype) for c in configs
        )
        needed = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        budget = cfg.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * 0.8)
            else:
                budget = int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
                budget = int(budget * _CPU_KV_MEMORY_FRACTION)
        return max(1, min(needed, budget // per_block))

    def _kv_caches(self, model_config, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        layers, kv_heads, head_dim = model_kv_shape(model_config)
        shape = (num_blocks, self.config.block_size, kv_heads, head_dim)
        # Allocated once, never reallocated; empty: every slot is written before it is read.
        return [
            (
                torch.empty(shape, dtype=self.dtype, device=self.device),
                torch.empty(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(layers)
        ]

    # --- public API ---------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> None:
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        token_ids = self._prompt_token_ids(prompt)
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"n must be <= max_num_seqs ({self.config.max_num_seqs}), got {params.n}"
            )
        self._check_params(params)
        self._check_fits(token_ids, params)
        request = Request(
            request_id, prompt if isinstance(prompt, str) else None, token_ids, params
        )
        seq = Sequence(self._new_seq_id(), token_ids)
        seq.seats = params.n  # its forks take their seats when the prompt is done
        self._add_sample(request, seq, 0)
        self.requests[request_id] = request
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        request = self.requests.pop(request_id, None) if isinstance(request_id, str) else None
        if request is None:
            return False
        for sample in request.samples:
            if not sample.finished:
                sample.finish_reason = "abort"
            self._retire(sample)
        request.finished = True
        self._aborted.append(request.output())
        return True

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or an abort's final output has not been returned yet."""
        return bool(self.requests or self._aborted)

    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_total_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks(),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            num_prefix_cache_hit_tokens=self.scheduler.num_prefix_cache_hit_tokens,
            num_draft_tokens=self._num_draft_tokens,
            num_accepted_tokens=self._num_accepted_tokens,
            num_verifications=self._num_verifications,
            accepted_by_position=tuple(self._accepted_by_position),
        )

    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        sched = self.scheduler.schedule(self._lookahead_this_step())
        if self.proposer is not None:
            for seq in sched.preempted:
                self.proposer.release(seq.seq_id)
        if sched.is_empty:
            return outputs
        self.runner.copy_blocks(sched.blocks_to_copy)
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.runner.copy_blocks(sched.blocks_to_copy)
        drafts = self._propose(sched.scheduled)

        spans = []
        for s in sched.scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            tokens = seq.token_ids[start : start + s.num_new_tokens]
            d = drafts.get(seq.seq_id, [])
            spans.append(Span(seq.seq_id, tokens + d, start, 1 + len(d) if s.samples else 0))
        logits = self.runner.forward(spans)

        # (sample, its logit rows, its drafts, tokens computed before this step)
        to_sample: list[tuple[SampleState, torch.Tensor, list[int], int]] = []
        progressed: dict[str, Request] = {}
        row = 0
        for s, span in zip(sched.scheduled, spans, strict=True):
            seq = s.seq
            before = seq.num_computed_tokens
            seq.num_computed_tokens += s.num_new_tokens
            request, sample = self._samples[seq.seq_id]
            if not s.samples:
                self._commit_prefix(seq, before)
                continue
            rows = logits[row : row + span.num_logits]
            row += span.num_logits
            progressed[request.request_id] = request
            d = drafts.get(seq.seq_id, [])
            forks = (
                self._fork(request, sample) if len(request.samples) < request.params.n else [sample]
            )
            to_sample.extend((fork, rows, d, before) for fork in forks)

        tokens, logprobs = self._sample([(s, rows, d) for s, rows, d, _ in to_sample])
        for (sample, _, _, before), new_tokens, token_logprobs in zip(
            to_sample, tokens, logprobs, strict=True
        ):
            self._commit(sample, new_tokens, token_logprobs, before)

        for request in progressed.values():
            if all(s.finished for s in request.samples):
                request.finished = True
                del self.requests[request.request_id]
            outputs.append(request.output())
        return outputs

    # --- requests -----------------------------------------------------------------------------
    def _prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError("this model has no tokenizer: give the prompt as token ids")
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        elif isinstance(prompt, list | tuple):
            token_ids = list(prompt)
            bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)]
            bad += [t for t in token_ids if isinstance(t, int) and not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}"
                )
        else:
            raise ValueError(f"prompt must be a str or a list of token ids, got {type(prompt)}")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; it must be shorter than max_model_len "
                f"({self.max_model_len})"
            )
        return token_ids

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check without the vocabulary."""
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs must be in [0, {self.vocab_size}], got {params.logprobs}")

    def _check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        """Reject what could never run: one sequence needing more KV blocks than exist."""
        longest = len(token_ids) + (params.max_tokens or self.max_model_len) + self.num_lookahead
        longest = min(longest, self.max_model_len + self.num_lookahead)
        needed = -(-longest // self.config.block_size)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"request needs up to {needed} KV blocks ({longest} tokens) but the cache has "
                f"{self.block_manager.num_blocks}; lower max_tokens or raise num_kv_blocks"
            )

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def _add_sample(self, request: Request, seq: Sequence, index: int) -> SampleState:
        params = request.params
        sample = SampleState(
            index,
            seq,
            params,
            # A config-only dummy model has no tokenizer: token ids only, no text.
            None
            if self.tokenizer is None
            else IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids),
            logprobs=[] if params.logprobs is not None else None,
        )
        request.samples.append(sample)
        self._samples[seq.seq_id] = (request, sample)
        return sample

    def _fork(self, request: Request, parent: SampleState) -> list[SampleState]:
        """n > 1: the prompt was computed once; the samples share its blocks (copy-on-write)."""
        forks = [parent]
        parent.seq.seats = 1
        for index in range(1, request.params.n):
            child = Sequence(self._new_seq_id(), parent.seq.token_ids)
            child.num_computed_tokens = parent.seq.num_computed_tokens
            self.block_manager.fork(parent.seq.seq_id, child.seq_id)
            self.scheduler.add_running(child)
            forks.append(self._add_sample(request, child, index))
        return forks

    def _retire(self, sample: SampleState) -> None:
        self.scheduler.finish(sample.seq)
        self._samples.pop(sample.seq.seq_id, None)
        if self.proposer is not None:
            self.proposer.release(sample.seq.seq_id)
            self.backoff.release(sample.seq.seq_id)

    # --- speculation ----------------------------------------------------------------------------
    def _lookahead_this_step(self) -> int:
        spec = self.config.speculative_config
        if spec is None:
            return 0
        # Count every running sequence, not only the decoding ones: prompts being prefilled
        # are about to decode, and a step full of prefill chunks is already compute-bound.
        busy = len(self.scheduler.running) + len(self.scheduler.waiting)
        return 0 if busy >= spec.disable_batch_size else spec.num_speculative_tokens

    def _propose(self, scheduled) -> dict[int, list[int]]:
        if self.proposer is None:
            return {}
        wanted = []
        for s in scheduled:
            seq = s.seq
            if not s.num_lookahead_slots or not seq.num_output_tokens:
                continue
            if not self.backoff.should_draft(seq.seq_id):
                continue
            params = self._samples[seq.seq_id][1].params
            left = (params.max_tokens or self.max_model_len) - seq.num_output_tokens
            k = min(s.num_lookahead_slots, left - 1, self.max_model_len - len(seq) - 1)
            if k > 0:
                wanted.append((seq, k))
        if not wanted:
            return {}
        proposals = self.proposer.propose([seq for seq, _ in wanted], [k for _, k in wanted])
        return {seq.seq_id: d for (seq, _), d in zip(wanted, proposals, strict=True) if d}

    # --- sampling and commit --------------------------------------------------------------------
    def _sample(self, batch: list[tuple[SampleState, torch.Tensor, list[int]]]):
        """One target sample per row; rows of a verification span then accept or reject drafts.

        Returns (tokens per sample, logprob dicts per sample or None).
        """
        if not batch:
            return [], []
        all_rows, row_params, row_gens, starts = [], [], [], []
        num_rows = 0
        for sample, rows, _ in batch:
            starts.append(num_rows)
            num_rows += rows.shape[0]
            all_rows.append(self._mask_min_tokens(sample, rows))
            row_params.extend([sample.params] * rows.shape[0])
            row_gens.extend(self._position_generators(sample, rows.shape[0]))
        logits = _concat_rows(all_rows)
        sbatch = SamplingBatch.from_params(
            temperature=[p.temperature for p in row_params],
            top_k=[p.top_k for p in row_params],
            top_p=[p.top_p for p in row_params],
            min_p=[p.min_p for p in row_params],
            generators=row_gens,
            device=logits.device,
        )
        samples = self.sampler(logits, sbatch).token_ids.tolist()
        drafts = [d for _, _, d in batch]
        tokens = verify_deterministic_drafts(samples, drafts, starts)
        for (sample, _, d), emitted in zip(batch, tokens, strict=True):
            if d:
                accepted = len(emitted) - 1
                self.backoff.record(sample.seq.seq_id, accepted)
                self._num_draft_tokens += len(d)
                self._num_accepted_tokens += accepted
                self._num_verifications += 1
                for j in range(accepted):
                    self._accepted_by_position[j] += 1
        logprobs = [
            self._logprobs(s, logits[st : st + len(t)], t)
            for (s, _, _), st, t in zip(batch, starts, tokens, strict=True)
        ]
        return tokens, logprobs

    def _position_generators(self, sample: SampleState, num_rows: int):
        """A seeded sample draws output position i from a generator seeded by (seed, sample
        index, i) alone, so its tokens do not depend on the batch, on preemption, or on
        whether speculation drafted them. Unseeded rows use the sampler's shared generator."""
        seed = sample.params.seed
        if seed is None:
            return [None] * num_rows
        first = sample.seq.num_output_tokens
        return [
            torch.Generator(device=self.device).manual_seed(
                hash((seed, sample.index, first + j)) & 0x7FFF_FFFF_FFFF_FFFF
            )
            for j in range(num_rows)
        ]

    def _mask_min_tokens(self, sample: SampleState, rows: torch.Tensor) -> torch.Tensor:
        """Before min_tokens outputs, EOS and stop token ids cannot be sampled (row j of a
        verification span is output number num_output_tokens + j)."""
        params = sample.params
        short = params.min_tokens - sample.seq.num_output_tokens
        if short <= 0:
            return rows
        banned = list(self.eos_token_ids | set(params.stop_token_ids))
        rows = rows.clone()
        rows[:short, banned] = float("-inf")
        return rows

    def _logprobs(self, sample: SampleState, rows: torch.Tensor, tokens: list[int]):
        n = sample.params.logprobs
        if n is None:
            return None
        lp = torch.log_softmax(rows.float(), dim=-1)
        top = lp.topk(n, dim=-1) if n else None
        result = []
        for j, t in enumerate(tokens):
            entry = {t: lp[j, t].item()}
            if top is not None:
                entry.update(zip(top.indices[j].tolist(), top.values[j].tolist(), strict=True))
            result.append(entry)
        return result

    def _commit(
        self, sample: SampleState, new_tokens: list[int], logprobs, computed_before: int
    ) -> None:
        """Append accepted tokens one at a time, stopping exactly where a stop condition hits;
        then roll the block table back to the tokens whose KV is valid."""
        seq = sample.seq
        # Accepted drafts already have their KV: the verification pass wrote it.
        seq.num_computed_tokens += len(new_tokens) - 1
        for j, token in enumerate(new_tokens):
            seq.token_ids.append(token)
            delta = sample.detokenizer.add(token) if sample.detokenizer else ""
            sample.text += delta
            if sample.logprobs is not None:
                sample.logprobs.append(logprobs[j])
            if self._check_stop(sample, token, len(delta)):
                break
        if sample.finished:
            if sample.detokenizer and not isinstance(sample.stop_reason, str):
                sample.text += sample.detokenizer.flush()  # text held for an unfinished char
            self._retire(sample)
            return
        # Rollback: rejected drafts' slots (and unused lookahead) leave the block table.
        self.block_manager.truncate(seq.seq_id, seq.num_computed_tokens)
        self._commit_prefix(seq, computed_before)

    def _commit_prefix(self, seq: Sequence, old_computed: int) -> None:
        """Register newly completed full blocks of committed tokens for prefix caching."""
        bs = self.config.block_size
        if self.config.enable_prefix_caching and seq.num_computed_tokens // bs > old_computed // bs:
            self.block_manager.commit(seq.seq_id, seq.token_ids[: seq.num_computed_tokens])

    def _check_stop(self, sample: SampleState, token: int, new_chars: int) -> bool:
        seq, params = sample.seq, sample.params
        n_out = seq.num_output_tokens
        if n_out >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                sample.finish_reason = "stop"
            elif token in params.stop_token_ids:
                sample.finish_reason, sample.stop_reason = "stop", token
            elif params.stop_strings:
                _check_stop_strings(sample, new_chars)
        if not sample.finished and (
            (params.max_tokens is not None and n_out >= params.max_tokens)
            or len(seq) >= self.max_model_len
        ):
            sample.finish_reason = "length"
        return sample.finished


def _check_stop_strings(sample: SampleState, new_chars: int) -> None:
    """A stop string ends the text just before it; only the new characters can complete one."""
    text = sample.text
    for stop in sample.params.stop_strings:
        at = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if at >= 0:
            sample.text = text[:at]
            sample.finish_reason, sample.stop_reason = "stop", stop
            return


def _eos_token_ids(model_config, tokenizer) -> set[int]:
    ids = getattr(model_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, list | tuple) else [] if ids is None else [ids])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _concat_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(rows) of 2-D row blocks, as a view when they already lie back to back in one
    tensor (every step without n > 1 forks or min_tokens masking): no copy of B x vocab floats."""
    first = rows[0]
    offset = first.storage_offset()
    for r in rows:
        if (
            r.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or r.storage_offset() != offset
            or not r.is_contiguous()
        ):
            return torch.cat(rows)
        offset += r.numel()
    width = first.shape[1]
    return first.as_strided((sum(r.shape[0] for r in rows), width), (width, 1))
