"""Colibri as a transformers 5 experts implementation.

    import colibri.experts_backend as cb
    cb.register()                                  # once per process: "colibri"
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="colibri")
    # or, on a loaded model:  cb.set_experts_implementation(model)

transformers 5 dispatches every fused experts module (classes decorated with
use_experts_implementation: MixtralExperts, Qwen3MoeExperts, ...) through
its ExpertsInterface by the config's _experts_implementation, the way it
chooses "grouped_mm" or "batched_mm". register() adds "colibri" there. No
module is patched: the model's routers, shared experts and everything else
stay PyTorch's, and only the experts' computation, given the router's
top_k_index and top_k_weights, runs in Colibri.

Each experts module gets its own Colibri copy of its weights the first time
it is called (and a new one if its weight tensors are replaced or modified
in place), so the first forward pass is slower. The PyTorch weights stay (the
fallback needs them): use colibri.torch.accelerate() instead when memory is
tight (it releases them and shares one thread pool among all layers).

Falls back to the module's eager forward, exactly as transformers computes
it, for: tensors not on the CPU, autograd (grad mode on and an input or
weight that requires grad), training mode, and any module that is not
exactly the engine's SwiGLU (a custom _apply_gate, a clamp, biases, a
transposed or interleaved layout, another activation: see
colibri.torch.recognise), except transformers' GptOssExperts, whose clamped
SwiGLU, biases and interleaved layout Colibri computes; status(model) says which modules run where and
why. Expert ids >= the module's number of experts mean "no expert" (expert
parallelism's sentinel), as in transformers.

transformers 5.0 to 5.5 check experts_implementation against a fixed list
("eager", "grouped_mm", "batched_mm", and from 5.5 "deepgemm"), so
from_pretrained(..., experts_implementation="colibri") raises there.
set_experts_implementation(model) then sets the configs' implementation
directly, which those versions' dispatch honours; register() reports which
case applies (accepts_name)."""

import sys
import warnings

import torch

from .model import Model
from .torch import ColibriExperts, _colibri_dtype, _fused_module_problem, _gpt_oss_experts_spec, _needs_pytorch

__all__ = ["register", "set_experts_implementation", "status", "experts_forward", "NAME"]

NAME = "colibri"
_options = {"threads": 0, "dtype": None, "bf16_compute": False, "exact_prefill": False}
_CACHE = "_colibri_backend"  # per module: (weights key, ColibriExperts or None, reason)


def _transformers_moe():
    try:
        from transformers.integrations import moe
    except ImportError as e:
        raise ImportError("colibri.experts_backend needs transformers 5 (transformers.integrations.moe): %s" % e) \
            from None
    if not hasattr(moe, "ExpertsInterface"):
        raise ImportError("this transformers (%s) has no ExpertsInterface: experts implementations need transformers "
                          ">= 5; use colibri.torch.accelerate(model)" % _version())
    return moe


def _version():
    t = sys.modules.get("transformers")
    return getattr(t, "__version__", "?")


def accepts_name(name=NAME):
    """Whether this transformers' name check accepts a registered
    implementation name (5.6 and later), i.e. whether
    from_pretrained(..., experts_implementation=name) works."""
    from transformers import PreTrainedModel

    probe = type("_Probe", (), {"_grouped_mm_can_dispatch": lambda self: None})()
    try:
        return PreTrainedModel.get_correct_experts_implementation(probe, name) == name
    except ValueError:
        return False


def register(name=NAME, *, threads=0, dtype=None, bf16_compute=False, exact_prefill=False):
    """Registers Colibri in transformers' ExpertsInterface under `name`, with
    the options every module's Colibri copy is built with (threads per
    module, 0 = one per core; dtype None = the weights' own; the precision
    options of colibri.Model). Returns whether from_pretrained's name check
    accepts it (see accepts_name; if not, use set_experts_implementation)."""
    moe = _transformers_moe()
    _options.update(threads=threads, dtype=dtype, bf16_compute=bf16_compute, exact_prefill=exact_prefill)
    moe.ExpertsInterface.register(name, experts_forward)
    return accepts_name(name)


def set_experts_implementation(model, name=NAME):
    """Selects `name` for every experts module of a loaded model: through
    model.set_experts_implementation where this transformers accepts the name,
    else by setting each config's _experts_implementation (transformers 5.0
    to 5.5). Registers Colibri first if needed."""
    moe = _transformers_moe()
    if name not in moe.ALL_EXPERTS_FUNCTIONS:
        register(name)
    if accepts_name(name) and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(name)
        return
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    for cfg in configs.values():
        if hasattr(cfg, "_experts_implementation_internal"):
            cfg._experts_implementation_internal = name
        else:
            cfg._experts_implementation = name


def _eager(module):
    """The module class's own (eager) forward, under transformers' dispatch."""
    fwd = type(module).forward
    return getattr(fwd, "__wrapped__", fwd).__get__(module)


def _weights_key(module):
    key = ()
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor):
            key += (t.data_ptr(), t._version, tuple(t.shape), t.dtype)
    return key


def _gpt_oss_colibri(spec):
    """GptOssExperts (transformers' class, recognised by colibri.torch): the
    clamped SwiGLU and the biases in Colibri."""
    model = Model.from_arrays([spec.layer_dict(shared_in_colibri=False)],
                              dtype=_colibri_dtype(_options["dtype"], spec.weight_like), threads=_options["threads"],
                              bf16_compute=_options["bf16_compute"], exact_prefill=_options["exact_prefill"],
                              **spec.model_options())
    return ColibriExperts._view(model, 0)


def _colibri_for(module):
    """(ColibriExperts or None, reason) for a module, built on first use."""
    key = _weights_key(module) if isinstance(getattr(module, "gate_up_proj", None), torch.Tensor) else None
    cached = module.__dict__.get(_CACHE)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    if cached is not None and cached[1] is not None:
        cached[1].close()
    gpt_oss = _gpt_oss_experts_spec(module) if type(module).__name__ == "GptOssExperts" else None
    why = gpt_oss if isinstance(gpt_oss, str) else None if gpt_oss is not None else _fused_module_problem(module)
    experts = None
    if gpt_oss is not None and why is None:
        experts = _gpt_oss_colibri(gpt_oss)
    elif why is None:
        experts = ColibriExperts(gate_up_proj=module.gate_up_proj.detach(), down_proj=module.down_proj.detach(),
                                 dtype=_options["dtype"], threads=_options["threads"],
                                 bf16_compute=_options["bf16_compute"], exact_prefill=_options["exact_prefill"])
    else:
        warnings.warn("colibri experts backend: %s runs its eager forward: %s" % (type(module).__name__, why),
                      stacklevel=3)
    module.__dict__[_CACHE] = (key, experts, why)
    return experts, why


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The "colibri" experts implementation (ExpertsInterface signature)."""
    wants_grad = torch.is_grad_enabled() and (
        top_k_weights.requires_grad or any(p.requires_grad for p in (self.gate_up_proj, self.down_proj)
                                           if isinstance(p, torch.Tensor)))
    if wants_grad or _needs_pytorch(self, hidden_states, (), {}) or top_k_index.device.type != "cpu":
        return _eager(self)(hidden_states, top_k_index, top_k_weights)
    experts, _ = _colibri_for(self)
    if experts is None:
        return _eager(self)(hidden_states, top_k_index, top_k_weights)
    E = experts.n_experts
    ids = top_k_index.reshape(hidden_states.shape[0], -1)
    ids = torch.where(ids < E, ids, torch.full_like(ids, -1)).to(torch.int32)
    return experts(hidden_states, ids, top_k_weights.reshape(ids.shape))


def status(model):
    """[(path, "colibri" | "eager" | "not yet called", reason)] for every
    experts module transformers dispatches."""
    out = []
    for path, m in model.named_modules():
        # Flags such as has_gate came in 5.x releases after 5.0: look for the
        # fused weights and the decorator's wrapped forward instead.
        if not isinstance(getattr(m, "down_proj", None), torch.Tensor) or \
                not hasattr(type(m).forward, "__wrapped__"):
            continue
        cached = m.__dict__.get(_CACHE)
        if cached is None:
            out.append((path, "not yet called", ""))
        elif cached[1] is None:
            out.append((path, "eager", cached[2]))
        else:
            out.append((path, "colibri", ""))
    return out
