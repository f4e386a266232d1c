"""Weight loading: HF directories, GGUF files (tiny ones written here), dummy weights, bad input."""

import copy
import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from loading_imports import CONFIG_CHAIN, imported_after_loading
from model_files import TINY, Q, load_cpu, random_hf_model, write_gguf
from paged_harness import PagedHarness
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig, Qwen2Config

import pagedspec.engine.loader.default_model
from pagedspec import LLM, SamplingParams
from pagedspec.engine.loader import model_loader
from pagedspec.engine.loader.default_model import convert_gguf
from pagedspec.engine.loader.gguf_loader import iter_gguf
from pagedspec.engine.loader.model_loader import load_model, resolve_dtype
from pagedspec.engine.loader.safetensors_loader import iter_safetensors
from pagedspec.engine.models.layers import RMSNorm
from pagedspec.engine.models.linear import packed_weight
from pagedspec.engine.models.quant import quantized_weight
from pagedspec.kernels import cpu_extension


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


GGUF_CASES = {
    "llama": (LlamaConfig, {}),
    "llama-untied": (LlamaConfig, {"tie_word_embeddings": False}),
    "qwen2": (Qwen2Config, {"tie_word_embeddings": True}),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_f32_gguf_loads_the_same_weights_as_the_hf_checkpoint(case, tmp_path):
    config_cls, extra = GGUF_CASES[case]
    hf = random_hf_model(config_cls(**TINY, **extra), seed=1)
    hf.save_pretrained(tmp_path / "hf")
    arch = hf.config.model_type
    write_gguf(hf, str(tmp_path / "tiny.gguf"), arch)
    from_gguf = load_cpu(tmp_path / "tiny.gguf")
    assert from_gguf.config.model_type == arch
    assert from_gguf.tokenizer("abc").input_ids == [257 - 1, ord("c")]
    assert_same_weights(from_gguf.model, load_cpu(tmp_path / "hf").model)


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_tokenizer_is_the_one_autotokenizer_loads(case, tmp_path):
    config_cls, extra = GGUF_CASES[case]
    hf = random_hf_model(config_cls(**TINY, **extra), seed=1)
    write_gguf(hf, str(tmp_path / "tiny.gguf"), hf.config.model_type)
    ours = load_model(str(tmp_path / "tiny.gguf"), load_format="dummy").tokenizer
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.special_tokens_map == theirs.special_tokens_map
    text = "ab abc, b\u00e9a!\n"
    assert ours(text).input_ids == theirs(text).input_ids


def test_gguf_tokenizer_declared_beside_the_file_is_left_to_autotokenizer(tmp_path, monkeypatch):
    hf = random_hf_model(LlamaConfig(**TINY), seed=1)
    write_gguf(hf, str(tmp_path / "tiny.gguf"), "llama")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "X"}))
    calls = []
    monkeypatch.setattr(
        model_loader.AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append((a, k))
    )
    load_model(str(tmp_path / "tiny.gguf"), load_format="dummy")
    assert calls == [((str(tmp_path),), {"gguf_file": "tiny.gguf"})]


def test_loading_a_gguf_imports_no_model_config_module(tmp_path) -> None:
    """AutoTokenizer builds a GGUF's model config (LlamaConfig, and through it sympy) first."""
    hf = random_hf_model(LlamaConfig(**TINY), seed=1)
    write_gguf(hf, str(tmp_path / "tiny.gguf"), "llama")
    assert imported_after_loading(str(tmp_path / "tiny.gguf"), CONFIG_CHAIN) == []


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_quantized_gguf_logits_match_hf_loading_the_same_file(qtype, tmp_path):
    hf = random_hf_model(LlamaConfig(**TINY), seed=2)
    write_gguf(hf, str(tmp_path / "tiny.gguf"), "llama", qtype)
    ref_model = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.float32
    ).eval()
    ours = load_cpu(tmp_path / "tiny.gguf").model
    tokens = torch.randint(257, (19,), generator=torch.Generator().manual_seed(2)).tolist()
    (logits,) = PagedHarness(ours, num_seqs=1, max_len=19).step([(0, tokens)])
    with torch.no_grad():
        ref = ref_model(torch.tensor([tokens])).logits[0]
        exact = hf(torch.tensor([tokens])).logits[0]
    assert float((logits - ref).abs().max() / ref.abs().max()) < 1e-4
    assert not torch.allclose(logits, exact, rtol=1e-4, atol=1e-4)  # the file really is quantized


def test_convert_gguf_writes_an_equivalent_hf_directory(tmp_path):
    hf = random_hf_model(LlamaConfig(**TINY), seed=3)
    write_gguf(hf, str(tmp_path / "tiny.gguf"), "llama", Q.Q8_0)
    target = tmp_path / "cache" / "tiny"
    convert_gguf(str(tmp_path / "tiny.gguf"), str(target))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(target))
    assert os.listdir(tmp_path / "cache") == ["tiny"]  # no temporary directory left behind
    converted, direct = load_cpu(target), load_cpu(tmp_path / "tiny.gguf")
    assert_same_weights(converted.model, direct.model)
    written = load_file(target / "model.safetensors")  # safetensors' own reader takes the file
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    expected = dict(iter_gguf(reader, direct.config))
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[name], expected[name]) for name in expected)
    assert converted.tokenizer("abcab").input_ids == direct.tokenizer("abcab").input_ids
    # config.json also holds LlamaConfig's defaults for fields a GGUF does not carry
    written_config, gguf_config = converted.config.to_dict(), direct.config.to_dict()
    del gguf_config["_name_or_path"]
    assert {k: written_config[k] for k in gguf_config} == gguf_config


def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch):
    hf = random_hf_model(LlamaConfig(**TINY), seed=4)
    write_gguf(hf, str(tmp_path / "tiny.gguf"), "llama")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pagedspec.engine.loader.default_model, "save_float32", killed)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(str(tmp_path / "tiny.gguf"), str(tmp_path / "cache" / "tiny"))
    assert os.listdir(tmp_path / "cache") == []


def test_dummy_weights_from_a_config_alone(tmp_path):
    config = Qwen2Config(**TINY)
    config.save_pretrained(tmp_path)
    a = load_cpu(tmp_path / "config.json", load_format="dummy", seed=7)
    b = load_cpu(tmp_path, load_format="dummy", seed=7)
    c = load_cpu(tmp_path, load_format="dummy", seed=8)
    assert a.tokenizer is None and a.config.model_type == "qwen2"
    assert_same_weights(a.model, b.model)
    attn = a.model.model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape == (64 + 2 * 32, 64)
    assert attn.qkv_proj.bias.shape == (128,)
    assert a.model.lm_head.weight.shape == (257, 64)
    assert len(a.model.model.layers) == 2
    name = "model.layers.1.mlp.gate_up_proj.weight"
    weight = a.model.state_dict()[name]
    assert abs(float(weight.std()) - 0.02) < 0.002
    assert not torch.equal(weight, c.model.state_dict()[name])
    for module in a.model.modules():
        if isinstance(module, RMSNorm):
            assert torch.equal(module.weight, torch.ones_like(module.weight))


def test_dummy_weights_in_bfloat16(tmp_path):
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    model = load_model(str(tmp_path), dtype=torch.bfloat16, device="cpu", load_format="dummy")
    assert {p.dtype for p in model.model.parameters()} == {torch.bfloat16}


def test_missing_path_raises(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match="does not exist.*nope"):
        load_cpu(missing)


def test_unsupported_architecture_raises(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    for load_format in ("auto", "dummy"):
        with pytest.raises(ValueError, match="'gpt2'.*supported"):
            load_cpu(tmp_path, load_format=load_format)


def test_unsupported_gguf_quantization_raises(tmp_path):
    path = str(tmp_path / "q81.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 64), dtype=np.float32))
    block_bytes = gguf.GGML_QUANT_SIZES[Q.Q8_1][1]
    w.add_tensor("blk.0.attn_q.weight", np.zeros((2, block_bytes), np.uint8), raw_dtype=Q.Q8_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'blk.0.attn_q.weight'.*Q8_1"):
        load_cpu(path)


def test_checkpoint_problems_raise(tmp_path):
    hf = random_hf_model(LlamaConfig(**TINY), seed=5)
    hf.save_pretrained(tmp_path)
    file = str(tmp_path / "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.1.self_attn.k_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, file)
    with pytest.raises(ValueError, match="missing.*model.layers.1.self_attn.qkv_proj.weight"):
        load_cpu(tmp_path)
    save_file(tensors | {"model.layers.0.extra.weight": torch.zeros(2)}, file)
    with pytest.raises(ValueError, match="'model.layers.0.extra.weight'"):
        load_cpu(tmp_path)
    save_file(tensors | {name: torch.zeros(5, 64)}, file)
    with pytest.raises(ValueError, match=f"'{name}' has shape \\(5, 64\\)"):
        load_cpu(tmp_path)
    os.remove(file)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_cpu(tmp_path)
    os.remove(tmp_path / "config.json")
    with pytest.raises(ValueError, match="no config.json"):
        load_cpu(tmp_path)


def test_sharded_index_is_followed(tmp_path):
    hf = random_hf_model(Qwen2Config(**TINY), seed=6)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    (tmp_path / "stray.safetensors").write_bytes(b"not listed in the index, never opened")
    model = load_cpu(tmp_path).model
    embed = model.state_dict()["model.embed_tokens.weight"]
    assert torch.equal(embed, hf.model.embed_tokens.weight)


def test_bad_options_raise(tmp_path):
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tmp_path), dtype="int8", device="cpu", load_format="dummy")
    with pytest.raises(ValueError, match="device"):
        load_model(str(tmp_path), device="tpu", load_format="dummy")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_model(str(tmp_path), device="cuda", load_format="dummy")
    with pytest.raises(ValueError, match="load_format"):
        load_model(str(tmp_path), device="cpu", load_format="pt")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype(torch.float16, torch.device("cpu")) == torch.float16


def test_iter_safetensors_reads_what_safetensors_wrote(tmp_path):
    tensors = {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(4, 2).bfloat16(),
        "f16": torch.randn(7).half(),
        "i64": torch.arange(6).view(2, 3),
        "flag": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    file = tmp_path / "mixed.safetensors"
    save_file(tensors, file)
    read = list(iter_safetensors([str(file)]))
    assert [name for name, _ in read][:2] == ["f32", "i64"]  # the largest first
    expected = load_file(file)
    assert {name for name, _ in read} == set(expected)
    for name, tensor in read:
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    file.write_bytes(file.read_bytes()[:-8])
    with pytest.raises(ValueError, match="ends inside tensor"):
        list(iter_safetensors([str(file)]))


@pytest.mark.skipif(not cpu_extension.available(), reason="the C++ CPU kernels cannot be built")
@pytest.mark.parametrize("quantization", ["", "int8"])
def test_loading_a_packed_model_peaks_at_about_one_copy_of_its_weights(tmp_path, quantization):
    """In a fresh process, loading a model with 40 MB of float32 weights (a tied 17 MB
    embedding) may raise peak RSS by at most 1.2x that: no initialisation before loading (nor
    an untied LM head's own weight), no memory-mapped checkpoint pages kept, no plain weight
    kept beside its pack, no second buffer for packing. (Building on the CPU as before: 1.42x.)
    Quantising to int8 at load stays below one float copy of the model (0.9x): each weight is
    quantised from its read buffer, whose float data goes as its int8 pack comes."""
    sizes = {"vocab_size": 16384, "hidden_size": 256, "intermediate_size": 1024,
             "num_hidden_layers": 6, "tie_word_embeddings": True}  # fmt: skip
    config = LlamaConfig(**(TINY | sizes))
    model = random_hf_model(config, seed=0)
    model.save_pretrained(tmp_path / "model")
    LlamaConfig(**TINY).save_pretrained(tmp_path / "tiny")
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())
    # Transparent huge pages off for the process (PR_SET_THP_DISABLE): where the host's THP is
    # "always", each allocation's first touch (malloc's header) can fault in a 2 MB page, which
    # moved the measure by up to +0.2x from one machine to another
    script = (
        "import ctypes; assert ctypes.CDLL(None).prctl(41, 1, 0, 0, 0) == 0\n"
        "import sys, torch\n"
        "from pagedspec.engine.loader.model_loader import load_model\n"
        "from pagedspec.kernels import cpu_extension\n"
        "def hwm():\n"
        "    status = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "    return int(status['VmHWM'].split()[0]) * 1024\n"
        "cpu_extension.load()\n"
        "load_model(sys.argv[2], dtype='float32', device='cpu', load_format='dummy')\n"  # imports
        "before = hwm()\n"
        "load_model(sys.argv[1], dtype='float32', device='cpu', quantization=sys.argv[3] or None)\n"
        "print(hwm() - before)\n"
    )
    env = os.environ | {"PYTHONPATH": os.getcwd()}
    paths = [str(tmp_path / "model"), str(tmp_path / "tiny"), quantization]
    out = subprocess.run([sys.executable, "-c", script, *paths], capture_output=True,
                         text=True, env=env, check=True)  # fmt: skip
    growth = int(out.stdout.split()[-1])
    # Measured 0.97x (int8: 0.65-0.70x), the same with glibc's malloc on huge pages
    # (GLIBC_TUNABLES=glibc.malloc.hugetlb=1). int8 copying each weight out of its read buffer
    # before quantising (the 17 MB embedding resident twice) measured 1.06-1.07x
    bound = 0.9 if quantization else 1.2
    assert growth <= bound * weight_bytes, (growth / 1e6, weight_bytes / 1e6)


def test_a_float16_model_never_asks_for_the_cpp_kernels(tmp_path, monkeypatch):
    """The C++ kernels are float32/bf16 only: loading and running a float16 model (the GPU
    check's CPU dry run) must not build them, a first build being minutes on 2 cores."""

    def refuse() -> None:
        raise AssertionError("the C++ extension was asked for")

    monkeypatch.setattr(cpu_extension, "load", refuse)
    monkeypatch.setattr(cpu_extension, "available", refuse)
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    llm = LLM(
        model=str(tmp_path),
        load_format="dummy",
        dtype="float16",
        device="cpu",
        attention_backend="torch",
        max_model_len=64,
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    [out] = llm.generate([[1, 2, 3]], params)
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.skipif(not cpu_extension.available(), reason="the C++ CPU kernels cannot be built")
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_deep_copy_of_a_packed_model_computes_the_same_tokens(tiny_llama, quantization):
    """A packed (or quantised) weight's data is a NaN placeholder; its copy must get a pack of
    its own, not a clone of the placeholder."""
    llm = LLM(tiny_llama, quantization=quantization, num_kv_blocks=32)
    runner, params = llm.llm_engine.runner, SamplingParams(temperature=0, max_tokens=12)
    model = runner.model
    lm_head = model.lm_head.weight
    assert (
        packed_weight(lm_head) if quantization is None else quantized_weight(lm_head)
    ) is not None
    expected = llm.generate(["one two three"], params, use_tqdm=False)[0].outputs[0].token_ids
    runner.model = copy.deepcopy(model)
    got = llm.generate(["one two three"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == expected
