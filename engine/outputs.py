"""What the engine returns: vLLM-shaped request outputs and engine statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedspec.memory import BlockManager
    from pagedspec.scheduler import Scheduler


class Logprob(float):
    """vLLM's ``Logprob`` (``logprob``, ``rank``: 1 for the most likely token, and
    ``decoded_token``) that is also the logprob itself as a float, so code that reads a
    logprobs entry as {token id: float} keeps working."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __getnewargs__(self) -> tuple:  # copy and pickle keep rank and decoded_token
        return (float(self), self.rank, self.decoded_token)

    def __repr__(self) -> str:
        fields = f"logprob={float(self)!r}, rank={self.rank}, decoded_token={self.decoded_token!r}"
        return f"Logprob({fields})"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    logprobs: list[dict[int, Logprob]] | None = None  # per token: {token id: its Logprob}
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    # the sum of the tokens' logprobs (of the raw logits), when logprobs were asked for
    cumulative_logprob: float | None = None

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
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then per token
    # {token id: logprob} (it and the top ones), as the prompt's prefill computed them
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


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

    @classmethod
    def of(
        cls, block_manager: BlockManager, scheduler: Scheduler, speculation: dict[str, Any]
    ) -> EngineStats:
        """The engine's parts' counters now (``speculation``: its round's ``stats()``)."""
        return cls(
            num_total_blocks=block_manager.num_blocks,
            num_free_blocks=block_manager.num_free_blocks(),
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_preemptions=scheduler.num_preemptions,
            num_prefix_cache_hit_tokens=scheduler.num_prefix_cache_hit_tokens,
            num_prefix_cache_query_tokens=scheduler.num_prefix_cache_query_tokens,
            **speculation,
        )

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification round (accepted drafts + the recovered/bonus token)."""
        if not self.num_verifications:
            return 0.0
        return (self.num_accepted_tokens + self.num_verifications) / self.num_verifications
