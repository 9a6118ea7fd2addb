"""A MiniMax-M3-shaped sparse decode step: grouped-query attention over the pages each row selected.

64 query heads share 4 KV heads of head dim 128; the paged cache holds K and V of each KV head in
pages of 128 tokens; every (row, KV head) attends to the 16 pages its selector picked (the last page,
the local window, among them), causally. One step, for every request:

1. metadata (``MiniMaxM3MetadataBuilder``: per-row lengths and causal limits, the write slots);
2. cache writes (each layer's new K and V into its cache);
3. attention (``sparse_gqa_decode`` per layer).

The cache format is a table entry (:data:`FORMATS`, ``--m3-format``): ``"fp8"`` pages (float8_e4m3fn
with per-tensor K and V scales) or ``"nvfp4"`` pages (E2M1 values with an E4M3 scale per 16 values,
docs/formats.md). A format names how to allocate a cache and how plain PyTorch writes and reads it;
the library step writes every format with ``gqa_kv_cache_insert``. The page selector is model code:
the demo draws random pages.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

import torch_sparse_mla as tsm
from torch_sparse_mla.bench import baselines

from ._common import (check_graphs, compile_step, cudagraph_skips, format_table, rel_err, say, stage_row, warm,
                      whole_step_rows)

I32, I64 = torch.int32, torch.int64


@dataclasses.dataclass(frozen=True)
class Format:
    """A sparse-GQA cache format, as plain PyTorch sees it."""

    make: Callable  # (pages, hkv, page_size, dh, device) -> cache tensor
    write: Callable  # plain PyTorch: (k, v, slots, cache, k_scale, v_scale), slots valid
    read: Callable  # plain PyTorch: (cache, phys_pages [...], kv_head [...]) -> (k, v) float32 [..., ps, dh], unscaled


def _fp8_make(pages, hkv, page_size, dh, device):
    return torch.zeros(pages, hkv, page_size, 2 * dh, dtype=torch.float8_e4m3fn, device=device)


def _fp8_write(k, v, slots, cache, k_scale, v_scale):
    page_size = cache.shape[2]
    page, row = torch.div(slots, page_size, rounding_mode="floor"), slots % page_size
    heads = torch.arange(cache.shape[1], device=k.device)
    kv = torch.cat([(k.float() / k_scale), (v.float() / v_scale)], dim=-1).clamp(-448, 448).to(cache.dtype)
    cache[page[:, None], heads[None, :], row[:, None]] = kv


def _fp8_read(cache, pages, heads):
    kv = cache[pages, heads].float()
    dh = cache.shape[-1] // 2
    return kv[..., :dh], kv[..., dh:]


def _nvfp4_make(pages, hkv, page_size, dh, device):
    if dh != 128:
        raise ValueError(f"--m3-format nvfp4: the NVFP4 cache has head dim 128, got {dh}")
    return torch.zeros(pages, 2 * hkv, page_size, 72, dtype=torch.uint8, device=device)


def _nvfp4_write(k, v, slots, cache, k_scale, v_scale):
    baselines.gqa_insert_nvfp4(k, v, slots, cache, k_scale, v_scale)


def _nvfp4_read(cache, pages, heads):
    """Slot 2g of a page is KV head g's K, 2g + 1 its V (values times their e4m3 group scales)."""
    num_pages, slots_per_page, ps, _ = cache.shape
    flat = cache.reshape(num_pages, slots_per_page, ps * 72)
    k = baselines._nvfp4_values(flat[pages, 2 * heads], ps, False).float()
    v = baselines._nvfp4_values(flat[pages, 2 * heads + 1], ps, True).float()
    return k, v


FORMATS = {"fp8": Format(_fp8_make, _fp8_write, _fp8_read), "nvfp4": Format(_nvfp4_make, _nvfp4_write, _nvfp4_read)}


@dataclasses.dataclass(frozen=True)
class Config:
    batch: int = 32
    context: int = 8192
    q_heads: int = 64
    kv_heads: int = 4
    head_dim: int = 128
    page_size: int = 128
    selected: int = 16
    query_len: int = 1  # query tokens per request (more with speculative decoding)
    layers: int = 2
    kv_format: str = "fp8"
    k_scale: float = 0.5
    v_scale: float = 0.25

    @property
    def max_model_len(self) -> int:
        return self.context + self.page_size

    def describe(self) -> str:
        layers = f"{self.layers} layer{'s' if self.layers > 1 else ''}"
        return (f"{layers}, batch {self.batch} (one padded request), context up to {self.context}, "
                f"{self.q_heads}/{self.kv_heads} heads x {self.head_dim}, {self.selected} pages of {self.page_size} "
                f"per row and KV head, {self.kv_format} cache")


class Batch:
    """Request lengths, page table and the per-layer stand-in activations of one step."""

    def __init__(self, cfg: Config, gen: torch.Generator, device):
        b, q = cfg.batch, cfg.query_len
        self.seq_lens = torch.randint(max(cfg.context // 2, q + 1), cfg.context + 1, (b,), generator=gen).to(I32)
        if b > 1:
            self.seq_lens[-1] = 0  # a padded request: no key, nothing written
        cols = -(-cfg.max_model_len // cfg.page_size)
        self.pages = b * cols
        self.block_table = torch.randperm(self.pages, generator=gen).view(b, cols).to(I32)
        rows = b * q
        # Selector stand-in: the row's own last page plus distinct random earlier pages, -1 past the context.
        req = torch.arange(rows) // q
        pos = self.seq_lens.to(I64)[req] - q + torch.arange(rows) % q
        last = (pos.clamp_min(0) // cfg.page_size)
        prio = torch.rand(cfg.layers, rows, cfg.kv_heads, cols, generator=gen)
        col = torch.arange(cols)
        prio = torch.where(col > last[None, :, None, None], -1.0, prio)
        prio = torch.where(col == last[None, :, None, None], 2.0, prio)
        top = prio.topk(min(cfg.selected, cols), dim=-1)
        self.topk_pages = torch.where(top.values >= 0, top.indices, -1).to(I32)
        shape = (cfg.layers, rows)
        self.tensors = {
            "seq_lens": self.seq_lens, "block_table": self.block_table, "topk_pages": self.topk_pages,
            "q": torch.randn(*shape, cfg.q_heads, cfg.head_dim, generator=gen).to(torch.bfloat16),
            "k": torch.randn(*shape, cfg.kv_heads, cfg.head_dim, generator=gen).to(torch.bfloat16),
            "v": torch.randn(*shape, cfg.kv_heads, cfg.head_dim, generator=gen).to(torch.bfloat16),
        }
        self.tensors = {k: t.to(device) for k, t in self.tensors.items()}


STEP_ARGS = ("seq_lens", "block_table", "topk_pages", "q", "k", "v")


class MiniMaxM3Step(torch.nn.Module):
    """The attention part of a MiniMax-M3 decode step over ``cfg.layers`` layers (caches in buffers)."""

    def __init__(self, cfg: Config, batch: Batch, device):
        super().__init__()
        self.cfg = cfg
        self.fmt = FORMATS[cfg.kv_format]
        self.builder = tsm.MiniMaxM3MetadataBuilder(max_num_reqs=cfg.batch, max_model_len=cfg.max_model_len,
                                                    page_size=cfg.page_size, decode_query_len=cfg.query_len,
                                                    device=device)
        for layer in range(cfg.layers):  # one trailing scratch page for the plain step's padding writes
            self.register_buffer(f"cache{layer}", self.fmt.make(batch.pages + 1, cfg.kv_heads, cfg.page_size,
                                                                cfg.head_dim, device))
        self.scale = cfg.head_dim ** -0.5

    def cache(self, layer: int) -> torch.Tensor:
        return getattr(self, f"cache{layer}")

    def metadata(self, seq_lens, block_table):
        return self.builder(seq_lens, block_table)

    def write_caches(self, m, k, v):
        cfg = self.cfg
        for layer in range(cfg.layers):
            tsm.gqa_kv_cache_insert(k[layer], v[layer], m.slot_mapping, self.cache(layer), k_scale=cfg.k_scale,
                                    v_scale=cfg.v_scale)

    def plain_write(self, slots, k, v, cache):
        """The format's plain-PyTorch writer; padding rows (slot -1) write the scratch page."""
        scratch = (cache.shape[0] - 1) * cache.shape[2]
        self.fmt.write(k, v, torch.where(slots >= 0, slots, scratch), cache, self.cfg.k_scale, self.cfg.v_scale)

    def attend(self, m, layer: int, q, topk_pages):
        cfg = self.cfg
        return tsm.sparse_gqa_decode(q[layer], self.cache(layer), topk_pages[layer], m.block_table, m.kv_segment_lens,
                                     m.qo_offset, decode_query_len=cfg.query_len, softmax_scale=self.scale,
                                     k_scale=cfg.k_scale, v_scale=cfg.v_scale)

    def forward(self, seq_lens, block_table, topk_pages, q, k, v):
        m = self.metadata(seq_lens, block_table)
        self.write_caches(m, k, v)
        return tuple(self.attend(m, layer, q, topk_pages) for layer in range(self.cfg.layers))


class PlainMiniMaxM3Step(MiniMaxM3Step):
    """The same step in plain PyTorch: lengths and slots from ``repeat_interleave`` and gathers, the
    format's plain writer, attention as gather of the selected pages, masks, bf16 ``einsum``, fp32
    softmax, ``einsum``."""

    def metadata(self, seq_lens, block_table):
        q, ps = self.cfg.query_len, self.cfg.page_size
        kv_lens = seq_lens.repeat_interleave(q)
        qo = kv_lens - q + torch.arange(kv_lens.shape[0], device=seq_lens.device) % q
        req = torch.arange(kv_lens.shape[0], device=seq_lens.device) // q
        col = torch.div(qo, ps, rounding_mode="floor").clamp(0, block_table.shape[1] - 1)
        page = block_table[req, col].to(I64)
        slots = torch.where((qo >= 0) & (page >= 0), page * ps + qo % ps, -1)
        return tsm.MiniMaxM3Metadata(kv_lens, qo.to(I32), slots, block_table)

    def write_caches(self, m, k, v):
        for layer in range(self.cfg.layers):
            self.plain_write(m.slot_mapping, k[layer], v[layer], self.cache(layer))

    def attend(self, m, layer: int, q, topk_pages):
        cfg = self.cfg
        rows, hq, dh = q[layer].shape
        g, ps = cfg.kv_heads, cfg.page_size
        sel = topk_pages[layer]  # [rows, g, n]
        req = torch.arange(rows, device=q.device) // cfg.query_len
        phys = m.block_table[req[:, None, None], sel.clamp(min=0)]
        heads = torch.arange(g, device=q.device)[None, :, None]
        k, v = self.fmt.read(self.cache(layer), phys.clamp(min=0).to(I64), heads)  # [rows, g, n, ps, dh]
        k, v = k.flatten(2, 3).to(torch.bfloat16), v.flatten(2, 3).to(torch.bfloat16)
        pos = (sel[..., None].to(I64) * ps + torch.arange(ps, device=q.device)).flatten(2)
        ok = ((sel >= 0) & (phys >= 0))[..., None].expand(-1, -1, -1, ps).flatten(2)
        ok = ok & (pos <= m.qo_offset[:, None, None]) & (pos < m.kv_segment_lens[:, None, None])
        s = torch.einsum("tgqd,tgkd->tgqk", q[layer].view(rows, g, hq // g, dh), k).float()
        s = (s * (self.scale * cfg.k_scale)).masked_fill(~ok[:, :, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0).to(torch.bfloat16)
        out = torch.einsum("tgqk,tgkd->tgqd", p, v).float() * cfg.v_scale
        return out.reshape(rows, hq, dh).to(q.dtype)


def fill_history(model: MiniMaxM3Step, batch: Batch, gen: torch.Generator, device) -> None:
    """Every earlier token of every request, in each layer's cache (random K and V, the step's writer)."""
    cfg = model.cfg
    for layer in range(cfg.layers):
        pos = torch.cat([torch.arange(max(int(s) - cfg.query_len, 0)) for s in batch.seq_lens])
        req = torch.cat([torch.full((max(int(s) - cfg.query_len, 0),), r) for r, s in enumerate(batch.seq_lens)])
        slots = (batch.block_table[req, pos // cfg.page_size].to(I64) * cfg.page_size + pos % cfg.page_size)
        for start in range(0, len(slots), 32768):  # bounded temporaries
            part = slots[start:start + 32768].to(device)
            k, v = (torch.randn(len(part), cfg.kv_heads, cfg.head_dim, generator=gen).to(device) for _ in range(2))
            tsm.gqa_kv_cache_insert(k, v, part, model.cache(layer), k_scale=cfg.k_scale, v_scale=cfg.v_scale)


def reference(model: MiniMaxM3Step, batch: Batch) -> torch.Tensor:
    """float64 attention from first principles: positions and page lookups with Python integers, keys
    and values read from the caches the step wrote."""
    cfg = model.cfg
    x = batch.tensors
    seq = batch.seq_lens.tolist()
    table = batch.block_table.tolist()
    group = cfg.q_heads // cfg.kv_heads
    out = torch.zeros(cfg.layers, cfg.batch * cfg.query_len, cfg.q_heads, cfg.head_dim, dtype=torch.float64)
    for layer in range(cfg.layers):
        cache = model.cache(layer)
        q = x["q"][layer].double().cpu()
        sel = x["topk_pages"][layer].cpu().tolist()
        for t in range(cfg.batch * cfg.query_len):
            r = t // cfg.query_len
            limit = seq[r] - cfg.query_len + t % cfg.query_len  # the row's own position
            for g in range(cfg.kv_heads):
                pages = [b for b in sel[t][g] if b >= 0 and table[r][b] >= 0]
                if not pages or limit < 0:
                    continue
                phys = torch.tensor([table[r][b] for b in pages], device=cache.device)
                k, v = model.fmt.read(cache, phys, torch.full_like(phys, g))
                k = k.double().cpu().flatten(0, 1) * cfg.k_scale
                v = v.double().cpu().flatten(0, 1) * cfg.v_scale
                pos = torch.tensor([b * cfg.page_size + o for b in pages for o in range(cfg.page_size)])
                keep = (pos <= limit) & (pos < seq[r])
                if keep.any():
                    s = q[t, g * group:(g + 1) * group] @ k[keep].T * model.scale
                    out[layer, t, g * group:(g + 1) * group] = torch.softmax(s, dim=-1) @ v[keep]
    return out


def _stack(outs) -> torch.Tensor:
    return torch.stack([o.detach().clone() for o in outs])


def run(cfg: Config, device: torch.device, iters: int, compile_plain: bool) -> str:
    say(f"MiniMax-M3-shaped sparse decode step: {cfg.describe()}")
    gen = torch.Generator().manual_seed(1)
    batch = Batch(cfg, gen, device)
    args = [batch.tensors[k] for k in STEP_ARGS]
    with torch.no_grad():
        ours = MiniMaxM3Step(cfg, batch, device)
        fill_history(ours, batch, gen, device)
        base = PlainMiniMaxM3Step(cfg, batch, device)
        base.load_state_dict(ours.state_dict())
        twin = MiniMaxM3Step(cfg, batch, device)
        twin.load_state_dict(ours.state_dict())
        plain_ref = PlainMiniMaxM3Step(cfg, batch, device)
        plain_ref.load_state_dict(ours.state_dict())
        compiled_default, compiled_graph = compile_step(ours, device)
        mode = "reduce-overhead (CUDA graph)" if compiled_graph is not None else "default (CPU: no CUDA graph)"
        step_fn = compiled_graph if compiled_graph is not None else compiled_default
        skips = cudagraph_skips()
        got = warm(lambda: _stack(step_fn(*args)), f"the step (torch.compile fullgraph=True, mode={mode})")
        check_graphs(compiled_graph, skips)
        eager = _stack(twin(*args))
        want = reference(twin, batch)
        plain_out = _stack(plain_ref(*args))
        err, cerr, perr = rel_err(eager, want), rel_err(got, eager), rel_err(plain_out, want)
        same = all(torch.equal(ours.cache(i)[:-1].view(torch.uint8), twin.cache(i)[:-1].view(torch.uint8))
                   for i in range(cfg.layers))  # the scratch page (padding rows' plain writes) excluded
        say(f"  eager vs float64 reference rel err {err:.1e}; compiled vs eager {cerr:.1e}, caches identical: {same}; "
            f"plain PyTorch vs reference {perr:.1e}")
        if not (err < 2e-2 and cerr < 1e-2 and same and perr < 2e-2):
            raise AssertionError("MiniMax-M3 step: result outside tolerance (see the line above)")

        say("  timing ...")
        x = batch.tensors
        m_ours, m_base = ours.metadata(x["seq_lens"], x["block_table"]), base.metadata(x["seq_lens"], x["block_table"])

        def row(name, fn_ours, fn_base):
            return stage_row(name, fn_ours, fn_base, device, iters, compile_plain)

        rows = [
            row("metadata (2 ops)", lambda: ours.metadata(x["seq_lens"], x["block_table"]),
                lambda: base.metadata(x["seq_lens"], x["block_table"])),
            row(f"cache writes ({cfg.layers} layers, gqa_kv_cache_insert)",
                lambda: ours.write_caches(m_ours, x["k"], x["v"]), lambda: base.write_caches(m_base, x["k"], x["v"])),
            row(f"attention ({cfg.layers} layers)",
                lambda: [ours.attend(m_ours, i, x["q"], x["topk_pages"]) for i in range(cfg.layers)],
                lambda: [base.attend(m_base, i, x["q"], x["topk_pages"]) for i in range(cfg.layers)]),
        ]
        rows += whole_step_rows(ours, compiled_default, compiled_graph, base, args, device, iters, compile_plain)
    where = "GPU, stages timed as CUDA-graph replays" if device.type == "cuda" else "CPU, stages timed eagerly"
    layers = f"{cfg.layers} layer{'s' if cfg.layers > 1 else ''}"
    return format_table(f"MiniMax-M3 step, {layers}, batch {cfg.batch} ({where}):", rows)
