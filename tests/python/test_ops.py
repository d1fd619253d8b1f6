"""moekit.ops.batched_experts over NumPy (no torch needed): the experts alone in the
BatchedExperts convention against a float64 NumPy reference on the same FP8 operands (the
activation re-quantized to FP8 per token as the recipe does), padding rows never written, ragged /
empty / full counts, and bad input as moekit.Error. With torch installed, torch.ops.moekit and
torch.compile(fullgraph=True) give the same bits."""
import numpy as np
import pytest

import moekit

E4M3 = None


def e4m3_table():
    global E4M3
    if E4M3 is None:
        c = np.arange(256)
        sign = np.where(c >> 7, -1.0, 1.0)
        e, m = (c >> 3) & 0xF, c & 7
        v = sign * np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7))
        v[(c & 0x7F) == 0x7F] = np.nan
        E4M3 = v
    return E4M3


def decode(codes):
    return e4m3_table()[codes]


def encode(x):
    """Nearest e4m3 code (saturating to +-448): the quantizer's rounding up to rare ties."""
    table = e4m3_table()
    finite = np.where(np.isnan(table), np.inf, table)
    x = np.clip(x, -448.0, 448.0)
    return np.abs(x[..., None] - finite).argmin(axis=-1).astype(np.uint8)


def random_codes(rng, shape, spread=2.0):
    """FP8 codes of normal values (no NaN), and their per-row scales bringing them to ~1/sqrt(cols)."""
    return encode(rng.normal(0, spread, size=shape) * 64)


def round_bf16(x):
    """float64 -> the nearest bfloat16 (through float32, ties to even), as float64."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def reference(a1q, a1q_scale, counts, w1, w1_scale, w2, w2_scale, swiglu=None):
    """float64 on the recipe's roundings: x = a1q * scale, h = bf16(x W1^T) (the W1 output the
    recipe stores), silu(gate) * up (swiglu = (limit, alpha): gpt-oss's swigluoai on interleaved
    gate / up columns, as transformers' GptOssExperts), FP8 per token, y = act W2^T."""
    E, M, K = a1q.shape
    I = w2.shape[2]
    out = np.full((E, M, K), np.nan)
    for e in range(E):
        m = counts[e]
        x = decode(a1q[e, :m]) * a1q_scale[e, :m, None]
        W1 = decode(w1[e]) * w1_scale[e][:, None]
        W2 = decode(w2[e]) * w2_scale[e][:, None]
        h = round_bf16(x @ W1.T)
        if swiglu is None:
            g, u = h[:, :I], h[:, I:]
            act = (g / (1 + np.exp(-g))) * u
        else:
            limit, alpha = swiglu
            g, u = np.minimum(h[:, 0::2], limit), np.clip(h[:, 1::2], -limit, limit)
            act = (u + 1) * g / (1 + np.exp(-float(np.float32(alpha)) * g))
        amax = np.abs(act).max(axis=1, keepdims=True)
        scale = np.where(amax > 0, amax / 448.0, 1.0)
        act_q = decode(encode(act / scale)) * scale
        out[e, :m] = act_q @ W2.T
    return out


def bf16_to_f64(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("counts", [[5, 0, 12, 1], [12, 12, 12, 12], [0, 0, 0, 0]])
def test_matches_float64_reference(counts):
    rng = np.random.default_rng(5)
    E, M, K, I = 4, 12, 256, 128
    a1q = random_codes(rng, (E, M, K))
    a1q_scale = np.full((E, M), 1 / 64, np.float32)
    w1 = random_codes(rng, (E, 2 * I, K))
    w1_scale = np.full((E, 2 * I), 1 / (64 * np.sqrt(K)), np.float32)
    w2 = random_codes(rng, (E, K, I))
    w2_scale = np.full((E, K), 1 / (64 * np.sqrt(I)), np.float32)
    cnt = np.array(counts, np.int32)
    out = np.full((E, M, K), 0xFFFF, np.uint16)  # NaN: padding rows must stay as they are
    moekit.ops.batched_experts(a1q, a1q_scale, cnt, w1, w1_scale, w2, w2_scale, out)
    ref = reference(a1q, a1q_scale, cnt, w1, w1_scale, w2, w2_scale)
    for e in range(E):
        m = cnt[e]
        assert (out[e, m:] == 0xFFFF).all(), f"expert {e}: a padding row was written"
        if m == 0:
            continue
        got = bf16_to_f64(out[e, :m])
        err = np.linalg.norm(got - ref[e, :m]) / np.linalg.norm(ref[e, :m])
        # Measured 1.6-1.7e-3 (bf16 output rounding and rare FP8 code ties); indexing or scaling bugs give O(1).
        assert err < 1e-2, f"expert {e}: relative error {err:.3e}"


@pytest.mark.parametrize("limit,alpha", [(7.0, 1.702), (7.0, 1.0), (1.5, 2.5)])
def test_swigluoai_takes_the_configs_limit_and_alpha(limit, alpha):
    """swiglu_limit= and swiglu_alpha= reach the activation (gpt-oss's config.swiglu_limit and
    config.swiglu_alpha): moekit against the float64 reference run with the same pair, and far from
    it run with the released alpha where the caller's differs."""
    rng = np.random.default_rng(7)
    E, M, K, I = 2, 8, 256, 128
    case = batched_case(rng, [8, 5], M, K, I)
    out = np.full((E, M, K), 0xFFFF, np.uint16)
    moekit.ops.batched_experts(**case, out=out, activation="swigluoai", swiglu_limit=limit, swiglu_alpha=alpha)
    args = [case[k] for k in ("a1q", "a1q_scale", "expert_num_tokens", "w1", "w1_scale", "w2", "w2_scale")]
    ref = reference(*args, swiglu=(limit, alpha))
    released = reference(*args, swiglu=(limit, 1.702))
    for e, m in enumerate(case["expert_num_tokens"]):
        got, want = bf16_to_f64(out[e, :m]), ref[e, :m]
        # Measured 1.6-1.7e-3 against the same pair; 4.4-7.1e-2 against the released alpha's output.
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < 1e-2, f"limit {limit} alpha {alpha} expert {e}: relative error {err:.3e}"
        if alpha != 1.702:
            off = np.linalg.norm(got - released[e, :m]) / np.linalg.norm(released[e, :m])
            assert off > 2e-2, f"alpha {alpha} expert {e}: only {off:.3e} from the released alpha's output"
    # Bad values are refused by name, never clamped; the workspace query takes the same keywords.
    for bad in (0.0, -1.0, float("nan"), 2048.0):
        with pytest.raises(moekit.Error, match=r"field 'swiglu_alpha' = .* must be a finite number in \(0, 1024\]"):
            moekit.ops.batched_experts(**case, out=out, activation="swigluoai", swiglu_alpha=bad)
    assert moekit.ops.batched_experts_workspace_bytes(E, M, K, 2 * I, "swigluoai", swiglu_alpha=alpha,
                                                      device="cpu") > 0


def test_bad_input_is_moekit_error():
    rng = np.random.default_rng(1)
    E, M, K, I = 2, 4, 128, 128
    a1q = random_codes(rng, (E, M, K))
    args = dict(a1q=a1q, a1q_scale=np.ones((E, M), np.float32), expert_num_tokens=np.array([4, 2], np.int32),
                w1=random_codes(rng, (E, 2 * I, K)), w1_scale=np.ones((E, 2 * I), np.float32),
                w2=random_codes(rng, (E, K, I)), w2_scale=np.ones((E, K), np.float32),
                out=np.zeros((E, M, K), np.uint16))
    moekit.ops.batched_experts(**args)
    with pytest.raises(moekit.Error, match="expert_num_tokens\\[1\\] = 9 is outside \\[0, M = 4\\]"):
        moekit.ops.batched_experts(**{**args, "expert_num_tokens": np.array([4, 9], np.int32)})
    with pytest.raises(moekit.Error, match="expert_num_tokens: dtype int64 where int32"):
        moekit.ops.batched_experts(**{**args, "expert_num_tokens": np.array([4, 2], np.int64)})
    with pytest.raises(moekit.Error, match="w2: shape"):
        moekit.ops.batched_experts(**{**args, "w2": args["w2"][:, :, :64]})
    with pytest.raises(moekit.Error, match="out: not C-contiguous"):
        moekit.ops.batched_experts(**{**args, "out": np.zeros((K, M, E), np.uint16).T})
    for bad in (-1, M + 1):
        with pytest.raises(moekit.Error, match=f"max_rows = {bad}"):
            moekit.ops.batched_experts(**args, max_rows=bad)


def batched_case(rng, counts, M, K, I):
    """Per-token operands of the batched op: len(counts) experts of M rows, counts valid."""
    E = len(counts)
    return dict(a1q=random_codes(rng, (E, M, K)), a1q_scale=np.full((E, M), 1 / 64, np.float32),
                expert_num_tokens=np.array(counts, np.int32), w1=random_codes(rng, (E, 2 * I, K)),
                w1_scale=np.full((E, 2 * I), 1 / (64 * np.sqrt(K)), np.float32), w2=random_codes(rng, (E, K, I)),
                w2_scale=np.full((E, K), 1 / (64 * np.sqrt(I)), np.float32))


def bf16_bits(x):
    """float64 -> bfloat16 bits (nearest, ties to even), uint16."""
    return (round_bf16(x).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_reference(a, counts, w1, w2):
    """float64 on the bf16 recipe's roundings: h = bf16(x W1^T), act = bf16(silu(gate) * up), y = act W2^T."""
    E, M, K = a.shape
    I = w2.shape[2]
    out = np.full((E, M, K), np.nan)
    for e in range(E):
        m = counts[e]
        h = round_bf16(bf16_to_f64(a[e, :m]) @ bf16_to_f64(w1[e]).T)
        g, u = h[:, :I], h[:, I:]
        act = round_bf16(g / (1 + np.exp(-g)) * u)
        out[e, :m] = act @ bf16_to_f64(w2[e]).T
    return out


def test_bf16_recipe_batched_and_standard():
    """quant='bf16' (named): bf16 a1q and weights (uint16 bits), no scales, against float64 on the
    recipe's roundings; padding rows never written; the standard op equal to batched-then-combine. FP8
    codes passed as bf16, or bf16 operands without quant='bf16', are errors naming the fix."""
    rng = np.random.default_rng(11)
    E, M, K, I = 3, 8, 128, 64
    counts = np.array([5, 0, 8], np.int32)
    a = bf16_bits(rng.normal(0, 1, (E, M, K)))
    w1 = bf16_bits(rng.normal(0, 1 / np.sqrt(K), (E, 2 * I, K)))
    w2 = bf16_bits(rng.normal(0, 1 / np.sqrt(I), (E, K, I)))
    out = np.full((E, M, K), 0xFFFF, np.uint16)
    moekit.ops.batched_experts(a, None, counts, w1, None, w2, None, out, quant="bf16")
    ref = bf16_reference(a, counts, w1, w2)
    for e in range(E):
        m = counts[e]
        assert (out[e, m:] == 0xFFFF).all(), f"expert {e}: a padding row was written"
        if m:
            err = np.linalg.norm(bf16_to_f64(out[e, :m]) - ref[e, :m]) / np.linalg.norm(ref[e, :m])
            # Measured 1.6-1.7e-3 (one bf16 rounding of the output, rare one-ulp flips of h or act).
            assert err < 5e-3, f"expert {e}: relative error {err:.3e}"
            print(f"bf16 batched expert {e}: {err:.2e}")
    # Standard: tokens in order, top-2 over the 3 experts, against the same float64 experts.
    T = 6
    x = bf16_bits(rng.normal(0, 1, (T, K)))
    ids = np.array([[0, 2], [2, 1], [1, 0], [0, -1], [2, 0], [1, 2]], np.int32)
    wts = rng.uniform(0.1, 1.0, (T, 2)).astype(np.float32)
    got = np.zeros((T, K), np.uint16)
    empty = np.zeros((E, 0), np.float32)
    moekit.ops.standard_experts(x, np.zeros((0,), np.float32), ids, wts, w1, empty, w2, empty, got, quant="bf16")
    rows = np.broadcast_to(x, (E, T, K))
    full = bf16_reference(np.ascontiguousarray(rows), np.full(E, T, np.int32), w1, w2)
    want = np.zeros((T, K))
    for t in range(T):
        for s in range(2):
            if ids[t, s] >= 0:
                want[t] += wts[t, s] * full[ids[t, s], t]
    err = np.linalg.norm(bf16_to_f64(got) - want) / np.linalg.norm(want)
    assert err < 5e-3, f"standard: relative error {err:.3e}"
    print(f"bf16 standard: {err:.2e}")
    with pytest.raises(moekit.Error, match="a1q.*bfloat16 \\(or its uint16 bits\\) for quant='bf16'"):
        moekit.ops.batched_experts(np.zeros((E, M, K), np.uint8), None, counts, w1, None, w2, None, out, quant="bf16")
    with pytest.raises(moekit.Error, match="quant='bf16'"):
        moekit.ops.batched_experts(a, None, counts, w1, None, w2, None, out)


def test_fp16_recipe_batched_and_standard():
    """quant='fp16' (named): numpy float16 a1q, weights and out, no scales, against float64 on the
    recipe's roundings (W1's output and the activation's in fp16); padding rows never written; the
    standard op's out in float16 or bfloat16, each rounded once from the same fp32 sums; past
    fp16's range the values are inf, as in the model run in fp16; bf16 operands are refused by name."""
    rng = np.random.default_rng(12)
    E, M, K, I = 3, 8, 128, 64
    counts = np.array([5, 0, 8], np.int32)
    a = rng.normal(0, 1, (E, M, K)).astype(np.float16)
    w1 = rng.normal(0, 1 / np.sqrt(K), (E, 2 * I, K)).astype(np.float16)
    w2 = rng.normal(0, 1 / np.sqrt(I), (E, K, I)).astype(np.float16)

    def expert(x, e):
        h = (x.astype(np.float64) @ w1[e].astype(np.float64).T).astype(np.float16).astype(np.float64)
        g, u = h[:, :I], h[:, I:]
        act = (g / (1 + np.exp(-g)) * u).astype(np.float16).astype(np.float64)
        return act @ w2[e].astype(np.float64).T

    out = np.full((E, M, K), np.nan, np.float16)
    moekit.ops.batched_experts(a, None, counts, w1, None, w2, None, out, quant="fp16")
    for e in range(E):
        m = counts[e]
        assert np.isnan(out[e, m:]).all(), f"expert {e}: a padding row was written"
        if m:
            ref = expert(a[e, :m], e)
            err = np.linalg.norm(out[e, :m].astype(np.float64) - ref) / np.linalg.norm(ref)
            # One fp16 rounding of the output (2^-12 RMS relative), rare one-ulp flips of h or act.
            assert err < 6e-4, f"expert {e}: relative error {err:.3e}"
            print(f"fp16 batched expert {e}: {err:.2e}")
    T = 6
    x = rng.normal(0, 1, (T, K)).astype(np.float16)
    ids = np.array([[0, 2], [2, 1], [1, 0], [0, -1], [2, 0], [1, 2]], np.int32)
    wts = rng.uniform(0.1, 1.0, (T, 2)).astype(np.float32)
    want = np.zeros((T, K))
    for t in range(T):
        for s in range(2):
            if ids[t, s] >= 0:
                want[t] += wts[t, s] * expert(x[t:t + 1], ids[t, s])[0]
    got16 = np.zeros((T, K), np.float16)
    moekit.ops.standard_experts(x, None, ids, wts, w1, None, w2, None, got16, quant="fp16")
    err16 = np.linalg.norm(got16.astype(np.float64) - want) / np.linalg.norm(want)
    assert err16 < 6e-4, f"standard: relative error {err16:.3e}"
    print(f"fp16 standard: {err16:.2e}")
    bits16 = np.zeros((T, K), np.uint16)  # uint16 bits: the recipe's output dtype, fp16 here
    moekit.ops.standard_experts(x, None, ids, wts, w1, None, w2, None, bits16, quant="fp16")
    assert np.array_equal(bits16, got16.view(np.uint16))
    torch = pytest.importorskip("torch")
    got_bf = torch.zeros((T, K), dtype=torch.bfloat16)  # the same fp32 sums rounded once to bf16
    moekit.ops.standard_experts(torch.from_numpy(x), None, torch.from_numpy(ids), torch.from_numpy(wts),
                                torch.from_numpy(w1), None, torch.from_numpy(w2), None, got_bf, quant="fp16")
    err_bf = np.linalg.norm(got_bf.double().numpy() - want) / np.linalg.norm(want)
    assert 5e-4 < err_bf < 5e-3 and err16 < err_bf / 3, f"fp16 out {err16:.3e}, bf16 out {err_bf:.3e}"
    # Overflow: W1's output past 65504 is inf in fp16 (and the output NaN / inf), not saturated.
    big = np.full((1, M, K), 8.0, np.float16)
    hot = np.full((1, 2 * I, K), 64.0, np.float16)  # each W1 output 128 * 8 * 64 = 65536: inf
    y = np.zeros((1, M, K), np.float16)
    moekit.ops.batched_experts(big, None, np.array([2], np.int32), hot, None, w2[:1], None, y, quant="fp16")
    assert not np.isfinite(y[0, :2]).any(), "an fp16 overflow came out finite"
    with pytest.raises(moekit.Error, match="a1q.*float16 \\(or its uint16 bits\\) for quant='fp16'"):
        moekit.ops.batched_experts(a.astype(np.float32), None, counts, w1, None, w2, None, out, quant="fp16")
    with pytest.raises(moekit.Error, match="out.*float16 \\(or its uint16 bits\\) for quant='fp16'"):
        moekit.ops.batched_experts(a, None, counts, w1, None, w2, None, np.zeros((E, M, K), np.float32),
                                   quant="fp16")


def test_max_rows_bounds_the_call_and_an_expert_past_it_is_an_error():
    """max_rows: declared at the largest count, the same bits as undeclared; one under it, the expert
    past it is skipped (its rows untouched, the others' the same bits) and raised."""
    rng = np.random.default_rng(3)
    E, M, K, I = 3, 16, 128, 128
    args = batched_case(rng, [5, 9, 0], M, K, I)
    undeclared, declared, under = (np.full((E, M, K), 0xFFFF, np.uint16) for _ in range(3))
    moekit.ops.batched_experts(**args, out=undeclared)
    moekit.ops.batched_experts(**args, out=declared, max_rows=9)
    assert np.array_equal(declared, undeclared)
    with pytest.raises(moekit.Error, match="expert 1 received 9 rows, more than the 8"):
        moekit.ops.batched_experts(**args, out=under, max_rows=8)
    assert (under[1] == 0xFFFF).all(), "the skipped expert's rows were written"
    assert np.array_equal(under[0], undeclared[0]) and np.array_equal(under[2], undeclared[2])


def test_torch_custom_op_and_compile():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    E, M, K, I = 2, 8, 128, 128
    t = {
        "a1q": torch.from_numpy(random_codes(rng, (E, M, K))).view(torch.float8_e4m3fn),
        "a1q_scale": torch.full((E, M), 1 / 64),
        "expert_num_tokens": torch.tensor([8, 3], dtype=torch.int32),
        "w1": torch.from_numpy(random_codes(rng, (E, 2 * I, K))).view(torch.float8_e4m3fn),
        "w1_scale": torch.full((E, 2 * I), 1 / (64 * K**0.5)),
        "w2": torch.from_numpy(random_codes(rng, (E, K, I))).view(torch.float8_e4m3fn),
        "w2_scale": torch.full((E, K), 1 / (64 * I**0.5)),
    }
    eager = torch.zeros((E, M, K), dtype=torch.bfloat16)
    torch.ops.moekit.batched_experts(**t, out=eager)

    def f(out):
        torch.ops.moekit.batched_experts(**t, out=out)
        return out * 1

    compiled = torch.compile(f, fullgraph=True)(torch.zeros_like(eager))
    assert torch.equal(compiled, eager)
    assert eager[0].abs().sum() > 0


def to_batched(a1q, a1q_scale, topk_ids, E, quant):
    """The standard input's (token, slot) pairs as BatchedExperts rows, in token order per expert."""
    T, K = a1q.shape
    M = max(T, 1)
    rows = {e: [(t, s) for t in range(T) for s in range(topk_ids.shape[1]) if topk_ids[t, s] == e] for e in range(E)}
    b = np.zeros((E, M, K), np.uint8)
    scale_shape = {"per-tensor": (E,), "per-token": (E, M), "block128": (E, M, -(-K // 128))}[quant]
    bs = np.ones(scale_shape, np.float32)
    for e, pairs in rows.items():
        for i, (t, _) in enumerate(pairs):
            b[e, i] = a1q[t]
            if quant == "per-token":
                bs[e, i] = a1q_scale[t]
            elif quant == "block128":
                bs[e, i] = a1q_scale[t]
        if quant == "per-tensor":
            bs[e] = a1q_scale[0]
    counts = np.array([len(rows[e]) for e in range(E)], np.int32)
    return b, bs, counts, rows


@pytest.mark.parametrize("quant", ["per-tensor", "per-token", "block128"])
def test_standard_experts_equal_batched_then_combine(quant):
    rng = np.random.default_rng(7)
    E, T, topk, K, I = 4, 6, 3, 256, 128
    a1q = random_codes(rng, (T, K))
    a1q_scale = {"per-tensor": np.full((1,), 1 / 64, np.float32), "per-token": rng.uniform(0.01, 0.02, T),
                 "block128": rng.uniform(0.01, 0.02, (T, K // 128))}[quant].astype(np.float32)
    n1, n2 = {"per-tensor": (1, 1), "per-token": (2 * I, K), "block128": (2 * I // 128 * K // 128, K // 128 * I // 128)}[quant]
    w1, w2 = random_codes(rng, (E, 2 * I, K)), random_codes(rng, (E, K, I))
    w1_scale = (rng.uniform(0.5, 1.5, (E, n1)) / (64 * np.sqrt(K))).astype(np.float32)
    w2_scale = (rng.uniform(0.5, 1.5, (E, n2)) / (64 * np.sqrt(I))).astype(np.float32)
    topk_ids = np.array([[0, 1, 2], [3, -1, 0], [1, 1, 3], [-1, -1, -1], [2, 0, 1], [3, 2, 1]], np.int32)
    topk_w = rng.uniform(0, 1, (T, topk)).astype(np.float32)
    out = np.full((T, K), 0xFFFF, np.uint16)
    layout = "block_pairs" if quant == "block128" else "gate_up"  # random codes: either order
    moekit.ops.standard_experts(a1q, a1q_scale, topk_ids, topk_w, w1, w1_scale, w2, w2_scale, out, w1_layout=layout)

    b, bs, counts, rows = to_batched(a1q, a1q_scale, topk_ids, E, quant)
    y = np.full((E, b.shape[1], K), 0xFFFF, np.uint16)
    moekit.ops.batched_experts(b, bs, counts, w1, w1_scale, w2, w2_scale, y, quant=quant, w1_layout=layout)
    expect = np.zeros((T, K), np.float32)
    for e, pairs in rows.items():
        for i, (t, s) in enumerate(pairs):
            expect[t] += np.float32(topk_w[t, s]) * bf16_to_f64(y[e, i]).astype(np.float32)
    got = bf16_to_f64(out)
    if quant == "per-tensor":
        # The W1 output's one FP8 scale spans every row of the call in the standard format and each
        # expert's rows in the batched one: other codes, a different (equally valid) result. Measured 2.2e-2.
        err = np.linalg.norm(got - expect) / np.linalg.norm(expect)
        assert err < 5e-2, err
    else:
        # One bf16 rounding of the same fp32 sums (the slot order may differ from this loop's by a few ulp).
        assert np.allclose(got, expect, rtol=2**-7, atol=1e-6), np.abs(got - expect).max()
    assert (got[3] == 0).all(), "a token routed nowhere sums to zero"


def test_ambiguous_or_unknown_scales_raise():
    rng = np.random.default_rng(3)
    E, T, K, I = 2, 1, 128, 128  # T = 1: a (1,) scale fits per-tensor and per-token; K = N = 128 blocks are 1
    a1q = random_codes(rng, (T, K))
    w1 = random_codes(rng, (E, 2 * I, K))
    args = dict(a1q=a1q, a1q_scale=np.ones((T,), np.float32), topk_ids=np.zeros((T, 1), np.int32),
                topk_weights=np.ones((T, 1), np.float32), w1=w1, w1_scale=np.ones((E, 2 * I), np.float32),
                w2=random_codes(rng, (E, K, I)), w2_scale=np.ones((E, K), np.float32),
                out=np.zeros((T, K), np.uint16))
    moekit.ops.standard_experts(**args)  # only per-token has (E, N) W1 scales
    with pytest.raises(moekit.Error, match="fit no scheme"):
        moekit.ops.standard_experts(**{**args, "w1_scale": np.ones((E, 3), np.float32)})
    with pytest.raises(moekit.Error, match="w1_scale: shape"):
        moekit.ops.standard_experts(**args, quant="per-tensor")
    with pytest.raises(moekit.Error, match="topk_ids dtype float"):
        moekit.ops.standard_experts(**{**args, "topk_ids": np.zeros((T, 1), np.float32)})
    with pytest.raises(moekit.Error, match="expert id 5|id 5|5 is outside"):
        moekit.ops.standard_experts(**{**args, "topk_ids": np.full((T, 1), 5, np.int32)})


def test_standard_experts_with_topk_over_the_local_experts():
    """An expert-parallel rank's standard input: topk = 4 slots over E_local = 2 experts, most -1."""
    rng = np.random.default_rng(9)
    E, T, K, I = 2, 3, 128, 128
    a1q = random_codes(rng, (T, K))
    args = dict(a1q=a1q, a1q_scale=np.full((T,), 1 / 64, np.float32),
                topk_ids=np.array([[0, -1, -1, 1], [-1, -1, -1, -1], [1, -1, 0, -1]], np.int32),
                topk_weights=np.full((T, 4), 0.5, np.float32), w1=random_codes(rng, (E, 2 * I, K)),
                w1_scale=np.full((E, 2 * I), 1 / (64 * np.sqrt(K)), np.float32), w2=random_codes(rng, (E, K, I)),
                w2_scale=np.full((E, K), 1 / (64 * np.sqrt(I)), np.float32))
    out = np.full((T, K), 0xFFFF, np.uint16)
    moekit.ops.standard_experts(**args, out=out)
    assert (out[1] == 0).all() and np.isfinite(bf16_to_f64(out)).all() and (out[0] != 0).any()


def test_standard_experts_reuse_a_workspace_for_fewer_tokens():
    """T = 6 then T = 5 share one workspace (capacity 8): per-token results row for row the same."""
    rng = np.random.default_rng(4)
    E, T, K, I = 3, 6, 256, 128
    a1q = random_codes(rng, (T, K))
    w = dict(w1=random_codes(rng, (E, 2 * I, K)), w1_scale=np.full((E, 2 * I), 1 / (64 * np.sqrt(K)), np.float32),
             w2=random_codes(rng, (E, K, I)), w2_scale=np.full((E, K), 1 / (64 * np.sqrt(I)), np.float32))
    ids = rng.integers(-1, E, (T, 2)).astype(np.int32)
    wts = rng.uniform(0, 1, (T, 2)).astype(np.float32)
    scale = rng.uniform(0.01, 0.02, T).astype(np.float32)
    six = np.zeros((T, K), np.uint16)
    moekit.ops.standard_experts(a1q, scale, ids, wts, **w, out=six)
    before = moekit.ops.workspace_bytes()
    five = np.full((T - 1, K), 0xFFFF, np.uint16)
    moekit.ops.standard_experts(a1q[:-1].copy(), scale[:-1].copy(), ids[:-1].copy(), wts[:-1].copy(), **w, out=five)
    assert moekit.ops.workspace_bytes() == before, "T = 5 built a new workspace"
    assert np.array_equal(five, six[:-1])


def test_fuse_w1_runs_the_lean_recipe_and_drops_w1_out():
    """fuse_w1 (block128): the activation in W1's epilogue, no bf16 W1 output. Batched and standard
    agree with the unfused op within the requantization flips (a W1 value rounded to bf16 or not
    moves an FP8 code by one step: ~1e-2 end to end, as the C++ layer tests measure), padding rows
    stay unwritten, the fused call builds its own workspace (on the CPU it trades w1_out for a
    chunk of fp32 rows; test_gpu.py checks the GPU's drops exactly w1_out), and a scheme that cannot
    fuse raises."""
    rng = np.random.default_rng(21)
    E, M, K, I = 3, 13, 256, 256
    N = 2 * I
    a1q = random_codes(rng, (E, M, K))
    a1q_scale = (rng.uniform(0.5, 1.5, (E, M, K // 128)) / 64).astype(np.float32)
    w = dict(w1=random_codes(rng, (E, N, K)),
             w1_scale=(rng.uniform(0.5, 1.5, (E, N // 128 * K // 128)) / (64 * np.sqrt(K))).astype(np.float32),
             w2=random_codes(rng, (E, K, I)),
             w2_scale=(rng.uniform(0.5, 1.5, (E, K // 128 * I // 128)) / (64 * np.sqrt(I))).astype(np.float32))
    counts = np.array([13, 0, 6], np.int32)
    outs = {}
    grew = {}
    for fuse in (False, True):
        before = moekit.ops.workspace_bytes()
        out = np.full((E, M, K), 0xFFFF, np.uint16)
        moekit.ops.batched_experts(a1q, a1q_scale, counts, **w, out=out, fuse_w1=fuse, w1_layout="block_pairs")
        grew[fuse] = moekit.ops.workspace_bytes() - before
        for e, m in enumerate(counts):
            assert (out[e, m:] == 0xFFFF).all(), f"fuse_w1={fuse}: expert {e}: a padding row was written"
        outs[fuse] = out
    assert grew[False] > 0 and grew[True] > 0, grew
    for e, m in enumerate(counts):
        if m:
            a, b = bf16_to_f64(outs[True][e, :m]), bf16_to_f64(outs[False][e, :m])
            err = np.linalg.norm(a - b) / np.linalg.norm(b)
            assert err < 3e-2, f"expert {e}: fused vs unfused relative error {err:.3e}"

    T, topk = 7, 2
    ids = rng.integers(-1, E, (T, topk)).astype(np.int32)
    wts = rng.uniform(0, 1, (T, topk)).astype(np.float32)
    ta1q, tscale = a1q[0, :T].copy(), a1q_scale[0, :T].copy()
    std = {}
    for fuse in (False, True):
        std[fuse] = np.zeros((T, K), np.uint16)
        moekit.ops.standard_experts(ta1q, tscale, ids, wts, **w, out=std[fuse], fuse_w1=fuse, w1_layout="block_pairs")
    a, b = bf16_to_f64(std[True]), bf16_to_f64(std[False])
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 3e-2

    per_token = dict(w1=w["w1"], w1_scale=np.full((E, N), 1e-3, np.float32), w2=w["w2"],
                     w2_scale=np.full((E, K), 1e-3, np.float32))
    with pytest.raises(moekit.Error, match="fused W1"):
        moekit.ops.batched_experts(a1q, np.full((E, M), 1 / 64, np.float32), counts, **per_token,
                                   out=np.zeros((E, M, K), np.uint16), fuse_w1=True)


def standard_case(rng, quant="per-token", E=4, T=9, topk=3, K=256, I=128):
    """Operands of the standard op in moekit's canonical shapes."""
    N = 2 * I
    n1, n2 = {"per-tensor": (1, 1), "per-token": (N, K), "block128": (N // 128 * K // 128, K // 128 * I // 128)}[quant]
    a_scale = {"per-tensor": (1,), "per-token": (T,), "block128": (T, K // 128)}[quant]
    return dict(a1q=random_codes(rng, (T, K)), a1q_scale=rng.uniform(0.01, 0.02, a_scale).astype(np.float32),
                topk_ids=np.array([rng.permutation(np.arange(-1, E))[:topk] for _ in range(T)], np.int32),
                topk_weights=rng.uniform(0, 1, (T, topk)).astype(np.float32),
                w1=random_codes(rng, (E, N, K)),
                w1_scale=(rng.uniform(0.5, 1.5, (E, n1)) / (64 * np.sqrt(K))).astype(np.float32),
                w2=random_codes(rng, (E, K, I)),
                w2_scale=(rng.uniform(0.5, 1.5, (E, n2)) / (64 * np.sqrt(I))).astype(np.float32))


def run_standard(args, **kw):
    out = np.full((args["a1q"].shape[0], args["a1q"].shape[1]), 0xFFFF, np.uint16)
    moekit.ops.standard_experts(**args, out=out, **kw)
    return out


def test_engine_conventions_give_the_same_bits():
    """What engines pass (vLLM's fused-MoE tests, DeepEP, checkpoints): scales with trailing ones or
    in weight_scale_inv's 3-D block shape, int64 ids, global ids with an expert_map, float16 output,
    vLLM's activation names. Each gives the bits of moekit's canonical call, or refuses by name."""
    rng = np.random.default_rng(31)
    E, T, K, I = 4, 9, 256, 128
    for quant in ("per-token", "per-tensor", "block128"):
        args = standard_case(rng, quant, E=E, T=T, K=K, I=I)
        layout = "block_pairs" if quant == "block128" else "gate_up"
        base = run_standard(args, quant=quant, w1_layout=layout)
        shaped = dict(args)
        if quant == "per-token":
            shaped["a1q_scale"] = args["a1q_scale"].reshape(T, 1)  # (T, 1)
            shaped["w1_scale"] = args["w1_scale"].reshape(E, 2 * I, 1)  # (E, N, 1)
            shaped["w2_scale"] = args["w2_scale"].reshape(E, K, 1)
        elif quant == "per-tensor":
            shaped["w1_scale"] = args["w1_scale"].reshape(E, 1, 1)  # (E, 1, 1)
            shaped["w2_scale"] = args["w2_scale"].reshape(E)  # (E,)
        else:
            shaped["w1_scale"] = args["w1_scale"].reshape(E, 2 * I // 128, K // 128)  # weight_scale_inv
            shaped["w2_scale"] = args["w2_scale"].reshape(E, K // 128, I // 128)
        assert np.array_equal(run_standard(shaped, quant=quant, w1_layout=layout), base), quant
        # int64 ids (torch.topk, DeepEP) read as the same local ids.
        assert np.array_equal(run_standard({**args, "topk_ids": args["topk_ids"].astype(np.int64)}, quant=quant,
                                           w1_layout=layout), base), quant

    args = standard_case(rng, "per-token", E=E, T=T, K=K, I=I)
    base = run_standard(args)
    # Global ids over 3 ranks' 12 experts, this rank holding global 4..7 as local 0..3 (vLLM's expert_map).
    expert_map = np.full(12, -1, np.int32)
    expert_map[4:8] = np.arange(4)
    local = args["topk_ids"]
    glob = np.where(local >= 0, local + 4, rng.choice([0, 3, 9, 11], local.shape)).astype(np.int64)
    assert np.array_equal(run_standard({**args, "topk_ids": glob}, expert_map=expert_map), base)
    # A global id outside the map's experts, or an int64 id past int32, is never another expert, and
    # the error names the id the caller gave (not the value it was converted to).
    for bad in (12, 2**32 + 1, -2):
        ids = glob.copy()
        ids[0, 0] = bad
        with pytest.raises(moekit.Error, match=f"topk_ids\\[0\\]\\[0\\] = {bad} is outside \\[-1, E = 12\\)"):
            run_standard({**args, "topk_ids": ids}, expert_map=expert_map)
    unmapped = expert_map.copy()
    unmapped[4] = 7  # a map entry past this rank's 4 experts
    ids = glob.copy()
    ids[0, 0] = 4
    with pytest.raises(moekit.Error, match="topk_ids\\[0\\]\\[0\\] = 4 maps to expert_map\\[4\\] = 7, outside"):
        run_standard({**args, "topk_ids": ids}, expert_map=unmapped)
    for bad in (2**32 + 1, 4, -2):  # local int64 ids, no map
        ids = local.astype(np.int64)
        ids[1, 0] = bad
        with pytest.raises(moekit.Error, match=f"topk_ids\\[1\\]\\[0\\] = {bad} is outside \\[-1, E_local = 4\\)"):
            run_standard({**args, "topk_ids": ids})
    with pytest.raises(moekit.Error, match="expert_map must be a 1-D"):
        run_standard({**args, "topk_ids": glob}, expert_map=expert_map.astype(np.float32))
    # float16 output: the same fp32 sums rounded once to fp16 (not the bf16 result converted): within
    # half a bf16 ulp of the bf16 result, and finer than it (3 more bits).
    half = np.full((T, K), np.nan, np.float16)
    moekit.ops.standard_experts(**args, out=half)
    ref16 = bf16_to_f64(base)
    assert np.all(np.abs(half.astype(np.float64) - ref16) <= np.abs(ref16) * 2.0**-8 + 2.0**-24)
    assert not np.array_equal(half, ref16.astype(np.float16)), "fp16 out holds only the bf16 result's bits"
    # vLLM's activation names, on non-gated experts (W1 of I rows).
    ng = {**args, "w1": args["w1"][:, :I].copy(), "w1_scale": args["w1_scale"][:, :I].copy()}
    assert np.array_equal(run_standard(ng, activation="relu2_no_mul"), run_standard(ng, activation="relu2"))
    gelu = run_standard(ng, activation="gelu_no_mul")
    assert np.isfinite(bf16_to_f64(gelu)).all() and not np.array_equal(gelu, run_standard(ng, activation="relu2"))


def test_batched_float16_output_leaves_padding_rows():
    rng = np.random.default_rng(32)
    E, M, K = 3, 8, 128
    args = batched_case(rng, [8, 0, 3], M, K, 128)
    bf = np.full((E, M, K), 0xFFFF, np.uint16)
    moekit.ops.batched_experts(**args, out=bf)
    half = np.full((E, M, K), 7.0, np.float16)
    moekit.ops.batched_experts(**args, out=half)
    for e, m in enumerate(args["expert_num_tokens"]):
        assert np.array_equal(half[e, :m], bf16_to_f64(bf[e, :m]).astype(np.float16))
        assert (half[e, m:] == 7.0).all(), f"expert {e}: a padding row was written"


def test_w1_layout_is_explicit_and_never_misread():
    """Under block128 the kernels read W1 in block pairs; the checkpoint's gate-then-up order (the
    default w1_layout) has the same shape and is refused, naming the one-time arrangement; the
    arranged W1 with w1_layout='block_pairs' equals the per-token-style reading of the halves."""
    rng = np.random.default_rng(33)
    args = standard_case(rng, "block128", E=2, T=5, K=256, I=256)
    with pytest.raises(moekit.Error, match="arrange_w1_block_pairs"):
        run_standard(args)
    pairs, pairs_scale = moekit.arrange_w1_block_pairs(args["w1"], args["w1_scale"])
    arranged = run_standard({**args, "w1": pairs, "w1_scale": pairs_scale}, w1_layout="block_pairs")
    assert np.isfinite(bf16_to_f64(arranged)).all()
    # Where the recipe reads W1 as stored, pre-arranged pairs are refused.
    per_token = standard_case(rng, "per-token", E=2, T=5, K=256, I=256)
    with pytest.raises(moekit.Error, match="w1_layout = 'block_pairs'"):
        run_standard(per_token, w1_layout="block_pairs")


def test_workspaces_stay_within_the_cap_and_are_released():
    """100 problem shapes through the ops: the cached total never passes the cap (one workspace
    larger than the cap alone excepted), each shape's first call grows it by the query's figure,
    release_workspaces() frees everything. A loop over engines' test grids no longer holds every
    shape's workspace for the life of the process."""
    # Earlier tests' CUDA graphs are gone: their captured workspaces may go too.
    moekit.ops.release_workspaces(captured=True)
    cap_before = moekit.ops.workspace_cap()
    assert cap_before == 4 << 30
    rng = np.random.default_rng(34)
    K, I, E = 128, 128, 2
    w = dict(w1=random_codes(rng, (E, 2 * I, K)), w1_scale=np.full((E, 2 * I), 1 / (64 * np.sqrt(K)), np.float32),
             w2=random_codes(rng, (E, K, I)), w2_scale=np.full((E, K), 1 / (64 * np.sqrt(I)), np.float32))
    sizes = {M: moekit.ops.batched_experts_workspace_bytes(E, M, K, 2 * I, device="cpu") for M in range(1, 101)}
    cap = 3 * sizes[100]
    moekit.ops.set_workspace_cap(cap)
    try:
        for M in range(1, 101):
            before = moekit.ops.workspace_bytes()
            out = np.zeros((E, M, K), np.uint16)
            moekit.ops.batched_experts(random_codes(rng, (E, M, K)), np.full((E, M), 1 / 64, np.float32),
                                       np.array([M, M // 2], np.int32), **w, out=out)
            assert moekit.ops.workspace_bytes() <= cap, (M, moekit.ops.workspace_bytes(), cap)
            assert moekit.ops.workspace_bytes() >= sizes[M]
            if before + sizes[M] <= cap:
                assert moekit.ops.workspace_bytes() == before + sizes[M], M
        T = 7
        need = moekit.ops.standard_experts_workspace_bytes(T, K, 2 * I, 2, E, device="cpu")
        held = moekit.ops.workspace_bytes()
        assert need > 0
        freed = moekit.ops.release_workspaces()
        assert freed == held and moekit.ops.workspace_bytes() == 0
        # One workspace larger than the cap stands alone.
        moekit.ops.set_workspace_cap(sizes[50] - 1)
        out = np.zeros((E, 50, K), np.uint16)
        moekit.ops.batched_experts(random_codes(rng, (E, 50, K)), np.full((E, 50), 1 / 64, np.float32),
                                   np.array([50, 1], np.int32), **w, out=out)
        assert moekit.ops.workspace_bytes() == sizes[50]
        with pytest.raises(moekit.Error, match="a byte count >= 0"):
            moekit.ops.set_workspace_cap(-1)
    finally:
        moekit.ops.set_workspace_cap(cap_before)
        moekit.ops.release_workspaces()


def test_a_caller_workspace_gives_the_cached_bits_and_holds_nothing():
    """workspace=: the caller's buffer of the query's size runs the op (the same bits as the cached
    workspace), the ops cache no workspace for it, and a short or misshapen buffer is refused."""
    moekit.ops.release_workspaces(captured=True)  # earlier tests' graphs are gone
    rng = np.random.default_rng(35)
    E, M, K, I = 3, 16, 128, 128
    args = batched_case(rng, [16, 4, 0], M, K, I)
    cached = np.full((E, M, K), 0xFFFF, np.uint16)
    moekit.ops.batched_experts(**args, out=cached)
    moekit.ops.release_workspaces(captured=True)
    need = moekit.ops.batched_experts_workspace_bytes(E, M, K, 2 * I, device="cpu")
    buf = np.zeros(need + 64, np.uint8)[16:16 + need]  # NumPy's 16-byte alignment, not more
    mine = np.full((E, M, K), 0xFFFF, np.uint16)
    moekit.ops.batched_experts(**args, out=mine, workspace=buf)
    assert np.array_equal(mine, cached)
    assert moekit.ops.workspace_bytes() == 0, "a call with its own workspace cached one"
    moekit.ops.check_status(workspace=buf)  # nothing raised
    with pytest.raises(moekit.Error, match="pass a larger buffer"):
        moekit.ops.batched_experts(**args, out=mine, workspace=np.zeros(need - 1, np.uint8))
    with pytest.raises(moekit.Error, match="1-D uint8"):
        moekit.ops.batched_experts(**args, out=mine, workspace=np.zeros((2, need), np.uint8))
    # The standard op too; a bad id still raises at once on the CPU.
    sargs = standard_case(rng, "per-token", E=E, T=5, K=K, I=I)
    need = moekit.ops.standard_experts_workspace_bytes(5, K, 2 * I, 3, E, device="cpu")
    assert np.array_equal(run_standard(sargs, workspace=np.zeros(need, np.uint8)), run_standard(sargs))
    bad = dict(sargs, topk_ids=np.full((5, 3), 7, np.int32))
    with pytest.raises(moekit.Error, match="outside"):
        run_standard(bad, workspace=np.zeros(need, np.uint8))
    moekit.ops.release_workspaces()
