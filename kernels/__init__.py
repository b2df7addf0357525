"""kernels: hot operations as torch references and Triton versions with the same signatures.

topk_merge.py       fused gather of scattered expert rows + weighted top-k sum + shared + residual
permute.py          stable counting sort of routed rows into expert order; row gather
grouped_ffn.py      grouped expert FFN over rows sorted by expert (Triton / torch._grouped_mm)
paged_attention.py  decode attention over a paged KV cache (GQA, sliding window, sinks)
dispatch.py         which version a call runs (DATAFLOW_KERNELS), lazy triton.jit
"""
