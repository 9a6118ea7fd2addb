"""Fakes for sparse_mla_decode (SPEC section 6). PLACEHOLDER: replaced by the sparse_mla work."""


def sparse_mla_decode(q, kv_cache, indices, softmax_scale, kv_format="auto", head_dim_v=512, topk_length=None,
                      attn_sink=None, extra_kv_cache=None, extra_indices=None, extra_topk_length=None):
    raise NotImplementedError("sparse_mla_decode")


def sparse_mla_decode_out(q, kv_cache, indices, softmax_scale, kv_format="auto", head_dim_v=512, topk_length=None,
                          attn_sink=None, extra_kv_cache=None, extra_indices=None, extra_topk_length=None, *, out, lse):
    raise NotImplementedError("sparse_mla_decode")
