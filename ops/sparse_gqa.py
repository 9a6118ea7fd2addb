"""Kernels for the sparse_gqa family. PLACEHOLDER: replaced by the sparse_gqa work."""


def sparse_gqa_decode_torch(*args):
    raise NotImplementedError('sparse_gqa_decode_torch')


def sparse_gqa_decode_triton(*args):
    raise NotImplementedError('sparse_gqa_decode_triton')
