"""config.json keys that no mapping in models/hf_config.py read: refused when they change the forward pass, else
reported as ignored.

`spec_dict_from_config` records every key its family's mapping reads (models.hf_config._Cfg.read). A key left over
is one of:
- a setting that changes the math in the family that wrote it (a Granite multiplier, a logit soft-cap, MLP biases,
  ...) with a non-neutral value: a config relabelled as a family that does not have it (a Granite config called
  Mixtral) would compile into a different model, so it is a UserError naming the key and the family;
- bookkeeping (`_BOOKKEEPING`: training-only, tokenizer ids, provenance): not reported;
- anything else: returned by `ignored_keys` for the compile summary to list.
"""
from __future__ import annotations

from typing import Any

# key -> values under which it does not change the forward pass (an empty tuple: any value does)
FORWARD_KEYS: dict[str, tuple[Any, ...]] = {
    "embedding_multiplier": (1, 1.0), "residual_multiplier": (1, 1.0), "logits_scaling": (1, 1.0),
    "attention_multiplier": (), "scale_emb": (1, 1.0), "scale_depth": (1, 1.0), "logit_scale": (1, 1.0),
    "final_logit_softcapping": (), "attn_logit_softcapping": (), "query_pre_attn_scalar": (),
    "clip_qkv": (), "mlp_bias": (False,), "use_bias": (False,), "use_qk_norm": (False,),
    "scoring_func": ("softmax",), "n_shared_experts": (0,), "shared_expert_intermediate_size": (0,),
    "first_k_dense_replace": (0,), "moe_layer_freq": (1,), "rope_interleave": (),
    "moe_num_shared_experts": (0,), "use_routing_bias": (False,), "use_cla": (False,),
}

# Keys that never change the forward pass of a causal LM: not worth a line in the summary.
_BOOKKEEPING = frozenset({
    "architectures", "model_type", "transformers_version", "_name_or_path", "auto_map", "initializer_range",
    "use_cache", "bos_token_id", "pad_token_id", "sep_token_id", "eod_token_id", "output_router_logits",
    "router_aux_loss_coef", "router_z_loss_coef", "attention_dropout", "hidden_dropout", "dropout",
    "router_jitter_noise", "aux_loss_alpha", "seq_aux", "pretraining_tp", "output_attentions",
    "output_hidden_states", "return_dict", "is_encoder_decoder", "tokenizer_class", "id2label", "label2id",
    "problem_type", "chunk_size_feed_forward", "torchscript", "use_return_dict", "tie_encoder_decoder",
})


def check_unread(data: dict, read: set[str], family: str, source: str) -> list[str]:
    """UserError for a forward-pass key the family's mapping did not read; the other unread keys, sorted."""
    from graph_ir.errors import UserError

    unread = sorted(set(data) - read)
    for key in unread:
        value = data[key]
        if key in FORWARD_KEYS and value is not None and value not in FORWARD_KEYS[key]:
            raise UserError(f"{source}: '{key}' = {value!r} changes the forward pass, and dataflow's {family} "
                            f"mapping (like transformers' {family}) has no such setting; the config and its "
                            f"'architectures' disagree")
    return [key for key in unread if key not in _BOOKKEEPING]
