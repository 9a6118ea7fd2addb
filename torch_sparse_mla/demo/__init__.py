"""``python -m torch_sparse_mla.demo``: a DeepSeek-V4 and a MiniMax-M3 decode step, built from the
library, checked against a float64 reference, compiled and timed against the same step in plain
PyTorch. See ``__main__.py`` for the options and ``deepseek_v4.py`` / ``minimax_m3.py`` for the steps."""
