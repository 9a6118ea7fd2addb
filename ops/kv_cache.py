"""Kernels for the kv_cache family. PLACEHOLDER: replaced by the kv_cache work."""


def kv_cache_insert_torch(*args):
    raise NotImplementedError('kv_cache_insert_torch')


def kv_cache_insert_triton(*args):
    raise NotImplementedError('kv_cache_insert_triton')


def kv_cache_gather_torch(*args):
    raise NotImplementedError('kv_cache_gather_torch')


def kv_cache_gather_triton(*args):
    raise NotImplementedError('kv_cache_gather_triton')
