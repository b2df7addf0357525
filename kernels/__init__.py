"""kernels: hot operations as torch references and Triton versions with the same signatures.

Each is the implementation of one step of a stage function of models/layers.py; its torch reference is (or calls)
the model's own code, and a Triton version refuses what it does not implement (an activation it has no code for).

topk_merge.py       fused gather of scattered expert rows + weighted top-k sum + shared + residual
permute.py          stable counting sort of routed rows into expert order; row gather
grouped_ffn.py      grouped expert FFN over rows sorted by expert (models.moe.glu's activations)
paged_attention.py  decode attention over a paged KV cache (GQA, sliding window, sinks), by rows or row blocks
rms_norm.py         RMSNorm in one launch (models.attention.rms_norm)
rope_kv_write.py    RoPE + this step's K/V written into the paged cache in one launch
dispatch.py         which version a call runs (the `kernels` option), lazy triton.jit
"""
