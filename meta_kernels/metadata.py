"""Fakes (and the shared argument checks) of the metadata operators, SPEC sections 1-4.

Each function validates its arguments from metadata only and, for a functional overload, returns
empty outputs of the right shape, dtype and device. The real implementations call these first.
"""

from __future__ import annotations

import torch

from ._common import (
    INDEX_DTYPES,
    INT32_MAX,
    SLOT_DTYPES,
    check_min_size,
    check_positive,
    check_size,
    check_tensor,
    expect,
)


def _check_block_table(block_table: torch.Tensor, device) -> None:
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2, device=device)


def _check_out(name, t, dtype, ndim, device):
    check_tensor(name, t, dtypes=(dtype,), ndim=ndim, device=device)


# -- compressed_slot_mapping ---------------------------------------------------------------------------


def _check_compressed_slot_mapping(query_start_loc, seq_lens, block_table, block_size, compress_ratio):
    check_tensor("query_start_loc", query_start_loc, dtypes=INDEX_DTYPES, ndim=1)
    device = query_start_loc.device
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, ndim=1, device=device)
    _check_block_table(block_table, device)
    check_size("query_start_loc", query_start_loc, 0, seq_lens.shape[0] + 1, "len(seq_lens) + 1")
    check_size("block_table", block_table, 0, seq_lens.shape[0], "len(seq_lens)")
    check_positive("block_size", block_size, maximum=INT32_MAX)
    check_positive("compress_ratio", compress_ratio, maximum=INT32_MAX)


def compressed_slot_mapping(query_start_loc, seq_lens, block_table, num_tokens, block_size, compress_ratio):
    _check_compressed_slot_mapping(query_start_loc, seq_lens, block_table, block_size, compress_ratio)
    check_positive("num_tokens", num_tokens, minimum=0)
    return query_start_loc.new_empty((num_tokens,), dtype=torch.int64)


def compressed_slot_mapping_out(query_start_loc, seq_lens, block_table, block_size, compress_ratio, *, out):
    _check_compressed_slot_mapping(query_start_loc, seq_lens, block_table, block_size, compress_ratio)
    _check_out("out", out, torch.int64, 1, query_start_loc.device)


# -- c128a_topk_indices ----------------------------------------------------------------------------------


def _check_per_token(lead_name, lead, lead_dtypes, lead_ndim, token_to_req, block_table, slot_mapping,
                     block_size):
    """Arguments with one entry per token, the first of which (``lead``: positions or local_indices)
    sets the device and the number of tokens."""
    check_tensor(lead_name, lead, dtypes=lead_dtypes, ndim=lead_ndim)
    device = lead.device
    check_tensor("token_to_req", token_to_req, dtypes=INDEX_DTYPES, ndim=1, device=device)
    _check_block_table(block_table, device)  # in schema order, so an error names the first bad argument
    check_tensor("slot_mapping", slot_mapping, dtypes=SLOT_DTYPES, ndim=1, device=device)
    num_tokens = lead.shape[0]
    what = "len(positions)" if lead_ndim == 1 else f"{lead_name}.shape[0]"
    check_size("token_to_req", token_to_req, 0, num_tokens, what)
    check_size("slot_mapping", slot_mapping, 0, num_tokens, what)
    check_positive("block_size", block_size, maximum=INT32_MAX)
    return num_tokens


def _check_token_lists(positions, token_to_req, block_table, slot_mapping, block_size):
    """Arguments shared by c128a_topk_indices and swa_indices."""
    return _check_per_token("positions", positions, SLOT_DTYPES, 1, token_to_req, block_table, slot_mapping,
                            block_size)


def _check_c128a(positions, token_to_req, block_table, slot_mapping, num_decode_tokens, compress_ratio,
                 block_size, width):
    num_tokens = _check_token_lists(positions, token_to_req, block_table, slot_mapping, block_size)
    check_positive("num_decode_tokens", num_decode_tokens, minimum=0)
    expect(num_decode_tokens <= num_tokens,
           lambda: f"num_decode_tokens: expected <= len(positions) ({num_tokens}), got {num_decode_tokens}")
    check_positive("compress_ratio", compress_ratio, maximum=INT32_MAX)
    check_positive("width", width, minimum=0, maximum=INT32_MAX)
    return num_tokens


def c128a_topk_indices(positions, token_to_req, block_table, slot_mapping, num_decode_tokens, compress_ratio,
                       block_size, width):
    num_tokens = _check_c128a(positions, token_to_req, block_table, slot_mapping, num_decode_tokens,
                              compress_ratio, block_size, width)
    decode_indices = positions.new_empty((num_decode_tokens, width), dtype=torch.int32)
    decode_lens = positions.new_empty((num_decode_tokens,), dtype=torch.int32)
    prefill_indices = positions.new_empty((num_tokens - num_decode_tokens, width), dtype=torch.int32)
    return decode_indices, decode_lens, prefill_indices


def c128a_topk_indices_out(positions, token_to_req, block_table, slot_mapping, num_decode_tokens,
                           compress_ratio, block_size, width, *, decode_indices, decode_lens, prefill_indices):
    num_tokens = _check_c128a(positions, token_to_req, block_table, slot_mapping, num_decode_tokens,
                              compress_ratio, block_size, width)
    device = positions.device
    _check_out("decode_indices", decode_indices, torch.int32, 2, device)
    _check_out("decode_lens", decode_lens, torch.int32, 1, device)
    _check_out("prefill_indices", prefill_indices, torch.int32, 2, device)
    check_min_size("decode_indices", decode_indices, 0, num_decode_tokens, "num_decode_tokens")
    check_min_size("decode_indices", decode_indices, 1, width, "width")
    check_min_size("decode_lens", decode_lens, 0, num_decode_tokens, "num_decode_tokens")
    check_min_size("prefill_indices", prefill_indices, 0, num_tokens - num_decode_tokens,
                   "len(positions) - num_decode_tokens")
    check_min_size("prefill_indices", prefill_indices, 1, width, "width")


# -- decode_runtime_metadata -----------------------------------------------------------------------------


def _check_decode_runtime_metadata(seq_lens, decode_query_len):
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, ndim=1)
    check_positive("decode_query_len", decode_query_len, maximum=INT32_MAX)
    return seq_lens.shape[0] * decode_query_len


def decode_runtime_metadata(seq_lens, decode_query_len):
    rows = _check_decode_runtime_metadata(seq_lens, decode_query_len)
    return seq_lens.new_empty((rows,)), seq_lens.new_empty((rows,))


def decode_runtime_metadata_out(seq_lens, decode_query_len, *, kv_segment_lens, qo_offset):
    rows = _check_decode_runtime_metadata(seq_lens, decode_query_len)
    for name, t in (("kv_segment_lens", kv_segment_lens), ("qo_offset", qo_offset)):
        _check_out(name, t, torch.int32, 1, seq_lens.device)
        check_size(name, t, 0, rows, "len(seq_lens) * decode_query_len")


# -- swa_indices -------------------------------------------------------------------------------------------


def _check_swa(positions, token_to_req, block_table, slot_mapping, window, block_size):
    num_tokens = _check_token_lists(positions, token_to_req, block_table, slot_mapping, block_size)
    check_positive("window", window, maximum=INT32_MAX)
    return num_tokens


def swa_indices(positions, token_to_req, block_table, slot_mapping, window, block_size):
    num_tokens = _check_swa(positions, token_to_req, block_table, slot_mapping, window, block_size)
    return (positions.new_empty((num_tokens, window), dtype=torch.int32),
            positions.new_empty((num_tokens,), dtype=torch.int32))


def _check_index_outputs(indices, lens, num_tokens, width, width_name, device):
    _check_out("indices", indices, torch.int32, 2, device)
    _check_out("lens", lens, torch.int32, 1, device)
    check_min_size("indices", indices, 0, num_tokens, "the number of tokens")
    check_min_size("indices", indices, 1, width, width_name)
    check_min_size("lens", lens, 0, num_tokens, "the number of tokens")


def swa_indices_out(positions, token_to_req, block_table, slot_mapping, window, block_size, *, indices, lens):
    num_tokens = _check_swa(positions, token_to_req, block_table, slot_mapping, window, block_size)
    _check_index_outputs(indices, lens, num_tokens, window, "window", positions.device)


# -- compressed_topk_to_global ---------------------------------------------------------------------------


def _check_topk_to_global(local_indices, token_to_req, block_table, slot_mapping, block_size):
    num_tokens = _check_per_token("local_indices", local_indices, INDEX_DTYPES, 2, token_to_req, block_table,
                                  slot_mapping, block_size)
    return num_tokens, local_indices.shape[1]


def compressed_topk_to_global(local_indices, token_to_req, block_table, slot_mapping, block_size):
    num_tokens, k = _check_topk_to_global(local_indices, token_to_req, block_table, slot_mapping, block_size)
    return (local_indices.new_empty((num_tokens, k)), local_indices.new_empty((num_tokens,)))


def compressed_topk_to_global_out(local_indices, token_to_req, block_table, slot_mapping, block_size, *,
                                  indices, lens):
    num_tokens, k = _check_topk_to_global(local_indices, token_to_req, block_table, slot_mapping, block_size)
    _check_index_outputs(indices, lens, num_tokens, k, "local_indices.shape[1]", local_indices.device)
