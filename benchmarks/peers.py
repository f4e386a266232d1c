"""HF transformers peers, on the same workload and weights as pagedspec, timed like it (from
the moment the whole workload was submitted, each token's time recorded).

- ``hf-static``: ``model.generate`` over static, left-padded batches of ``batch_size`` requests
  in order, each batch run to its longest requested output (EOS cannot end it early); only each
  request's own tokens count.
- ``hf-batch``: transformers' paged continuous batching (the manager behind
  ``generate_batch``, driven directly so each request gets its own length), at most
  ``batch_size`` requests and MAX_BATCH_TOKENS (as pagedspec's default) per step.
"""

import math
import os
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from benchmarks.timing import RequestTiming
from benchmarks.workload import BenchRequest

PEERS = ("hf-static", "hf-batch")
MAX_BATCH_TOKENS = 2048


def load_hf_model(
    path: str | None, config, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> AutoModelForCausalLM:
    """``path``'s weights (a HF directory or .gguf), or (None) random ones from ``config``."""
    if path is not None:
        folder, gguf = os.path.split(path) if path.endswith(".gguf") else (path, None)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=dtype).to(device)
    else:
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


class _StepClock(LogitsProcessor):
    """Records the time each generation step's logits come out (one call per new token)."""

    def __init__(self, device: torch.device, start: float):
        self.device, self.start, self.times = device, start, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter() - self.start)
        return scores


def pad_id(model) -> int:
    """The model's pad token id (0 where it names none)."""
    values = (model.generation_config.pad_token_id, model.config.pad_token_id)
    return next((v for v in values if isinstance(v, int)), 0)


@torch.inference_mode()
def run_hf_static(model, requests: list[BenchRequest], batch_size: int) -> list[RequestTiming]:
    """Static batches of ``batch_size`` in request order, each run to its longest output."""
    device, pad, timings, start = model.device, pad_id(model), [], time.perf_counter()
    for lo in range(0, len(requests), batch_size):
        group = requests[lo : lo + batch_size]
        width = max(len(r.prompt_ids) for r in group)
        ids = torch.full((len(group), width), pad, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, r in enumerate(group):
            ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids) :] = 1
        longest = max(r.output_len for r in group)
        clock = _StepClock(device, start)
        config = GenerationConfig(max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
            pad_token_id=pad, eos_token_id=model.generation_config.eos_token_id)  # fmt: skip
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                       generation_config=config, logits_processor=[clock])  # fmt: skip
        if len(clock.times) != longest:
            raise RuntimeError(f"hf-static made {len(clock.times)} steps, expected {longest}")
        t = clock.times
        timings += [RequestTiming(t[0], t[r.output_len - 1], r.output_len) for r in group]
    return timings


@torch.inference_mode()
def run_hf_batch(model, requests: list[BenchRequest], batch_size: int) -> list[RequestTiming]:
    """Transformers' paged continuous batching: up to ``batch_size`` requests per step."""
    longest = max(len(r.prompt_ids) + r.output_len for r in requests)
    page = 256
    # Every request fits at once: like pagedspec's sizing, no run is memory-bound.
    cb_config = ContinuousBatchingConfig(
        page_size=page,
        max_requests_per_batch=batch_size,
        num_blocks=batch_size * (math.ceil(longest / page) + 1),
        max_batch_tokens=MAX_BATCH_TOKENS,
    )
    # No EOS: every request makes exactly its output_len tokens.
    gen_config = GenerationConfig(max_new_tokens=max(r.output_len for r in requests),
        do_sample=False, eos_token_id=-1, pad_token_id=pad_id(model))  # fmt: skip
    results = {}
    with model.continuous_batching_context_manager(
        generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=30
    ) as manager:
        start = time.perf_counter()
        for i, r in enumerate(requests):
            manager.add_request(r.prompt_ids, request_id=f"r{i}", max_new_tokens=r.output_len,
                                eos_token_id=-1, record_timestamps=True)  # fmt: skip
        while len(results) < len(requests):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
    timings = []
    for i, r in enumerate(requests):
        result = results[f"r{i}"]
        if result.error is not None:
            raise RuntimeError(f"hf-batch request failed: {result.error}")
        stamps, made = result.timestamps or [], len(result.generated_tokens)
        if made != r.output_len or len(stamps) != r.output_len:
            raise RuntimeError(f"hf-batch made {made} tokens, expected {r.output_len}")
        timings.append(RequestTiming(stamps[0] - start, stamps[-1] - start, r.output_len))
    return timings


def run_peer(name: str, model, requests: list[BenchRequest], batch_size: int) -> list:
    """``name``'s timings on ``requests``, from the moment they were all submitted."""
    if name not in PEERS:
        raise ValueError(f"peer must be one of {PEERS}, got {name!r}")
    run = run_hf_static if name == "hf-static" else run_hf_batch
    return run(model, requests, batch_size)
