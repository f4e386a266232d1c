"""Host overhead of an engine step: tiny-llama (benchmarks/model_configs) with dummy weights on the
CPU, a model that computes almost nothing, so what a step costs beyond it is the engine's own.

Per batch size B (--batch-sizes) and speculation method (--methods: off; ngram and eagle, k=4,
forced on at every B, eagle with a random head and its draft tree): B requests of 16 prompt
tokens (ngram: a pattern of 4 repeated, for drafts to match) submitted at once, greedy, EOS
ignored, stepped through prefill and --warmup-steps decode steps, then --steps decode steps
timed one by one. Per step: wall time, model compute (the target's forward and compute_logits),
draft compute (the EAGLE head's), and the host time left, split by phase with timers wrapped
around the engine's methods (HOOKS; a path the engine under test lacks is skipped and its time
falls to "commit"): schedule, draft (the proposer's propose, less the draft compute), prepare
inputs (the runner's forward less the model, and the speculation object's prepare less the
draft), sample/verify (the step sampler, the speculation object's verify) and commit + outputs
(the rest of the step). Times are exclusive: a timed call inside another counts in its own
phase, so a phase holds what the tree under test does in the methods named.
A round's figure is the median step's, the result the median over --rounds rounds.

With a baseline (--baseline-commit; --no-baseline skips it) the same rounds also run on a git
worktree of that commit (build/host-overhead-<commit>). Each tree is measured by a worker
process running this file by path with the tree's root first on sys.path, so the baseline needs
no copy of this script; the trees take turns on every configuration, round by round (round r
of every configuration before round r + 1 of any), and the speedup is the median of the rounds'
ratios, so the host's drift cancels. Both trees load the same C++ kernels build where
kernels/csrc is the same (its build name hashes the sources); otherwise the baseline builds its
own once (about a minute, cached for later runs).
"""

import collections
import gc
import importlib
import inspect
import json
import operator
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import workload

ROOT = Path(__file__).resolve().parent.parent
# The tree run from (this checkout, or a worker's: its cwd) names the engine's API: the package
# ``pagedspec`` from issue 59 on; a baseline from before it has the top-level ``engine``.
_API = importlib.import_module("pagedspec" if (Path.cwd() / "pagedspec").is_dir() else "engine")
EngineConfig, LLMEngine, SamplingParams = _API.EngineConfig, _API.LLMEngine, _API.SamplingParams
MODEL = ROOT / "benchmarks" / "model_configs" / "tiny-llama.json"
BASELINE = "b11ce88"  # main before issue 50's engine step
PROMPT_LEN, PATTERN, K, HEAD_VOCAB = 16, 4, 4, 256
ALWAYS = 1 << 30  # a batch size no run reaches: speculation (and eagle's tree) stays on
FORCED = {"num_speculative_tokens": K, "disable_batch_size": ALWAYS, "max_draft_skip": 0}
SPECULATION = {
    "off": None,
    "ngram": {"method": "ngram"} | FORCED,
    "eagle": {"method": "eagle", "disable_tree_batch_size": ALWAYS} | FORCED,
}
# (phase, attribute path from the engine): the target model and the draft head are compute, the
# rest host phases. "spec" is the engine's speculation object: at BASELINE a manager whose
# propose drafts; after issue 50 one object per method that also builds the spans and verifies.
HOOKS = (
    ("schedule", "scheduler.schedule"),
    ("prepare", "spec.prepare"),
    ("draft", "spec.propose"),
    ("draft", "spec.proposer.propose"),
    ("draft_model", "spec.proposer.runner.model.forward"),
    ("draft_model", "spec.proposer.runner.model.compute_logits"),
    ("prepare", "runner.forward"),
    ("model", "runner.model.forward"),
    ("model", "runner.model.compute_logits"),
    ("sample", "spec.verify"),
    ("sample", "step_sampler.__call__"),
)
PHASES = ("schedule", "draft", "prepare", "sample", "commit")  # commit: the step's rest


class Clock:
    """Exclusive seconds per phase of the calls it wraps since ``seconds`` was last cleared."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self._inner: list[float] = []  # per open call, the seconds of timed calls inside it

    def wrap(self, obj: object, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            self._inner.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.seconds[phase] += elapsed - self._inner.pop()
                if self._inner:
                    self._inner[-1] += elapsed

        if name.startswith("__"):  # obj(...) looks __call__ up on the type: give obj its own
            cls = type(obj)
            obj.__class__ = type(cls.__name__, (cls,), {name: lambda _, *a, **k: timed(*a, **k)})
        else:
            setattr(obj, name, timed)


def hook(engine: LLMEngine, clock: Clock) -> list[str]:
    """Wraps each HOOKS path ``engine`` has; returns those paths."""
    hooked = []
    for phase, path in HOOKS:
        parent, _, name = path.rpartition(".")
        try:
            obj = operator.attrgetter(parent)(engine)
            getattr(obj, name)
        except AttributeError:
            continue
        clock.wrap(obj, name, phase)
        hooked.append(path)
    return hooked


def build(method: str, setup: dict) -> tuple[LLMEngine, Clock, list[str]]:
    """An engine speculating by ``method``, its clock and the paths it hooked."""
    speculative = SPECULATION[method]
    if method == "eagle":
        speculative = speculative | {"draft_model": setup["eagle_head"]}
    config = EngineConfig(model=setup["model"], load_format="dummy", dtype="float32",
        device="cpu", seed=setup["seed"], max_num_seqs=setup["max_num_seqs"],
        num_kv_blocks=setup["num_kv_blocks"], speculative_config=speculative)  # fmt: skip
    engine, clock = LLMEngine(config), Clock()
    return engine, clock, hook(engine, clock)


def prompts(batch: int, method: str, vocab: int, seed: int) -> list[list[int]]:
    """PROMPT_LEN random ids per sequence, past the special ids 0-2 (ngram: PATTERN repeated)."""
    rng, period = random.Random(seed), PATTERN if method == "ngram" else PROMPT_LEN
    patterns = ([rng.randrange(3, vocab) for _ in range(period)] for _ in range(batch))
    return [p * (PROMPT_LEN // period) for p in patterns]


def measure(engine: LLMEngine, clock: Clock, batch: int, method: str, setup: dict) -> dict:
    """One round: the median timed decode step's figures (seconds per step) and the tokens each
    sequence made per step; the requests are aborted after it."""
    params = SamplingParams(temperature=0.0, max_tokens=setup["max_tokens"], ignore_eos=True)
    for i, prompt in enumerate(prompts(batch, method, setup["vocab_size"], setup["seed"])):
        engine.add_request(str(i), prompt, params)
    made: dict[str, int] = {}  # tokens so far per request
    while len(made) < batch:  # prefill, chunked when the prompts outnumber a step's tokens
        made |= {o.request_id: len(o.outputs[0].token_ids) for o in engine.step()}
    for _ in range(setup["warmup_steps"]):
        made |= {o.request_id: len(o.outputs[0].token_ids) for o in engine.step()}
    before, steps = sum(made.values()), []
    gc.collect()
    for _ in range(setup["steps"]):
        clock.seconds.clear()
        start = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - start
        if len(outputs) != batch or any(o.finished for o in outputs):
            raise RuntimeError(f"a sequence finished while timed at B={batch}: fewer --steps")
        made |= {o.request_id: len(o.outputs[0].token_ids) for o in outputs}
        steps.append(_step_figures(wall, clock.seconds))
    for i in range(batch):
        engine.abort_request(str(i))
    engine.step()  # hands back the aborts' outputs: the next round reuses their ids
    result = {key: statistics.median(s[key] for s in steps) for key in steps[0]}
    tokens = (sum(made.values()) - before) / (batch * setup["steps"])
    return result | {"tokens_per_seq_step": tokens}


def _step_figures(wall: float, seconds: dict[str, float]) -> dict[str, float]:
    """A step's wall, model and draft-model seconds, host seconds and host phases'."""
    compute = seconds["model"] + seconds["draft_model"]
    figures = {"wall_s": wall, "model_s": seconds["model"], "draft_model_s": seconds["draft_model"]}
    figures |= {"host_s": wall - compute, "commit": wall - sum(seconds.values())}
    return figures | {phase: seconds[phase] for phase in PHASES[:-1]}


def serve(setup: dict) -> None:
    """A worker: per line of stdin ({"batch_size", "method"}), one round's figures and the paths
    hooked as a line of JSON on stdout (anything the engine prints goes to stderr)."""
    imported = Path(inspect.getfile(LLMEngine)).resolve()
    if not imported.is_relative_to(Path(setup["root"]).resolve()):
        raise RuntimeError(f"the worker for {setup['root']} imported the engine at {imported}")
    reply, sys.stdout = sys.stdout, sys.stderr
    engines: dict[str, tuple[LLMEngine, Clock, list[str]]] = {}
    for line in sys.stdin:
        job = json.loads(line)
        if job["method"] not in engines:
            engines[job["method"]] = build(job["method"], setup)
        engine, clock, hooked = engines[job["method"]]
        result = measure(engine, clock, job["batch_size"], job["method"], setup)
        reply.write(json.dumps({"figures": result, "hooked": hooked}) + "\n")
        reply.flush()


# Runs this file as __main__ with the cwd (the tree's root, PYTHONPATH too) first on sys.path: as
# a script it would have benchmarks/ there, whose memory.py and kernels.py shadow the packages.
WORKER = "import runpy, sys; sys.argv.pop(0); runpy.run_path(sys.argv[0], run_name='__main__')"


class Worker:
    """A ``serve`` process for the tree at ``root``; ``timed``: the paths it hooked so far."""

    def __init__(self, root: Path, setup: dict):
        self.root, self.timed = root, set()
        argv = [sys.executable, "-c", WORKER, __file__, "--worker"]
        argv.append(json.dumps(setup | {"root": str(root)}))
        env = os.environ | {"PYTHONPATH": str(root)}
        self.process = subprocess.Popen(argv, cwd=root, env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)  # fmt: skip

    def measure(self, batch: int, method: str) -> dict:
        """One round's figures (``measure``)."""
        self.process.stdin.write(json.dumps({"batch_size": batch, "method": method}) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker for {self.root} exited ({self.process.wait()})")
        reply = json.loads(line)
        self.timed.update(reply["hooked"])
        return reply["figures"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


def worktree(commit: str) -> tuple[Path, str]:
    """A detached worktree of ``commit`` under build/ (made once, then reused), and its hash."""
    sha = git("rev-parse", "--verify", f"{commit}^{{commit}}")
    path = ROOT / "build" / f"host-overhead-{sha[:12]}"
    if not path.is_dir():
        git("worktree", "add", "--detach", str(path), sha)
    return path, sha[:7]


def take_turns(workers: dict[str, Worker], batches: list[int], methods: list[str], rounds: int):
    """Every (batch, method)'s rounds, round r of every configuration before round r + 1 of
    any (a slow spell of the host then costs each configuration a round or two, which its
    median drops, not all of one configuration's rounds), the trees taking turns in each (in
    reverse order every other round); yields a result row per configuration."""
    configs = [(batch, method) for batch in batches for method in methods]
    runs: dict[tuple[int, str], dict[str, list[dict]]] = {
        config: {name: [] for name in workers} for config in configs
    }
    for r in range(rounds):
        for batch, method in configs:
            for name in sorted(workers, reverse=r % 2 == 1):
                runs[batch, method][name].append(workers[name].measure(batch, method))
                figures = runs[batch, method][name][-1]
                print(f"  {name:>8} B={batch:3d} {method:5s}: step "
                      f"{figures['wall_s'] * 1e3:6.2f} ms, host "
                      f"{figures['host_s'] / batch * 1e6:6.1f} µs/seq", flush=True)  # fmt: skip
    for batch, method in configs:
        yield _row(batch, method, runs[batch, method])


def _row(batch: int, method: str, runs: dict[str, list[dict]]) -> dict:
    """A configuration's row: per tree the median over rounds of each figure; with a baseline,
    the median over rounds of the baseline's step time over the current tree's."""
    row: dict = {"batch_size": batch, "method": method}
    for name, figures in runs.items():
        median = {key: statistics.median(f[key] for f in figures) for key in figures[0]}
        row[name] = {key: median[key] for key in ("wall_s", "model_s", "draft_model_s", "host_s")}
        row[name] |= {"phases_s": {p: median[p] for p in PHASES}}
        row[name] |= {"tokens_per_seq_step": median["tokens_per_seq_step"]}
    if "baseline" in runs:
        pairs = zip(runs["baseline"], runs["current"], strict=True)
        ratios = [b["wall_s"] / c["wall_s"] for b, c in pairs]
        row["speedup"] = statistics.median(ratios)
    return row


def run(args) -> dict:
    batches = workload.parse_int_list(args.batch_sizes, "batch_sizes")
    methods = list(dict.fromkeys(args.methods.split(",")))
    if not methods or set(methods) - set(SPECULATION):
        raise ValueError(f"--methods must name some of {list(SPECULATION)}, got {args.methods!r}")
    model = json.loads(MODEL.read_text())
    max_len, largest = model["max_position_embeddings"], max(batches)
    setup = {
        "model": str(MODEL), "vocab_size": model["vocab_size"], "seed": args.seed,
        "max_num_seqs": max(largest, 256), "max_tokens": max_len - PROMPT_LEN,
        "num_kv_blocks": largest * (-(-max_len // workload.BLOCK_SIZE) + 1),
        "steps": args.steps, "warmup_steps": args.warmup_steps,
    }  # fmt: skip
    current = git("rev-parse", "--short=7", "HEAD")
    # (results that make bench's earlier benchmarks just wrote are not the code under test)
    results = (":(exclude)benchmarks/results", ":(exclude)benchmarks/RESULTS.md")
    changed = git("status", "-s", "--", ".", *results)
    trees = {"current": {"commit": current, "uncommitted_changes": bool(changed)}}
    roots = {"current": ROOT}
    if not args.no_baseline:
        roots["baseline"], commit = worktree(args.baseline_commit)
        trees["baseline"] = {"commit": commit}
    with tempfile.TemporaryDirectory() as tmp:
        if "eagle" in methods:
            # benchmarks.random_heads is not in every baseline: the worker never imports it
            from benchmarks.random_heads import build_random_eagle_head

            setup["eagle_head"] = build_random_eagle_head(Path(tmp, "head"), str(MODEL), HEAD_VOCAB)
        workers = {name: Worker(root, setup) for name, root in roots.items()}
        try:
            results = list(take_turns(workers, batches, methods, args.rounds))
        finally:
            for w in workers.values():
                w.close()
    for name, tree in trees.items():
        tree["timed"] = [path for _, path in HOOKS if path in workers[name].timed]
    config = {"methods": methods, "steps": args.steps,
              "warmup_steps": args.warmup_steps, "rounds": args.rounds, "seed": args.seed,
              "prompt_len": PROMPT_LEN, "k": K}  # fmt: skip
    machine = workload.machine_info(workload.resolve_device("cpu", "float32")[0],
                                    "benchmarks.host_overhead")  # fmt: skip
    payload = {"benchmark": "host_overhead", "machine": machine, "config": config,
               "model": MODEL.stem, "trees": trees, "results": results}  # fmt: skip
    workload.save(payload, args.output_dir, "host_overhead", plot)
    return payload


def plot(payload: dict, path) -> None:
    lines, trees = [], payload["trees"]
    for i, method in enumerate(payload["config"]["methods"]):
        for name, marker in (("current", "o-"), ("baseline", "s--")):
            rows = [r for r in payload["results"] if r["method"] == method and name in r]
            if rows:
                label = f"{name} ({trees[name]['commit']}): {method}"
                ys = [r[name]["host_s"] / r["batch_size"] * 1e6 for r in rows]
                lines.append(([r["batch_size"] for r in rows], ys, label, f"C{i}{marker}"))
    title = f"{payload['model']}, dummy weights: host time per sequence per decode step"
    workload.plot(path, lines, "batch size", "host µs per sequence per step", title, log=True)


def build_parser():
    parser = workload.parser(__doc__, model=False)
    add = parser.add_argument
    add("--batch-sizes", default="1,64,256")
    add("--methods", default="off,ngram,eagle", help="a comma-separated subset of the default")
    add("--steps", type=int, default=30, help="timed decode steps per round")
    add("--warmup-steps", type=int, default=5, help="untimed decode steps before them")
    # enough rounds that the model's swing from round to round on a shared VM (up to a third)
    # leaves the median ratio where it is
    add("--rounds", type=int, default=9)
    add("--seed", type=int, default=0)
    add("--baseline-commit", default=BASELINE)
    add("--no-baseline", action="store_true")
    return parser


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:  # a Worker's process (see Worker)
        serve(json.loads(sys.argv[2]))
    else:
        run(build_parser().parse_args())
