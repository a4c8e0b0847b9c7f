"""The H200 benchmark helpers that run off the GPU: the llama.cpp peer's rows in bench_cuda's JSON, and the kernel
families of dev/ncu_table.py."""
import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def util():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        return _load("benchmarks/bench_cuda_util.py", "bench_cuda_util_under_test")
    finally:
        sys.path.pop(0)


def test_llamacpp_rows_map_phases_lengths_and_fractions(util, tmp_path):
    from lily.config import ModelConfig
    from lily.testing.synthetic import config_dict

    cost = util.CostModel(ModelConfig.from_dict(config_dict("tiny")))
    peer = {"meta": {"type": "Q4_0"}, "results": [
        {"n_prompt": 4096, "n_gen": 0, "n_depth": 0, "n_ubatch": 2048, "avg_ts": 10000.0, "stddev_ts": 5.0},
        {"n_prompt": 0, "n_gen": 128, "n_depth": 32768, "n_ubatch": 512, "avg_ts": 200.0, "stddev_ts": 1.0}]}
    path = tmp_path / "llamacpp_h200.json"
    path.write_text(json.dumps(peer))
    bw, mflops = 4.0e12, 8.0e14
    pre, dec = util.llamacpp_rows(str(path), cost, bw, mflops)
    assert (pre["engine"], pre["phase"], pre["tokens"], pre["tok_s"]) == ("llama.cpp", "prefill", 4096, 10000.0)
    assert (dec["engine"], dec["phase"], dec["tokens"], dec["tok_s"]) == ("llama.cpp", "decode", 32768, 200.0)
    # the same fractions of the ceilings as lily's rows: bytes per token x tok/s / bandwidth, FLOPs likewise
    assert dec["frac_bandwidth"] == pytest.approx(cost.decode_bytes(32768) * 200.0 / bw)
    assert pre["frac_matrix_rate"] == pytest.approx(cost.prefill_flops_per_token(4096) * 10000.0 / mflops)
    assert dec["ms"] == pytest.approx(5.0) and pre["ms"] == pytest.approx(409.6)
    assert "ubatch 2048" in pre["note"] and "depth 32768" in dec["note"]

    rows = [{"engine": "lily-cuda-greedy", "phase": "decode", "tokens": 32768, "tok_s": 500.0},
            {"engine": "lily-cuda", "phase": "decode", "tokens": 4096, "tok_s": 450.0}, pre, dec]
    util.add_peer_ratios(rows)
    assert rows[0]["ratio_to_llamacpp"] == pytest.approx(2.5)
    assert "ratio_to_llamacpp" not in rows[1]  # no llama.cpp row at that length
    assert "2.50x" in util.short_table(rows)


def test_ncu_families_keep_template_arguments():
    nt = _load("dev/ncu_table.py", "ncu_table_under_test")
    assert nt.family("void lily::cuda::gemv::<unnamed>::gemv_kernel<0, 1>(lily::cuda::gemv::Launch)") == \
        "gemv_kernel<0, 1>"
    # ncu cuts long names, sometimes inside "<unnamed>"
    assert nt.family("unnamed>::deltanet_step_kernel<4>(kp::DeltaNetParams, const float *)") == \
        "deltanet_step_kernel<4>"
    assert nt.family("attn_combine_kernel") == "attn_combine_kernel"
