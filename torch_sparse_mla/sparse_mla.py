"""Public function of sparse_mla_decode. PLACEHOLDER: replaced by the sparse_mla work."""


def sparse_mla_decode(*args, **kwargs):
    raise NotImplementedError
