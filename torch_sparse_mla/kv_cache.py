"""Public functions of the KV cache operators. PLACEHOLDER: replaced by the kv_cache work."""


def kv_cache_insert(*args, **kwargs):
    raise NotImplementedError


def kv_cache_gather(*args, **kwargs):
    raise NotImplementedError
