"""Public function of sparse_gqa_decode. PLACEHOLDER: replaced by the sparse_gqa work."""


def sparse_gqa_decode(*args, **kwargs):
    raise NotImplementedError
