"""Fakes for sparse_gqa_decode (SPEC section 7). PLACEHOLDER: replaced by the sparse_gqa work."""


def sparse_gqa_decode(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len,
                      softmax_scale, q_scale=1.0, k_scale=1.0, v_scale=1.0):
    raise NotImplementedError("sparse_gqa_decode")


def sparse_gqa_decode_out(q, kv_cache, topk_pages, block_table, kv_segment_lens, qo_offset, decode_query_len,
                          softmax_scale, q_scale=1.0, k_scale=1.0, v_scale=1.0, *, out):
    raise NotImplementedError("sparse_gqa_decode")
