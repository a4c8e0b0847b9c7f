"""The NumPy reference checked against independent formulations of each sub-block."""
import numpy as np
import pytest

from lily.testing.metrics import assert_close
from lily.reference import causal_conv, gated_delta_recurrence, rope, route


@pytest.mark.parametrize("S,Hk,Hv,Dk,Dv", [(1, 1, 1, 4, 4), (7, 2, 6, 48, 32), (33, 3, 3, 16, 40)])
def test_delta_rule_matches_closed_form(rng, S, Hk, Hv, Dk, Dv):
    q = rng.standard_normal((S, Hk, Dk)).astype(np.float32) / np.sqrt(Dk)
    k = rng.standard_normal((S, Hk, Dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((S, Hv, Dv)).astype(np.float32)
    g = rng.uniform(0.5, 1.0, (S, Hv)).astype(np.float32)
    beta = rng.uniform(0, 1, (S, Hv)).astype(np.float32)
    s0 = rng.standard_normal((Hv, Dv, Dk)).astype(np.float32)
    o, s1 = gated_delta_recurrence(q, k, v, g, beta, s0)
    # closed form with the state in the HF layout [Dk, Dv]: S_t = g S (I - b k k^T) ... transposed
    ratio = Hv // Hk
    for h in range(Hv):
        st = s0[h].T.astype(np.float64)  # [Dk, Dv]
        for t in range(S):
            kk = k[t, h // ratio].astype(np.float64)
            st = g[t, h] * (np.eye(Dk) - beta[t, h] * np.outer(kk, kk)) @ st + beta[t, h] * np.outer(kk, v[t, h])
            assert_close(f"delta o[t={t},h={h}]", o[t, h], st.T @ q[t, h // ratio], 1e-5) if t == S - 1 else None
        assert_close(f"delta state h={h}", s1[h], st.T, 1e-5)


def test_rope_matches_complex_rotation(rng):
    S, H, D, R, theta = 5, 3, 32, 16, 1e7
    x = rng.standard_normal((S, H, D)).astype(np.float32)
    pos = np.arange(100, 100 + S)
    out = rope(x, pos, R, theta)
    half = R // 2
    z = x[..., :half] + 1j * x[..., half:R]
    ang = pos[:, None] * theta ** (-np.arange(half) * 2.0 / R)
    z = z * np.exp(1j * ang)[:, None, :]
    assert_close("rope rotated dims", out[..., :R], np.concatenate([z.real, z.imag], -1), 1e-5)
    np.testing.assert_array_equal(out[..., R:], x[..., R:])


def test_conv_state_carries_across_calls(rng):
    C, K = 9, 4
    w = rng.standard_normal((C, K)).astype(np.float32)
    xs = rng.standard_normal((6, C)).astype(np.float32)
    full, _ = causal_conv(xs, np.zeros((K - 1, C), np.float32), w)
    st = np.zeros((K - 1, C), np.float32)
    parts = []
    for a, b in [(0, 1), (1, 3), (3, 6)]:  # S shorter than K-1 included
        y, st = causal_conv(xs[a:b], st, w)
        parts.append(y)
    assert_close("conv chunked", np.concatenate(parts), full, 1e-6)
    # tap K-1 multiplies the current token
    direct = sum(w[:, j] * (xs[5 - (K - 1) + j]) for j in range(K))
    assert_close("conv newest tap", full[5], direct, 1e-6)


def test_route_topk_renormalised(rng):
    logits = rng.standard_normal((6, 11)).astype(np.float32)
    idx, w = route(logits, 3, True)
    for s in range(6):
        assert set(idx[s]) == set(np.argsort(-logits[s])[:3])
        e = np.exp(logits[s, idx[s]] - logits[s, idx[s]].max())
        np.testing.assert_allclose(w[s], e / e.sum(), rtol=1e-5)


def test_bf16_matrix_rounds_the_activation_operand(rng):
    """The envelope's bf16 engine: x @ W and W @ x see x rounded to bf16 (W is rounded by its builder)."""
    from lily.quant import round_bf16
    from lily.reference import Bf16Matrix
    a = round_bf16(rng.standard_normal((5, 3)).astype(np.float32))
    x = (1.0 + rng.random((4, 5)) * 2.0 ** -10).astype(np.float32)  # not bf16-representable
    assert not np.array_equal(round_bf16(x), x)
    m = Bf16Matrix(a)
    np.testing.assert_array_equal(x @ m, round_bf16(x) @ a)
    np.testing.assert_array_equal(m.T @ x.T, a.T @ round_bf16(x).T)
    np.testing.assert_array_equal(x[:, 1:3] @ m[1:3], round_bf16(x[:, 1:3]) @ a[1:3])
    assert not np.allclose(x @ m, x @ a, rtol=0, atol=1e-7)
