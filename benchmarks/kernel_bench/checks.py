"""`python -m benchmarks.kernel_bench --check`: every Triton kernel against its torch reference.

Inputs are random with odd sizes (no dimension a multiple of a kernel's tile), block tables
are shuffled and padded past the longest context. Attention and MoE references run on fp32
copies of the inputs; elementwise ops against the reference in the same dtype (they repeat
its roundings). The score is ||out - ref|| / ||ref||; a NaN never passes.
On CPU the kernels run in the Triton interpreter (`TRITON_INTERPRET=1`) at small sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer_kernels import ops
from deepinfer_kernels.attention_refs import paged_decode_attention_ref, paged_prefill_attention_ref
from deepinfer_kernels.fp8 import quantize_block_fp8
from deepinfer_kernels.fused_moe import fused_experts_ref, moe_align_ref, moe_topk_ref
from deepinfer_kernels.mla_decode import mla_decode_attention_ref
from deepinfer_kernels.registry import triton_module


@dataclass
class CheckResult:
    kernel: str
    case: str
    error: float
    tol: float

    @property
    def ok(self) -> bool:
        return not math.isnan(self.error) and self.error <= self.tol


def _poison_unowned(cache: torch.Tensor, bt: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    """Stale NaN in every latent-cache slot no sequence owns (block 0, the tail of each last block),
    after the reference has been computed: a kernel that lets 0 * NaN into its accumulator fails."""
    page = cache.shape[1]
    cache[0] = float("nan")
    for i, n in enumerate(seq_lens):
        if n % page:
            cache[bt[i, (n - 1) // page].long(), n % page :] = float("nan")
    return cache


class Checker:
    def __init__(self, device: torch.device, seed: int, small: bool):
        self.device = device
        self.small = small
        self.dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.results: list[CheckResult] = []

    # -- helpers -----------------------------------------------------------------------------
    def randn(self, *shape, dtype=None, scale=1.0) -> torch.Tensor:
        x = torch.randn(*shape, generator=self.gen, device=self.device, dtype=torch.float32) * scale
        return x.to(dtype or self.dtype)

    def randint(self, high: int, shape) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.gen, device=self.device)

    def tol(self, dtype: torch.dtype | None = None) -> float:
        return 1e-4 if (dtype or self.dtype) == torch.float32 else 2e-2

    def record(self, kernel: str, case: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
        out, ref = out.double(), ref.double()
        err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if torch.isnan(out).any():
            err = float("nan")
        self.results.append(CheckResult(kernel, case, err, tol))

    def paged(self, seq_lens: list[int], page: int, extra_width: int = 3) -> tuple[int, torch.Tensor]:
        """(blocks the cache needs, shuffled block tables padded `extra_width` past the longest)."""
        need = [(n + page - 1) // page for n in seq_lens]
        num_blocks = sum(need) + 5
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(len(seq_lens))).tolist()
        width = max(need) + extra_width
        tables = []
        for n in need:
            row = [perm.pop() for _ in range(n)]
            tables.append(row + [row[-1]] * (width - n))  # padding points at a real block
        bt = torch.tensor(tables, dtype=torch.int32, device=self.device)
        return num_blocks, bt

    # -- checks ------------------------------------------------------------------------------
    def rms_norm(self) -> None:
        T, H = (13, 72) if self.small else (37, 1000)
        x, res, w = self.randn(T, H), self.randn(T, H), self.randn(H)
        out = ops.rms_norm(x, w, 1e-6, backend="triton")
        self.record("rms_norm", f"T={T} H={H}", out, ops.rms_norm(x, w, 1e-6, backend="torch"), self.tol())
        out, summed = ops.rms_norm(x, w, 1e-6, res, backend="triton")
        ref, ref_sum = ops.rms_norm(x, w, 1e-6, res, backend="torch")
        self.record(
            "rms_norm", f"T={T} H={H} +residual", torch.cat([out, summed]), torch.cat([ref, ref_sum]), self.tol()
        )

    def rotary(self) -> None:
        T, H, D = (11, 3, 24) if self.small else (29, 7, 80)
        table = self.randn(64, D, dtype=torch.float32)
        pos = self.randint(64, (T,))
        cos, sin = table[pos].chunk(2, dim=-1)
        x = self.randn(T, H, D)
        out = ops.rotary(x, cos, sin, backend="triton")
        self.record("rotary", f"T={T} H={H} D={D}", out, ops.rotary(x, cos, sin, backend="torch"), self.tol())

    def reshape_and_cache(self) -> None:
        T, hkv, d, page = (9, 3, 24, 4) if self.small else (23, 3, 40, 16)
        num_blocks = (T + page - 1) // page + 3
        cache = self.randn(num_blocks, 2, page, hkv, d)
        slots = torch.randperm(num_blocks * page, generator=torch.Generator().manual_seed(T))[:T].to(self.device)
        slots[::4] = -1
        k, v = self.randn(T, hkv, d), self.randn(T, hkv, d)
        ref = cache.clone()
        ops.reshape_and_cache(k, v, cache, slots, backend="triton")
        ops.reshape_and_cache(k, v, ref, slots, backend="torch")
        self.record("reshape_and_cache", f"T={T} Hkv={hkv} D={d} page={page}", cache, ref, 0.0)

    def copy_blocks(self) -> None:
        L, N, shape = (2, 9, (2, 4, 3, 8)) if self.small else (3, 11, (2, 16, 3, 40))
        buf = self.randn(L, N, *shape)
        src = torch.tensor([0, 3, 5], device=self.device)
        dst = torch.tensor([7, 1, 8], device=self.device)
        ref = buf.clone()
        ops.copy_blocks(buf, src, dst, backend="triton")
        ops.copy_blocks(ref, src, dst, backend="torch")
        self.record("copy_blocks", f"L={L} N={N} block={shape}", buf, ref, 0.0)

    def decode_attention(self) -> None:
        hq, hkv, d, page = (6, 2, 24, 4) if self.small else (12, 3, 80, 16)
        seq_lens = [1, 37, 20] if self.small else [1, 37, 200, 777, 64]
        num_blocks, bt = self.paged(seq_lens, page)
        cache = self.randn(num_blocks, 2, page, hkv, d)
        q = self.randn(len(seq_lens), hq, d)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=self.device)
        scale = d**-0.5
        ref = paged_decode_attention_ref(q.float(), cache.float(), bt, lens, scale)
        impl = triton_module("decode_attention").paged_decode_attention
        for splits in (None, 1, 3):
            out = impl(q, cache, bt, lens, scale, num_splits=splits)
            self.record(
                "paged_decode_attention",
                f"B={len(seq_lens)} Hq={hq} Hkv={hkv} D={d} splits={splits}",
                out,
                ref,
                self.tol(),
            )

    def prefill_attention(self) -> None:
        hq, hkv, d, page = (4, 2, 24, 4) if self.small else (6, 2, 40, 16)
        cached, new = ([0, 5, 9], [19, 1, 7]) if self.small else ([0, 50, 29, 0], [37, 1, 70, 129])
        seq_lens = [c + n for c, n in zip(cached, new)]
        num_blocks, bt = self.paged(seq_lens, page)
        cache = self.randn(num_blocks, 2, page, hkv, d)
        q = self.randn(sum(new), hq, d)
        qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=self.device)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=self.device)
        scale = d**-0.5
        ref = paged_prefill_attention_ref(q.float(), cache.float(), bt, qsl, lens, max(new), scale)
        out = ops.paged_prefill_attention(q, cache, bt, qsl, lens, max(new), scale, backend="triton")
        self.record(
            "paged_prefill_attention", f"cached={cached} new={new} Hq={hq} Hkv={hkv} D={d}", out, ref, self.tol()
        )

    def mla_decode(self) -> None:
        H, lora, rope, page = (5, 40, 8, 4) if self.small else (10, 72, 24, 16)
        seq_lens = [1, 29, 13] if self.small else [1, 37, 300, 129]
        num_blocks, bt = self.paged(seq_lens, page)
        bt = bt + 1  # block 0 belongs to no sequence
        cache = self.randn(num_blocks + 1, page, lora + rope)
        qn, qp = self.randn(len(seq_lens), H, lora), self.randn(len(seq_lens), H, rope)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=self.device)
        scale = (lora // 2 + rope) ** -0.5
        ref = mla_decode_attention_ref(qn.float(), qp.float(), cache.float(), bt, lens, scale)
        _poison_unowned(cache, bt, seq_lens)
        impl = triton_module("mla_decode").mla_decode_attention
        default = triton_module("mla_decode").default_config(H, lora, qn.dtype)
        for splits, tail_only in ((None, False), (1, False), (3, False), (1, True), (3, True)):
            out = impl(qn, qp, cache, bt, lens, scale, num_splits=splits, config={**default, "TAIL_ONLY": tail_only})
            case = f"B={len(seq_lens)} H={H} lora={lora} rope={rope} splits={splits}" + (" tail-only masks" * tail_only)
            self.record("mla_decode_attention", case, out, ref, self.tol())
        if self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) == (9, 0):
            self.mla_decode_hopper()

    def mla_decode_hopper(self) -> None:
        """The sm_90 warp-group kernels at DeepSeek's latent dims: ragged lengths (tails inside a page,
        a 64-token block and a 128-token step), a partial head block, stale NaN past every sequence,
        splits, page sizes 16, 8, 64 and 128 (TMA boxes of a page; from 64, 3D boxes of a block's
        four column chunks), 4, 48, 96 (blocks that straddle pages) and pages that are not back to back
        (no TMA: `cp.async` rows), and scores that keep rising along each sequence (every block moves
        the running maximum: the accumulators' rescaling)."""
        lora, rope = 512, 64
        seq_lens = [1, 37, 300, 129, 64, 1000, 192]
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=self.device)
        scale = 192**-0.5
        impl = triton_module("mla_decode")
        # 32, 20 and 16 heads (a tensor-parallel rank's share): tokens as the MMA's rows, 20 with padded
        # columns; 16 again with heads as rows, most of the tile's rows empty
        cases = [(128, "auto", 16), (80, "auto", 16), (32, "auto", 16), (20, "auto", 16), (16, "auto", 16),
                 (16, "wgmma", 16), (128, "auto", 8), (128, "auto", 64), (16, "auto", 64), (128, "auto", 128),
                 (128, "auto", 4), (128, "auto", 48), (128, "auto", 96), (128, "auto", -16),
                 (128, "auto", 16, "rising"), (32, "auto", 16, "rising")]  # fmt: skip
        for H, kernel, page, *rising in cases:
            apart, page = page < 0, abs(page)  # negative: each page followed by a page-sized gap
            num_blocks, bt = self.paged(seq_lens, page)
            bt = bt + 1
            cache = self.randn(num_blocks + 1, page, lora + rope)
            if rising:  # row t of a sequence scaled by 1 + t / 64
                pos = torch.zeros(num_blocks + 1, page, device=self.device)
                for b, n in enumerate(seq_lens):
                    for w in range((n + page - 1) // page):
                        pos[bt[b, w]] = w * page + torch.arange(page, device=self.device)
                cache = (cache.float() * (1 + pos[..., None] / 64)).to(cache.dtype)
            qn, qp = self.randn(len(seq_lens), H, lora), self.randn(len(seq_lens), H, rope)
            ref = mla_decode_attention_ref(qn.float(), qp.float(), cache.float(), bt, lens, scale)
            stale = _poison_unowned(cache.clone(), bt, seq_lens)
            if apart:
                spaced = torch.full((num_blocks + 1, 2 * page, lora + rope), float("nan"), device=self.device,
                                    dtype=stale.dtype)  # fmt: skip
                spaced[:, :page] = stale
                stale = spaced[:, :page]
            for splits in (None, 1, 3):
                out = impl.mla_decode_attention(qn, qp, stale, bt, lens, scale, num_splits=splits,
                                                config={"kernel": kernel})  # fmt: skip
                layout = (", pages apart" if apart else "") + (", rising scores" if rising else "")
                case = f"B={len(seq_lens)} H={H} page={page}{layout} splits={splits} sm_90 kernel={kernel}"
                self.record("mla_decode_attention", case, out, ref, self.tol())

    def moe_topk(self) -> None:
        T = 7 if self.small else 19
        cases = {
            "softmax E=24 k=5": dict(E=24, top_k=5, scoring="softmax"),
            "sigmoid+bias E=48 groups 6/3 k=4": dict(
                E=48, top_k=4, scoring="sigmoid", num_groups=6, topk_groups=3, bias=True, routed_scaling_factor=2.5
            ),  # fmt: skip
            "softmax E=40 groups 5/2 k=3 no renorm": dict(
                E=40, top_k=3, num_groups=5, topk_groups=2, renormalize=False
            ),
        }
        for name, c in cases.items():
            c = dict(c)
            E, top_k = c.pop("E"), c.pop("top_k")
            if c.pop("bias", False):
                c["correction_bias"] = self.randn(E, dtype=torch.float32, scale=0.1)
            logits = self.randn(T, E, dtype=torch.float32)
            w, ids = ops.moe_topk(logits, top_k, backend="triton", **c)
            rw, rids = moe_topk_ref(logits, top_k, **c)
            same = torch.equal(ids.sort(dim=1).values, rids.sort(dim=1).values)
            w_by_id = w.gather(1, ids.long().argsort(dim=1))
            rw_by_id = rw.gather(1, rids.long().argsort(dim=1))
            if same:
                self.record("moe_topk", f"T={T} {name}", w_by_id, rw_by_id, 1e-5)
            else:
                self.results.append(CheckResult("moe_topk", f"T={T} {name} (ids differ)", float("nan"), 0.0))

    def moe_align(self) -> None:
        T, k, E, bm = (7, 3, 10, 4) if self.small else (19, 5, 24, 16)
        ids = self.randint(E, (T, k)).to(torch.int32)
        out = ops.moe_align(ids, E, bm, backend="triton")
        ref = moe_align_ref(ids, E, bm)
        ok = torch.equal(out[1], ref[1]) and torch.equal(out[2], ref[2])
        used = int(ref[2].item())

        def canonical(sorted_ids, expert_ids):  # rows of one expert in any order
            experts = expert_ids.repeat_interleave(bm)[:used].long()
            return (experts * (T * k + 1) + sorted_ids[:used].long()).sort().values

        ok = ok and torch.equal(canonical(out[0], out[1]), canonical(ref[0], ref[1]))
        self.results.append(
            CheckResult("moe_align", f"T={T} k={k} E={E} block_m={bm}", 0.0 if ok else float("nan"), 0.0)
        )

    def fused_experts(self) -> None:
        T, H, inter, E, k = (5, 24, 40, 6, 2) if self.small else (19, 72, 40, 12, 3)
        x = self.randn(T, H)
        w13, w2 = self.randn(E, 2 * inter, H, scale=H**-0.5), self.randn(E, H, inter, scale=inter**-0.5)
        weights, ids = moe_topk_ref(self.randn(T, E, dtype=torch.float32), k)
        ref = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
        out = ops.fused_experts(x, w13, w2, weights, ids, backend="triton")
        self.record("fused_experts", f"T={T} H={H} I={inter} E={E} k={k}", out, ref, self.tol())
        if not self.small:  # prefill-sized tiles too (many rows per expert)
            T = 301
            x = self.randn(T, H)
            weights, ids = moe_topk_ref(self.randn(T, E, dtype=torch.float32), k)
            ref = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
            out = ops.fused_experts(x, w13, w2, weights, ids, backend="triton")
            self.record("fused_experts", f"T={T} H={H} I={inter} E={E} k={k}", out, ref, self.tol())
        # expert weights through TMA descriptors (the prefill tiles' loads on sm_90+), odd sizes
        impl = triton_module("fused_moe")
        up, down = (dict(c, TMA=True) for c in impl.default_configs(T * k, E, x.dtype))
        out = impl.fused_experts(x, w13, w2, weights, ids, configs=(up, down))
        self.record("fused_experts", f"T={T} H={H} I={inter} E={E} k={k} TMA", out, ref, self.tol())
        self.fused_experts_fp8()

    def fused_experts_fp8(self) -> None:
        """Block-scaled FP8 expert weights: blocks that do not divide the sizes (partial last blocks,
        the up half's factors starting mid-way), decode- and prefill-sized batches."""
        T, H, inter, E, k = (5, 24, 40, 6, 2) if self.small else (19, 200, 136, 12, 3)
        block = (16, 16) if self.small else (64, 64)
        gate, up, down = (self.randn(E, inter, H, scale=H**-0.5), self.randn(E, inter, H, scale=H**-0.5),
                          self.randn(E, H, inter, scale=inter**-0.5))  # fmt: skip
        (gq, gs), (uq, us), (w2, s2) = (quantize_block_fp8(w, block) for w in (gate, up, down))
        w13, s13 = torch.cat([gq, uq], dim=1), torch.cat([gs, us], dim=1)
        for rows in (T, 7 * T if self.small else 301):
            x = self.randn(rows, H)
            weights, ids = moe_topk_ref(self.randn(rows, E, dtype=torch.float32), k)
            fp8 = dict(w13_scale=s13, w2_scale=s2, fp8_block=block)
            ref = fused_experts_ref(x.float(), w13, w2, weights, ids, **fp8)
            out = ops.fused_experts(x, w13, w2, weights, ids, backend="triton", **fp8)
            self.record(
                "fused_experts", f"T={rows} H={H} I={inter} E={E} k={k} FP8 {list(block)}", out, ref, self.tol()
            )

    def all_checks(self) -> dict[str, Callable[[], None]]:
        return {
            "rms_norm": self.rms_norm,
            "rotary": self.rotary,
            "reshape_and_cache": self.reshape_and_cache,
            "copy_blocks": self.copy_blocks,
            "paged_decode_attention": self.decode_attention,
            "paged_prefill_attention": self.prefill_attention,
            "mla_decode_attention": self.mla_decode,
            "moe_topk": self.moe_topk,
            "moe_align": self.moe_align,
            "fused_experts": self.fused_experts,
        }


def run_checks(device: torch.device, seed: int, small: bool, only: list[str] | None = None) -> list[CheckResult]:
    checker = Checker(device, seed, small)
    for name, check in checker.all_checks().items():
        if not only or name in only:
            try:
                check()
            except Exception as exc:  # a crash is a failed check, reported with the others
                checker.results.append(CheckResult(name, f"raised {type(exc).__name__}: {exc}", float("nan"), 0.0))
    return checker.results
