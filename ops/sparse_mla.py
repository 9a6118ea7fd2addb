"""Kernels for the sparse_mla family. PLACEHOLDER: replaced by the sparse_mla work."""


def sparse_mla_decode_torch(*args):
    raise NotImplementedError('sparse_mla_decode_torch')


def sparse_mla_decode_triton(*args):
    raise NotImplementedError('sparse_mla_decode_triton')
