"""Fakes for the KV cache operators (SPEC section 5). PLACEHOLDER: replaced by the kv_cache work."""


def kv_cache_insert(kv, slot_mapping, kv_cache, kv_format):
    raise NotImplementedError("kv_cache_insert")


def kv_cache_gather(kv_cache, slots, kv_format, dtype=None):
    raise NotImplementedError("kv_cache_gather")


def kv_cache_gather_out(kv_cache, slots, kv_format, dtype=None, *, out):
    raise NotImplementedError("kv_cache_gather")
