"""llama.cpp as a peer (llama-cpp-python's low-level API; ``make bench-peers`` installs it).

- GGUF files at each precision from the default model's weights, written by llama.cpp's own
  quantizer from the shipped Q4_1 file (``allow_requantize``: each tensor is dequantized to fp32,
  the exact values pagedspec runs, then quantized) and cached under the pagedspec cache folder.
- ``LlamaCpp``: a model and one context; ``decode`` runs one ``llama_batch`` and returns the
  logits of the tokens that asked for them.
- ``run_batched``: greedy continuous batching as llama-server drives it, one sequence id per
  request, decodes and prompt chunks sharing each batch, EOS ignored.

Nothing here imports ``llama_cpp`` until a file is quantized or a model loaded, so the driver
and the file naming are testable without it.
"""

import ctypes
import logging
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from benchmarks.timing import RequestTiming

# llama_ftype values (llama.h) of the files we write.
FTYPES = {"F32": 0, "F16": 1, "Q4_1": 3, "Q8_0": 7, "BF16": 32}
CACHE_VERSION = 1  # bump when the way the files are written changes


def unavailable_reason() -> str | None:
    """Why the llama.cpp peer cannot run here, or None when ``llama_cpp`` imports."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:  # an OSError from a broken build surfaces here too
        return f"llama_cpp is not importable ({exc}); `make bench-peers` installs it"
    return None


def _lib():
    """The llama_cpp module, its backend started and its log lines below errors silenced."""
    import llama_cpp

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    llama_cpp.llama_backend_init()
    return llama_cpp


def version() -> str:
    import llama_cpp

    return llama_cpp.__version__


def file_type(path: str) -> str:
    """The GGUF's ``general.file_type`` as a FTYPES name (read with gguf-py, no llama_cpp)."""
    import gguf

    value = gguf.GGUFReader(path).get_field("general.file_type").contents()
    names = {v: k for k, v in FTYPES.items()}
    if value not in names:
        raise ValueError(f"{path}: general.file_type {value} is none of {sorted(FTYPES)}")
    return names[value]


def source_gguf(spec) -> str | None:
    """The GGUF llama.cpp's files are made from, for a benchmarks.workload.ModelSpec: None for
    the default model (its shipped file), else --model's .gguf; ValueError for anything else."""
    model = spec.engine_model
    if spec.load_format == "dummy" or (model is not None and not model.endswith(".gguf")):
        raise ValueError("llama.cpp needs GGUF weights: the default model or a .gguf --model")
    return model and spec.hf_path


def cached_path(source: str, gguf_type: str, cache_root: str) -> str:
    """Where ``source`` converted to ``gguf_type`` is cached: one folder per source file."""
    if gguf_type not in FTYPES:
        raise ValueError(f"gguf_type must be one of {sorted(FTYPES)}, got {gguf_type!r}")
    stem = os.path.basename(source).removesuffix(".gguf")
    return os.path.join(cache_root, f"llamacpp-v{CACHE_VERSION}", stem, f"{gguf_type}.gguf")


def gguf_file(gguf_type: str, source: str | None = None, threads: int | None = None) -> str:
    """``source`` (default: the default model's shipped GGUF) at ``gguf_type``: the source
    itself when it already is that type, else llama.cpp's quantizer's output, made once."""
    from pagedspec.engine.loader.default_model import cache_root, default_gguf_path

    source = source or default_gguf_path()
    if file_type(source) == gguf_type:
        return source
    target = cached_path(source, gguf_type, cache_root())
    if os.path.isfile(target):
        return target
    lib = _lib()
    params = lib.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = FTYPES[gguf_type], True
    params.nthread = threads or os.cpu_count() or 1
    os.makedirs(os.path.dirname(target), exist_ok=True)
    # Written beside the target and renamed: a killed run never leaves a half file in place.
    fd, tmp = tempfile.mkstemp(suffix=".gguf", dir=os.path.dirname(target))
    os.close(fd)
    try:
        rc = lib.llama_model_quantize(source.encode(), tmp.encode(), ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({source} -> {gguf_type}) returned {rc}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


class LlamaCpp:
    """A llama.cpp model and one context of ``n_seq_max`` sequences, each with its own KV
    stream of ``n_ctx_seq`` positions (``kv_unified`` off: attention reads only its own)."""

    def __init__(self, path: str, n_seq_max: int, n_ctx_seq: int, n_batch: int, threads: int):
        lib = self.lib = _lib()
        self.model = lib.llama_model_load_from_file(path.encode(), lib.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_seq_max = n_seq_max * n_ctx_seq, n_seq_max
        params.n_batch, params.n_ubatch = n_batch, min(n_batch, 512)  # llama-server's ubatch
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified, params.no_perf = False, True
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not make a context for {path}")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        self.memory = lib.llama_get_memory(self.ctx)

    def decode(
        self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
        outputs: Sequence[bool],
    ) -> np.ndarray:  # fmt: skip
        """One ``llama_decode``; the logits [outputs, vocab] of the flagged tokens, in batch
        order (a view of llama.cpp's buffer, valid until the next call)."""
        n, b = len(tokens), self.batch
        if not 0 < n <= self.n_batch:
            raise ValueError(f"a batch holds 1..{self.n_batch} tokens, got {n}")
        for i, (t, p, s, o) in enumerate(zip(tokens, positions, seq_ids, outputs, strict=True)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = t, p, 1, s, o
        b.n_tokens = n
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        rows = sum(map(bool, outputs))
        if rows == 0:  # a prompt chunk that is not a prompt's end
            return np.empty((0, self.n_vocab), dtype=np.float32)
        return np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), (rows, self.n_vocab))

    def clear(self, seq_id: int) -> None:
        """Drop sequence ``seq_id``'s KV: its id can serve the next request."""
        self.lib.llama_memory_seq_rm(self.memory, seq_id, -1, -1)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


@dataclass
class _Slot:
    index: int  # the request's position in the workload
    prompt: Sequence[int]
    output_len: int
    fed: int = 0  # prompt tokens sent so far
    out: list[int] = field(default_factory=list)
    first_s: float = 0.0


def run_batched(
    llama, requests: Sequence, batch_size: int, clock: Callable[[], float] = time.perf_counter
) -> tuple[list[RequestTiming], list[list[int]]]:
    """Every request (``prompt_ids``, ``output_len``) submitted at once; at most ``batch_size``
    in flight, each on its own sequence id (reused once freed). Each batch holds every running
    sequence's next token, then prompt chunks in arrival order up to ``llama.n_batch`` tokens
    (llama-server's order); a prompt's last token asks for logits. Greedy, EOS ignored. Returns
    per-request timings (seconds from submission) and generated tokens, in request order."""
    if not 1 <= batch_size <= llama.n_batch:
        raise ValueError(f"batch_size must be in 1..n_batch ({llama.n_batch}), got {batch_size}")
    for i, r in enumerate(requests):
        if not r.prompt_ids or r.output_len < 1:
            got = f"got {len(r.prompt_ids)} prompt tokens and output_len {r.output_len}"
            raise ValueError(
                f"request {i}: prompt_ids must be non-empty and output_len >= 1, {got}"
            )
    waiting, free_ids = deque(enumerate(requests)), list(range(batch_size))
    running: dict[int, _Slot] = {}
    done: dict[int, tuple[RequestTiming, list[int]]] = {}
    start = clock()
    while waiting or running:
        while waiting and free_ids:
            i, r = waiting.popleft()
            running[free_ids.pop(0)] = _Slot(i, r.prompt_ids, r.output_len)
        entries = []  # (token, position, seq id, wants logits)
        for sid, s in running.items():
            if s.fed == len(s.prompt):
                entries.append((s.out[-1], len(s.prompt) + len(s.out) - 1, sid, True))
        for sid, s in running.items():
            take = min(llama.n_batch - len(entries), len(s.prompt) - s.fed)
            if take <= 0:
                continue
            for j in range(s.fed, s.fed + take):
                entries.append((s.prompt[j], j, sid, j == len(s.prompt) - 1))
            s.fed += take
        logits = llama.decode(*zip(*entries, strict=True))
        now = clock() - start
        asked = [sid for *_, sid, wants in entries if wants]
        for sid, token in zip(asked, np.argmax(logits, axis=-1).tolist(), strict=True):
            s = running[sid]
            s.out.append(token)
            s.first_s = now if len(s.out) == 1 else s.first_s
            if len(s.out) == s.output_len:
                done[s.index] = (RequestTiming(s.first_s, now, len(s.out)), s.out)
                llama.clear(sid)
                free_ids.append(sid)
                del running[sid]
    ordered = [done[i] for i in range(len(requests))]
    return [t for t, _ in ordered], [tokens for _, tokens in ordered]
