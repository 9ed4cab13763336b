"""The sm_90 MLA decode kernels (Gluon) cannot run without a Hopper GPU, but they compile anywhere:
build them for sm_90 with the installed Triton and check what each kernel's design promises.

- Each tile's tensor-core work is issued once.
  - Heads as rows (`mla_decode_wgmma`, warp-specialised), per consumer warp group and 128-token
    step: 36 `m64n64k16` instructions for its own block's scores (64 heads x 64 tokens, 576 deep)
    and 8 `m64n256k16` for P.V (256 of the 512 output dims, both blocks); two groups, so 72 + 16
    in the kernel. The `tl.dot` kernel has both warp groups compute every score.
  - Tokens as rows (`mla_decode_wgmma_narrow`, ≤ 32 heads): 36 `m64nHk16` for S^T (64 tokens x H
    heads, 576 deep) and 32 for O^T (8 blocks of 64 output dims x 4 steps of 16 tokens), H being
    16 or 32: no instruction carries padding rows.
- Each fits one multiprocessor: shared memory within the 227 KiB an sm_90 block may have, and no
  register spills (a spill in the loop would cost more than the tiling saves).
- The warp-specialised kernel brings whole blocks by TMA: per producer (one per buffer) and
  128-token step, its block in boxes of one 16-token page x 64 columns: 4 pages x (8 latent + 1 rope)
  = 36, so 72 in the kernel. At 64-token pages a block lies in one page and each half of its latent
  columns is one 3D box (4 chunks x 64 rows x 64 columns): 2 3D boxes and 1 rope box a producer,
  4 + 2 in the kernel. Without a TMA descriptor (pages under 8 tokens, pages not back to back) it
  gathers by `cp.async` and issues none. With a descriptor for the output (whole blocks of heads, no
  split partials) each consumer group stores its half of the output by TMA: 4 boxes of 64 heads x 64
  dims, 8 in the kernel.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from deepinfer_kernels.triton_impl import mla_decode_wgmma, mla_decode_wgmma_narrow
except (ImportError, AttributeError) as exc:  # a Triton without Gluon, or an older Gluon
    pytest.skip(f"no Gluon front end for the sm_90 kernel: {exc}", allow_module_level=True)

SM90_SHARED_LIMIT = 227 * 1024
POINTERS = ("qn_ptr", "qp_ptr", "cache_ptr", "bt_ptr", "seq_lens_ptr", "out_ptr", "lse_ptr")
STRIDES = ("stride_qnb", "stride_qnh", "stride_qpb", "stride_qph", "stride_cb", "stride_cs", "stride_btb",
           "stride_ob", "stride_oh", "stride_os", "stride_lb", "stride_lh")  # fmt: skip


HEADS_AS_ROWS = {"m64n64k16": 72, "m64n256k16": 16}
# name: (module, kernel, heads per tile, split partials, TMA, page, instruction shape -> count, TMA
# boxes loaded (2D, 3D), TMA boxes stored, stack bytes allowed). The warp-specialised kernel may keep a few values
# on the stack: none with Triton 3.6 (8 bytes in its `cp.async` producers), 96 bytes with Triton 3.9
# (a few values of the second consumer and the producers' partial-block row addresses), 136 at 64-token
# pages (the producers also hold the block's page row across their wait). What it must
# not do is spill its consumers' operands, which took 384-504 bytes of stack when its buffers'
# shared-memory descriptors were hoisted out of the loops.
WS = (mla_decode_wgmma, "_mla_decode_wgmma_kernel", 64)
KERNELS = {
    "heads as rows": (*WS, False, True, 16, HEADS_AS_ROWS, (72, 0), 8, 128),
    "heads as rows, 64-token pages": (*WS, False, True, 64, HEADS_AS_ROWS, (2, 4), 8, 160),
    "heads as rows, split partials": (*WS, True, True, 16, HEADS_AS_ROWS, (72, 0), 0, 128),
    "heads as rows, cp.async": (*WS, False, False, 16, HEADS_AS_ROWS, (0, 0), 8, 128),
    "tokens as rows, 16 heads": (mla_decode_wgmma_narrow, "_mla_decode_narrow_kernel", 16, True, None, 16,
                                 {"m64n16k16": 68}, (0, 0), 0, 0),
    "tokens as rows, 32 heads": (mla_decode_wgmma_narrow, "_mla_decode_narrow_kernel", 32, True, None, 16,
                                 {"m64n32k16": 68}, (0, 0), 0, 0),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(KERNELS))
def compiled(request):
    module, name, block_h, write_lse, use_tma, page = KERNELS[request.param][:6]
    fn = getattr(module, name)
    consts = dict(LORA=512, ROPE=64, PAGE=page, BLOCK_H=block_h, BLOCK_N=module.BLOCK_N, WRITE_LSE=write_lse)
    sig = {name: "*bf16" for name in POINTERS} | {"bt_ptr": "*i32", "seq_lens_ptr": "*i32", "lse_ptr": "*fp32"}
    sig |= {name: "i32" for name in STRIDES} | {"qk_scale": "fp32", "NUM_HEADS": "i32", "num_splits": "i32"}
    if use_tma is not None:
        consts["USE_TMA"] = use_tma
        rows = min(page, module.BLOCK_N)
        box = gl.NVMMASharedLayout.get_default_for([rows, 64], gl.bfloat16)
        sig["cache_desc"] = f"tensordesc<bf16[{rows}, 64],{box!r}>" if use_tma else "constexpr"
        if not use_tma:
            consts["cache_desc"] = None
        # a block in one page: each half's latent columns as one 3D box of 4 chunks
        if use_tma and page >= module.BLOCK_N:
            sig["chunk_desc"] = f"tensordesc<bf16[4, {rows}, 64],{module.CHUNKS_LAYOUT.value!r}>"
        else:
            sig["chunk_desc"] = "constexpr"
            consts["chunk_desc"] = None
        # the output by TMA: whole blocks of heads, no split partials
        out_box = gl.NVMMASharedLayout.get_default_for([block_h, 64], gl.bfloat16)
        sig["out_desc"] = "constexpr" if write_lse else f"tensordesc<bf16[{block_h}, 64],{out_box!r}>"
        if write_lse:
            consts["out_desc"] = None
    sig |= {name: "constexpr" for name in consts}
    aligned = [n for n in POINTERS + STRIDES if n not in ("stride_os", "stride_lh")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(fn, {n: sig[n] for n in fn.arg_names}, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=module.NUM_WARPS))
    return kernel, *KERNELS[request.param][-4:]


def test_each_tile_issues_its_tensor_core_work_once(compiled) -> None:
    kernel, expected, _, _, _ = compiled
    shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", kernel.asm["ptx"])
    assert {shape: shapes.count(shape) for shape in set(shapes)} == expected, shapes


def test_whole_blocks_come_and_go_by_tma(compiled) -> None:
    kernel, _, loaded, stored, _ = compiled
    ptx = kernel.asm["ptx"]
    boxes = tuple(len(re.findall(rf"cp\.async\.bulk\.tensor\.{d}d\.shared::\w+\.global", ptx)) for d in (2, 3))
    assert boxes == loaded
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.global\.shared", ptx)) == stored


def test_fits_one_multiprocessor_without_spills(compiled) -> None:
    compiled, _, _, _, max_stack = compiled
    assert compiled.metadata.shared <= SM90_SHARED_LIMIT
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        pytest.skip("Triton ships no cuobjdump here")
    with open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"mla_sm90_{os.getpid()}.cubin"), "wb") as f:
        f.write(compiled.asm["cubin"])
    try:
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    line = next(ln for ln in usage.splitlines() if "REG:" in ln)
    assert "LOCAL:0 " in line and int(re.search(r"STACK:(\d+)", line).group(1)) <= max_stack, line


def test_heads_as_rows_rescales_lazily_per_warp(compiled) -> None:
    """Three accumulator rescalings a step (group 0 twice, group 1 once), each decided by a warp vote
    and skipped as one branch around the thread's 128 multiplications."""
    kernel = compiled[0]
    if kernel.name != "_mla_decode_wgmma_kernel":
        pytest.skip("the tokens-as-rows kernel keeps its own softmax")
    ptx = kernel.asm["ptx"]
    assert len(re.findall(r"vote\.sync\.any\.pred", ptx)) == 3
    skipped = re.findall(r"@\S+ bra\.uni (\w+);((?:\s*mul\.f32[^;]*;)+)\s*\1:", ptx)
    assert [body.count("mul.f32") for _, body in skipped] == [mla_decode_wgmma.ACC_PER_THREAD] * 3


@pytest.mark.parametrize(
    "page, boxes",
    [
        (4, (None, None)),  # under 8 rows: cp.async
        (8, ([8, 64], None)),
        (16, ([16, 64], None)),
        (48, (None, None)),  # a 64-token block would straddle two pages: cp.async
        (64, ([64, 64], [4, 64, 64])),  # a block is one page: 3D boxes of a half's four column chunks
        (96, (None, None)),
        (128, ([64, 64], [4, 64, 64])),
    ],
)
def test_tma_reads_the_cache_only_where_blocks_tile_its_pages(page, boxes) -> None:
    """The heads-as-rows kernel's TMA boxes never cross a page: a box is a page or a block's piece of
    one, so pages that 64-token blocks do not tile (and pages not back to back) are gathered instead."""
    cache = torch.zeros(6, page, 576, dtype=torch.bfloat16)
    descs = mla_decode_wgmma._rows_descriptors(cache)
    assert tuple(d.block_shape if d is not None else None for d in descs) == boxes
    apart = torch.zeros(6, 2 * page, 576, dtype=torch.bfloat16)[:, :page]  # each page followed by a gap
    assert mla_decode_wgmma._rows_descriptors(apart) == (None, None)
