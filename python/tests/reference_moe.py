"""Small reference MoE blocks that follow each family's published Hugging
Face forward exactly (transformers' modeling_mixtral / qwen2_moe / qwen3_moe
/ olmoe, DeepSeek-V2/V3's modeling_deepseek), written here so the tests need
no transformers. Attribute names match the originals, which is what
colibri.torch.accelerate recognises.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


def init_(module, gen, gate_scale=1.0):
    """Random weights of realistic scale: N(0, 1/in_features) for every
    matrix (so activations keep unit scale), the routers scaled by
    gate_scale to make routing decisive."""
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            fan_in = p.shape[-1]
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
        elif "bias" in name:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    for name, m in module.named_modules():
        if name.endswith("gate") and hasattr(m, "weight") and gate_scale != 1.0:
            with torch.no_grad():
                m.weight.mul_(gate_scale)
    return module


# ------------------------------------------------------------------- experts


class MixtralBlockSparseTop2MLP(nn.Module):
    def __init__(self, D, F_):
        super().__init__()
        self.w1 = nn.Linear(D, F_, bias=False)
        self.w2 = nn.Linear(F_, D, bias=False)
        self.w3 = nn.Linear(D, F_, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        current_hidden_states = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        return self.w2(current_hidden_states)


class MLP(nn.Module):
    """Qwen2MoeMLP / Qwen3MoeMLP / OlmoeMLP / DeepseekV2MLP."""

    def __init__(self, D, F_):
        super().__init__()
        self.gate_proj = nn.Linear(D, F_, bias=False)
        self.up_proj = nn.Linear(D, F_, bias=False)
        self.down_proj = nn.Linear(F_, D, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _hf_expert_loop(experts, hidden_states, selected_experts, routing_weights, num_experts):
    """The expert loop of MixtralSparseMoeBlock / Qwen2MoeSparseMoeBlock."""
    n, hidden_dim = hidden_states.shape
    final_hidden_states = torch.zeros((n, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device)
    expert_mask = F.one_hot(selected_experts, num_classes=num_experts).permute(2, 1, 0)
    for expert_idx in range(num_experts):
        expert_layer = experts[expert_idx]
        idx, top_x = torch.where(expert_mask[expert_idx])
        current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
        current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
        final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
    return final_hidden_states


# -------------------------------------------------------------------- Mixtral


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, D, F_, E, k):
        super().__init__()
        self.hidden_dim, self.ffn_dim, self.num_experts, self.top_k = D, F_, E, k
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([MixtralBlockSparseTop2MLP(D, F_) for _ in range(E)])
        self.jitter_noise = 0.0

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = _hf_expert_loop(self.experts, hidden_states, selected_experts, routing_weights, self.num_experts)
        return final.reshape(batch_size, sequence_length, hidden_dim), router_logits


# ---------------------------------------------------------- Qwen2/Qwen3/OLMoE


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self, D, F_, E, k, shared_F, norm_topk_prob=False):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = E, k, norm_topk_prob
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([MLP(D, F_) for _ in range(E)])
        self.shared_expert = MLP(D, shared_F)
        self.shared_expert_gate = nn.Linear(D, 1, bias=False)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = _hf_expert_loop(self.experts, hidden_states, selected_experts, routing_weights, self.num_experts)
        shared_expert_output = self.shared_expert(hidden_states)
        shared_expert_output = torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared_expert_output
        final = final + shared_expert_output
        return final.reshape(batch_size, sequence_length, hidden_dim), router_logits


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, D, F_, E, k, norm_topk_prob=True):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = E, k, norm_topk_prob
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList([MLP(D, F_) for _ in range(E)])

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = _hf_expert_loop(self.experts, hidden_states, selected_experts, routing_weights, self.num_experts)
        return final.reshape(batch_size, sequence_length, hidden_dim), router_logits


class OlmoeSparseMoeBlock(Qwen3MoeSparseMoeBlock):
    def __init__(self, D, F_, E, k, norm_topk_prob=False):
        super().__init__(D, F_, E, k, norm_topk_prob)


# ------------------------------------------------------------------ DeepSeek


class MoEGate(nn.Module):
    """modeling_deepseek's MoEGate: V2 (softmax; greedy or
    group_limited_greedy) and V3 (sigmoid; noaux_tc with
    e_score_correction_bias). Evaluation mode only (no aux loss)."""

    def __init__(self, D, E, k, version, n_group=1, topk_group=1, norm_topk_prob=False,
                 routed_scaling_factor=1.0, topk_method=None):
        super().__init__()
        self.top_k = k
        self.n_routed_experts = E
        self.routed_scaling_factor = routed_scaling_factor
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.gating_dim = D
        self.weight = nn.Parameter(torch.empty((E, D)))
        if version == 2:
            self.scoring_func = "softmax"
            self.topk_method = topk_method or ("group_limited_greedy" if n_group > 1 else "greedy")
        else:
            self.scoring_func = "sigmoid"
            self.topk_method = "noaux_tc"
            self.e_score_correction_bias = nn.Parameter(torch.empty((E,)))

    def forward(self, hidden_states):
        bsz, seq_len, h = hidden_states.shape
        hidden_states = hidden_states.view(-1, h)
        if self.scoring_func == "softmax":
            logits = F.linear(hidden_states, self.weight, None)
            scores = logits.softmax(dim=-1, dtype=torch.float32)
        else:
            logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32), None)
            scores = logits.sigmoid()
        if self.topk_method == "greedy":
            topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        elif self.topk_method == "group_limited_greedy":
            group_scores = scores.view(bsz * seq_len, self.n_group, -1).max(dim=-1).values
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = (group_mask.unsqueeze(-1)
                          .expand(bsz * seq_len, self.n_group, self.n_routed_experts // self.n_group)
                          .reshape(bsz * seq_len, -1))
            tmp_scores = scores.masked_fill(~score_mask.bool(), 0.0)
            topk_weight, topk_idx = torch.topk(tmp_scores, k=self.top_k, dim=-1, sorted=False)
        elif self.topk_method == "noaux_tc":
            scores_for_choice = scores.view(bsz * seq_len, -1) + self.e_score_correction_bias.unsqueeze(0)
            group_scores = scores_for_choice.view(bsz * seq_len, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = (group_mask.unsqueeze(-1)
                          .expand(bsz * seq_len, self.n_group, self.n_routed_experts // self.n_group)
                          .reshape(bsz * seq_len, -1))
            tmp_scores = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
            _, topk_idx = torch.topk(tmp_scores, k=self.top_k, dim=-1, sorted=False)
            topk_weight = scores.gather(1, topk_idx)
        if self.scoring_func == "softmax":  # V2
            if self.top_k > 1 and self.norm_topk_prob:
                denominator = topk_weight.sum(dim=-1, keepdim=True) + 1e-20
                topk_weight = topk_weight / denominator
            else:
                topk_weight = topk_weight * self.routed_scaling_factor
            return topk_idx, topk_weight, None
        if self.top_k > 1 and self.norm_topk_prob:  # V3
            denominator = topk_weight.sum(dim=-1, keepdim=True) + 1e-20
            topk_weight = topk_weight / denominator
        topk_weight = topk_weight * self.routed_scaling_factor
        return topk_idx, topk_weight


class DeepseekMoE(nn.Module):
    """DeepseekV2MoE / DeepseekV3MoE in evaluation mode."""

    def __init__(self, D, F_, E, k, version, n_shared_experts=1, **gate_kw):
        super().__init__()
        self.num_experts_per_tok = k
        self.experts = nn.ModuleList([MLP(D, F_) for _ in range(E)])
        self.gate = MoEGate(D, E, k, version, **gate_kw)
        self.n_shared_experts = n_shared_experts
        if n_shared_experts is not None:
            self.shared_experts = MLP(D, F_ * n_shared_experts)

    def forward(self, hidden_states):
        identity = hidden_states
        orig_shape = hidden_states.shape
        topk_idx, topk_weight = self.gate(hidden_states)[:2]
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        y = self.moe_infer(hidden_states, topk_idx, topk_weight).view(*orig_shape)
        if self.n_shared_experts is not None:
            y = y + self.shared_experts(identity)
        return y

    @torch.no_grad()
    def moe_infer(self, x, topk_ids, topk_weight):
        cnts = topk_ids.new_zeros((topk_ids.shape[0], len(self.experts)))
        cnts.scatter_(1, topk_ids, 1)
        tokens_per_expert = cnts.sum(dim=0)
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        tokens_per_expert = tokens_per_expert.cpu().numpy()
        outputs = []
        start_idx = 0
        for i, num_tokens in enumerate(tokens_per_expert):
            end_idx = start_idx + num_tokens
            if num_tokens == 0:
                continue
            expert = self.experts[i]
            tokens_for_this_expert = sorted_tokens[start_idx:end_idx]
            outputs.append(expert(tokens_for_this_expert))
            start_idx = end_idx
        outs = torch.cat(outputs, dim=0) if len(outputs) else sorted_tokens.new_empty(0)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        final_out = (new_x.view(*topk_ids.shape, -1).type(topk_weight.dtype).mul_(topk_weight.unsqueeze(dim=-1))
                     .sum(dim=1).type(new_x.dtype))
        return final_out


# ------------------------------------------------------- fused expert layout


class TopKRouter(nn.Module):
    """transformers' (v5) MixtralTopKRouter: logits, softmax, top-k, renormalise."""

    def __init__(self, D, E, k):
        super().__init__()
        self.top_k, self.num_experts, self.hidden_dim = k, E, D
        self.weight = nn.Parameter(torch.empty(E, D))

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        router_probs = F.softmax(router_logits.float(), dim=-1)
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
        router_scores = router_top_value.to(router_logits.dtype)
        return router_logits, router_scores, router_indices


class FusedExperts(nn.Module):
    """transformers' (v5) fused experts: gate_up_proj [E, 2F, D] (gate rows
    first), down_proj [E, D, F]; forward(hidden, top_k_index, top_k_weights)."""

    def __init__(self, D, F_, E):
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = E, D, F_
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * F_, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, F_))
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts)
            expert_mask = expert_mask.permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[token_idx]
            gate, up = F.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current_hidden_states = self.act_fn(gate) * up
            current_hidden_states = F.linear(current_hidden_states, self.down_proj[expert_idx])
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
        return final_hidden_states


class FusedSparseMoeBlock(nn.Module):
    """transformers' (v5) MixtralSparseMoeBlock: router module + fused experts;
    returns the hidden states only."""

    def __init__(self, D, F_, E, k):
        super().__init__()
        self.top_k = k
        self.gate = TopKRouter(D, E, k)
        self.experts = FusedExperts(D, F_, E)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        _, top_k_weights, top_k_index = self.gate(hidden_states)
        hidden_states = self.experts(hidden_states, top_k_index, top_k_weights)
        return hidden_states.reshape(batch_size, sequence_length, hidden_dim)


# --------------------------------------------------------------- tiny models


class DecoderLayer(nn.Module):
    def __init__(self, D, moe, attr):
        super().__init__()
        self.attr = attr
        self.input_layernorm = nn.LayerNorm(D)
        setattr(self, attr, moe)

    def forward(self, h):
        out = getattr(self, self.attr)(self.input_layernorm(h))
        if isinstance(out, tuple):
            out = out[0]
        return h + out


class TinyModel(nn.Module):
    """model.layers[i].mlp (or .block_sparse_moe for Mixtral)."""

    def __init__(self, D, make_block, n_layers=2, attr="mlp"):
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(D, make_block(), attr) for _ in range(n_layers)])

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return h


FAMILIES = ["mixtral", "qwen2_moe", "qwen2_moe_norm", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v2_group",
            "deepseek_v2_norm", "deepseek_v3", "deepseek_v3_nonorm", "fused"]


def make_block(family, D=64, F_=48, E=8, k=2):
    """A reference block of `family` (see FAMILIES) with the family's
    distinctive options."""
    if family == "mixtral":
        return MixtralSparseMoeBlock(D, F_, E, k)
    if family == "qwen2_moe":
        return Qwen2MoeSparseMoeBlock(D, F_, E, k, shared_F=2 * F_ + 16, norm_topk_prob=False)
    if family == "qwen2_moe_norm":
        return Qwen2MoeSparseMoeBlock(D, F_, E, k, shared_F=F_, norm_topk_prob=True)
    if family == "qwen3_moe":
        return Qwen3MoeSparseMoeBlock(D, F_, E, k, norm_topk_prob=True)
    if family == "olmoe":
        return OlmoeSparseMoeBlock(D, F_, E, k, norm_topk_prob=False)
    if family == "deepseek_v2":
        return DeepseekMoE(D, F_, E, k, 2, n_shared_experts=2, routed_scaling_factor=1.5)
    if family == "deepseek_v2_group":
        return DeepseekMoE(D, F_, E, k, 2, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.0)
    if family == "deepseek_v2_norm":
        return DeepseekMoE(D, F_, E, k, 2, n_shared_experts=None, norm_topk_prob=True)
    if family == "deepseek_v3":
        return DeepseekMoE(D, F_, E, k, 3, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
                           routed_scaling_factor=2.5)
    if family == "deepseek_v3_nonorm":
        return DeepseekMoE(D, F_, E, k, 3, n_shared_experts=1, n_group=2, topk_group=1, norm_topk_prob=False,
                           routed_scaling_factor=1.0)
    if family == "fused":
        return FusedSparseMoeBlock(D, F_, E, k)
    raise ValueError(family)


EXPECTED_FAMILY = {"mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "qwen2_moe_norm": "qwen2_moe",
                   "qwen3_moe": "qwen3_moe", "olmoe": "olmoe", "deepseek_v2": "deepseek_v2",
                   "deepseek_v2_group": "deepseek_v2", "deepseek_v2_norm": "deepseek_v2",
                   "deepseek_v3": "deepseek_v3", "deepseek_v3_nonorm": "deepseek_v3", "fused": "mixtral"}


def make_model(family, seed=0, n_layers=2, D=64, F_=48, E=8, k=2, gate_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    attr = "block_sparse_moe" if family == "mixtral" else "mlp"
    model = TinyModel(D, lambda: make_block(family, D, F_, E, k), n_layers=n_layers, attr=attr)
    init_(model, gen, gate_scale=gate_scale)
    for m in model.modules():
        if isinstance(m, MoEGate) and hasattr(m, "e_score_correction_bias"):
            with torch.no_grad():
                m.e_score_correction_bias.copy_(torch.rand(m.e_score_correction_bias.shape, generator=gen) * 0.2)
    return model.eval()


def blocks_of(model):
    return [getattr(layer, layer.attr) for layer in model.layers]


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def reference_selection(block, x):
    """The expert set each token of x is routed to by `block` (any block of
    this module), computed in float64: (ids [N, k] sorted per row, margin
    [N]). margin is, per token, the smallest gap between the last chosen and
    the first rejected score, over the expert choice and (group-limited
    DeepSeek rules) the group choice; where it is tiny (say < 1e-4) float32
    arithmetic may legitimately choose otherwise."""
    gate = block.gate
    D = gate.weight.shape[1]
    x = x.detach().double().reshape(-1, D)
    logits = x @ gate.weight.detach().double().T
    N, E = logits.shape
    k = gate.top_k if hasattr(gate, "top_k") else block.top_k
    margins = []
    deepseek = isinstance(gate, MoEGate)
    if deepseek and gate.scoring_func == "sigmoid":
        c = torch.sigmoid(logits) + gate.e_score_correction_bias.detach().double()
    else:
        c = torch.softmax(logits, -1)
    if deepseek and gate.topk_method != "greedy" and gate.n_group > 1:
        G, kg = gate.n_group, gate.topk_group
        grouped = c.view(N, G, -1)
        gs = grouped.topk(2, -1)[0].sum(-1) if gate.scoring_func == "sigmoid" else grouped.max(-1).values
        if kg < G:
            gsorted = gs.sort(-1, descending=True).values
            margins.append(gsorted[:, kg - 1] - gsorted[:, kg])
        keep = torch.zeros_like(gs).scatter_(1, gs.topk(kg, -1)[1], 1.0)
        mask = keep.unsqueeze(-1).expand(N, G, E // G).reshape(N, E).bool()
        c = c.masked_fill(~mask, float("-inf"))
    if k < E:
        cs = c.sort(-1, descending=True).values
        margins.append(cs[:, k - 1] - cs[:, k])
    ids = c.topk(k, -1)[1]
    margin = torch.stack(margins).min(0).values if margins else torch.full((N,), float("inf"), dtype=torch.float64)
    return ids.sort(-1).values, margin
