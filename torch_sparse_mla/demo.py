"""``python -m torch_sparse_mla.demo``: one decode step of each model family, eager and compiled.

1. DeepSeek-V4 (sparse MLA, FP8 584-byte pages, 16 heads as at tensor-parallel 8): the step writes this
   token's latent into the sliding-window cache and its compressed entry (ratio 4) into the compressed
   cache, builds the window indices and maps an indexer's top-k to global slots, then attends to both
   caches in one softmax with an attention sink.
2. MiniMax-M3 (sparse GQA over selected pages, 2 query tokens per request, FP8 cache with scales).

Each step runs eagerly and through ``torch.compile(fullgraph=True)``; on a GPU the compiled step runs
with ``mode="reduce-overhead"`` (captured in a CUDA graph, which the demo checks) and replays the next
step with new inputs. Results are compared with a float64 computation on the dequantised cache.
"""

from __future__ import annotations

import argparse
import time

import torch

import torch_sparse_mla as tsm

I32, I64 = torch.int32, torch.int64


# =====================================================================================================
# DeepSeek-V4: sliding window (main cache) + indexer-selected compressed entries (extra cache)
# =====================================================================================================


class DeepSeekV4Step(torch.nn.Module):
    """Caches live in module buffers, so a reduce-overhead graph can write them."""

    def __init__(self, pages: int, comp_pages: int, page_size: int, ratio: int, window: int, device):
        super().__init__()
        self.page_size, self.comp_page_size, self.ratio, self.window = page_size, page_size // ratio, ratio, window
        # DeepSeek-V4 pads each page to a multiple of 576 bytes: page stride > page_size * 584.
        self.register_buffer("cache", self._padded_cache(pages, page_size, device))
        self.register_buffer("comp_cache", self._padded_cache(comp_pages, self.comp_page_size, device))

    @staticmethod
    def _padded_cache(pages: int, page_size: int, device) -> torch.Tensor:
        stride = -(-page_size * 584 // 576) * 576
        flat = torch.zeros(pages, stride, dtype=torch.uint8, device=device)
        return torch.as_strided(flat, (pages, page_size, 584), (stride, 584, 1))

    def forward(self, q, kv_new, comp_kv_new, query_start_loc, seq_lens, positions, token_to_req, slot_mapping,
                block_table, comp_block_table, local_topk, attn_sink):
        tsm.kv_cache_insert(kv_new, slot_mapping, self.cache, kv_format="fp8_584")
        comp_slots = tsm.compressed_slot_mapping(query_start_loc, seq_lens, comp_block_table,
                                                 num_tokens=positions.shape[0], block_size=self.comp_page_size,
                                                 compress_ratio=self.ratio)
        tsm.kv_cache_insert(comp_kv_new, comp_slots, self.comp_cache, kv_format="fp8_584")
        window_idx, window_len = tsm.swa_indices(positions, token_to_req, block_table, slot_mapping,
                                                 window=self.window, block_size=self.page_size)
        comp_idx, comp_len = tsm.compressed_topk_to_global(local_topk, token_to_req, comp_block_table, slot_mapping,
                                                           block_size=self.comp_page_size)
        out, lse = tsm.sparse_mla_decode(q, self.cache, window_idx, softmax_scale=512 ** -0.5, kv_format="fp8_584",
                                         topk_length=window_len, attn_sink=attn_sink, extra_kv_cache=self.comp_cache,
                                         extra_indices=comp_idx, extra_topk_length=comp_len)
        return out, lse, window_idx, window_len, comp_idx, comp_len


def _v4_inputs(step: int, seq0: torch.Tensor, bt: torch.Tensor, cbt: torch.Tensor, m: DeepSeekV4Step, heads: int,
               topk: int, device):
    """Inputs of decode step ``step``: every request has grown by ``step`` tokens."""
    g = torch.Generator().manual_seed(100 + step)
    batch = seq0.shape[0]
    seq_lens = seq0 + step
    positions = (seq_lens - 1).to(I64)
    slot_mapping = bt[torch.arange(batch), positions // m.page_size].to(I64) * m.page_size + positions % m.page_size
    completed = (positions + 1) // m.ratio
    local = torch.full((batch, topk), -1, dtype=I32)
    for r in range(batch):  # a stand-in indexer: random completed entries
        n = min(topk, int(completed[r]))
        local[r, :n] = torch.randperm(int(completed[r]), generator=g)[:n].to(I32)
    host = dict(
        q=torch.randn(batch, heads, 512, generator=g).to(torch.bfloat16),
        kv_new=torch.randn(batch, 512, generator=g),
        comp_kv_new=torch.randn(batch, 512, generator=g),
        query_start_loc=torch.arange(batch + 1, dtype=I32),
        seq_lens=seq_lens.to(I32),
        positions=positions,
        token_to_req=torch.arange(batch, dtype=I32),
        slot_mapping=slot_mapping,
        block_table=bt,
        comp_block_table=cbt,
        local_topk=local,
        attn_sink=torch.randn(heads, generator=g),
    )
    return {k: v.to(device) for k, v in host.items()}


def _reference_mla(m: DeepSeekV4Step, inputs, window_idx, window_len, comp_idx, comp_len):
    """float64 attention over the dequantised cache entries the index lists select."""
    q = inputs["q"].double().cpu()
    outs, lses = [], []
    for t in range(q.shape[0]):
        window = window_idx[t, : int(window_len[t])]
        compressed = comp_idx[t, : int(comp_len[t])]
        keys = [tsm.kv_cache_gather(m.cache, window, kv_format="fp8_584", dtype=torch.float32),
                tsm.kv_cache_gather(m.comp_cache, compressed, kv_format="fp8_584", dtype=torch.float32)]
        k = torch.cat(keys).double().cpu()
        k = k[torch.cat([window, compressed]).cpu() >= 0]
        scores = q[t] @ k.T * 512 ** -0.5
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.softmax(scores, dim=-1) @ k
        out = out * torch.sigmoid(lse - inputs["attn_sink"].double().cpu())[:, None]
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def deepseek_v4(device, compiled_mode: str | None) -> list[str]:
    batch, heads, page_size, ratio, window, topk = 4, 16, 64, 4, 128, 64
    g = torch.Generator().manual_seed(0)
    seq0 = torch.randint(150, 700, (batch,), generator=g)
    max_pages = (int(seq0.max()) + 8) // page_size + 1
    pages, comp_pages = batch * max_pages + 3, batch * max_pages + 3
    bt = torch.randperm(pages, generator=g)[: batch * max_pages].view(batch, max_pages).to(I32)
    cbt = torch.randperm(comp_pages, generator=g)[: batch * max_pages].view(batch, max_pages).to(I32)
    eager = DeepSeekV4Step(pages, comp_pages, page_size, ratio, window, device)

    # Fill the history: every earlier token in the window cache, every completed compressed entry.
    pos = torch.cat([torch.arange(int(s) - 1) for s in seq0])
    req = torch.cat([torch.full((int(s) - 1,), r) for r, s in enumerate(seq0)])
    hist_slots = (bt[req, pos // page_size].to(I64) * page_size + pos % page_size).to(device)
    tsm.kv_cache_insert(torch.randn(pos.shape[0], 512, generator=g).to(device), hist_slots, eager.cache,
                        kv_format="fp8_584")
    ent = torch.cat([torch.arange(int(s - 1) // ratio) for s in seq0])
    ereq = torch.cat([torch.full((int(s - 1) // ratio,), r) for r, s in enumerate(seq0)])
    cps = page_size // ratio
    comp_slots = (cbt[ereq, ent // cps].to(I64) * cps + ent % cps).to(device)
    tsm.kv_cache_insert(torch.randn(ent.shape[0], 512, generator=g).to(device), comp_slots, eager.comp_cache,
                        kv_format="fp8_584")
    compiled = DeepSeekV4Step(pages, comp_pages, page_size, ratio, window, device)
    compiled.load_state_dict(eager.state_dict())
    compiled_fn = torch.compile(compiled, fullgraph=True, mode=compiled_mode)

    lines = []
    for step in range(3):
        inputs = _v4_inputs(step, seq0, bt, cbt, eager, heads, topk, device)
        t0 = time.perf_counter()
        out, lse, widx, wlen, cidx, clen = eager(**inputs)
        ref_out, ref_lse = _reference_mla(eager, inputs, widx, wlen, cidx, clen)
        c_out, c_lse, *_ = [x.clone() for x in compiled_fn(**inputs)]  # clone: graph outputs are reused
        dt = time.perf_counter() - t0
        cache_same = torch.equal(compiled.cache, eager.cache) and torch.equal(compiled.comp_cache, eager.comp_cache)
        lines.append(
            f"  step {step}: window lens {wlen.tolist()}, compressed lens {clen.tolist()}; "
            f"eager vs float64 rel err {_rel(out.cpu(), ref_out):.1e} (lse {_rel(lse.cpu(), ref_lse):.1e}); "
            f"compiled vs eager {_rel(c_out, out):.1e}; caches identical: {cache_same} ({dt:.1f} s)"
        )
        assert _rel(out.cpu(), ref_out) < 2e-2 and _rel(c_out, out) < 1e-2 and cache_same
    return lines


# =====================================================================================================
# MiniMax-M3: sparse GQA over selected pages
# =====================================================================================================


def minimax_m3(device, compiled_mode: str | None) -> list[str]:
    batch, q_len, hq, hkv, dh, page_size, n_sel = 3, 2, 16, 2, 128, 64, 4
    g = torch.Generator().manual_seed(1)
    seq_lens = torch.randint(200, 900, (batch,), generator=g).to(I32)
    seq_lens[-1] = 0  # a padded request
    pages_per_req = 16
    block_table = torch.randperm(batch * pages_per_req + 2, generator=g)[: batch * pages_per_req]
    block_table = block_table.view(batch, pages_per_req).to(I32)
    cache = (torch.randn(batch * pages_per_req + 2, hkv, page_size, 2 * dh, generator=g) * 2).to(torch.float8_e4m3fn)
    rows = batch * q_len
    topk_pages = torch.stack([torch.randperm(pages_per_req, generator=g)[:n_sel] for _ in range(rows * hkv)])
    topk_pages = topk_pages.view(rows, hkv, n_sel).to(I32)
    topk_pages[0, 0, 1] = -1  # an empty selection entry
    q = torch.randn(rows, hq, dh, generator=g).to(torch.bfloat16)
    args = [x.to(device) for x in (q, cache, topk_pages, block_table, seq_lens)]
    k_scale, v_scale = 0.5, 0.25

    def step(q, cache, topk_pages, block_table, seq_lens):
        kv_lens, qo = tsm.decode_runtime_metadata(seq_lens, decode_query_len=q_len)
        return tsm.sparse_gqa_decode(q, cache, topk_pages, block_table, kv_lens, qo, decode_query_len=q_len,
                                     softmax_scale=dh ** -0.5, k_scale=k_scale, v_scale=v_scale)

    out = step(*args)
    compiled = torch.compile(step, fullgraph=True, mode=compiled_mode)
    c_out = compiled(*args).clone()
    # float64 reference: gather each row's selected pages, causal mask, softmax.
    ref = torch.zeros(rows, hq, dh, dtype=torch.float64)
    kv = cache.double()
    for t in range(rows):
        r, j = divmod(t, q_len)
        limit = int(seq_lens[r]) - q_len + j  # qo_offset
        for h in range(hq):
            kvh = h // (hq // hkv)
            keys, vals = [], []
            for b in topk_pages[t, kvh].tolist():
                if b < 0:
                    continue
                x = b * page_size + torch.arange(page_size)
                keep = (x <= limit) & (x < int(seq_lens[r]))
                page = kv[int(block_table[r, b]), kvh][keep]
                keys.append(page[:, :dh] * k_scale)
                vals.append(page[:, dh:] * v_scale)
            if keys:
                k, v = torch.cat(keys), torch.cat(vals)
                if k.shape[0]:
                    ref[t, h] = torch.softmax(q[t, h].double() @ k.T * dh ** -0.5, dim=0) @ v
    err, cerr = _rel(out.cpu(), ref), _rel(c_out, out)
    assert err < 2e-2 and cerr < 1e-2
    return [f"  rows {rows} (padded request included), Hq/Hkv {hq}/{hkv}, {n_sel} pages of {page_size}: "
            f"eager vs float64 rel err {err:.1e}; compiled vs eager {cerr:.1e}"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m torch_sparse_mla.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    mode = "reduce-overhead" if device.type == "cuda" else None
    print(f"torch_sparse_mla demo on {device} (torch {torch.__version__}); compile mode: {mode or 'default'}")
    from torch._dynamo.utils import counters

    counters.clear()
    print("DeepSeek-V4 sparse MLA decode (fp8_584 pages, window 128 + 64 compressed entries, 16 heads, sink):")
    for line in deepseek_v4(device, mode):
        print(line)
    print("MiniMax-M3 sparse GQA decode (fp8 cache, 2 query tokens per request):")
    for line in minimax_m3(device, mode):
        print(line)
    if device.type == "cuda":
        skips = counters["inductor"]["cudagraph_skips"]
        print(f"CUDA graphs: {skips} skipped captures (0 means every compiled step ran as a graph)")
        assert skips == 0
    print("OK")


if __name__ == "__main__":
    main()
