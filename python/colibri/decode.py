"""A decode step of a from_pretrained model without transformers' module
calls: the same C calls in the same order, so the same bits.

At one token, a block's work in Colibri is a dozen C calls of 5-600
microseconds (norms, projections, rope, attention, the MoE layer);
transformers' forward wraps them in module calls, decorators, views,
masks and per-call checks, about 0.2 ms a block on a 2-core AMD EPYC
Zen 5, a fifth of a Qwen3-30B-A3B-shaped block's decode step.
`install(model)` replaces the base model's forward with one that, for a
step of one token of one sequence on a filled cache, walks the blocks
itself: per block RMS norm, q / k / v projections, the family's q / k
norms, rope, `cache.update` (transformers' own cache, so generate and the
prefill path see the same cache), attention, o projection, residual, RMS
norm, one `colibri_infer` with the built-in router (or the block's own
feed-forward module where Colibri does not run it), residual. DeepSeek-V3's
latent attention is its absorbed form's calls (q low-rank pair, latent kv
projection and norm, rope, k_b, attention over the cached latents, v_b, o). Each call
gets descriptors and buffers made once at install.

Any other call runs the original forward: several tokens or sequences,
inputs_embeds, a padded attention mask, hidden states / attentions /
router logits requested, autograd, training, torch.compile, forward hooks
on any submodule, a call from a second thread while one runs, and caches
longer than a sliding window of the model (the fast path has no masks;
gpt-oss's sliding layers pass their window to the attention instead).
"""

import threading

import torch

from . import _lib as L
from . import nn as cnn
from . import rope as colibri_rope
from ._arrays import leading_strides

_FFN_NAMES = ("mlp", "block_sparse_moe", "feed_forward")

# Families whose blocks are x + attn(norm(x)), then x + ffn(norm(x)), with
# q / k / v / o projections, and whose attention forward the step below
# reproduces (q / k norms per head or over the whole projection, biases in
# the projections, gpt-oss's sinks).
_FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "glm4_moe", "gpt_oss")
# Families whose attention is DeepSeek's absorbed latent attention
# (loader._absorb): DeepSeek-V3's runs as C calls (_LatentAttention),
# DeepSeek-V2's (a complex rotation) through its own forward called with no
# mask; the rest of the block as above.
_OWN_ATTENTION = ("deepseek_v2", "deepseek_v3")

# Families whose sliding layers the step runs with the window as the
# attention's own (colibri_attention's `window`, what the model's mask
# says); other families with a window fall back past it.
_WINDOWED = ("gpt_oss",)

_HARMLESS = {"cache_position", "return_dict", "output_attentions", "output_hidden_states", "output_router_logits",
             "use_cache", "position_ids", "attention_mask", "logits_to_keep"}


class _Block:
    """One block's calls: modules, buffers and C descriptors."""

    def __init__(self, index, layer, config, style, threads):
        attn = layer.self_attn
        self.index = index
        ffn_name = next(n for n in _FFN_NAMES if isinstance(getattr(layer, n, None), torch.nn.Module))
        self.ffn = getattr(layer, ffn_name)
        routed = self.ffn.__dict__.get("_colibri_routed")
        self.moe = (routed[0], routed[2]) if routed is not None else None
        self.routed = routed  # the expert-parallel group rides along (all_reduce_share)
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        d = self.norm1.weight.shape[0]
        self.d = d
        self.h = torch.empty(1, d)
        self.ffn_out = torch.empty(1, d)
        self.own_attention = attn.forward if "_colibri_absorbed" in attn.__dict__ else None
        self.mla = None
        if self.own_attention is not None:
            self.mla = _LatentAttention.of(attn, config, threads)
            return
        self.q, self.k, self.v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        H = config.num_attention_heads
        Hkv = getattr(config, "num_key_value_heads", None) or H
        D = attn.head_dim
        Dv = self.v.out_features // Hkv
        self.H, self.Hkv, self.D, self.Dv = H, Hkv, D, Dv
        # q / k norms: per head (Qwen3, GLM-4 with use_qk_norm) or over the
        # whole projection (OLMoE); rows x width of one C call.
        self.qk_norms = None
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if q_norm is not None and getattr(attn, "use_qk_norm", True):
            qw, kw = q_norm.weight.shape[0], k_norm.weight.shape[0]
            self.qk_norms = (q_norm, (1, H * D) if qw == H * D else (H, D), k_norm,
                             (1, Hkv * D) if kw == Hkv * D else (Hkv, D))
        sinks = getattr(attn, "sinks", None)
        self.sinks = sinks.detach().to(torch.float32).contiguous() if sinks is not None else None
        self.q_out = torch.empty(1, H * D)
        self.q_normed = torch.empty(1, H * D)
        self.k_normed = torch.empty(1, Hkv * D)
        self.q_roped = torch.empty(1, H, 1, D)
        self.attn_out = torch.empty(1, 1, H, Dv)
        self.o_out = torch.empty(1, d)
        rotary, half = {"full": (D, 0), "partial": (None, 0), "half": (D, 1)}[style]
        self.rope_q = self._rope_desc(H, D, rotary, half, self.q_normed if self.qk_norms else self.q_out, self.q_roped)
        self.rope_k = self._rope_desc(Hkv, D, rotary, half, None, None)
        a = L.AttentionDesc()
        a.batch, a.heads, a.kv_heads, a.q_len, a.qk_dim, a.v_dim = 1, H, Hkv, 1, D, Dv
        a.n_threads = int(threads)
        a.scale = float(attn.scaling)
        a.q = self.q_roped.data_ptr()
        a.q_stride[:] = (0, D, 0)
        a.sinks = self.sinks.data_ptr() if self.sinks is not None else None
        # gpt-oss's sliding layers: the window the model's mask would apply.
        window = getattr(attn, "sliding_window", None) if config.model_type in _WINDOWED else None
        a.window = int(window or 0)
        a.out = self.attn_out.data_ptr()
        self.attn = a

    @staticmethod
    def _rope_desc(heads, D, rotary, half, x, out):
        r = L.RopeDesc()
        r.batch, r.heads, r.tokens, r.head_dim, r.rotary_dim, r.half_table = 1, heads, 1, D, rotary or 0, half
        r.x_stride[:] = (0, D, 0)
        r.out_stride[:] = (0, D, 0)
        if x is not None:
            r.x = x.data_ptr()
        if out is not None:
            r.out = out.data_ptr()
        return r


class _LatentAttention:
    """DeepSeek-V3's absorbed latent attention (loader._absorb) at one token
    as C calls on buffers made once: the same calls in the same order as
    loader._absorbed_mla_forward, so the same bits. Its rotary embedding
    (transformers' apply_rotary_pos_emb_interleave, or the plain
    rotate_half form without rope_interleave) is colibri_rope on the pairs
    de-interleaved, which computes the same products and sums; DeepSeek-V2's
    complex rotation keeps the module's forward."""

    @classmethod
    def of(cls, attn, config, threads):
        if config.model_type != "deepseek_v3":
            return None
        names = ["kv_a_proj_with_mqa", "o_proj"]
        names += ["q_a_proj", "q_b_proj"] if attn.q_lora_rank else ["q_proj"]
        if not all(isinstance(getattr(attn, n, None), cnn.Linear) for n in names):
            return None
        norms = ["kv_a_layernorm"] + (["q_a_layernorm"] if attn.q_lora_rank else [])
        if not all(isinstance(getattr(attn, n, None), cnn.RMSNorm) for n in norms):
            return None
        k_b, v_b, _ = attn.__dict__["_colibri_absorbed"]
        return cls(attn, config, threads, k_b, v_b)

    def __init__(self, attn, config, threads, k_b, v_b):
        self.attn = attn
        self.k_b, self.v_b = k_b, v_b
        H = config.num_attention_heads
        nope, rope, rank = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.kv_lora_rank
        v_head = attn.v_head_dim
        self.H, self.nope, self.rope, self.rank = H, nope, rope, rank
        self.interleave = bool(getattr(config, "rope_interleave", True))
        self.layer_idx = attn.layer_idx
        if attn.q_lora_rank:
            self.q_a = torch.empty(1, attn.q_lora_rank)
            self.q_a_normed = torch.empty(1, attn.q_lora_rank)
        self.q = torch.empty(1, H * (nope + rope))
        self.kv_a = torch.empty(1, rank + rope)
        self.q_nope = torch.empty(1, H * nope)
        self.q_rot_pairs = torch.empty(H, rope)  # de-interleaved
        self.k_rot_pairs = torch.empty(1, rope)
        self.q_lat = torch.empty(1, H * rank)
        self.query = torch.empty(H, rank + rope)  # latent part, then the rope part
        self.lat = torch.empty(1, 1, H, rank)
        self.v_out = torch.empty(1, H * v_head)
        self.o_out = torch.empty(1, config.hidden_size)
        q_rot_src = self.q_rot_pairs if self.interleave else self.q[:, nope:]
        self.rope_q = _Block._rope_desc(H, rope, rope, 0, q_rot_src, self.query[:, rank:])
        self.rope_q.x_stride[:] = (0, rope if self.interleave else nope + rope, 0)
        self.rope_q.out_stride[:] = (0, rank + rope, 0)
        self.rope_k = _Block._rope_desc(1, rope, rope, 0, None, None)
        a = L.AttentionDesc()
        a.batch, a.heads, a.kv_heads, a.q_len, a.qk_dim, a.v_dim, a.qk2_dim = 1, H, 1, 1, rank, rank, rope
        a.n_threads = int(attn.__dict__.get("_colibri_threads", threads))
        a.scale = float(attn.scaling)
        a.q = self.query.data_ptr()
        a.q_stride[:] = (0, rank + rope, 0)
        a.out = self.lat.data_ptr()
        self.desc = a

    def run(self, step, h, cos_p, sin_p, cache):
        """Attention of the normed hidden state at pointer h; returns the o
        projection's output [1, d]."""
        linear, norm, rope = step.linear, step.norm, step.rope
        attn, H, nope, rope_dim, rank = self.attn, self.H, self.nope, self.rope, self.rank
        if attn.q_lora_rank:
            _ok(linear(attn.q_a_proj._handle, 1, h, self.q_a.data_ptr()), "colibri_linear_forward")
            n = attn.q_a_layernorm
            _ok(norm(self.q_a.data_ptr(), n.weight.data_ptr(), 1, self.q_a.shape[1], n.variance_epsilon,
                     self.q_a_normed.data_ptr()), "colibri_rms_norm")
            _ok(linear(attn.q_b_proj._handle, 1, self.q_a_normed.data_ptr(), self.q.data_ptr()),
                "colibri_linear_forward")
        else:
            _ok(linear(attn.q_proj._handle, 1, h, self.q.data_ptr()), "colibri_linear_forward")
        _ok(linear(attn.kv_a_proj_with_mqa._handle, 1, h, self.kv_a.data_ptr()), "colibri_linear_forward")
        # Fresh tensors for what the cache keeps (a cache may hold them as given).
        latent = torch.empty(1, 1, 1, rank)
        k_rot = torch.empty(1, 1, 1, rope_dim)
        n = attn.kv_a_layernorm
        _ok(norm(self.kv_a.data_ptr(), n.weight.data_ptr(), 1, rank, n.variance_epsilon, latent.data_ptr()),
            "colibri_rms_norm")
        q = self.q.view(H, nope + rope_dim)
        self.q_nope.view(H, nope).copy_(q[:, :nope])
        if self.interleave:
            self.q_rot_pairs.view(H, 2, rope_dim // 2).copy_(q[:, nope:].view(H, rope_dim // 2, 2).transpose(1, 2))
            self.k_rot_pairs.view(2, rope_dim // 2).copy_(self.kv_a[0, rank:].view(rope_dim // 2, 2).t())
            k_src = self.k_rot_pairs
        else:
            k_src = self.kv_a[:, rank:]
        _rope_q_and_k(rope, self.rope_q, self.rope_k, k_src, k_rot, cos_p, sin_p)
        keys, keys_rot = cache.update(latent, k_rot, self.layer_idx)
        _ok(linear(self.k_b._handle, 1, self.q_nope.data_ptr(), self.q_lat.data_ptr()), "colibri_linear_forward")
        self.query[:, :rank].copy_(self.q_lat.view(H, rank))
        a = self.desc
        a.kv_len = keys.shape[2]
        a.k = a.v = keys.data_ptr()
        a.k_stride[:] = a.v_stride[:] = leading_strides(keys, 3)
        a.k2 = keys_rot.data_ptr()
        a.k2_stride[:] = leading_strides(keys_rot, 3)
        _ok(step.attention(a), "colibri_attention")
        _ok(linear(self.v_b._handle, 1, self.lat.data_ptr(), self.v_out.data_ptr()), "colibri_linear_forward")
        _ok(linear(attn.o_proj._handle, 1, self.v_out.data_ptr(), self.o_out.data_ptr()), "colibri_linear_forward")
        return self.o_out


class _Step:
    def __init__(self, model, base, original, style, threads):
        config = model.config
        self.config = config
        self.base = base
        self.original = original
        # Blocks past num_hidden_layers (GLM's multi-token prediction) are not run by the forward.
        layers = base.layers[: config.num_hidden_layers]
        self.blocks = [_Block(i, layer, config, style, threads) for i, layer in enumerate(layers)]
        self.standard = any(b.own_attention is None and b.mla is None for b in self.blocks)
        self.latent = [b.mla.rope for b in self.blocks if b.mla is not None]
        self.partial = style == "partial"
        self.modules = list(base.modules())
        self.lock = threading.Lock()
        self.steps = 0  # steps taken on the direct path, for tests and benchmarks
        self.batch_steps = 0  # run_batch's steps
        self.output = None  # (class, cache field) of the original forward's output, seen at its first call
        windows = []
        if config.model_type not in _WINDOWED:
            windows = [getattr(config, "sliding_window", None)]
            windows += [getattr(layer.self_attn, "sliding_window", None) for layer in layers]
        windows = [int(w) for w in windows if isinstance(w, int) and not isinstance(w, bool) and w > 0]
        self.max_kv = min(windows) if windows else None
        lib = L.lib()
        self.linear, self.norm, self.rope, self.attention = (lib.colibri_linear_forward, lib.colibri_rms_norm,
                                                             lib.colibri_rope, lib.colibri_attention)

    def fits(self, input_ids, attention_mask, cache, kwargs):
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] != 1:
            return False
        if cache is None or self.output is None or self.base.training or torch.is_grad_enabled():
            return False
        if torch.compiler.is_compiling() or kwargs.get("inputs_embeds") is not None:
            return False
        for key, value in kwargs.items():
            if value is None:
                continue
            if key not in _HARMLESS or (key.startswith("output_") and value) or (
                    key in ("use_cache", "return_dict") and value is False):
                return False
        config = self.config
        if (config.output_hidden_states or config.output_attentions
                or getattr(config, "output_router_logits", False)):
            return False
        if not hasattr(cache, "get_seq_length") or not hasattr(cache, "update"):
            return False
        past = cache.get_seq_length()
        if past == 0 or (self.max_kv is not None and past + 1 > self.max_kv):
            return False
        if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[-1] != past + 1
                                           or not bool(attention_mask.all())):
            return False
        if any(m._forward_hooks or m._forward_pre_hooks for m in self.modules):
            return False
        from torch.nn.modules import module as torch_module
        if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return False
        return True

    def run(self, input_ids, position_ids, cache):
        base = self.base
        x = base.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.tensor([[cache.get_seq_length()]], dtype=torch.long)
        if x.dtype != torch.float32:
            return None
        position_embeddings = base.rotary_emb(x, position_ids)
        if self.standard or self.latent:
            cos, sin = position_embeddings
            if cos.dtype != torch.float32 or any(width != cos.shape[-1] for width in self.latent):
                return None
            cos, sin = cos.contiguous(), sin.contiguous()
            cos_p, sin_p, width = cos.data_ptr(), sin.data_ptr(), cos.shape[-1]
        x = x.reshape(1, -1)
        linear, norm, rope, attention = self.linear, self.norm, self.rope, self.attention
        for b in self.blocks:
            h = b.h.data_ptr()
            _ok(norm(x.data_ptr(), b.norm1.weight.data_ptr(), 1, b.d, b.norm1.variance_epsilon, h), "colibri_rms_norm")
            if b.mla is not None:
                x = x + b.mla.run(self, h, cos_p, sin_p, cache)
                self._feed_forward(b, x)
                x = x + b.ffn_result
                continue
            if b.own_attention is not None:
                out = b.own_attention(b.h.view(1, 1, -1), position_embeddings=position_embeddings,
                                      attention_mask=None, cache=cache)[0]
                x = x + out.reshape(1, -1)
                self._feed_forward(b, x)
                x = x + b.ffn_result
                continue
            k = torch.empty(1, b.Hkv * b.D)
            v = torch.empty(1, b.Hkv * b.Dv)
            _ok(linear(b.q._handle, 1, h, b.q_out.data_ptr()), "colibri_linear_forward")
            _ok(linear(b.k._handle, 1, h, k.data_ptr()), "colibri_linear_forward")
            _ok(linear(b.v._handle, 1, h, v.data_ptr()), "colibri_linear_forward")
            if b.qk_norms is not None:
                q_norm, (q_rows, q_dim), k_norm, (k_rows, k_dim) = b.qk_norms
                _ok(norm(b.q_out.data_ptr(), q_norm.weight.data_ptr(), q_rows, q_dim, q_norm.variance_epsilon,
                         b.q_normed.data_ptr()), "colibri_rms_norm")
                _ok(norm(k.data_ptr(), k_norm.weight.data_ptr(), k_rows, k_dim, k_norm.variance_epsilon,
                         b.k_normed.data_ptr()), "colibri_rms_norm")
                k_in = b.k_normed
            else:
                k_in = k
            k_roped = torch.empty(1, b.Hkv, 1, b.D)
            _rope_q_and_k(rope, b.rope_q, b.rope_k, k_in, k_roped, cos_p, sin_p, width if self.partial else None)
            keys, values = cache.update(k_roped, v.view(1, 1, b.Hkv, b.Dv).transpose(1, 2), b.index)
            a = b.attn
            a.kv_len = keys.shape[2]
            a.k = keys.data_ptr()
            a.k_stride[:] = leading_strides(keys, 3)
            a.v = values.data_ptr()
            a.v_stride[:] = leading_strides(values, 3)
            _ok(attention(a), "colibri_attention")
            _ok(linear(b.o._handle, 1, b.attn_out.data_ptr(), b.o_out.data_ptr()), "colibri_linear_forward")
            x = x + b.o_out
            self._feed_forward(b, x)
            x = x + b.ffn_result
        last = base.norm(x.view(1, 1, -1))
        self.steps += 1
        cls, field = self.output
        return cls(**{"last_hidden_state": last, field: cache})


    def fits_batch(self, caches):
        """Whether run_batch may take a decode step of sequences with these
        caches now: what `fits` asks of one sequence, for each."""
        if self.base.training or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return False
        config = self.config
        if (config.output_hidden_states or config.output_attentions
                or getattr(config, "output_router_logits", False)):
            return False
        for cache in caches:
            if not hasattr(cache, "get_seq_length") or not hasattr(cache, "update"):
                return False
            past = cache.get_seq_length()
            if past == 0 or (self.max_kv is not None and past + 1 > self.max_kv):
                return False
        if any(m._forward_hooks or m._forward_pre_hooks for m in self.modules):
            return False
        from torch.nn.modules import module as torch_module
        return not (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)

    def run_batch(self, input_ids, positions, caches):
        """One decode step of B sequences, each on its own cache (continuous
        batching, colibri.batching): input_ids [B] the new tokens, positions
        [B] each sequence's cached length, caches the B transformers caches.
        The projections, norms and feed-forward layers run once on B rows
        (each weight read once for all); rope is per row at its own
        position, and each sequence's attention runs over its own cache.
        At B = 1 these are run()'s calls, so the same bits. Returns the final
        norm's output [B, d], or None, with no cache touched, where the step
        does not take this model's dtypes."""
        base, B = self.base, len(caches)
        x = base.embed_tokens(input_ids.view(B, 1))
        if x.dtype != torch.float32:
            return None
        position_embeddings = base.rotary_emb(x, positions.view(B, 1))
        if self.standard or self.latent:
            cos, sin = position_embeddings
            if cos.dtype != torch.float32 or any(width != cos.shape[-1] for width in self.latent):
                return None
            cos, sin = cos.contiguous(), sin.contiguous()
            width = cos.shape[-1]
            row_bytes = width * cos.element_size()
        x = x.reshape(B, -1)
        norm = self.norm
        for b in self.blocks:
            h = torch.empty(B, b.d)
            _ok(norm(x.data_ptr(), b.norm1.weight.data_ptr(), B, b.d, b.norm1.variance_epsilon, h.data_ptr()),
                "colibri_rms_norm")
            if b.mla is not None or b.own_attention is not None:
                out = torch.empty(B, b.d)
                for i in range(B):
                    if b.mla is not None:
                        o = b.mla.run(self, h[i:i + 1].data_ptr(), cos.data_ptr() + i * row_bytes,
                                      sin.data_ptr() + i * row_bytes, caches[i])
                    else:
                        own = position_embeddings  # DeepSeek-V2's complex rotation, or (cos, sin)
                        own = tuple(t[i:i + 1] for t in own) if isinstance(own, tuple) else own[i:i + 1]
                        o = b.own_attention(h[i:i + 1].view(1, 1, -1), attention_mask=None, cache=caches[i],
                                            position_embeddings=own)[0]
                    out[i].copy_(o.reshape(-1))
                x = x + out
            else:
                x = x + self._attention_rows(b, h, cos, sin, width, caches)
            x = x + self._feed_forward_rows(b, x)
        self.batch_steps += 1
        return base.norm(x.view(B, 1, -1)).view(B, -1)

    def _attention_rows(self, b, h, cos, sin, width, caches):
        """A standard block's attention of B normed rows h, each sequence
        over its own cache; returns the o projection's output [B, d]."""
        B, linear = h.shape[0], self.linear
        H, Hkv, D, Dv = b.H, b.Hkv, b.D, b.Dv
        q, k, v = torch.empty(B, H * D), torch.empty(B, Hkv * D), torch.empty(B, Hkv * Dv)
        for proj, out in ((b.q, q), (b.k, k), (b.v, v)):
            _ok(linear(proj._handle, B, h.data_ptr(), out.data_ptr()), "colibri_linear_forward")
        if b.qk_norms is not None:
            q_norm, (q_rows, q_dim), k_norm, (k_rows, k_dim) = b.qk_norms
            q_in, k_in = torch.empty_like(q), torch.empty_like(k)
            _ok(self.norm(q.data_ptr(), q_norm.weight.data_ptr(), B * q_rows, q_dim, q_norm.variance_epsilon,
                          q_in.data_ptr()), "colibri_rms_norm")
            _ok(self.norm(k.data_ptr(), k_norm.weight.data_ptr(), B * k_rows, k_dim, k_norm.variance_epsilon,
                          k_in.data_ptr()), "colibri_rms_norm")
        else:
            q_in, k_in = q, k
        q_roped, k_roped = torch.empty(B, H, 1, D), torch.empty(B, Hkv, 1, D)
        for template, heads, src, dst in ((b.rope_q, H, q_in, q_roped), (b.rope_k, Hkv, k_in, k_roped)):
            r = L.RopeDesc.from_buffer_copy(template)
            r.batch = B
            r.x, r.out = src.data_ptr(), dst.data_ptr()
            r.x_stride[:] = (heads * D, D, 0)
            r.out_stride[:] = (heads * D, D, 0)
            r.cos, r.sin = cos.data_ptr(), sin.data_ptr()
            r.table_stride[:] = (width, 0)
            if self.partial:
                r.rotary_dim = width
            _ok(self.rope(r), "colibri_rope")
        attn_out = torch.empty(B, 1, H, Dv)
        a = L.AttentionDesc.from_buffer_copy(b.attn)
        for i, cache in enumerate(caches):
            keys, values = cache.update(k_roped[i:i + 1], v[i:i + 1].view(1, 1, Hkv, Dv).transpose(1, 2), b.index)
            a.q, a.out = q_roped[i].data_ptr(), attn_out[i].data_ptr()
            a.kv_len = keys.shape[2]
            a.k, a.v = keys.data_ptr(), values.data_ptr()
            a.k_stride[:] = leading_strides(keys, 3)
            a.v_stride[:] = leading_strides(values, 3)
            _ok(self.attention(a), "colibri_attention")
        o = torch.empty(B, b.d)
        _ok(linear(b.o._handle, B, attn_out.data_ptr(), o.data_ptr()), "colibri_linear_forward")
        return o

    def _feed_forward_rows(self, b, x):
        """The block's norm and feed-forward of B rows x; returns [B, d]."""
        B = x.shape[0]
        h = torch.empty(B, b.d)
        _ok(self.norm(x.data_ptr(), b.norm2.weight.data_ptr(), B, b.d, b.norm2.variance_epsilon, h.data_ptr()),
            "colibri_rms_norm")
        if b.moe is None:
            out = b.ffn(h.view(B, 1, -1))
            return (out[0] if isinstance(out, tuple) else out).reshape(B, -1)
        model, layer = b.moe
        out = torch.empty(B, b.d)
        model._infer_pointers(layer, B, 0, h.data_ptr(), None, None, out.data_ptr())
        return all_reduce_share(out, b.routed)

    def _feed_forward(self, b, x):
        """The block's norm and feed-forward of x into b.ffn_result."""
        h = b.h.data_ptr()
        _ok(self.norm(x.data_ptr(), b.norm2.weight.data_ptr(), 1, b.d, b.norm2.variance_epsilon, h),
            "colibri_rms_norm")
        if b.moe is not None:
            model, layer = b.moe
            model._infer_pointers(layer, 1, 0, h, None, None, b.ffn_out.data_ptr())
            b.ffn_result = all_reduce_share(b.ffn_out, b.routed)
        else:
            out = b.ffn(b.h.view(1, 1, -1))
            b.ffn_result = (out[0] if isinstance(out, tuple) else out).reshape(1, -1)


def _rope_q_and_k(rope, rope_q, rope_k, k, k_out, cos_p, sin_p, rotary_dim=None):
    """The query's rope (its descriptor's buffers fixed) and the key's (k
    into k_out, fresh each step) at this position's cos / sin."""
    rope_k.x = k.data_ptr()
    rope_k.out = k_out.data_ptr()
    for desc in (rope_q, rope_k):
        desc.cos, desc.sin = cos_p, sin_p
        desc.table_stride[:] = (0, 0)
        if rotary_dim is not None:
            desc.rotary_dim = rotary_dim
        _ok(rope(desc), "colibri_rope")


def all_reduce_share(out, routed):
    """Adds the other ranks' shares into `out` where the block is expert
    parallel (its routed tuple, loader._route_in_colibri's, carries the
    torch.distributed group as a seventh field); returns `out`."""
    if routed is not None and len(routed) > 6:
        import torch.distributed as dist

        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=routed[6])
    return out


def _ok(status, name):
    if status:
        L.check(status, name)


def install(model):
    """Gives `model` (a from_pretrained model with Colibri's attention, rope,
    norms and linears) the direct decode step (module docstring). Returns
    True, or False when a part of the model is not one the step knows and
    the model is left as it was."""
    config = model.config
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    own_attention = config.model_type in _OWN_ATTENTION
    if (config.model_type not in _FAMILIES and not own_attention) or not layers or not hasattr(base, "rotary_emb"):
        return False
    layers = layers[: config.num_hidden_layers]
    if not str(getattr(config, "_attn_implementation", "")).startswith("colibri-"):
        return False
    if getattr(config, "clip_qkv", None) is not None:
        return False
    attn0 = layers[0].self_attn
    modeling = __import__(type(attn0).__module__, fromlist=["apply_rotary_pos_emb"])
    style = getattr(getattr(modeling, "apply_rotary_pos_emb", None), "_colibri_style", None)
    if own_attention:
        style = None
    elif style is None or style != colibri_rope._STYLES.get(config.model_type):
        return False
    if not isinstance(getattr(base, "norm", None), cnn.RMSNorm):
        return False
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if own_attention:
            if attn is None or "_colibri_absorbed" not in attn.__dict__:
                return False
        elif attn is None or not all(isinstance(getattr(attn, n, None), cnn.Linear)
                                   for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return False
        if not all(isinstance(getattr(layer, n, None), cnn.RMSNorm)
                   for n in ("input_layernorm", "post_attention_layernorm")):
            return False
        for n in ("q_norm", "k_norm"):
            norm = getattr(attn, n, None)
            if norm is not None and getattr(attn, "use_qk_norm", True) and not isinstance(norm, cnn.RMSNorm):
                return False
        if not any(isinstance(getattr(layer, n, None), torch.nn.Module) for n in _FFN_NAMES):
            return False
    threads = attn0.__dict__.get("_colibri_threads", 0)
    original = base.forward
    step = _Step(model, base, original, style, threads)

    def forward(input_ids=None, attention_mask=None, position_ids=None, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        rest = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")}
        if not args and step.fits(input_ids, attention_mask, cache, rest) and step.lock.acquire(blocking=False):
            try:
                out = step.run(input_ids, position_ids, cache)
            finally:
                step.lock.release()
            if out is not None:
                return out
        out = original(input_ids, attention_mask, position_ids, *args, **kwargs)
        if step.output is None and hasattr(out, "last_hidden_state"):
            fields = set(getattr(out, "__dataclass_fields__", {}))
            field = "past_key_values" if "past_key_values" in fields else "cache" if "cache" in fields else None
            if field is not None:
                step.output = (type(out), field)
        return out

    forward.__wrapped__ = original
    base.forward = forward
    base.__dict__["_colibri_decode_step"] = step
    return True
