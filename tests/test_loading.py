"""Per-rank loading (bigfit.loading): every rank builds the model on the meta device and fills only
what it stores, from its slices of safetensors weights or by Hugging Face's init seeded per block.

Weights: filled tensors equal from_pretrained's exactly (fp32 and bf16 files; GPT-2 saved without
its `transformer.` prefix; tied weights one parameter), on one process and, on 2 gloo ranks, as each
rank's slices under zero3, tensor parallelism, the offload engine and pipeline stages (and a device
map's modules on their devices, in one process); each rank's
reads are counted (the reader wrapped) and held to its share. Config-only models: one process and
zero3 on 2 ranks start from identical parameters, with HF's distributions. Bad files: one line."""
from __future__ import annotations

import torch
import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import bigfit, one_line
from dist import run_ranks, threads_per_rank, torch_threads
from tiny import FAMILIES, tiny_config


def _auto(family: str):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM if family == "t5" else AutoModelForCausalLM


def save_tiny(root, family: str, dtype=torch.float32, seed: int = 3):
    """A tiny model of `family` with random weights, saved as safetensors in `dtype`. "llama-odd":
    rows that do not split evenly over 2 ranks (vocabulary 385, FFN 63: FSDP2 pads its shards)."""
    torch.manual_seed(seed)
    config = tiny_config(family.split("-")[0])
    if family == "llama-odd":
        config.vocab_size, config.intermediate_size = 385, 63
    model = _auto(family).from_config(config).to(dtype)
    path = root / f"{family}-{str(dtype).split('.')[-1]}"
    model.save_pretrained(path, safe_serialization=True)
    return path


def file_bytes(path) -> int:
    """The bytes of every tensor in the file (its header left out)."""
    size = {"F32": 4, "BF16": 2, "F16": 2}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sum(size[f.get_slice(k).get_dtype()] * torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys())


def filled(model_dir, config, seed: int = 0):
    """One process: the meta model filled on the CPU (what `single` does after to_empty)."""
    from bigfit.loading import Weights, fill, loads_per_rank
    from bigfit.loading.files import Checkpoint, safetensors_dir
    from bigfit.models.source import build_model, locate

    src = locate(str(model_dir))
    assert loads_per_rank(src)
    model = build_model(src, config, seed, on_meta=True)
    directory = safetensors_dir(src)
    weights = Weights(build_model(src, config, seed, on_meta=True), seed, "cpu",
                      Checkpoint(directory) if directory else None)
    fill(model, weights, "cpu")
    return model, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_single_equals_from_pretrained(tmp_path, family, dtype):
    path = save_tiny(tmp_path, family, dtype)
    ref = _auto(family).from_pretrained(path, dtype=torch.float32)
    model, weights = filled(path, ref.config)
    got, want = {**model.state_dict(), **dict(model.named_buffers())}, {**ref.state_dict(), **dict(ref.named_buffers())}
    assert got.keys() == want.keys()  # with the buffers no file holds (Llama's rotary tables: from the init)
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    assert weights.ckpt.bytes_read == file_bytes(path)  # each tensor read once, tied copies not at all
    assert model.training  # fine-tuning trains with the model's dropout (from_pretrained gives eval mode)
    if family == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight
    if family == "t5":
        shared = model.shared.weight
        assert model.encoder.embed_tokens.weight is shared and model.decoder.embed_tokens.weight is shared
        assert model.lm_head.weight is shared


def test_gpt2_saved_without_its_prefix(tmp_path):
    """GPT-2's hub checkpoints name h.0... (the base model's keys), the LM model transformer.h.0..."""
    torch.manual_seed(4)
    lm = _auto("gpt2").from_config(tiny_config("gpt2"))
    lm.transformer.save_pretrained(tmp_path / "bare", safe_serialization=True)
    with safe_open(str(tmp_path / "bare" / "model.safetensors"), "pt") as f:
        assert "h.0.attn.c_attn.weight" in f.keys() and not any(k.startswith("transformer.") for k in f.keys())
    model, _ = filled(tmp_path / "bare", lm.config)
    want = lm.state_dict()
    assert all(torch.equal(t, want[k]) for k, t in model.state_dict().items())
    assert model.lm_head.weight is model.transformer.wte.weight


def test_sharded_index_and_the_hub_cache(tmp_path, monkeypatch):
    """Shards named by model.safetensors.index.json; a hub name found in the local cache only."""
    import huggingface_hub.constants

    from bigfit.loading.files import safetensors_dir
    from bigfit.models.source import ModelSource

    torch.manual_seed(5)
    ref = _auto("llama").from_config(tiny_config("llama"))
    snapshot = tmp_path / "hub" / "models--someone--tiny-llama" / "snapshots" / ("a" * 40)
    ref.save_pretrained(snapshot, safe_serialization=True, max_shard_size="40KB")
    assert (snapshot / "model.safetensors.index.json").is_file() and len(list(snapshot.glob("*.safetensors"))) > 1
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert safetensors_dir(ModelSource("hub", "someone/tiny-llama")) == snapshot
    assert safetensors_dir(ModelSource("hub", "someone/not-cached")) is None  # the rank-0 path, never the network
    model, weights = filled(snapshot, ref.config)
    want = ref.state_dict()
    assert all(torch.equal(t, want[k]) for k, t in model.state_dict().items())
    assert weights.ckpt.bytes_read == sum(t.numel() * 4 for t in want.values())


def test_missing_parameter_is_one_line(tmp_path):
    from bigfit.errors import BigfitError
    from bigfit.loading import check_weights
    from bigfit.models.source import load_config, locate

    path = save_tiny(tmp_path, "llama")
    file = path / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(tensors, str(file), metadata={"format": "pt"})
    src = locate(str(path))
    with pytest.raises(BigfitError, match=r"model\.safetensors has no tensor for parameter "
                                          r"model\.layers\.1\.mlp\.up_proj\.weight"):
        check_weights(src, load_config(src))
    out = bigfit("train", "--model", path, "--strategy", "zero3", "--nproc", "2", "--max-steps", "1",
                 "--output-dir", tmp_path / "out")
    assert out.returncode != 0 and "model.layers.1.mlp.up_proj.weight" in one_line(out.stderr)
    assert not (tmp_path / "out" / "logs").exists()  # said before any worker started


def test_shape_mismatch_is_one_line(tmp_path):
    from bigfit.errors import BigfitError
    from bigfit.loading import check_weights
    from bigfit.models.source import load_config, locate

    path = save_tiny(tmp_path, "gpt2")
    file = path / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["transformer.h.0.mlp.c_fc.weight"] = torch.zeros(32, 100)
    save_file(tensors, str(file), metadata={"format": "pt"})
    src = locate(str(path))
    with pytest.raises(BigfitError, match=r"transformer\.h\.0\.mlp\.c_fc\.weight: .*model\.safetensors holds "
                                          r".* with shape \[32, 100\], the model's is \[32, 128\]"):
        check_weights(src, load_config(src))


# -- 2 gloo ranks ------------------------------------------------------------------------------------

def load_on_ranks(dirs: dict, strategy: str, tp: int | None, world: int = 2):
    """Each family's model through `apply` under `strategy`, the reader counting each rank's bytes;
    every local tensor compared with the same slice of from_pretrained's. Returns per family the
    bytes read, the share of the model's elements this rank stores, and the mismatched names."""
    from torch.distributed.tensor import DTensor

    from bigfit.settings.config import TrainConfig
    from bigfit.common.distributed import init_runtime
    from bigfit.loading import files, local_box, loads_per_rank
    from bigfit.models.source import build_model
    from bigfit.parallel.apply import apply
    from bigfit.layout.mesh import with_mesh
    from bigfit.job.resolution import resolve
    from bigfit.job.prepare import prepare

    out = {}
    for family, path in dirs.items():
        cfg = TrainConfig(model=str(path), strategy=strategy, tp=tp, batch_size=4, eval_samples=0,
                          output_dir=str(path / "out"))
        job = prepare(resolve(cfg, world))
        rt = with_mesh(init_runtime(), job.plan)
        assert loads_per_rank(job.source)
        read, original = [0], files.Checkpoint.read

        def counting(self, key, box):
            t = original(self, key, box)
            read[0] += t.numel() * t.element_size()
            return t

        files.Checkpoint.read = counting
        try:
            model = build_model(job.source, job.model_config, cfg.seed, on_meta=True)
            engine = apply(model, job.plan, job.cfg, rt)
        finally:
            files.Checkpoint.read = original
        ref = _auto(family).from_pretrained(path, dtype=torch.float32).state_dict()
        stored, numel, bad = 0, 0, []
        for name, p in engine.module.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if not torch.equal(local.detach(), ref[name][local_box(p)].to(local.dtype)):
                bad.append(name)
            stored, numel = stored + local.numel(), numel + p.numel()
        out[family] = dict(read=read[0], stored=stored / numel, bad=bad, notes=engine.notes)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return ({f: save_tiny(root, f) for f in (*FAMILIES, "llama-odd")},
            {f: save_tiny(root, f, torch.bfloat16) for f in FAMILIES})


def _sizes(dirs):
    return {f: file_bytes(p) for f, p in dirs.items()}


@pytest.mark.parametrize("strategy,tp", [("zero3", None), ("zero3", 2), ("zero3-offload", None)])
def test_each_rank_reads_its_slices(saved, strategy, tp):
    for dirs in saved:  # fp32 and bf16 files
        if tp:  # 63 FFN columns do not split over tensor-parallel ranks
            dirs = {f: p for f, p in dirs.items() if f != "llama-odd"}
        ranks = run_ranks(load_on_ranks, 2, dirs, strategy, tp)
        for family, size in _sizes(dirs).items():
            for r in ranks:
                got = r[family]
                assert got["bad"] == [], (family, got["bad"])
                assert any("reads only its own slices" in n for n in got["notes"])
                # what it stores and no more: half of each split tensor (uneven: a row more), the
                # replicated ones (tensor parallelism's norms) whole
                assert got["read"] == pytest.approx(got["stored"] * size, rel=1e-6), (family, got, size)
                assert got["stored"] < (0.6 if tp else 0.51), (family, got)


def test_fsdp2_over_tensor_parallel_reads_its_boxes(saved):
    """FSDP2 x TP on 4 ranks: 2-D DTensors, FSDP2 splitting TP's shards again (_StridedShard)."""
    dirs = {f: p for f, p in saved[0].items() if f != "llama-odd"}
    ranks = run_ranks(load_on_ranks, 4, dirs, "zero3", 2, 4)
    for family, size in _sizes(dirs).items():
        for r in ranks:
            assert r[family]["bad"] == [], (family, r[family]["bad"])
            assert r[family]["read"] == pytest.approx(r[family]["stored"] * size, rel=1e-6), (family, r[family])
            assert r[family]["stored"] < 0.35, (family, r[family])  # a quarter, with what TP replicates


def test_offload_engine_and_pipeline_fill_from_the_file(saved):
    dirs = saved[1]  # bf16 files
    for strategy in ("zero2-offload", "pipeline"):
        ranks = run_ranks(load_on_ranks, 2, dirs, strategy, None)
        for family, size in _sizes(dirs).items():
            for r in ranks:
                assert r[family]["bad"] == [], (strategy, family, r[family]["bad"])
            reads = [r[family]["read"] for r in ranks]
            if strategy == "pipeline":  # each rank its stages (a tied copy may be read by both)
                assert max(reads) < size and sum(reads) < 1.5 * size, (family, reads, size)
            else:  # whole parameters on every device: each rank reads the file once, no broadcast
                assert reads == [size, size], (family, reads, size)


def test_device_map_fills_each_module_where_the_map_puts_it(saved):
    """One process, a device map with chunks: the meta model gets each module's storage on its device
    and is filled there from the file, each tensor read once (no whole copy made first)."""
    for dirs in saved:
        got = load_on_ranks({f: p for f, p in dirs.items() if f != "llama-odd"}, "device_map", None, world=1)
        for family, size in _sizes(dirs).items():
            if family in got:
                assert got[family]["bad"] == [], (family, got[family]["bad"])
                assert got[family]["read"] == size and got[family]["stored"] == 1, (family, got[family], size)
                assert any(n.startswith("device map:") for n in got[family]["notes"])


# -- config-only models: the seeded init -----------------------------------------------------------

def gathered_init(model_dirs: dict, strategy: str):
    """Rank 0's full parameters of each config-only model after `apply` (zero3: gathered)."""
    from torch.distributed.tensor import DTensor

    from bigfit.settings.config import TrainConfig
    from bigfit.common.distributed import init_runtime
    from bigfit.models.source import build_model
    from bigfit.parallel.apply import apply
    from bigfit.layout.mesh import with_mesh
    from bigfit.job.resolution import resolve
    from bigfit.job.prepare import prepare

    out = {}
    for family, path in model_dirs.items():
        job = prepare(resolve(TrainConfig(model=str(path), strategy=strategy, batch_size=4, eval_samples=0), 2))
        rt = with_mesh(init_runtime(), job.plan)
        engine = apply(build_model(job.source, job.model_config, 0, on_meta=True), job.plan, job.cfg, rt)
        full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in engine.module.named_parameters()}
        out[family] = full if rt.is_main else None
    return out


def test_init_is_the_same_for_one_process_and_zero3(model_dirs):
    from transformers import AutoConfig

    dirs = {f: model_dirs[f] for f in FAMILIES}
    ranks = run_ranks(gathered_init, 2, dirs, "zero3")
    with torch_threads(threads_per_rank(2)):
        for family, path in dirs.items():
            model, _ = filled(path, AutoConfig.from_pretrained(path))
            one = dict(model.named_parameters())
            two = ranks[0][family]
            assert one.keys() == two.keys()
            assert all(torch.equal(one[k], two[k]) for k in one), [k for k in one if not torch.equal(one[k], two[k])]
            assert model.training  # a config-only model trains with its dropout, as from_config gives it


def _stats_config(family: str):
    c = tiny_config(family)
    if family == "llama":
        c.hidden_size, c.intermediate_size, c.vocab_size = 256, 512, 1024
    elif family == "gpt2":
        c.n_embd, c.n_layer, c.vocab_size = 256, 4, 1024
    else:
        c.d_model, c.d_ff, c.d_kv, c.num_heads = 256, 512, 32, 8
    return c


@pytest.mark.parametrize("family", FAMILIES)
def test_init_follows_hugging_face(tmp_path, family):
    """Standard deviations of every weight within 5% of HF's own from_config init (GPT-2's scaled
    c_proj, T5's factors, Llama's initializer_range), norms and biases exactly; ties tied."""
    config = _stats_config(family)
    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    ref = dict(_auto(family).from_config(config).named_parameters())
    model, _ = filled(tmp_path, config)
    for name, p in model.named_parameters():
        p, want = p.detach(), ref[name].detach()
        if want.std() == 0 or want.numel() < 256:  # constants (norms, biases) and tiny tables
            assert torch.equal(p, want) or want.numel() < 256, name
        else:
            assert float(p.std()) == pytest.approx(float(want.std()), rel=0.05), name
            assert not torch.equal(p, want)  # drawn afresh, not copied
    if family == "gpt2":
        std = config.initializer_range / (2 * config.n_layer) ** 0.5
        assert float(model.transformer.h[0].attn.c_proj.weight.detach().std()) == pytest.approx(std, rel=0.05)
        assert model.lm_head.weight is model.transformer.wte.weight
    if family == "llama":
        assert float(model.model.layers[1].self_attn.q_proj.weight.detach().std()) == pytest.approx(0.02, rel=0.05)
        assert torch.equal(model.model.embed_tokens.weight[config.pad_token_id], torch.zeros(config.hidden_size))
    if family == "t5":
        q = model.encoder.block[0].layer[0].SelfAttention.q.weight.detach()
        assert float(q.std()) == pytest.approx((config.d_model * config.d_kv) ** -0.5, rel=0.05)
        assert model.lm_head.weight is model.shared.weight
