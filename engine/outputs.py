"""What the engine returns: vLLM-shaped request outputs and engine statistics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}
    stop_reason: str | int | None = None  # the stop string or stop token id that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None  # set when a step failed on this request and the engine aborted it


@dataclass(frozen=True)
class EngineStats:
    num_total_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_prefix_cache_hit_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_verifications: int = 0  # sequence-rounds that verified at least one draft
    accepted_by_position: tuple[int, ...] = field(default=())  # accepted count at draft position i
    num_prefix_cache_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    num_leaf_tokens: int = 0  # accepted tokens that were draft-tree leaves (in num_accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification round (accepted drafts + the recovered/bonus token)."""
        if not self.num_verifications:
            return 0.0
        return (self.num_accepted_tokens + self.num_verifications) / self.num_verifications
