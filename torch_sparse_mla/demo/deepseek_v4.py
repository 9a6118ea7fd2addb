"""A DeepSeek-V4-Flash-shaped decode step: the attention of several layers, built from the library.

Every layer keeps a sliding-window cache (``fp8_584`` pages of 64 tokens, padded to a multiple of 576
bytes as DeepSeek-V4 lays them out) and attends, with all 64 heads of head dim 512 and an attention
sink, to its last 128 tokens; compressed layers add entries of a second ``fp8_584`` cache: C4A layers
(one entry per 4 tokens) the entries their indexer picked, C128A layers (one per 128 tokens) every
completed entry. One step, for every request of the batch:

1. metadata (``DeepSeekV4MetadataBuilder``: window lists, compressed slot mappings, C128A lists);
2. cache writes (``kv_cache_insert``: the token's latent into each layer's window cache, the
   compressor's output into the compressed caches where the token closes an entry);
3. index mapping (``compressed_topk_to_global``: each C4A layer's indexer top-k to cache slots);
4. attention (``sparse_mla_decode`` over both lists, one softmax, with the sink).

The projections, rope, the compressor and the indexer's scoring are model code the library does not
provide: the demo feeds random stand-ins for their outputs (q, the latent, the compressed entry and
the indexer's top-k). ``PlainDeepSeekV4Step`` is the same step written in plain PyTorch (from
``torch_sparse_mla.bench.baselines``), for the speed comparison.
"""

from __future__ import annotations

import dataclasses

import torch

import torch_sparse_mla as tsm
from torch_sparse_mla.bench import baselines as plain

from ._common import (check_graphs, compile_step, cudagraph_skips, format_table, rel_err, say, stage_row, warm,
                      whole_step_rows)

I32, I64 = torch.int32, torch.int64
SWA_PAGE = 64  # tokens per page of the sliding-window cache
COMP_PAGE = 256  # tokens covered by one page of a compressed cache (64 C4 or 2 C128 entries)


@dataclasses.dataclass(frozen=True)
class Config:
    batch: int = 32
    context: int = 8192
    heads: int = 64
    head_dim: int = 512
    window: int = 128
    ratios: tuple[int, ...] = (1, 4, 128, 4)  # per layer: 1 = sliding window only, 4 = C4A, 128 = C128A
    index_topk: int = 512
    steps: int = 2  # decode steps checked (each one token further)

    @property
    def max_model_len(self) -> int:
        return self.context + self.steps + COMP_PAGE

    def describe(self) -> str:
        names = {1: "SWA", 4: "C4A", 128: "C128A"}
        return (f"{len(self.ratios)} layers ({', '.join(names[r] for r in self.ratios)}), batch {self.batch}, "
                f"context up to {self.context}, {self.heads} heads x {self.head_dim}, window {self.window}, "
                f"indexer top-{self.index_topk}, fp8_584 caches")


def _page_buffer(pages: int, page_size: int, device) -> torch.Tensor:
    """The bytes of an ``fp8_584`` cache, ``[pages + 1, page stride]``: DeepSeek-V4 pads each page to a
    multiple of 576 bytes, and one trailing scratch page, which no block table names, receives the
    plain-PyTorch step's writes of padding tokens."""
    return torch.zeros(pages + 1, -(-page_size * 584 // 576) * 576, dtype=torch.uint8, device=device)


def _cache_view(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """The ``[pages, page_size, 584]`` cache view of a page buffer (what the operators take)."""
    return torch.as_strided(pages, (pages.shape[0], page_size, 584), (pages.shape[1], 584, 1))


class Batch:
    """Host-side description of the batch: request lengths and page tables (shared by all steps)."""

    def __init__(self, cfg: Config, gen: torch.Generator):
        b = cfg.batch
        self.cfg = cfg
        lo = max(cfg.window + 2, cfg.context * 3 // 4)
        self.seq0 = torch.randint(lo, cfg.context + 1, (b,), generator=gen)  # lengths at step 0
        self.seq0[0] = cfg.context
        last = self.seq0 + cfg.steps - 1  # longest length reached
        # Sliding-window pages: only those that hold a position some step still sees are allocated.
        cols = -(-cfg.max_model_len // SWA_PAGE)
        first_page = ((self.seq0 - cfg.window - 1).clamp_min(0)) // SWA_PAGE
        last_page = (last - 1) // SWA_PAGE
        col = torch.arange(cols)[None, :]
        live = (col >= first_page[:, None]) & (col <= last_page[:, None])
        self.swa_pages = int(live.sum())
        self.swa_table = torch.full((b, cols), -1, dtype=I32)
        self.swa_table[live] = torch.randperm(self.swa_pages, generator=gen).to(I32)
        # Compressed caches (one table per ratio, shared by the layers of that ratio).
        ccols = -(-cfg.max_model_len // COMP_PAGE)
        self.comp_pages = b * ccols
        self.c4_table = torch.randperm(self.comp_pages, generator=gen)[: b * ccols].view(b, ccols).to(I32)
        self.c128_table = torch.randperm(self.comp_pages, generator=gen)[: b * ccols].view(b, ccols).to(I32)

    def step_inputs(self, step: int, gen: torch.Generator, device) -> dict:
        """Metadata inputs of decode step ``step`` (one token per request) and the layers' stand-in
        activations."""
        cfg, b = self.cfg, self.cfg.batch
        seq = self.seq0 + step
        pos = seq - 1
        slots = self.swa_table[torch.arange(b), pos // SWA_PAGE].to(I64) * SWA_PAGE + pos % SWA_PAGE
        num_layers, n_c4 = len(cfg.ratios), sum(r == 4 for r in cfg.ratios)
        # Stand-in indexer: up to index_topk distinct completed ratio-4 entries, -1 after.
        completed = (pos + 1) // 4
        width = int(completed.max())
        scores = torch.rand(n_c4, b, max(width, 1), generator=gen)
        scores[:, torch.arange(max(width, 1))[None, :].expand(b, -1) >= completed[:, None]] = -1.0
        k = min(cfg.index_topk, max(width, 1))
        top = scores.topk(k, dim=-1)
        local = torch.full((n_c4, b, cfg.index_topk), -1, dtype=I32)
        local[..., :k] = torch.where(top.values >= 0, top.indices, -1).to(I32)
        host = dict(
            query_start_loc=torch.arange(b + 1, dtype=I32), seq_lens=seq.to(I32), positions=pos.to(I64),
            token_to_req=torch.arange(b, dtype=I32), slot_mapping=slots, swa_block_table=self.swa_table,
            c4_block_table=self.c4_table, c128_block_table=self.c128_table,
            q=(torch.randn(num_layers, b, cfg.heads, cfg.head_dim, generator=gen) * 2).to(torch.bfloat16),
            kv=torch.randn(num_layers, b, cfg.head_dim, generator=gen).to(torch.bfloat16),
            compressed_kv=torch.randn(num_layers, b, cfg.head_dim, generator=gen).to(torch.bfloat16),
            local_topk=local,
        )
        return {k: v.to(device) for k, v in host.items()}


METADATA_ARGS = ("query_start_loc", "seq_lens", "positions", "token_to_req", "slot_mapping", "swa_block_table",
                 "c4_block_table", "c128_block_table")
STEP_ARGS = METADATA_ARGS + ("q", "kv", "compressed_kv", "local_topk")


class DeepSeekV4Step(torch.nn.Module):
    """The attention part of a DeepSeek-V4 decode step over ``len(cfg.ratios)`` layers.

    Caches and sinks are module buffers, so ``torch.compile(mode="reduce-overhead")`` keeps them at
    fixed addresses and the whole step becomes one CUDA graph.
    """

    def __init__(self, cfg: Config, batch: Batch, device):
        super().__init__()
        self.cfg = cfg
        self.builder = tsm.DeepSeekV4MetadataBuilder(
            max_num_tokens=cfg.batch, max_model_len=cfg.max_model_len, window=cfg.window, swa_page_size=SWA_PAGE,
            compressed_page_size=COMP_PAGE, index_topk=cfg.index_topk, device=device)
        # Caches are kept as their page buffers (the whole storage is a module buffer, so compiled code
        # sees every byte of it) and viewed as [pages, page_size, 584] where used.
        for layer, ratio in enumerate(cfg.ratios):
            self.register_buffer(f"swa_pages{layer}", _page_buffer(batch.swa_pages, SWA_PAGE, device))
            if ratio > 1:
                self.register_buffer(f"comp_pages{layer}", _page_buffer(batch.comp_pages, COMP_PAGE // ratio, device))
        gen = torch.Generator().manual_seed(7)
        self.register_buffer("sinks", torch.randn(len(cfg.ratios), cfg.heads, generator=gen).to(device))
        self.scale = cfg.head_dim ** -0.5

    def caches(self, layer: int):
        """``(sliding-window cache, compressed cache or None)`` of a layer, as ``fp8_584`` views."""
        ratio = self.cfg.ratios[layer]
        swa = _cache_view(getattr(self, f"swa_pages{layer}"), SWA_PAGE)
        return swa, (_cache_view(getattr(self, f"comp_pages{layer}"), COMP_PAGE // ratio) if ratio > 1 else None)

    # -- the four stages ----------------------------------------------------------------------------------

    def metadata(self, query_start_loc, seq_lens, positions, token_to_req, slot_mapping, swa_block_table,
                 c4_block_table, c128_block_table):
        return self.builder(query_start_loc, seq_lens, positions, token_to_req, slot_mapping, swa_block_table,
                            c4_block_table, c128_block_table)

    def write_caches(self, m: tsm.DeepSeekV4Metadata, kv, compressed_kv):
        for layer, ratio in enumerate(self.cfg.ratios):
            swa, comp = self.caches(layer)
            tsm.kv_cache_insert(kv[layer], m.slot_mapping, swa, kv_format="fp8_584")
            if ratio > 1:
                slots = m.c4_slot_mapping if ratio == 4 else m.c128_slot_mapping
                tsm.kv_cache_insert(compressed_kv[layer], slots, comp, kv_format="fp8_584")

    def extra_lists(self, m: tsm.DeepSeekV4Metadata, local_topk, c4_layer: int, ratio: int):
        if ratio == 4:
            return self.builder.c4a_indices(m, local_topk[c4_layer])
        return m.c128a_indices, m.c128a_lens

    def attend(self, m: tsm.DeepSeekV4Metadata, layer: int, q, extra):
        swa, comp = self.caches(layer)
        extra_idx, extra_len = extra if extra is not None else (None, None)
        out, _ = tsm.sparse_mla_decode(
            q[layer], swa, m.swa_indices, softmax_scale=self.scale, kv_format="fp8_584", topk_length=m.swa_lens,
            attn_sink=self.sinks[layer], extra_kv_cache=comp, extra_indices=extra_idx, extra_topk_length=extra_len)
        return out

    def forward(self, query_start_loc, seq_lens, positions, token_to_req, slot_mapping, swa_block_table,
                c4_block_table, c128_block_table, q, kv, compressed_kv, local_topk):
        m = self.metadata(query_start_loc, seq_lens, positions, token_to_req, slot_mapping, swa_block_table,
                          c4_block_table, c128_block_table)
        self.write_caches(m, kv, compressed_kv)
        outs, c4_layer = [], 0
        for layer, ratio in enumerate(self.cfg.ratios):
            extra = None
            if ratio > 1:
                extra = self.extra_lists(m, local_topk, c4_layer, ratio)
                c4_layer += ratio == 4
            outs.append(self.attend(m, layer, q, extra))
        return tuple(outs)  # one [T, H, 512] output per layer (a stack would be one more kernel)


class PlainDeepSeekV4Step(DeepSeekV4Step):
    """The same step written in plain PyTorch (``torch_sparse_mla.bench.baselines``): metadata from
    gathers and masks, quantisation and byte scatters into the same caches, attention as gather,
    dequantise, bf16 ``bmm``, masked fp32 softmax, ``bmm``. Padding tokens' cache writes go to the
    scratch page (a scatter cannot skip entries without a data-dependent shape)."""

    def metadata(self, query_start_loc, seq_lens, positions, token_to_req, slot_mapping, swa_block_table,
                 c4_block_table, c128_block_table):
        t = positions.shape[0]
        swa_idx, swa_lens = plain.swa_indices(positions, token_to_req, swa_block_table, slot_mapping, self.cfg.window,
                                              SWA_PAGE)
        c4 = plain.compressed_slot_mapping(query_start_loc, seq_lens, c4_block_table, t, COMP_PAGE // 4, 4)
        c128 = plain.compressed_slot_mapping(query_start_loc, seq_lens, c128_block_table, t, COMP_PAGE // 128, 128)
        c128a_idx, c128a_lens = plain.c128a_topk_indices(positions, token_to_req, c128_block_table, slot_mapping, 128,
                                                         COMP_PAGE // 128, self.builder.c128a_width)
        return tsm.DeepSeekV4Metadata(token_to_req, slot_mapping, swa_idx, swa_lens, c4, c128, c128a_idx, c128a_lens,
                                      c4_block_table)

    @staticmethod
    def _insert(kv, slots, pages, page_size):
        scratch = (pages.shape[0] - 1) * page_size
        plain.write_fp8_584_pages(kv, torch.where(slots >= 0, slots, scratch), pages, page_size)

    def write_caches(self, m, kv, compressed_kv):
        for layer, ratio in enumerate(self.cfg.ratios):
            self._insert(kv[layer], m.slot_mapping, getattr(self, f"swa_pages{layer}"), SWA_PAGE)
            if ratio > 1:
                self._insert(compressed_kv[layer], m.c4_slot_mapping if ratio == 4 else m.c128_slot_mapping,
                             getattr(self, f"comp_pages{layer}"), COMP_PAGE // ratio)

    def extra_lists(self, m, local_topk, c4_layer: int, ratio: int):
        if ratio == 4:
            return plain.compressed_topk_to_global(local_topk[c4_layer], m.token_to_req, m.c4_block_table,
                                                   m.slot_mapping, COMP_PAGE // 4)
        return m.c128a_indices, m.c128a_lens

    def attend(self, m, layer: int, q, extra):
        swa, comp = self.caches(layer)
        extra_idx, extra_len = extra if extra is not None else (None, None)
        return plain.mla_fp8_584_masked(q[layer], swa, m.swa_indices, m.swa_lens, self.sinks[layer], comp, extra_idx,
                                        extra_len, self.scale)


def fill_history(model: DeepSeekV4Step, batch: Batch, gen: torch.Generator, device) -> None:
    """Write the context every step reads: each layer's window of the last ``window`` positions before
    step 0, and every compressed entry closed before step 0 (random latents, through
    ``kv_cache_insert``)."""
    cfg = model.cfg
    for layer, ratio in enumerate(cfg.ratios):
        swa, comp = model.caches(layer)
        pos = torch.cat([torch.arange(max(int(s) - 1 - cfg.window, 0), int(s) - 1) for s in batch.seq0])
        req = torch.cat([torch.full((min(int(s) - 1, cfg.window),), r) for r, s in enumerate(batch.seq0)])
        slots = batch.swa_table[req, pos // SWA_PAGE].to(I64) * SWA_PAGE + pos % SWA_PAGE
        tsm.kv_cache_insert(torch.randn(len(slots), cfg.head_dim, generator=gen).to(device), slots.to(device), swa,
                            kv_format="fp8_584")
        if ratio > 1:
            table, per_page = (batch.c4_table if ratio == 4 else batch.c128_table), COMP_PAGE // ratio
            ent = torch.cat([torch.arange((int(s) - 1) // ratio) for s in batch.seq0])
            req = torch.cat([torch.full(((int(s) - 1) // ratio,), r) for r, s in enumerate(batch.seq0)])
            slots = table[req, ent // per_page].to(I64) * per_page + ent % per_page
            for start in range(0, len(slots), 65536):  # bounded temporaries
                part = slots[start:start + 65536]
                tsm.kv_cache_insert(torch.randn(len(part), cfg.head_dim, generator=gen).to(device), part.to(device),
                                    comp, kv_format="fp8_584")


def reference(model: DeepSeekV4Step, batch: Batch, inputs: dict) -> torch.Tensor:
    """float64 attention of every layer, from first principles: each token's candidate slots are
    worked out with Python integers from its position and the page tables (window positions, the
    indexer's entries or every completed ratio-128 entry), and their vectors are dequantised from the
    caches the step wrote."""
    cfg = model.cfg
    pos = inputs["positions"].tolist()
    swa_t, c4_t, c128_t = batch.swa_table.tolist(), batch.c4_table.tolist(), batch.c128_table.tolist()
    local = inputs["local_topk"].cpu()
    outs, c4_layer = [], 0
    for layer, ratio in enumerate(cfg.ratios):
        swa, comp = model.caches(layer)
        q = inputs["q"][layer].double().cpu()
        sink = model.sinks[layer].double().cpu()
        out = torch.zeros(cfg.batch, cfg.heads, cfg.head_dim, dtype=torch.float64)
        for t, p in enumerate(pos):
            main = [swa_t[t][x // SWA_PAGE] * SWA_PAGE + x % SWA_PAGE for x in range(max(p - cfg.window + 1, 0), p + 1)]
            extra = []
            if ratio > 1:
                per_page, table = COMP_PAGE // ratio, (c4_t if ratio == 4 else c128_t)
                entries = ([e for e in local[c4_layer, t].tolist() if e >= 0] if ratio == 4
                           else list(range((p + 1) // 128)))
                extra = [table[t][e // per_page] * per_page + e % per_page for e in entries]
            keys = [plain.gather_fp8_584(swa, torch.tensor(main, device=swa.device), torch.float32)]
            if extra:
                keys.append(plain.gather_fp8_584(comp, torch.tensor(extra, device=swa.device), torch.float32))
            k = torch.cat(keys).double().cpu()
            scores = q[t] @ k.T * model.scale
            lse = torch.logsumexp(scores, dim=-1)
            out[t] = torch.softmax(scores, dim=-1) @ k * torch.sigmoid(lse - sink)[:, None]
        outs.append(out)
        c4_layer += ratio == 4
    return torch.stack(outs)


def _stack(outs) -> torch.Tensor:
    """The layers' outputs as one tensor (a copy: graph outputs are reused by the next replay)."""
    return torch.stack([o.detach().clone() for o in outs])


def _cache_bytes(model: DeepSeekV4Step) -> list[torch.Tensor]:
    """Every cache's bytes without the scratch page."""
    return [b[:-1] for name, b in model.named_buffers() if "pages" in name]


def run(cfg: Config, device: torch.device, iters: int, compile_plain: bool) -> str:
    say(f"DeepSeek-V4-Flash-shaped decode step: {cfg.describe()}")
    gen = torch.Generator().manual_seed(0)
    batch = Batch(cfg, gen)
    with torch.no_grad():
        ours = DeepSeekV4Step(cfg, batch, device)
        fill_history(ours, batch, gen, device)
        base = PlainDeepSeekV4Step(cfg, batch, device)
        base.load_state_dict(ours.state_dict())
        compiled_default, compiled_graph = compile_step(ours, device)
        mode = "reduce-overhead (CUDA graph)" if compiled_graph is not None else "default (CPU: no CUDA graph)"
        step_fn = compiled_graph if compiled_graph is not None else compiled_default

        # -- correctness: every step checked against the float64 reference ---------------------------------
        inputs = [batch.step_inputs(s, gen, device) for s in range(cfg.steps)]
        plain_ref = PlainDeepSeekV4Step(cfg, batch, device)
        plain_ref.load_state_dict(ours.state_dict())
        twin = DeepSeekV4Step(cfg, batch, device)  # eager twin of the compiled module, same caches
        twin.load_state_dict(ours.state_dict())
        for s, x in enumerate(inputs):
            args = [x[k] for k in STEP_ARGS]
            if s == 0:
                skips = cudagraph_skips()
                got = warm(lambda: _stack(step_fn(*args)), f"the step (torch.compile fullgraph=True, mode={mode})")
                check_graphs(compiled_graph, skips)
            else:
                got = _stack(step_fn(*args))
            eager = _stack(twin(*args))
            want = reference(twin, batch, x)
            plain_out = _stack(plain_ref(*args))
            err, cerr, perr = rel_err(eager, want), rel_err(got, eager), rel_err(plain_out, want)
            same = all(torch.equal(a, b) for a, b in zip(_cache_bytes(ours), _cache_bytes(twin)))
            plain_same = all(torch.equal(a, b) for a, b in zip(_cache_bytes(plain_ref), _cache_bytes(twin)))
            lens = x["positions"].min().item() + 1, x["positions"].max().item() + 1
            say(f"  step {s} (sequence lengths {lens[0]}..{lens[1]}): eager vs float64 reference rel err {err:.1e}; "
                f"compiled vs eager {cerr:.1e}, caches identical: {same}; plain PyTorch vs reference {perr:.1e}, "
                f"caches identical: {plain_same}")
            if not (err < 2e-2 and cerr < 1e-2 and same and perr < 2e-2):
                raise AssertionError("DeepSeek-V4 step: result outside tolerance (see the line above)")

        # -- timing ------------------------------------------------------------------------------------------
        say("  timing ...")
        x = inputs[-1]
        meta_args = [x[k] for k in METADATA_ARGS]
        args = [x[k] for k in STEP_ARGS]
        rows = _stage_rows(ours, base, x, meta_args, device, iters, compile_plain)
        rows += whole_step_rows(ours, compiled_default, compiled_graph, base, args, device, iters, compile_plain)
    where = "GPU, stages timed as CUDA-graph replays" if device.type == "cuda" else "CPU, stages timed eagerly"
    return format_table(f"DeepSeek-V4 step, {len(cfg.ratios)} layers, batch {cfg.batch} ({where}):", rows)


def _stage_rows(ours: DeepSeekV4Step, base: PlainDeepSeekV4Step, x: dict, meta_args: list, device, iters: int,
                compile_plain: bool):
    """Per-stage times of the library's step and the plain one (see ``stage_row``)."""
    cfg = ours.cfg
    m_ours, m_base = ours.metadata(*meta_args), base.metadata(*meta_args)
    num_c4 = sum(r == 4 for r in cfg.ratios)
    extras_ours, extras_base, c4 = [], [], 0
    for r in cfg.ratios:  # each layer's lists, kept apart (C4A layers share the builder's buffer)
        e_o = ours.extra_lists(m_ours, x["local_topk"], c4, r) if r > 1 else None
        extras_ours.append(tuple(t.clone() for t in e_o) if e_o is not None else None)
        extras_base.append(base.extra_lists(m_base, x["local_topk"], c4, r) if r > 1 else None)
        c4 += r == 4
    n_layers = len(cfg.ratios)
    n_writes = n_layers + sum(r > 1 for r in cfg.ratios)

    def row(name, fn_ours, fn_base):
        return stage_row(name, fn_ours, fn_base, device, iters, compile_plain)

    rows = [
        row("metadata (4 ops)", lambda: ours.metadata(*meta_args), lambda: base.metadata(*meta_args)),
        row(f"cache writes ({n_writes} inserts)", lambda: ours.write_caches(m_ours, x["kv"], x["compressed_kv"]),
            lambda: base.write_caches(m_base, x["kv"], x["compressed_kv"])),
    ]
    if num_c4:
        rows.append(row(f"indexer top-k to slots ({num_c4} C4A layers)",
                        lambda: [ours.extra_lists(m_ours, x["local_topk"], i, 4) for i in range(num_c4)],
                        lambda: [base.extra_lists(m_base, x["local_topk"], i, 4) for i in range(num_c4)]))
    rows.append(row(f"attention ({n_layers} layers)",
                    lambda: [ours.attend(m_ours, i, x["q"], extras_ours[i]) for i in range(n_layers)],
                    lambda: [base.attend(m_base, i, x["q"], extras_base[i]) for i in range(n_layers)]))
    return rows
