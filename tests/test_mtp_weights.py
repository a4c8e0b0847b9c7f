"""The MTP head's weights (issue 39 part 1, lily.mtp_source): read from HF originals under the main layers' rules,
kept by `lily convert`, taken from another folder / file / repo (only its MTP shards), and refused with a clear
error, loading nothing, when the source does not match the model or is damaged."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

import lily
from lily.errors import CheckpointError
from lily.mtp_source import expected_mtp_modules, load_with_mtp
from lily.quant import round_bf16
from lily.safetensors_mmap import SafetensorsFile, save_file
from lily.testing import (random_dense_weights, random_mtp_dense_weights, random_weights, tiny_config_dicts,
                          tiny_configs, with_mtp_layers, write_hf_checkpoint, write_mlx_checkpoint, write_tokenizer)

INDEX = "model.safetensors.index.json"


def _hf_with_head(folder: Path, name: str = "tiny", seed: int = 1, **kw) -> tuple[Path, dict]:
    """An HF bf16 original with its MTP head (`mtp.*`, fused experts, zero-centred norms) and its dense weights."""
    cfg = tiny_configs()[name]
    dense = {**random_dense_weights(cfg, seed), **random_mtp_dense_weights(cfg, seed)}
    write_hf_checkpoint(folder, with_mtp_layers(tiny_config_dicts()[name], 1), dense, **kw)
    write_tokenizer(folder, cfg.vocab_size)
    return folder, dense


def _mlx_without_head(folder: Path, name: str = "tiny", seed: int = 2) -> Path:
    """An mlx-community-style 4-bit export: no mtp.* tensor."""
    cfg = tiny_configs()[name]
    write_mlx_checkpoint(folder, tiny_config_dicts()[name], *random_weights(cfg, seed))
    write_tokenizer(folder, cfg.vocab_size)
    return folder


def _split_source(tmp_path: Path) -> tuple[Path, dict[str, list[str]]]:
    """An HF original sharded small, so the head lies in shards of its own; returns it and shard -> tensor names."""
    folder, _ = _hf_with_head(tmp_path / "source", shard_bytes=60_000)
    wm = json.loads((folder / INDEX).read_text())["weight_map"]
    shards: dict[str, list[str]] = {}
    for name, shard in wm.items():
        shards.setdefault(shard, []).append(name)
    return folder, shards


def _load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "cannot be proven" note of an external head
        return load_with_mtp(path, progress=False, **kw)


def _same_head(a, b) -> None:
    assert a.quant == b.quant and set(a.tensors) == set(b.tensors)
    for k in a.tensors:
        np.testing.assert_array_equal(a.tensors[k], b.tensors[k], err_msg=k)


def test_the_head_of_the_spec(tmp_path):
    """docs/model.md §7.1: 19 HF tensors (fused experts) and 844,640,768 parameters at full size."""
    from lily.testing import full_config
    lin, vec = expected_mtp_modules(full_config())
    assert sum(int(np.prod(s)) for s in (*lin.values(), *vec.values())) == 844_640_768
    assert lin["mtp.fc"] == (2048, 4096) and lin["mtp.layers.0.self_attn.q_proj"] == (8192, 2048)
    folder, _ = _hf_with_head(tmp_path / "hf")
    names = json.loads((folder / INDEX).read_text())["weight_map"]
    assert len([n for n in names if n.startswith("mtp.")]) == 19
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in names and "mtp.pre_fc_norm_hidden.weight" in names


# ---- the checkpoint's own head --------------------------------------------------------------------------------
def test_hf_head_is_converted_by_the_main_layers_rules(tmp_path):
    """fc, attention and experts 4-bit g64, the router and shared-expert gate 8-bit, exactly as mx.quantize does
    them from the bf16 weights; all seven norms + 1 (HF stores them zero-centred); experts split gate first. The head
    stays out of the main tensors (the engine and the weights digest do not see it)."""
    mx = pytest.importorskip("mlx.core")
    folder, dense = _hf_with_head(tmp_path / "hf")
    ck = _load(folder)
    head = ck.mtp
    assert head is not None and not any(k.startswith("mtp.") for k in ck.tensors)
    lin, vec = expected_mtp_modules(ck.config)
    assert set(head.quant) == set(lin) and set(head.tensors) == {f"{m}.{p}" for m in lin for p in
                                                                 ("weight", "scales", "biases")} | set(vec)
    for module, bits in (("mtp.fc", 4), ("mtp.layers.0.mlp.gate", 8), ("mtp.layers.0.mlp.shared_expert_gate", 8),
                         ("mtp.layers.0.mlp.switch_mlp.up_proj", 4), ("mtp.layers.0.self_attn.q_proj", 4)):
        wq, s, b = mx.quantize(mx.array(dense[module + ".weight"]).astype(mx.bfloat16), group_size=64, bits=bits)
        np.testing.assert_array_equal(head.tensors[module + ".weight"], np.array(wq), err_msg=module)
        np.testing.assert_array_equal(head.tensors[module + ".scales"], np.array(s.view(mx.uint16)), err_msg=module)
        np.testing.assert_array_equal(head.tensors[module + ".biases"], np.array(b.view(mx.uint16)), err_msg=module)
        assert head.quant[module] == (bits, 64)
    assert len(vec) == 7
    for name in vec:
        np.testing.assert_array_equal(head.tensors[name], round_bf16(round_bf16(dense[name] - 1) + 1), err_msg=name)
    per_expert, _ = _hf_with_head(tmp_path / "per_expert", expert_layout="per_expert")
    _same_head(head, _load(per_expert).mtp)
    dense_head = _load(folder, quantize_dense=False).mtp
    assert dense_head.quant == {} and dense_head.tensors["mtp.fc.weight"].dtype == np.uint16


def test_convert_keeps_the_head(tmp_path):
    """`lily convert` writes the head as language_model.mtp.* (config mtp_num_hidden_layers 1); it loads back bit for
    bit, and mlx-lm still loads the export (it drops mtp.*)."""
    from lily.cli import main
    folder, _ = _hf_with_head(tmp_path / "hf", "tiny_dk_ne_dv")
    out = tmp_path / "out"
    assert main(["convert", str(folder), str(out)]) == 0
    names = {n for f in out.glob("*.safetensors") for n in SafetensorsFile(f)}
    assert "language_model.mtp.fc.weight" in names and "language_model.mtp.layers.0.mlp.gate.scales" in names
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    assert config["quantization"]["language_model.mtp.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}
    src, back = _load(folder), _load(out)
    assert back.source_format == "mlx" and back.mtp.source == "the checkpoint"
    _same_head(src.mtp, back.mtp)
    mlx_lm = pytest.importorskip("mlx_lm")
    mlx_lm.load(str(out))


def test_no_head_is_plain_decoding_with_a_note(tmp_path, capsys):
    from lily.cli import main
    folder = _mlx_without_head(tmp_path / "mlx")
    model = lily.load(str(folder), backend="reference")
    assert model.mtp is None and model.info()["mtp"].startswith("none: plain decoding")
    assert main(["info", "--model", str(folder), "--backend", "reference"]) == 0
    assert "  mtp: none: plain decoding (lily.load(path, mtp=SOURCE)" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match=r"has no MTP head .*pass mtp=SOURCE"):
        lily.load(str(folder), backend="reference", mtp=True)
    with_head = lily.load(str(_hf_with_head(tmp_path / "hf")[0]), backend="reference")
    assert with_head.info()["mtp"].startswith("1 layer (4-bit/8-bit, ") and "from the checkpoint" in \
        with_head.info()["mtp"]
    assert lily.load(str(tmp_path / "hf"), backend="reference", mtp=False).mtp is None


def test_broken_own_head_is_an_error_and_mtp_false_skips_it(tmp_path):
    cfg = tiny_configs()["tiny"]
    tensors, quant = random_weights(cfg, seed=1)
    write_mlx_checkpoint(tmp_path, tiny_config_dicts()["tiny"], tensors, quant,
                         extra_tensors={"language_model.mtp.fc.weight": np.ones((4, 4), np.float32)})
    with pytest.raises(CheckpointError, match=r"mtp\.fc\.weight has shape \(4, 4\), expected \(128, 256\) \(MTP head "
                                              r"from .*pass mtp=False to load the model without its MTP head"):
        _load(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck = load_with_mtp(tmp_path, progress=False, mtp=False)
    assert ck.mtp is None and set(ck.tensors) == set(tensors)


def test_own_head_with_a_shard_missing(tmp_path):
    """The main model does not need the head's shards: without them the default load names the missing shard, and
    mtp=False loads the model."""
    folder, shards = _split_source(tmp_path)
    head_only = [s for s, names in shards.items() if all(n.startswith("mtp.") for n in names)]
    assert head_only
    (folder / head_only[0]).unlink()
    with pytest.raises(CheckpointError, match=rf"lists the MTP head in {head_only[0]}, missing from .*pass mtp=False"):
        _load(folder)
    assert _load(folder, mtp=False).mtp is None


# ---- a head from elsewhere --------------------------------------------------------------------------------------
def test_head_from_another_folder_reads_only_its_shards(tmp_path):
    source, shards = _split_source(tmp_path)
    want = _load(source).mtp
    main_only = [s for s, names in shards.items() if not any(n.startswith("mtp.") for n in names)]
    assert main_only and len(main_only) < len(shards)
    for s in main_only:  # never opened: the index says where the head is
        (source / s).unlink()
    folder = _mlx_without_head(tmp_path / "mlx")
    with pytest.warns(UserWarning, match=r"MTP head from .*source: its config.json and tensor shapes match this "
                                         r"model; that it was trained with these main weights cannot be proven"):
        model = lily.load(str(folder), backend="reference", mtp=str(source))
    _same_head(model.mtp, want)
    assert model.mtp.source == str(source) and "cannot be proven" in model.info()["mtp"]


def test_head_from_a_safetensors_file_without_config(tmp_path):
    """A sidecar file: no config.json to compare, so only the shapes are checked, and the note says so."""
    cfg = tiny_configs()["tiny"]
    sidecar = tmp_path / "mtp.safetensors"
    hf, _ = _hf_with_head(tmp_path / "hf")
    f = SafetensorsFile(hf / "model.safetensors")
    save_file(sidecar, {n: np.array(f[n]) for n in f if n.startswith("mtp.")},
              dtypes={n: f.dtype(n) for n in f if n.startswith("mtp.")})
    with pytest.warns(UserWarning, match=r"its tensors have this model's shapes \(it has no config.json to compare\)"):
        ck = load_with_mtp(_mlx_without_head(tmp_path / "mlx"), progress=False, mtp=sidecar)
    _same_head(ck.mtp, _load(hf).mtp)
    assert ck.mtp.tensors["mtp.fc.weight"].shape == (cfg.hidden_size, 2 * cfg.hidden_size * 4 // 32)


def _fake_hub(monkeypatch, folder: Path, requested: list[str], missing: set[str] = frozenset()):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def fake(repo_id, filename, **kw):
        requested.append(filename)
        if filename in missing:
            raise LocalEntryNotFoundError(f"{filename} is not cached and outgoing traffic has been disabled")
        return str(folder / filename)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)


def test_head_from_a_repo_downloads_the_index_and_its_shards_only(tmp_path, monkeypatch):
    source, shards = _split_source(tmp_path)
    requested: list[str] = []
    _fake_hub(monkeypatch, source, requested)
    ck = _load(_mlx_without_head(tmp_path / "mlx"), mtp="Qwen/Qwen3.6-35B-A3B")
    head_shards = {s for s, names in shards.items() if any(n.startswith("mtp.") for n in names)}
    assert requested[:2] == [INDEX, "config.json"] and set(requested[2:]) == head_shards
    assert ck.mtp.source == "Qwen/Qwen3.6-35B-A3B"
    _same_head(ck.mtp, _load(source).mtp)


@pytest.mark.parametrize("missing", ["index", "shard"])
def test_offline_source_names_what_is_missing_and_how_to_get_it(tmp_path, monkeypatch, missing):
    source, shards = _split_source(tmp_path)
    head_shards = sorted(s for s, names in shards.items() if any(n.startswith("mtp.") for n in names))
    gone = {INDEX} if missing == "index" else {head_shards[0]}
    _fake_hub(monkeypatch, source, [], gone)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    first = INDEX if missing == "index" else head_shards[0]
    how = "hf download Qwen/Qwen3.6-35B-A3B model.safetensors.index.json config.json" + \
        ("" if missing == "index" else " " + " ".join(head_shards))
    with pytest.raises(CheckpointError, match=rf"MTP source Qwen/Qwen3.6-35B-A3B: {first} is not in the local Hugging "
                                              rf"Face cache and HF_HUB_OFFLINE is set\. Get it while online with "
                                              rf"`{how}`"):
        lily.load(str(_mlx_without_head(tmp_path / "mlx")), backend="reference", mtp="Qwen/Qwen3.6-35B-A3B")


# ---- sources that do not match, or are damaged: an error, and nothing loads ------------------------------------
def _edit_head(folder: Path, edit) -> None:
    """Rewrite the shards holding mtp.* tensors after edit(name, array, tag) -> None (drop) | (array, tag) | list."""
    for shard in sorted(folder.glob("*.safetensors")):
        f = SafetensorsFile(shard)
        out, tags = {}, {}
        for name in f:
            r = edit(name, np.array(f[name]), f.dtype(name)) if name.startswith("mtp.") else (np.array(f[name]),
                                                                                               f.dtype(name))
            for n, (a, t) in ([(name, r)] if isinstance(r, tuple) else r or []):
                out[n], tags[n] = a, t
        del f
        save_file(shard, out, dtypes=tags)
    (folder / INDEX).unlink()


def _nan_norm(name, a, tag):
    if name == "mtp.pre_fc_norm_hidden.weight":
        a = a.copy()
        a[3] = 0x7FC0  # bf16 NaN
    return a, tag


def _second_layer(name, a, tag):
    return [(name, (a, tag))] + ([(name.replace("layers.0", "layers.1"), (a, tag))] if ".layers.0." in name else [])


@pytest.mark.parametrize("case, match", [
    ("other_model", r"MTP source .* belongs to another model: its config.json differs from this model's in "
                    r"hidden_size: 192 there, 128 here"),
    ("no_head", r"its index lists no mtp\.\* tensor, so it has no MTP head"),
    ("wrong_shape", r"tensor mtp\.layers\.0\.self_attn\.k_proj\.weight has shape \(64, 128\), expected \(128, 128\) "
                    r"\(MTP head from"),
    ("missing", r"missing tensor mtp\.layers\.0\.self_attn\.q_norm\.weight \(MTP head from"),
    ("nan", r"tensor mtp\.pre_fc_norm_hidden\.weight has 1 NaN or infinite value\(s\)"),
    ("truncated", r"truncated"),
    ("two_layers", r"has MTP layers \[0, 1\]: lily runs the one-layer head"),
])
def test_mismatched_or_damaged_source_loads_nothing(tmp_path, case, match):
    main = _mlx_without_head(tmp_path / "mlx")
    if case == "other_model":
        source, _ = _hf_with_head(tmp_path / "src", "tiny_dk_ne_dv")
    elif case == "no_head":
        source = _mlx_without_head(tmp_path / "src")
    else:
        source, _ = _hf_with_head(tmp_path / "src")
        if case == "wrong_shape":
            _edit_head(source, lambda n, a, t: (a[:64], t) if n.endswith("k_proj.weight") else (a, t))
        elif case == "missing":
            _edit_head(source, lambda n, a, t: None if n.endswith("q_norm.weight") else (a, t))
        elif case == "nan":
            _edit_head(source, _nan_norm)
        elif case == "two_layers":
            _edit_head(source, _second_layer)
        elif case == "truncated":
            shard = source / "model.safetensors"
            shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=match):
        lily.load(str(main), backend="reference", mtp=str(source))


def test_source_that_is_not_a_source(tmp_path):
    with pytest.raises(CheckpointError, match=r"MTP source .*nope: no such folder or file, and not a Hugging Face "
                                              r"repo id"):
        _load(_mlx_without_head(tmp_path / "mlx"), mtp=str(tmp_path / "nope"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"is a file but not a \.safetensors file"):
        _load(tmp_path / "mlx", mtp=tmp_path / "notes.txt")
    shutil.copytree(tmp_path / "mlx", tmp_path / "empty")
    (tmp_path / "empty" / INDEX).unlink()
    with pytest.raises(CheckpointError, match=r"has no mtp\.\* tensor in any \*\.safetensors file"):
        _load(tmp_path / "mlx", mtp=tmp_path / "empty")
