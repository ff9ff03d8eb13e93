"""colibri.routing's routing traces: the `.ctrace` format (docs/FORMAT.md),
the synthetic generator, the expert-cache simulator, and record_trace on
tiny random transformers models (4.57 or 5.x, whichever this interpreter
has)."""

import copy
import inspect
import re
import struct

import numpy as np
import pytest

from colibri.routing import RoutingTrace, record_trace, simulate_cache, synthetic_trace, trace_working_set

HEADER = struct.Struct("<8sIIIIQ")


def trace_bytes(n_layers, n_experts, top_k, records, n_steps=None, magic=b"CLBTRACE", version=1):
    """Hand-built .ctrace bytes: records = [(layer, n_tokens, flat ids)]."""
    out = [HEADER.pack(magic, version, n_layers, n_experts, top_k, len(records) if n_steps is None else n_steps)]
    for layer, n, ids in records:
        out.append(struct.pack("<II", layer, n))
        out.append(struct.pack("<%di" % len(ids), *ids))
    return b"".join(out)


def load_bytes(tmp_path, data, name="trace.ctrace"):
    p = tmp_path / name
    p.write_bytes(data)
    return RoutingTrace.load(p)


# ------------------------------------------------------------------ format


def test_round_trip_is_bit_identical(tmp_path):
    rng = np.random.default_rng(5)
    steps = [(0, rng.integers(-1, 70, (13, 3))), (2, rng.integers(-1, 70, (1, 3))), (1, np.zeros((0, 3), int)),
             (2, np.array([[69, -1, 0]]))]
    tr = RoutingTrace(3, 70, 3, steps)
    path = tmp_path / "t.ctrace"
    tr.save(path)
    data = path.read_bytes()
    assert len(data) == 32 + sum(8 + 4 * ids.size for _, ids in steps)
    assert data[:8] == b"CLBTRACE"
    assert HEADER.unpack_from(data) == (b"CLBTRACE", 1, 3, 70, 3, 4)
    # the first record, byte by byte
    assert struct.unpack_from("<II", data, 32) == (0, 13)
    assert struct.unpack_from("<39i", data, 40) == tuple(steps[0][1].ravel().tolist())
    back = RoutingTrace.load(path)
    assert (back.n_layers, back.n_experts, back.top_k, len(back)) == (3, 70, 3, 4)
    for (l1, a), (l2, b) in zip(steps, back):
        assert l1 == l2 and b.dtype == np.int32 and b.shape == a.shape
        np.testing.assert_array_equal(a, b)
    back.save(tmp_path / "u.ctrace")
    assert (tmp_path / "u.ctrace").read_bytes() == data


def test_append_copies_and_accepts_one_token_rows():
    tr = RoutingTrace(2, 4, 2)
    a = np.array([[1, 2]], dtype=np.int32)
    tr.append(1, a)
    tr.append(0, [3, -1])
    a[0, 0] = 0
    assert tr.steps[0][1].tolist() == [[1, 2]]
    assert tr.steps[1][1].tolist() == [[3, -1]]
    with pytest.raises(ValueError, match=r"^step 2: layer 2 out of range \[0, 2\)$"):
        tr.append(2, [0, 1])
    with pytest.raises(ValueError, match=r"^step 2: token 0, slot 1: expert id 4 out of range \[-1, 4\)$"):
        tr.append(0, [[0, 4]])
    with pytest.raises(ValueError, match=r"step 2: ids must be \[n_tokens, top_k = 2\], got shape \[1, 3\]"):
        tr.append(0, [[0, 1, 2]])
    with pytest.raises(TypeError, match="step 2: ids must be integers"):
        tr.append(0, np.array([[0.0, 1.0]]))
    assert len(tr) == 2
    with pytest.raises(ValueError, match=r"top_k 5 out of range \[1, n_experts = 4\]"):
        RoutingTrace(1, 4, 5)


def test_save_validates_edited_steps(tmp_path):
    tr = RoutingTrace(2, 4, 1, [(0, [[1]])])
    tr.steps.append((1, np.array([[-2]], dtype=np.int32)))
    with pytest.raises(ValueError, match=r"^step 1: token 0, slot 0: expert id -2 out of range \[-1, 4\)$"):
        tr.save(tmp_path / "x.ctrace")
    assert not (tmp_path / "x.ctrace").exists()
    assert list(tmp_path.iterdir()) == []  # no temporary left behind


GOOD = [(0, 2, [0, 1, 2, 3]), (3, 1, [-1, 7])]  # n_layers 4, n_experts 8, top_k 2


def test_load_accepts_the_hand_built_file(tmp_path):
    tr = load_bytes(tmp_path, trace_bytes(4, 8, 2, GOOD))
    assert [(l, ids.tolist()) for l, ids in tr] == [(0, [[0, 1], [2, 3]]), (3, [[-1, 7]])]
    assert tr.total_lookups() == 5


def _truncated(n):
    return trace_bytes(4, 8, 2, GOOD)[:n]


# (data, the whole message after "<path>: ")
LOAD_ERRORS = [
    (_truncated(20), "truncated header: 20 of 32 bytes"),
    (b"", "truncated header: 0 of 32 bytes"),
    (trace_bytes(4, 8, 2, GOOD, magic=b"CLBTRACX"),
     "not a routing trace: bad magic b'CLBTRACX' (expected b'CLBTRACE')"),
    (b"GGUF\x03\x00\x00\x00" + bytes(4), "not a routing trace: bad magic b'GGUF\\x03\\x00\\x00\\x00' "
                                         "(expected b'CLBTRACE')"),
    (trace_bytes(4, 8, 2, GOOD, version=2), "unsupported version 2 (expected 1)"),
    (trace_bytes(0, 8, 2, []), "header: n_layers 0 out of range [1, 4096]"),
    (trace_bytes(4, 0, 2, []), "header: n_experts 0 out of range [1, 65536]"),
    (trace_bytes(4, 8, 9, []), "header: top_k 9 out of range [1, n_experts = 8]"),
    (_truncated(32 + 8 + 16 + 4), "step 1: truncated record header: 4 of 8 bytes"),
    (_truncated(32 + 8 + 16 + 8 + 6), "step 1: truncated record: n_tokens 1 needs 8 bytes of expert ids, 6 left"),
    (trace_bytes(4, 8, 2, GOOD, n_steps=3), "step 2: truncated record header: 0 of 8 bytes"),
    (trace_bytes(4, 8, 2, [GOOD[0], (9, 1, [0, 1])]), "step 1: layer 9 out of range [0, 4)"),
    (trace_bytes(4, 8, 2, [GOOD[0], (1, 1, [0, 8])]), "step 1: token 0, slot 1: expert id 8 out of range [-1, 8)"),
    (trace_bytes(4, 8, 2, [(0, 3, [0, 1, 2, 3, -2, 5])]),
     "step 0: token 2, slot 0: expert id -2 out of range [-1, 8)"),
    # the first problem in file order wins
    (trace_bytes(4, 8, 2, [(0, 1, [0, 99]), (7, 1, [0, 1])]),
     "step 0: token 0, slot 1: expert id 99 out of range [-1, 8)"),
    (trace_bytes(4, 8, 2, [(0, 1, [0, 1]), (7, 1, [0, 99])]), "step 1: layer 7 out of range [0, 4)"),
    (trace_bytes(4, 8, 2, GOOD) + b"\x00\x00\x00", "3 trailing bytes after the last step (n_steps = 2)"),
    (trace_bytes(4, 8, 2, GOOD, n_steps=1), "16 trailing bytes after the last step (n_steps = 1)"),
    (trace_bytes(4, 8, 2, [(0, 1 << 30, [])]), "step 0: n_tokens 1073741824 out of range [0, 2^28]"),
]


@pytest.mark.parametrize("data, message", LOAD_ERRORS,
                         ids=[re.sub(r"[^a-z0-9]+", "_", m[:36].lower()).strip("_") for _, m in LOAD_ERRORS])
def test_load_errors_name_the_file_step_and_field(tmp_path, data, message):
    with pytest.raises(ValueError) as e:
        load_bytes(tmp_path, data)
    assert str(e.value) == "%s: %s" % (tmp_path / "trace.ctrace", message)


def test_from_bytes_names_its_source():
    with pytest.raises(ValueError, match=r"^mem: step 1: layer 9 out of range \[0, 4\)$"):
        RoutingTrace.from_bytes(trace_bytes(4, 8, 2, [GOOD[0], (9, 1, [0, 1])]), name="mem")


# --------------------------------------------------------------- generator


def decode_ids(tr, prefill=0):
    """[T, L, k] ids of a synthetic trace's decode records."""
    L = tr.n_layers
    steps = tr.steps[L if prefill else 0:]
    assert len(steps) % L == 0
    return np.stack([ids[0] for _, ids in steps]).reshape(-1, L, tr.top_k)


def test_synthetic_structure_and_determinism():
    a = synthetic_trace(3, 20, 4, 30, prefill_tokens=7, seed=11)
    b = synthetic_trace(3, 20, 4, 30, prefill_tokens=7, seed=11)
    c = synthetic_trace(3, 20, 4, 30, prefill_tokens=7, seed=12)
    assert (a.n_layers, a.n_experts, a.top_k, len(a)) == (3, 20, 4, 3 + 30 * 3)
    assert [l for l, _ in a.steps] == [0, 1, 2] * 31
    assert [ids.shape[0] for _, ids in a.steps] == [7] * 3 + [1] * 90
    assert all(np.array_equal(x, y) and l1 == l2 for (l1, x), (l2, y) in zip(a, b))
    assert any(not np.array_equal(x, y) for (_, x), (_, y) in zip(a, c))
    for _, ids in a:
        assert ids.dtype == np.int32 and ids.min() >= 0 and ids.max() < 20
        assert all(len(set(row)) == 4 for row in ids.tolist()), "the k ids of a token must be distinct"
    a.validate()
    assert a.total_lookups() == sum(len(np.unique(ids)) for _, ids in a)
    assert len(synthetic_trace(2, 8, 2, 0)) == 0


def test_synthetic_k_equal_to_n_experts_and_extreme_skew():
    tr = synthetic_trace(2, 5, 5, 20, skew=60.0, seed=1)  # popularity underflows to 0 beyond the top ranks
    for _, ids in tr:
        assert sorted(ids[0].tolist()) == [0, 1, 2, 3, 4]


def top_share(tr, frac=0.1):
    """Mean over layers of the share of lookups that go to the top `frac` of experts."""
    ids = decode_ids(tr)
    E = tr.n_experts
    n_top = max(1, int(round(frac * E)))
    shares = []
    for l in range(tr.n_layers):
        counts = np.bincount(ids[:, l].ravel(), minlength=E)
        shares.append(np.sort(counts)[::-1][:n_top].sum() / counts.sum())
    return float(np.mean(shares))


def test_synthetic_skew_concentrates_popularity():
    skewed = top_share(synthetic_trace(4, 60, 2, 1500, skew=1.2, seed=3))
    uniform = top_share(synthetic_trace(4, 60, 2, 1500, skew=0.0, seed=3))
    # Zipf 1.2 over 60 experts: the top 6 hold about 60% of the mass (distinct k = 2 lowers that a little)
    assert skewed > 0.4, skewed
    assert uniform < 0.17, uniform  # uniform: 10%, plus the noise the top-6 selection picks up (about 0.13)
    assert skewed > 3 * uniform


def follower_hit_rate(tr):
    """For each layer l < L-1 and expert e at l, its most frequent layer-(l+1)
    companion is learnt on the first half of the tokens; returns how often
    that companion is among the token's layer-(l+1) experts on the second half."""
    ids = decode_ids(tr)
    T, L, k = ids.shape
    E = tr.n_experts
    half = T // 2
    hit = tot = 0
    for l in range(L - 1):
        co = np.zeros((E, E), dtype=np.int64)
        for t in range(half):
            for e in ids[t, l]:
                co[e, ids[t, l + 1]] += 1
        best = co.argmax(axis=1)
        for t in range(half, T):
            nxt = set(ids[t, l + 1].tolist())
            for e in ids[t, l]:
                hit += best[e] in nxt
                tot += 1
    return hit / tot


def test_synthetic_layer_correlation():
    corr = follower_hit_rate(synthetic_trace(4, 32, 2, 800, skew=0.0, layer_corr=0.8, temporal=0.0, seed=4))
    none = follower_hit_rate(synthetic_trace(4, 32, 2, 800, skew=0.0, layer_corr=0.0, temporal=0.0, seed=4))
    chance = 2 / 32
    # each of the 2 slots follows a random one of the 2 layer-l experts with p = 0.8: 1 - (1 - 0.4)^2 = 0.64
    assert corr > 0.5, corr
    assert none < 3 * chance, none
    assert corr > 5 * none


def test_synthetic_temporal_locality():
    def reuse(tr):
        ids = decode_ids(tr)
        same = [len(set(ids[t, l]) & set(ids[t - 1, l])) for t in range(1, ids.shape[0]) for l in range(ids.shape[1])]
        return np.mean(same) / ids.shape[2]

    high = reuse(synthetic_trace(3, 40, 4, 400, skew=0.0, layer_corr=0.0, temporal=0.9, seed=8))
    low = reuse(synthetic_trace(3, 40, 4, 400, skew=0.0, layer_corr=0.0, temporal=0.0, seed=8))
    assert high > 0.75, high
    assert low < 0.2, low  # chance: 4 of 40


@pytest.mark.parametrize("kwargs, message", [
    (dict(layer_corr=1.5), "layer_corr must be a probability"),
    (dict(temporal=-0.1), "temporal must be a probability"),
    (dict(skew=-1.0), "skew must be a finite number >= 0"),
    (dict(prefill_tokens=-1), "prefill_tokens must be an int >= 0"),
])
def test_synthetic_rejects_bad_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        synthetic_trace(2, 8, 2, 10, **kwargs)


# --------------------------------------------------------------- simulator


def singles(experts, layer=0, n_layers=1, n_experts=8):
    return RoutingTrace(n_layers, n_experts, 1, [(layer, [[e]]) for e in experts])


SCAN = [0, 0, 0, 1, 2, 0, 3, 4, 0, 5, 6, 0]  # a hot expert among a scan of cold ones


def counts(r):
    return r["hits"], r["misses"]


def test_freq_keeps_the_hot_expert_lru_does_not():
    tr = singles(SCAN)
    # LRU, capacity 2: only the two repeats of the first accesses hit; every
    # pair of cold experts pushes the hot one out.
    lru = simulate_cache(tr, 2, "lru")
    assert counts(lru) == (2, 10) and lru["lookups"] == 12
    assert lru["hit_rate"] == pytest.approx(2 / 12)
    # freq (H = 4 * 2 = 8): the hot expert's score (about 2.3 to 3.1) stays above a cold one's (<= 1):
    # only the 7 compulsory misses.
    assert counts(simulate_cache(tr, 2, "freq")) == (5, 7)
    assert counts(simulate_cache(tr, 2, "belady")) == (5, 7)
    # a half-life far below one access: the decayed scores order by recency (underflowing to 0, where the
    # tie-break by last access decides), so freq becomes LRU
    assert counts(simulate_cache(tr, 2, "freq", half_life=0.01)) == (2, 10)


def test_freq_decay_lets_a_formerly_hot_expert_go():
    # Expert 0 hot (10 accesses), then 1 and 2 alternate, capacity 2.
    tr = singles([0] * 10 + [1, 2] * 4)
    # LRU: 9 hits on 0; 1 misses, 2 misses (evicting 0), then 1 and 2 hit.
    assert counts(simulate_cache(tr, 2, "lru")) == (15, 3)
    # No decay: 0's score 10 beats 1's and 2's (at most 4), so 1 and 2 evict each other every time.
    assert counts(simulate_cache(tr, 2, "freq", half_life=1e12)) == (9, 9)
    # H = 2: 0's score is sum 0.5**(j/2), j < 10 = 3.31 at t = 10. t = 12: 2 misses, 0 at 1.65 vs 1 at 0.71:
    # 1 goes; t = 13: 1 misses, 0 at 1.17 vs 2 at 0.71: 2 goes; t = 14: 2 misses, 0 at 0.83 vs 1 at
    # (0.5 + 1) * 0.71 = 1.06: 0 goes, and the last 4 lookups hit.
    assert counts(simulate_cache(tr, 2, "freq", half_life=2)) == (13, 5)


def test_freq_default_half_life_is_four_times_the_capacity():
    tr = synthetic_trace(4, 16, 2, 300, skew=1.0, seed=6)
    for cap in (6, 20):
        default = simulate_cache(tr, cap, "freq")
        assert default == simulate_cache(tr, cap, "freq", half_life=4 * cap)
        assert default != simulate_cache(tr, cap, "freq", half_life=cap)  # the half-life matters here


def test_keys_are_layer_expert_pairs():
    tr = RoutingTrace(2, 4, 1, [(0, [[1]]), (1, [[1]]), (0, [[1]]), (1, [[1]])])
    for policy in ("lru", "freq", "belady"):
        assert counts(simulate_cache(tr, 2, policy)) == (2, 2)
        assert counts(simulate_cache(tr, 1, policy)) == (0, 4)
    assert trace_working_set(tr) == {(0, 1): 2, (1, 1): 2}


def test_duplicates_and_empty_slots_count_once():
    tr = RoutingTrace(1, 8, 2, [(0, [[2, 2], [-1, 2], [3, -1]]), (0, [[-1, -1]]), (0, [[3, 2]])])
    assert tr.total_lookups() == 4
    assert trace_working_set(tr) == {(0, 2): 2, (0, 3): 2}
    for policy in ("lru", "freq", "belady"):
        r = simulate_cache(tr, 4, policy)
        assert r == {"hits": 2, "misses": 2, "hit_rate": 0.5, "lookups": 4}


def test_a_record_pins_its_own_experts():
    # Capacity 2, resident: 9 (older), 5. The record {3, 9} looks up 3 first (ascending ids): the victim
    # must be 5, not the older 9, which the record needs, so 9 then hits.
    tr = RoutingTrace(1, 10, 2, [(0, [[9, -1]]), (0, [[5, -1]]), (0, [[9, 3]])])
    for policy in ("lru", "freq", "belady"):
        assert counts(simulate_cache(tr, 2, policy)) == (1, 3), policy


def test_records_larger_than_the_cache_go_in_waves():
    # Capacity 3. [4]; then [0..4] in waves [0, 1, 2] and [3, 4]: wave 1 evicts 4 (not pinned), wave 2
    # evicts 0 then 1 (the oldest, no longer pinned); then [2, 3, 4] hits three times.
    steps = [(0, [[4, -1, -1, -1, -1]]), (0, [[4, 3, 2, 1, 0]]), (0, [[2, 3, 4, -1, -1]])]
    tr = RoutingTrace(1, 8, 5, steps)
    assert tr.total_lookups() == 9
    assert counts(simulate_cache(tr, 3, "lru")) == (3, 6)
    # freq: in wave 2, 0, 1 and 2 each have score 1; 0 is the oldest, then 1: the same victims
    assert counts(simulate_cache(tr, 3, "freq")) == (3, 6)
    # capacity 1: every lookup is its own wave and nothing is looked up twice in a row: all miss
    assert counts(simulate_cache(tr, 1, "lru")) == (0, 9)


def test_freq_ties_break_by_older_last_then_smaller_key():
    # Capacity 2, H tiny: both residents' decayed scores underflow to exactly 0; the older (expert 6) goes,
    # although its id is the larger.
    tr = singles([6, 1, 4, 6], n_experts=8)
    assert counts(simulate_cache(tr, 2, "freq", half_life=1e-5)) == (0, 4)  # 4 evicts 6, then 6 evicts 1
    tr2 = singles([6, 1, 4, 1], n_experts=8)
    assert counts(simulate_cache(tr2, 2, "freq", half_life=1e-5)) == (1, 3)  # 1 survived


def test_capacity_covering_the_working_set_gives_only_compulsory_misses():
    tr = synthetic_trace(3, 16, 2, 200, prefill_tokens=9, seed=2)
    ws = trace_working_set(tr)
    assert sum(ws.values()) == tr.total_lookups()
    assert all(0 <= l < 3 and 0 <= e < 16 for l, e in ws)
    for policy in ("lru", "freq", "belady"):
        r = simulate_cache(tr, len(ws), policy)
        assert r["misses"] == len(ws) and r["lookups"] == tr.total_lookups(), policy
        assert simulate_cache(tr, 10 * len(ws), policy)["misses"] == len(ws)
        assert simulate_cache(tr, len(ws) - 1, policy)["misses"] > len(ws)


def test_freq_beats_lru_on_a_skewed_trace():
    for seed in (0, 1):
        tr = synthetic_trace(8, 32, 2, 600, skew=1.2, layer_corr=0.6, temporal=0.3, seed=seed)
        lru = simulate_cache(tr, 48, "lru")
        freq = simulate_cache(tr, 48, "freq")
        bel = simulate_cache(tr, 48, "belady")
        assert lru["lookups"] == freq["lookups"] == tr.total_lookups()
        assert freq["hit_rate"] >= lru["hit_rate"], (freq, lru)
        assert bel["hit_rate"] >= freq["hit_rate"], (bel, freq)
        assert 0.0 < lru["hit_rate"] < 1.0


def test_simulator_rejects_bad_arguments():
    tr = singles([1])
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        simulate_cache(tr, 0)
    with pytest.raises(ValueError, match="policy must be one of lru, freq, belady"):
        simulate_cache(tr, 2, "fifo")
    with pytest.raises(ValueError, match="half_life must be a positive finite number"):
        simulate_cache(tr, 2, "freq", half_life=0)
    assert simulate_cache(RoutingTrace(1, 4, 1), 2) == {"hits": 0, "misses": 0, "hit_rate": 0.0, "lookups": 0}


# --------------------------------------------------------------- recording

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

D, VOCAB = 48, 96
COMMON = dict(vocab_size=VOCAB, hidden_size=D, max_position_embeddings=128, tie_word_embeddings=False,
              rms_norm_eps=1e-6)
ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=12)
MLA = dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
           qk_rope_head_dim=8, v_head_dim=8)


def _config(family, **extra):
    c = transformers
    if family == "mixtral":
        return c.MixtralConfig(**COMMON, **ATTN, intermediate_size=24, num_hidden_layers=3, num_local_experts=6,
                               num_experts_per_tok=2, **extra)
    if family == "qwen2_moe":
        return c.Qwen2MoeConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
                                moe_intermediate_size=24, shared_expert_intermediate_size=32, num_hidden_layers=2,
                                num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1)
    if family == "qwen3_moe":
        return c.Qwen3MoeConfig(**COMMON, **ATTN, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=2,
                                num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=1)
    if family == "olmoe":
        return c.OlmoeConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, intermediate_size=24,
                             num_hidden_layers=2, num_experts=6, num_experts_per_tok=2)
    if family == "gpt_oss":
        return c.GptOssConfig(**COMMON, **ATTN, intermediate_size=24, num_hidden_layers=2, num_local_experts=6,
                              num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                              sliding_window=8)
    if family == "deepseek_v2":
        return c.DeepseekV2Config(**COMMON, **MLA, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=3,
                                  first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3,
                                  n_shared_experts=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                  routed_scaling_factor=1.5, norm_topk_prob=False)
    if family == "deepseek_v3":
        return c.DeepseekV3Config(**COMMON, **MLA, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=3,
                                  first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3,
                                  n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                  norm_topk_prob=True)
    raise KeyError(family)


def build(family, seed=0, **extra):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, **extra))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model.eval()


def moe_mlps(model):
    """The decoder layers' MoE blocks, in layer order (dense layers left out)."""
    blocks = [getattr(layer, "block_sparse_moe", None) or layer.mlp for layer in model.model.layers]  # 4.57 Mixtral
    return [b for b in blocks if hasattr(b, "experts")]


def router_of(block):
    return block.router if hasattr(block, "router") else block.gate


def reference_topk(family, block, x):
    """Top-k expert sets [N, k] (sorted per row) from the block's input x [N, D],
    computed in float64 NumPy from the router's weights, and a margin per
    token (how far the choice is from a tie)."""
    r = router_of(block)
    w = r.weight.detach().double().numpy()
    logits = x @ w.T
    if getattr(r, "bias", None) is not None:
        logits = logits + r.bias.detach().double().numpy()
    k = {"qwen3_moe": 3, "deepseek_v2": 3, "deepseek_v3": 3}.get(family, 2)
    margin = np.full(x.shape[0], np.inf)
    if family in ("deepseek_v2", "deepseek_v3"):
        G, TG = 4, 2
        E = w.shape[0]
        if family == "deepseek_v2":
            choice = np.exp(logits - logits.max(1, keepdims=True))
            choice /= choice.sum(1, keepdims=True)
            group = choice.reshape(-1, G, E // G).max(-1)
            fill = 0.0
        else:
            choice = 1.0 / (1.0 + np.exp(-logits)) + r.e_score_correction_bias.detach().double().numpy()
            group = np.sort(choice.reshape(-1, G, E // G), axis=-1)[..., -2:].sum(-1)
            fill = -np.inf
        gs = np.sort(group, axis=1)[:, ::-1]
        margin = gs[:, TG - 1] - gs[:, TG]
        keep = np.argsort(-group, axis=1, kind="stable")[:, :TG]
        mask = np.zeros_like(group, dtype=bool)
        np.put_along_axis(mask, keep, True, axis=1)
        choice = np.where(np.repeat(mask, E // G, axis=1), choice, fill)
    else:
        choice = logits  # softmax (and gpt-oss's top-k over logits) keeps the order of the logits
    cs = np.sort(choice, axis=1)[:, ::-1]
    margin = np.minimum(margin, cs[:, k - 1] - cs[:, k])
    ids = np.sort(np.argsort(-choice, axis=1, kind="stable")[:, :k], axis=1)
    return ids, margin


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3"]
TOP_K = {"qwen3_moe": 3, "deepseek_v2": 3, "deepseek_v3": 3}
N_EXPERTS = {"qwen3_moe": 8, "deepseek_v2": 8, "deepseek_v3": 8}


def capture_inputs(model, log):
    """Pre-hooks on each MoE block logging (layer, block input [N, D] float64) per call."""
    handles = []
    for i, block in enumerate(moe_mlps(model)):
        def pre(mod, args, i=i):
            log.append((i, args[0].detach().reshape(-1, D).double().numpy()))
        handles.append(block.register_forward_pre_hook(pre))
    return handles


def check_against_reference(family, model, tr, log):
    blocks = moe_mlps(model)
    assert len(tr) == len(log)
    checked = total = 0
    for step, ((layer, ids), (lay, x)) in enumerate(zip(tr, log)):
        assert layer == lay, "step %d" % step
        assert ids.shape == (x.shape[0], TOP_K.get(family, 2))
        ref, margin = reference_topk(family, blocks[layer], x)
        ok = margin > 1e-5
        got = np.sort(ids, axis=1)
        np.testing.assert_array_equal(got[ok], ref[ok], err_msg="%s step %d" % (family, step))
        checked += int(ok.sum())
        total += ok.size
    assert checked >= 0.9 * total


@pytest.mark.parametrize("family", FAMILIES)
def test_record_generate_matches_the_routers_top_k(family):
    model = build(family)
    L = len(moe_mlps(model))
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, VOCAB, (2, 9), generator=g)
    log = []
    handles = capture_inputs(model, log)
    try:
        with record_trace(model) as tr:
            with torch.inference_mode():
                model.generate(prompt, do_sample=False, max_new_tokens=4, min_new_tokens=4, pad_token_id=0)
    finally:
        for h in handles:
            h.remove()
    assert (tr.n_layers, tr.n_experts, tr.top_k) == (L, N_EXPERTS.get(family, 6), TOP_K.get(family, 2))
    # a prefill (one record per layer with all 2 x 9 tokens), then 3 decode forwards of 2 tokens
    assert [l for l, _ in tr] == list(range(L)) * 4
    assert [ids.shape[0] for _, ids in tr] == [18] * L + [2] * (3 * L)
    assert all(len(set(row)) == len(row) for _, ids in tr for row in ids.tolist())
    check_against_reference(family, model, tr, log)
    # the hooks are gone: another forward records nothing
    with torch.inference_mode():
        model(prompt)
    assert len(tr) == 4 * L
    assert all(not router_of(b)._forward_hooks for b in moe_mlps(model))


# transformers 5.2x renamed past_key_values to cache (argument and output)
CACHE_ARG = "cache" if "cache" in inspect.signature(transformers.MixtralForCausalLM.forward).parameters \
    else "past_key_values"


def test_record_forward_calls_and_output_router_logits():
    """Plain forward calls with a KV cache; the recorded ids against
    transformers' own router logits (output_router_logits)."""
    model = build("mixtral")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (1, 6), generator=g)
    logits_seen = []
    with record_trace(model) as tr:
        with torch.inference_mode():
            out = model(ids, use_cache=True, output_router_logits=True)
            logits_seen.append(out.router_logits)
            nxt = out.logits[:, -1:].argmax(-1)
            for _ in range(2):
                kv = {CACHE_ARG: getattr(out, CACHE_ARG)}
                out = model(nxt, use_cache=True, output_router_logits=True, **kv)
                logits_seen.append(out.router_logits)
                nxt = out.logits[:, -1:].argmax(-1)
    assert [ids.shape[0] for _, ids in tr] == [6] * 3 + [1] * 6
    step = 0
    for call in logits_seen:
        assert len(call) == 3
        for layer, lg in enumerate(call):
            lg = lg.reshape(-1, 6).double().numpy()
            ref = np.argsort(-lg, axis=1, kind="stable")[:, :2]
            l, got = tr.steps[step]
            assert l == layer
            np.testing.assert_array_equal(got, ref)  # descending score order, as torch.topk gives
            step += 1


def test_record_pads_to_a_larger_top_k_and_expert_count():
    model = build("olmoe")
    with record_trace(model, n_experts=10, top_k=4) as tr:
        with torch.inference_mode():
            model(torch.tensor([[1, 2, 3]]))
    assert (tr.n_experts, tr.top_k, len(tr)) == (10, 4, 2)
    for _, ids in tr:
        assert ids.shape == (3, 4)
        assert (ids[:, 2:] == -1).all() and (ids[:, :2] >= 0).all() and (ids[:, :2] < 6).all()
    with pytest.raises(ValueError, match="top_k=1, but the model's blocks route to up to 2 experts"):
        with record_trace(model, top_k=1):
            pass
    with pytest.raises(ValueError, match="n_experts=4, but the model's blocks have up to 6 experts"):
        with record_trace(model, n_experts=4):
            pass


def test_record_removes_its_hooks_on_exceptions():
    model = build("qwen3_moe")
    routers = [router_of(b) for b in moe_mlps(model)]
    before = [len(r._forward_hooks) for r in routers]
    with pytest.raises(RuntimeError, match="boom"):
        with record_trace(model) as tr:
            with torch.inference_mode():
                model(torch.tensor([[5, 6]]))
            assert [len(r._forward_hooks) for r in routers] == [b + 1 for b in before]
            raise RuntimeError("boom")
    assert [len(r._forward_hooks) for r in routers] == before
    assert len(tr) == 2
    with torch.inference_mode():
        model(torch.tensor([[5, 6]]))
    assert len(tr) == 2


def test_record_a_block_colibri_cannot_run_from_its_router():
    """Experts with GELU: colibri.torch does not recognise the block (the
    engine's SwiGLU is SiLU), but its router is a known kind, so its routing
    is still recorded, exactly."""
    import colibri.torch as ct

    model = build("mixtral", hidden_act="gelu")
    assert isinstance(ct.recognise(moe_mlps(model)[0]), str)
    log = []
    handles = capture_inputs(model, log)
    try:
        with record_trace(model) as tr:
            with torch.inference_mode():
                model(torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]))
    finally:
        for h in handles:
            h.remove()
    assert len(tr) == 3
    check_against_reference("mixtral", model, tr, log)


def test_record_a_per_expert_block_whose_gate_returns_logits():
    """A block with one module per expert and an nn.Linear gate (4.57's
    layout; here a hand-written Mixtral-style block, in any transformers):
    the gate returns bare logits and the block's rule (softmax, top-k) gives
    the ids."""
    nn = torch.nn
    E, K = 7, 3

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3, self.w2 = nn.Linear(D, 8, bias=False), nn.Linear(D, 8, bias=False), \
                nn.Linear(8, D, bias=False)
            self.act_fn = nn.SiLU()

        def forward(self, x):
            return self.w2(self.act_fn(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.top_k = K
            self.gate = nn.Linear(D, E, bias=False)
            self.experts = nn.ModuleList([Expert() for _ in range(E)])

        def forward(self, h):
            x = h.reshape(-1, D)
            p = torch.softmax(self.gate(x), dim=1, dtype=torch.float)
            w, idx = torch.topk(p, K, dim=-1)
            y = torch.zeros_like(x)
            for j in range(K):
                for e in range(E):
                    sel = idx[:, j] == e
                    if sel.any():
                        y[sel] += w[sel, j, None] * self.experts[e](x[sel])
            return h + y.reshape(h.shape)

    torch.manual_seed(2)
    net = nn.Sequential(Block(), Block()).eval()
    import colibri.torch as ct
    assert ct.recognise(net[0]).family == "mixtral"
    x = torch.randn(2, 5, D)
    with record_trace(net) as tr:
        with torch.inference_mode():
            net(x)
            net(x[:, :1])
    assert (tr.n_layers, tr.n_experts, tr.top_k) == (2, E, K)
    assert [(l, ids.shape[0]) for l, ids in tr] == [(0, 10), (1, 10), (0, 2), (1, 2)]
    with torch.inference_mode():
        h1 = net[0](x)
    for (layer, ids), inp in zip(tr.steps[:2], (x, h1)):
        lg = inp.reshape(-1, D).double().numpy() @ net[layer].gate.weight.detach().double().numpy().T
        np.testing.assert_array_equal(ids, np.argsort(-lg, axis=1, kind="stable")[:, :K])


def test_record_refuses_unknown_blocks():
    nn = torch.nn

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Odd()

    with pytest.raises(ValueError, match=r"cannot record the MoE block block \(Odd\).*no \.gate or \.router"):
        with record_trace(Net()):
            pass
    with pytest.raises(ValueError, match="no MoE blocks"):
        with record_trace(nn.Linear(3, 3)):
            pass
    with pytest.raises(TypeError, match="takes a torch.nn.Module"):
        with record_trace(object()):
            pass


def _library_ok():
    try:
        import colibri
        return colibri.has_open_memory()
    except Exception:  # noqa: BLE001 (no library built: the test is skipped)
        return False


@pytest.mark.skipif(not _library_ok(), reason="needs libcolibri with colibri_open_memory")
def test_record_an_accelerated_model():
    """After colibri.torch.accelerate (PyTorch expert weights released) the
    routing recorded is the one the unaccelerated model has."""
    import colibri.torch as ct

    model = build("mixtral")
    plain = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(9))
    report = ct.accelerate(model, threads=1)
    assert len(report.accelerated) == 3 and report.released_bytes > 0
    with record_trace(model) as got:
        with torch.inference_mode():
            model(ids)
    with record_trace(plain) as want:
        with torch.inference_mode():
            plain(ids)
    assert len(got) == len(want) == 3
    # layer 0's router sees bit-identical inputs; later ones agree up to rounding (no near-ties here)
    np.testing.assert_array_equal(got.steps[0][1], want.steps[0][1])
    for (l1, a), (l2, b) in zip(got, want):
        assert l1 == l2
        assert (a == b).all(axis=1).mean() >= 0.9
