"""What the pipeline needs to know about a Hugging Face causal LM's structure, through its public API only.

Building on the meta device (with the buffers a checkpoint does not hold computed), finding the decoder layers,
which weights are tied. Every strategy, the weight loader, the checkpointer and MODEL_DOWNLOAD's check use these,
so a model whose structure they cannot read fails here, with its class named, and nowhere else.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pipeline.errors import UserError

TESTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mixtral", "qwen3_moe",
                      "gemma4_text", "llama4_text", "qwen3_5_text", "qwen3_5_moe_text", "deepseek_v3", "glm4_moe",
                      "olmo3", "ministral3")
"""The model_type of every family the suite trains end to end (prep/tiny.FAMILIES; README, "Model families")."""


def untested_family(config) -> str:
    """Why the suite does not vouch for this model's family ("" when it is one it trains)."""
    model_type = getattr(config, "model_type", "")
    if model_type in TESTED_MODEL_TYPES:
        return ""
    return f"model_type {model_type!r} is not one of the families the suite trains ({', '.join(TESTED_MODEL_TYPES)})"


def cannot_train(config) -> str:
    """Why the trainer refuses this config's causal LM ("" when it does not): every rule below, first match."""
    return own_loss(config) or attends_ahead(config)


def causal_lm_source(config, member: str) -> tuple[type | None, str]:
    """The config's causal-LM class and the source of one of its members; (None, "") when it has no causal LM
    (from_config says so in its own words), "" when the source cannot be read: the rules reading it refuse nothing."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ImportError):
        return None, ""
    try:
        return model_class, inspect.getsource(getattr(model_class, member))
    except (OSError, TypeError):
        return model_class, ""


def attends_ahead(config) -> str:
    """Why this config's causal LM attends to later tokens ("" when it does not): the encoder families' causal-LM
    classes (BERT, RoBERTa, ELECTRA, RemBERT and the others that warn "as a standalone, add is_decoder=True") build
    a two-way mask unless config.is_decoder, and only log that warning. Trained on the next token, such a model
    reads it: ELECTRA and RemBERT trained with exit 0 (bench/all_families.py measures the leak over transformers'
    whole registry). Read from the class's own __init__, where transformers checks the flag."""
    model_class, source = causal_lm_source(config, "__init__")
    if "not config.is_decoder" not in source or getattr(config, "is_decoder", False):
        return ""
    return (f"{model_class.__name__} attends to later tokens unless its config sets is_decoder (false here), so "
            "next-token training would teach it to read the answer; set \"is_decoder\": true in its config.json")


def own_loss(config) -> str:
    """Why the trainer cannot train this config's causal LM ("" when it can): its forward does not compute
    transformers' causal-LM loss (`self.loss_function`: labels shifted by one, summed over
    num_items_in_batch), which the trainer's loss, its gradients and their sum over the ranks rest on
    (pipeline/objectives/causal_lm.py). BartForCausalLM and the other encoder-decoder families' decoders take the mean
    over unshifted labels: they trained to copy their input, with a loss times the world size, exit 0. Read from the
    forward's source, the property itself: bench/all_families.py checks it over transformers' whole registry."""
    model_class, source = causal_lm_source(config, "forward")
    if not source or "loss_function(" in source:
        return ""
    return (f"{model_class.__name__}'s forward does not compute transformers' causal-LM loss (loss_function: labels "
            "shifted by one, summed over num_items_in_batch), so the trainer would train it wrong; fine-tune a "
            "decoder-only causal LM instead")


ATTENTION_SUPPORT = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn",
                     "flash_attention_2": "_supports_flash_attn"}
"""transformers' class flags saying which attention kernels a family implements (eager: every family)."""


def meta_model(hf_config, dtype: torch.dtype = torch.float32, attn_implementation: str = "auto") -> nn.Module:
    """The model of hf_config on the meta device: its structure, no memory (compute_buffers gives its buffers).
    attn_implementation "auto" leaves the choice to transformers (what from_pretrained gives); a kernel the family
    or this machine refuses is one line naming the ones the family accepts."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # on a copy: transformers sets the kernel (even a refused one) on the config it is given
        if attn_implementation == "auto":
            return AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), dtype=dtype)
        try:
            return AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), dtype=dtype,
                                                    attn_implementation=attn_implementation)
        except (ValueError, ImportError) as exc:
            model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), dtype=dtype)
            why = str(exc).split(". ")[0].strip()
            raise UserError(f"--attn-implementation {attn_implementation}: {type(model).__name__} refuses it ({why});"
                            f" it accepts {', '.join(accepted_attention(model))}") from None


def accepted_attention(model: nn.Module) -> list[str]:
    """The attention kernels the model's family implements, by transformers' own flags (a kernel may still need
    its package installed)."""
    return ["eager", *(name for name, flag in ATTENTION_SUPPORT.items() if getattr(model, flag, False))]


def compute_buffers(model: nn.Module) -> None:
    """Every buffer of a meta-device model as from_pretrained gives it where no file holds it (rotary frequencies, an
    embedding scale, ...), on the CPU, by transformers' own initialisation of the family (`initialize_weights`), not by
    a list of ours: the parameters are marked initialised so it only fills the buffers. Small tensors; the strategies
    copy them into the materialised model (Strategy.restore_buffers), since to_empty leaves buffers uninitialised."""
    for param in model.parameters():
        param._is_hf_initialized = True  # transformers' flag: its init helpers leave these alone
    for name, buf in list(model.named_buffers()):
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        owner.register_buffer(leaf, torch.empty_like(buf, device="cpu"),
                              persistent=leaf not in owner._non_persistent_buffers_set)
    model.initialize_weights()


def layer_configs(config) -> list:
    """The text config as each decoder layer sees it: transformers' per-layer views where layers differ (Gemma 4's
    head sizes: reading such an attribute from the config itself raises), else the config for every layer."""
    text = config.get_text_config()
    if getattr(text, "is_heterogeneous", False):
        return list(text.per_layer_config)
    return [text] * text.num_hidden_layers


def trunk(model: nn.Module) -> nn.Module:
    """The decoder stack without its head (what returns last_hidden_state: `model.model` in every family the suite
    trains), found by structure as the module holding the decoder layers: `model.base_model` is the causal LM itself
    where base_model_prefix names a module it does not have (Llama 4)."""
    layers = decoder_layers(model)
    return next(m for m in model.modules() if any(child is layers for child in m.children()))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks, in order, found by structure: the shallowest ModuleList holding the text config's
    num_hidden_layers modules (`model.model.layers` in every family the suite trains). base_model_prefix is not
    enough: Llama 4's names a module its causal LM does not have, and a multimodal model's text config is nested."""
    n = model.config.get_text_config().num_hidden_layers
    found = [(name.count("."), name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) == n]
    shallowest = [f for f in found if f[0] == min((f[0] for f in found), default=0)]
    if n < 1 or len(shallowest) != 1:
        raise UserError(f"cannot find the {n} decoder layers of {type(model).__name__} to shard (found "
                        f"{len(shallowest)} lists of {n} modules at its shallowest depth: "
                        f"{', '.join(name for _, name, _ in shallowest) or 'none'})")
    return shallowest[0][2]


def tied_keys(model: nn.Module) -> dict[str, str]:
    """{output embedding key: input embedding key} when the model ties them (one tensor under two names), else {}.

    Read from the config and checked on the modules themselves: a config that ties the embeddings while the model
    holds two tensors is an error, never a silently untied (or silently tied) checkpoint.
    """
    if not getattr(model.config, "tie_word_embeddings", False):
        return {}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or head.weight is not embed.weight:
        raise UserError(f"{type(model).__name__}: the config ties the word embeddings but the output embedding is "
                        "a separate tensor")
    names = {id(m): name for name, m in model.named_modules()}
    return {f"{names[id(head)]}.weight": f"{names[id(embed)]}.weight"}


def tied_partners(model: nn.Module) -> dict[str, str]:
    """Both directions of tied_keys: a tied weight is stored in a file under either of its names."""
    pairs = tied_keys(model)
    return {**pairs, **{v: k for k, v in pairs.items()}}


def retie(model: nn.Module) -> None:
    """Tie the LM head to the input embedding again where the config ties them and both are materialised:
    to_empty gives every module its own new tensor, so a meta model materialised unsharded (DDP) or module by
    module (FSDP1's param_init_fn) loses the tie."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head.weight is not embed.weight and not head.weight.is_meta and not embed.weight.is_meta:
        head.weight = embed.weight


def param_counts(model: nn.Module) -> tuple[int, int]:
    """(parameters, parameters that take part in a matrix product per token) of an unwrapped model (a tied weight
    counted once). The second leaves out an input embedding that is only looked up (a tied embedding is also the LM
    head, a 2 x vocab x hidden product per token, so it counts) and, in a mixture of experts, the experts a token
    is not routed to: fused expert weights ([experts, ...], transformers 5's layout) count num_experts_per_tok of
    their experts."""
    total = sum(p.numel() for p in model.parameters())
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    matmul = total if head is not None and head.weight is embed.weight else total - embed.weight.numel()
    return total, matmul - idle_expert_params(model)


def moe_shape(config) -> tuple[int, int]:
    """(routed experts per layer, experts per token) of a mixture of experts' config, under whichever name the family
    uses; (0, 0) for a dense model."""
    text = config.get_text_config()
    experts = (getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
               or getattr(text, "n_routed_experts", None))
    top_k = getattr(text, "num_experts_per_tok", None) or getattr(text, "top_k_experts", None)
    return (int(experts), int(top_k)) if experts and top_k else (0, 0)


def idle_expert_params(model: nn.Module) -> int:
    """Parameters of the experts one token is not routed to (0 for a dense model)."""
    text = model.config.get_text_config()
    top_k = getattr(text, "num_experts_per_tok", None) or getattr(text, "top_k_experts", None)
    if not top_k:
        return 0
    return sum(p.numel() * (p.shape[0] - top_k) // p.shape[0] for name, p in model.named_parameters()
               if p.ndim == 3 and in_routed_experts(name))


def in_routed_experts(name: str) -> bool:
    """Whether a parameter belongs to a mixture of experts' routed experts, by the name transformers 5 gives their
    module in every family it ships (`mlp.experts`, `feed_forward.experts`; a shared expert is `shared_expert(s)`),
    an adapter on them included (`mlp.experts.lora_A.default.weight`)."""
    return "experts" in name.split(".")


def fused_experts(model: nn.Module) -> Iterator[tuple[int, nn.Module, str, nn.Module]]:
    """(layer index, decoder layer, name in the layer, module) of every routed experts module holding fused 3-D
    weights (transformers 5's layout; a linear attention's 3-D convolution is not one): what adapters, the router's
    load and expert parallelism find the experts by."""
    for i, layer in enumerate(decoder_layers(model)):
        for name, module in layer.named_modules():
            if in_routed_experts(name) and any(p.ndim == 3 for p in module.parameters(recurse=False)):
                yield i, layer, name, module


ROUTING_ARGS = ("top_k_index", "router_indices", "selected_experts")
"""What transformers' fused experts modules call the routing indices, their second argument (the routing weights
come third)."""


def routing_arguments(experts: nn.Module) -> tuple[str, str] | None:
    """The names of the routing indices and weights among a fused experts module's forward arguments (second and
    third, as transformers 5's experts take them: 68 of the 73 experts modules 5.23 ships), or None where it takes
    none (Llama 4's run every expert on every token, scaled by the router's scores)."""
    import inspect

    names = list(inspect.signature(experts.forward).parameters)
    return (names[1], names[2]) if len(names) >= 3 and names[1] in ROUTING_ARGS else None


def expert_counts(model: nn.Module) -> tuple[int, int]:
    """(parameters in the routed experts, of which trainable) of an unwrapped model, adapters on them included."""
    params = [p for name, p in model.named_parameters() if in_routed_experts(name)]
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
"""What wrappers insert into a module's name (FSDP1, torch's checkpoint wrapper, torch.compile)."""


def plain_name(name: str) -> str:
    """A parameter's or buffer's name in the unwrapped model."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def plain_named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The parameters of a distributed model (DDP's `module.` left out) under their names in the unwrapped one."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    for name, param in inner.named_parameters():
        yield plain_name(name), param
