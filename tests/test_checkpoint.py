"""Checkpoint I/O: safetensors memmap reader, MLX/HF writers, load_checkpoint (formats, conversion,
every error path), tokenizer + chat template of the synthetic checkpoints."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from lily.checkpoint import expected_modules, load_checkpoint
from lily.errors import CheckpointError
from lily.quant import bf16_to_f32, f32_to_bf16, round_bf16
from lily.safetensors_mmap import SafetensorsFile, save_file
from lily.testing import random_dense_weights, random_weights, tiny_config_dicts, tiny_configs
from lily.testing.checkpoint_writer import (QWEN_SPECIAL_TOKENS, write_hf_checkpoint, write_mlx_checkpoint,
                                            write_tokenizer)

CONFIGS = sorted(tiny_configs())


@pytest.fixture(scope="module")
def mlx_ckpt(tmp_path_factory):
    """The 'tiny' model as a sharded MLX 4-bit export + its source tensors."""
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=3)
    folder = tmp_path_factory.mktemp("mlx")
    write_mlx_checkpoint(folder, tiny_config_dicts()["tiny"], tensors, quant, shard_bytes=150_000,
                         generation_config={"eos_token_id": [2, 3], "temperature": 1.0})
    write_tokenizer(folder, cfg.vocab_size)
    return folder, tensors, quant


def _copy(folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(folder, dst)
    return dst


def _rewrite(folder: Path, edit, drop_from_index: bool = True) -> None:
    """Rewrite every shard after edit(name, array, tag) -> None (drop) | (array, tag)."""
    for shard in sorted(folder.glob("*.safetensors")):
        f = SafetensorsFile(shard)
        out, tags = {}, {}
        for name in f:
            r = edit(name, np.array(f[name]), f.dtype(name))
            if r is not None:
                out[name], tags[name] = r
        del f
        save_file(shard, out, dtypes=tags)
    index = folder / "model.safetensors.index.json"
    if index.is_file() and drop_from_index:
        # a consistent (but incomplete) export: the index lists only what the shards hold
        idx = json.loads(index.read_text())
        names = {n for shard in folder.glob("*.safetensors") for n in SafetensorsFile(shard)}
        idx["weight_map"] = {n: f for n, f in idx["weight_map"].items() if n in names}
        index.write_text(json.dumps(idx))


def _load(folder, **kw):
    return load_checkpoint(folder, progress=False, **kw)


# ---- safetensors reader ---------------------------------------------------------------------------------
def test_reader_matches_safetensors_package(tmp_path):
    from safetensors.numpy import save_file as st_save
    rng = np.random.default_rng(0)
    arrs = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": np.arange(7, dtype=np.uint32),
            "c": rng.integers(-5, 5, (2, 2, 2)).astype(np.int64), "d": np.float16([1.5, -2]),
            "e": np.zeros((0, 4), np.float32), "f": np.array(3.0, np.float64)}
    st_save(arrs, str(tmp_path / "x.safetensors"), metadata={"format": "np"})
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.metadata == {"format": "np"} and set(f) == set(arrs)
    for k, v in arrs.items():
        np.testing.assert_array_equal(f[k], v)
        assert f[k].dtype == v.dtype and f[k].shape == v.shape
    a = f["a"]
    assert isinstance(a, np.memmap) and not a.flags.writeable


def test_reader_bf16_interop_with_mlx(tmp_path):
    mx = pytest.importorskip("mlx.core")
    x = round_bf16(np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32))
    mx.save_safetensors(str(tmp_path / "m.safetensors"), {"w": mx.array(x).astype(mx.bfloat16)})
    f = SafetensorsFile(tmp_path / "m.safetensors")
    assert f.dtype("w") == "BF16"
    np.testing.assert_array_equal(bf16_to_f32(f["w"]), x)
    # and what we write as BF16, mlx reads as bfloat16
    save_file(tmp_path / "o.safetensors", {"w": f32_to_bf16(x)}, dtypes={"w": "BF16"})
    back = mx.load(str(tmp_path / "o.safetensors"))["w"]
    assert back.dtype == mx.bfloat16
    np.testing.assert_array_equal(np.array(back.astype(mx.float32)), x)


def _raw_file(path: Path, header: bytes, data: bytes = b"", hlen: int | None = None) -> Path:
    import struct
    path.write_bytes(struct.pack("<Q", len(header) if hlen is None else hlen) + header + data)
    return path


@pytest.mark.parametrize("header, data, hlen, match", [
    (b"{not json", b"", None, "not valid JSON"),
    (b"[1, 2]", b"", None, "must be a JSON object"),
    (json.dumps({"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}}).encode(), b"xx", None,
     "tensor w: unknown dtype 'Q7'"),
    (json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode(), b"\0" * 8, None,
     "tensor w: file is truncated"),
    (json.dumps({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}).encode(), b"\0" * 16, None,
     "tensor w: data_offsets"),
    (json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode(), b"\0" * 12, None, "overlap"),
    (b"{}", b"", 1 << 40, "truncated or not a safetensors file"),
])
def test_reader_errors(tmp_path, header, data, hlen, match):
    p = _raw_file(tmp_path / "bad.safetensors", header, data, hlen)
    with pytest.raises(CheckpointError, match=match) as e:
        SafetensorsFile(p)
    assert str(p) in str(e.value)


def test_reader_tiny_file(tmp_path):
    (tmp_path / "t.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="truncated"):
        SafetensorsFile(tmp_path / "t.safetensors")


# ---- MLX format roundtrip --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CONFIGS)
def test_mlx_roundtrip_identical(tmp_path, name):
    cfg = tiny_configs()[name]
    tensors, quant = random_weights(cfg, seed=5)
    write_mlx_checkpoint(tmp_path, tiny_config_dicts()[name], tensors, quant, shard_bytes=300_000)
    ck = _load(tmp_path)
    assert set(ck.tensors) == set(tensors)
    for k, want in tensors.items():
        got = ck.tensors[k]
        assert got.dtype == want.dtype and got.shape == want.shape, k
        np.testing.assert_array_equal(got, want, err_msg=k)
        assert got.flags.c_contiguous
    assert ck.quant == quant
    assert ck.source_format == "mlx"
    assert ck.nbytes == sum(a.nbytes for a in tensors.values())
    # the returned config describes the loaded quantization exactly
    lin, _ = expected_modules(ck.config)
    for m in lin:
        spec = ck.config.quant_for(m)
        assert (None if spec is None else (spec.bits, spec.group_size)) == quant.get(m), m


def test_mlx_published_layout(mlx_ckpt):
    folder, tensors, quant = mlx_ckpt
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe" and cfg["text_config"]["model_type"] == "qwen3_5_moe_text"
    q = cfg["quantization"]
    assert q == cfg["quantization_config"]
    assert (q["bits"], q["group_size"], q["mode"]) == (4, 64, "affine")
    assert q["language_model.model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}
    assert q["language_model.model.layers.2.mlp.shared_expert_gate"] == {"group_size": 64, "bits": 8}
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {p.name for p in shards}
    assert all(n.startswith("language_model.") for n in index["weight_map"])
    f = SafetensorsFile(folder / index["weight_map"]["language_model.model.layers.0.mlp.gate.scales"])
    assert f.dtype("language_model.model.layers.0.mlp.gate.scales") == "BF16"
    assert f.dtype("language_model.model.layers.0.mlp.gate.weight") == "U32"


def test_mlx_load_is_zero_copy_memmap(mlx_ckpt):
    folder, _, _ = mlx_ckpt
    ck = _load(folder)
    for k in ("model.layers.0.mlp.switch_mlp.gate_proj.weight", "model.layers.0.mlp.gate.scales",
              "lm_head.weight"):
        a = ck.tensors[k]
        assert isinstance(a, np.memmap) and not a.flags.writeable, k
        assert isinstance(a.base, np.memmap) or isinstance(a.base.base, np.memmap)
    # norms are upcast to float32 (small) and A_log always float32
    assert ck.tensors["model.norm.weight"].dtype == np.float32
    assert ck.tensors["model.layers.0.linear_attn.A_log"].dtype == np.float32
    assert ck.tensors["model.layers.0.linear_attn.conv1d.weight"].shape[-1] == 1


def test_metadata_files(mlx_ckpt):
    folder, _, _ = mlx_ckpt
    ck = _load(folder)
    assert ck.tokenizer_path == folder / "tokenizer.json"
    assert ck.chat_template and "<|im_start|>" in ck.chat_template
    assert ck.generation_config["eos_token_id"] == [2, 3]
    assert ck.path == folder


def test_mlx_loads_in_mlx_lm(mlx_ckpt):
    """The written checkpoint is a real MLX export: mlx-lm loads it with the same weights."""
    pytest.importorskip("mlx_lm")
    from mlx_lm.utils import load_model
    folder, tensors, _ = mlx_ckpt
    model, _ = load_model(folder)
    import mlx.core as mx
    from mlx.utils import tree_flatten
    params = dict(tree_flatten(model.parameters()))
    w = params["language_model.model.layers.1.mlp.gate.weight"]
    np.testing.assert_array_equal(np.array(w), tensors["model.layers.1.mlp.gate.weight"])
    s = params["language_model.model.embed_tokens.scales"]
    np.testing.assert_array_equal(np.array(s.view(mx.uint16)), tensors["model.embed_tokens.scales"])


def test_skips_vision_and_mtp(tmp_path):
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=1)
    extra = {"vision_tower.blocks.0.attn.qkv.weight": np.ones((4, 4), np.float32),
             "language_model.mtp.fc.weight": np.ones((4, 4), np.float32)}
    write_mlx_checkpoint(tmp_path, tiny_config_dicts()["tiny"], tensors, quant, extra_tensors=extra)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck = _load(tmp_path)
    assert set(ck.tensors) == set(tensors)


def test_plain_model_prefix_and_single_file(tmp_path):
    """mlx-lm text-only exports use `model.` / `lm_head` without `language_model.`."""
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=2)
    write_mlx_checkpoint(tmp_path, tiny_config_dicts()["tiny"], tensors, quant)
    assert (tmp_path / "model.safetensors").is_file()
    _rewrite(tmp_path, lambda n, a, t: (a, t))
    f = SafetensorsFile(tmp_path / "model.safetensors")
    plain = {n[len("language_model."):]: np.array(f[n]) for n in f}
    tags = {n[len("language_model."):]: f.dtype(n) for n in f}
    del f
    (tmp_path / "model.safetensors.index.json").unlink()
    save_file(tmp_path / "model.safetensors", plain, dtypes=tags)
    ck = _load(tmp_path)
    for k in tensors:
        np.testing.assert_array_equal(ck.tensors[k], tensors[k])


def test_unused_tensor_warns(tmp_path):
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=1)
    tensors = {**tensors, "model.layers.0.mlp.extra_bias": np.zeros(3, np.float32)}
    write_mlx_checkpoint(tmp_path, tiny_config_dicts()["tiny"], tensors, quant)
    with pytest.warns(UserWarning, match="model.layers.0.mlp.extra_bias"):
        _load(tmp_path)


# ---- HF bf16 -> quantized at load ----------------------------------------------------------------------
def _hf(tmp_path, name, seed=1, **kw):
    cfg = tiny_configs()[name]
    dense = random_dense_weights(cfg, seed)
    folder = tmp_path / f"hf_{name}_{kw.get('expert_layout', 'fused')}_{kw.get('a_log_dtype', 'bf16')}"
    write_hf_checkpoint(folder, tiny_config_dicts()[name], dense, **kw)
    return folder, dense


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("a_log_dtype", ["bf16", "f32"])
def test_hf_quantized_at_load_equals_mlx_lm_convert(tmp_path, name, a_log_dtype):
    """lily's load-time conversion is bit-identical to `mlx_lm.convert -q` of the same HF files."""
    pytest.importorskip("mlx_lm")
    pytest.importorskip("transformers")
    from mlx_lm.convert import convert
    folder, _ = _hf(tmp_path, name, a_log_dtype=a_log_dtype)
    write_tokenizer(folder, tiny_configs()[name].vocab_size)
    out = tmp_path / "converted"
    convert(str(folder), str(out), quantize=True, q_group_size=64, q_bits=4)
    ours, theirs = _load(folder), _load(out)
    assert ours.source_format == "hf" and theirs.source_format == "mlx"
    assert ours.quant == theirs.quant
    assert set(ours.tensors) == set(theirs.tensors)
    for k, want in theirs.tensors.items():
        got = ours.tensors[k]
        assert got.dtype == want.dtype and got.shape == want.shape, k
        np.testing.assert_array_equal(got, want, err_msg=k)
    assert ours.config.quant_overrides == theirs.config.quant_overrides or all(
        ours.config.quant_for(m) == theirs.config.quant_for(m) for m in expected_modules(ours.config)[0])


def test_hf_conversion_matches_mx_quantize_directly(tmp_path):
    """Same check without mlx-lm: mx.quantize on the bf16 weights, the router at 8 bits."""
    mx = pytest.importorskip("mlx.core")
    folder, dense = _hf(tmp_path, "tiny")
    ck = _load(folder)
    for module, bits in (("model.layers.0.mlp.gate", 8), ("model.layers.1.mlp.switch_mlp.gate_proj", 4),
                         ("model.layers.3.self_attn.q_proj", 4), ("lm_head", 4), ("model.embed_tokens", 4)):
        w = mx.array(dense[module + ".weight"]).astype(mx.bfloat16)
        wq, s, b = mx.quantize(w, group_size=64, bits=bits)
        np.testing.assert_array_equal(ck.tensors[module + ".weight"], np.array(wq))
        np.testing.assert_array_equal(ck.tensors[module + ".scales"], np.array(s.view(mx.uint16)))
        np.testing.assert_array_equal(ck.tensors[module + ".biases"], np.array(b.view(mx.uint16)))
        assert ck.quant[module] == (bits, 64)
    # HF norms are zero-centred: +1 at load; linear_attn.norm is used as stored
    np.testing.assert_array_equal(ck.tensors["model.norm.weight"],
                                  round_bf16(round_bf16(dense["model.norm.weight"] - 1) + 1))
    np.testing.assert_array_equal(ck.tensors["model.layers.0.linear_attn.norm.weight"],
                                  dense["model.layers.0.linear_attn.norm.weight"])
    np.testing.assert_array_equal(ck.tensors["model.layers.0.linear_attn.conv1d.weight"],
                                  dense["model.layers.0.linear_attn.conv1d.weight"])


def test_hf_per_expert_layout_equals_fused(tmp_path):
    a, _ = _hf(tmp_path, "tiny_dk_ne_dv", expert_layout="fused")
    b, _ = _hf(tmp_path, "tiny_dk_ne_dv", expert_layout="per_expert")
    ca, cb = _load(a), _load(b, threads=4)
    assert ca.quant == cb.quant and set(ca.tensors) == set(cb.tensors)
    for k in ca.tensors:
        np.testing.assert_array_equal(ca.tensors[k], cb.tensors[k], err_msg=k)


def test_hf_skips_mtp_and_vision(tmp_path):
    cfg = tiny_configs()["tiny"]
    extra = {"mtp.fc.weight": np.ones((8, 8), np.float32), "mtp.layers.0.input_layernorm.weight": np.ones(8),
             "model.visual.blocks.0.norm1.weight": np.ones(8)}
    write_hf_checkpoint(tmp_path, tiny_config_dicts()["tiny"], random_dense_weights(cfg, 0), extra_tensors=extra)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck = _load(tmp_path)
    assert not any("mtp" in k or "visual" in k for k in ck.tensors)


def test_hf_dense_load(tmp_path):
    folder, dense = _hf(tmp_path, "tiny")
    ck = _load(folder, quantize_dense=False)
    assert ck.quant == {} and ck.config.quant_for("lm_head") is None
    w = ck.tensors["model.layers.0.mlp.switch_mlp.up_proj.weight"]
    assert w.dtype == np.uint16 and w.flags.c_contiguous
    np.testing.assert_array_equal(bf16_to_f32(w), dense["model.layers.0.mlp.switch_mlp.up_proj.weight"])


def test_chunked_threaded_quantization_is_identical(tmp_path, monkeypatch):
    import lily.checkpoint as ckmod
    folder, _ = _hf(tmp_path, "tiny")
    one = _load(folder, threads=1)
    monkeypatch.setattr(ckmod, "_CHUNK_ELEMS", 1000)   # many row chunks on 4 threads
    many = _load(folder, threads=4)
    for k in one.tensors:
        np.testing.assert_array_equal(one.tensors[k], many.tensors[k], err_msg=k)


# ---- error paths -----------------------------------------------------------------------------------------
def test_missing_tensor(mlx_ckpt, tmp_path):
    folder = _copy(mlx_ckpt[0], tmp_path)
    _rewrite(folder, lambda n, a, t: None if n == "language_model.model.layers.1.mlp.gate.scales" else (a, t))
    # the scales are gone, so the packed weight has nothing to pair with
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.gate\.scales"):
        _load(folder)


def test_index_names_tensor_not_in_shard(mlx_ckpt, tmp_path):
    folder = _copy(mlx_ckpt[0], tmp_path)
    _rewrite(folder, lambda n, a, t: None if n == "language_model.model.norm.weight" else (a, t),
             drop_from_index=False)
    with pytest.raises(CheckpointError, match=r"says tensor language_model\.model\.norm\.weight is in "
                                              r"model-\d+-of-\d+\.safetensors, but that shard does not contain it"):
        _load(folder)


def test_missing_norm(mlx_ckpt, tmp_path):
    folder = _copy(mlx_ckpt[0], tmp_path)
    _rewrite(folder, lambda n, a, t: None if n == "language_model.model.norm.weight" else (a, t))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.norm\.weight: the checkpoint is not a "
                                              r"Qwen3\.5/3\.6-MoE 4-bit export"):
        _load(folder)


def test_wrong_shape_names_tensor(mlx_ckpt, tmp_path):
    """The config says the router is 8-bit g64; a 4-bit router has the wrong shapes."""
    folder = _copy(mlx_ckpt[0], tmp_path)
    name = "language_model.model.layers.3.mlp.gate.scales"
    _rewrite(folder, lambda n, a, t: (a[:, :1].copy(), t) if n == name else (a, t))
    with pytest.raises(CheckpointError) as e:
        _load(folder)
    assert str(e.value) == (f"[lily.load] tensor {name} has shape (8, 1), expected (8, 2): the checkpoint is "
                            f"not a Qwen3.5/3.6-MoE 4-bit export")


def test_config_quant_mismatch(mlx_ckpt, tmp_path):
    folder = _copy(mlx_ckpt[0], tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization"]["language_model.model.layers.0.mlp.gate"] = {"group_size": 64, "bits": 4}
    cfg.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tensor language_model\.model\.layers\.0\.mlp\.gate\.weight has "
                                              r"shape \(8, 32\), expected \(8, 16\)"):
        _load(folder)


def test_quant_inferred_without_config_block(mlx_ckpt, tmp_path):
    folder = _copy(mlx_ckpt[0], tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization"), cfg.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(cfg))
    ck = _load(folder)
    assert ck.quant == mlx_ckpt[2]


@pytest.mark.parametrize("target, newtag, match", [
    ("language_model.model.layers.0.mlp.gate.scales", "F16", "has dtype F16, expected BF16"),
    ("language_model.model.layers.0.mlp.gate.weight", "I32", "has dtype I32, expected U32"),
    ("language_model.model.norm.weight", "I16", "has dtype I16, expected BF16 or F16 or F32"),
])
def test_wrong_dtype(mlx_ckpt, tmp_path, target, newtag, match):
    folder = _copy(mlx_ckpt[0], tmp_path)
    views = {"F16": np.float16, "I32": np.int32, "I16": np.int16}
    _rewrite(folder, lambda n, a, t: (a.view(views[newtag]), newtag) if n == target else (a, t))
    with pytest.raises(CheckpointError, match=rf"tensor {target.replace('.', r'[.]')} {match}"):
        _load(folder)


def test_truncated_shard(mlx_ckpt, tmp_path):
    folder = _copy(mlx_ckpt[0], tmp_path)
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: tensor .* file is truncated"):
        _load(folder)


def test_missing_shard(mlx_ckpt, tmp_path):
    folder = _copy(mlx_ckpt[0], tmp_path)
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"lists shard {shard.name} but .* is missing"):
        _load(folder)


@pytest.mark.parametrize("fname, content, match", [
    ("config.json", "{oops", "config.json is not valid JSON"),
    ("model.safetensors.index.json", "{oops", "not a valid safetensors index"),
    ("model.safetensors.index.json", '{"metadata": {}}', "not a valid safetensors index"),
])
def test_bad_json(mlx_ckpt, tmp_path, fname, content, match):
    folder = _copy(mlx_ckpt[0], tmp_path)
    (folder / fname).write_text(content)
    with pytest.raises(CheckpointError, match=match):
        _load(folder)


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(model_type="llama", text_config={**c["text_config"], "model_type": "llama"}),
     "model_type 'llama' is not supported"),
    (lambda c: c["text_config"].pop("linear_num_value_heads"), "missing field 'linear_num_value_heads'"),
    (lambda c: c["text_config"].update(num_experts=0), "num_experts is missing or 0"),
])
def test_not_this_architecture(mlx_ckpt, tmp_path, edit, match):
    folder = _copy(mlx_ckpt[0], tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        _load(folder)


def test_config_shapes_disagree(mlx_ckpt, tmp_path):
    """A config whose hidden size does not match the tensors fails on the first tensor, by name."""
    folder = _copy(mlx_ckpt[0], tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["vocab_size"] += 64
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tensor language_model\.model\.embed_tokens\.weight has shape"):
        _load(folder)


def test_missing_folder_and_repo(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match="no such folder"):
        _load(tmp_path / "nope" / "deeper" / "x")
    with pytest.raises(CheckpointError, match="needs a config.json"):
        _load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe",
                                                      "text_config": tiny_config_dicts()["tiny"]}))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        _load(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE is set"):
        _load("lily-test-nonexistent-owner/nonexistent-repo-xyz")


def test_repo_id_uses_snapshot_download(mlx_ckpt, monkeypatch):
    import huggingface_hub
    calls = []

    def fake(repo_id, revision=None, allow_patterns=None, **kw):
        calls.append((repo_id, list(allow_patterns)))
        return str(mlx_ckpt[0])
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    ck = _load("someone/tiny-model")
    assert ck.path == mlx_ckpt[0] and len(ck.tensors) == len(mlx_ckpt[1])
    assert calls[0] == ("someone/tiny-model", ["*.json", "*.jinja", "tokenizer*", "*.txt"])
    # the second call asks for exactly the shards the index names
    assert sorted(p for p in calls[1][1] if p.endswith(".safetensors")) == \
        sorted(p.name for p in mlx_ckpt[0].glob("model-*.safetensors"))


# ---- tokenizer and chat template ---------------------------------------------------------------------------
def test_tokenizer(tmp_path):
    from tokenizers import Tokenizer
    info = write_tokenizer(tmp_path, 400)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == info["vocab_size"] <= 400
    ids = [info["special"][t] for t, _ in QWEN_SPECIAL_TOKENS]
    assert ids == list(range(info["vocab_size"] - len(ids), info["vocab_size"]))
    text = "<|im_start|>user\nHéllo wörld, 你好 😀!<|im_end|>\n<think>\nx\n</think>"
    enc = tok.encode(text, add_special_tokens=False)
    assert enc.ids[0] == info["special"]["<|im_start|>"] and info["special"]["<think>"] in enc.ids
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    # think / tool tags survive skip_special_tokens (as in Qwen's tokenizer); im tokens do not
    assert "<think>" in tok.decode(enc.ids, skip_special_tokens=True)
    assert "<|im_start|>" not in tok.decode(enc.ids, skip_special_tokens=True)


def _render(template, messages, **kw):
    import jinja2
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(ValueError(m))
    return env.from_string(template).render(messages=messages, **kw)


def test_chat_template_behaviour(tmp_path):
    write_tokenizer(tmp_path, 400)
    t = (tmp_path / "chat_template.jinja").read_text()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"},
            {"role": "user", "content": "Weather?"}]
    base = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert _render(t, msgs, add_generation_prompt=True) == (
        base + "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n"
               "<|im_start|>assistant\n<think>\n")
    assert _render(t, msgs, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert _render(t, msgs, preserve_thinking=True) == (
        base + "<|im_start|>assistant\n<think>\nhmm\n</think>\n\nHello!<|im_end|>\n"
               "<|im_start|>user\nWeather?<|im_end|>\n")
    # tool round: reasoning kept after the last query, XML call, merged tool responses
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    msgs2 = msgs + [
        {"role": "assistant", "content": "", "reasoning_content": "need tool",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}}]},
        {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "warm"}]
    out = _render(t, msgs2, tools=tools, add_generation_prompt=True)
    assert out.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                          '{"type": "function", "function": {"name": "get_weather", "parameters": {}}}\n</tools>')
    assert "</IMPORTANT>\n\nBe brief.<|im_end|>\n" in out
    assert out.endswith(
        "<|im_start|>assistant\n<think>\nneed tool\n</think>\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n[1, 2]\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n"
        "warm\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")
    with pytest.raises(ValueError, match="No user query"):
        _render(t, [{"role": "system", "content": "x"}])


def test_tokenizer_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    info = write_tokenizer(tmp_path, 400)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    assert ids[0] == info["special"]["<|im_start|>"]
    assert tok.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_export_converted_checkpoint(tmp_path):
    from lily.testing.checkpoint_writer import export_checkpoint
    folder, _ = _hf(tmp_path, "tiny_odd")
    write_tokenizer(folder, tiny_configs()["tiny_odd"].vocab_size)
    ck = _load(folder)
    out = export_checkpoint(ck, tmp_path / "out", shard_bytes=100_000)
    back = _load(out)
    assert back.source_format == "mlx" and back.quant == ck.quant
    for k in ck.tensors:
        np.testing.assert_array_equal(back.tensors[k], ck.tensors[k], err_msg=k)
    assert back.chat_template == ck.chat_template and back.tokenizer_path is not None


def test_hf_checkpoint_logits_equal_mlx_export_logits(tmp_path):
    """Issue 2: a tiny HF bf16 checkpoint quantized at load gives the same logits as the MLX export
    (by mlx_lm.convert) of the same weights, both run through lily's CPU engine."""
    pytest.importorskip("mlx_lm")
    from mlx_lm.convert import convert

    import lily
    from lily.testing.metrics import assert_close
    from lily.testing.tolerances import tol
    folder, _ = _hf(tmp_path, "tiny_dk_ne_dv")
    write_tokenizer(folder, tiny_configs()["tiny_dk_ne_dv"].vocab_size)
    out = tmp_path / "converted"
    convert(str(folder), str(out), quantize=True, q_group_size=64, q_bits=4)
    tokens = np.random.default_rng(3).integers(0, 700, 96).astype(np.int32)
    hf_logits = lily.load(str(folder), backend="cpu").logits(tokens)
    mlx_logits = lily.load(str(out), backend="cpu").logits(tokens)
    assert_close("hf quantized at load vs mlx export", hf_logits, mlx_logits, tol("hf_vs_mlx_export")["rel_rms"])
