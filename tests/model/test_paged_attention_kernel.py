"""The compiled paged-attention kernel against a plain fp64 softmax-attention reference.

Each case scatters random sequences over shuffled cache blocks (block 0, the null block, filled
with NaN and never referenced), so a read outside a sequence's own visible slots shows as NaN or
a wrong value.
"""

import math
import os

import pytest
import torch

from prefixserve.model.kernels import build as kernels
from prefixserve.model.kernels.build import paged_attention_kernel

kernel = paged_attention_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the kernel could not be built here")


def test_kernel_is_built_where_required():
    """`make test` sets PREFIXSERVE_REQUIRE_KERNEL=1: there a failed build fails the suite instead
    of quietly testing only the PyTorch fallback."""
    if os.environ.get("PREFIXSERVE_REQUIRE_KERNEL") == "1":
        assert kernel is not None, "the paged attention kernel did not build (see the warning)"
    elif kernel is None:
        pytest.skip("the kernel could not be built here")


@needs_kernel
@pytest.mark.timeout(300)
def test_a_stale_build_lock_does_not_hang_the_start():
    """A build killed mid-way leaves torch's `lock` file behind; the next start must not wait on
    it forever."""
    build_dir = kernels._build_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "lock").write_text("")
    assert kernels._build() is not None
    assert not (build_dir / "lock").exists()


def test_each_checkout_and_sources_digest_builds_in_a_directory_of_its_own(monkeypatch, tmp_path):
    """Two checkouts (or two versions of csrc/) never share a build directory: torch would
    rebuild one over the other at every start."""
    here = kernels._build_dir()
    assert here.parent.name == kernels._build_tag()
    monkeypatch.setattr(kernels, "_CSRC", tmp_path / "other-checkout" / "csrc")
    assert kernels._build_dir() != here
    assert kernels._build_dir().parent == here.parent


def test_old_builds_are_pruned_unless_one_is_being_built(tmp_path):
    """The most recently used builds stay; an older one goes, unless a process holds its lock."""
    import fcntl
    import os

    dirs = []
    for i in range(kernels.MAX_KEPT_BUILDS + 3):
        d = tmp_path / f"build{i}"
        d.mkdir()
        (d / kernels._LOCK_NAME).touch()  # as a build leaves it (before the times are set)
        os.utime(d, (1000 + i, 1000 + i))
        dirs.append(d)
    busy = dirs[0]  # the oldest, but a build holds it
    with open(busy / kernels._LOCK_NAME, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        kernels._prune_builds(tmp_path, keep=dirs[1])
    left = sorted(p.name for p in tmp_path.iterdir())
    newest = [d.name for d in dirs[-(kernels.MAX_KEPT_BUILDS - 1) :]]
    assert left == sorted({busy.name, dirs[1].name, *newest})


def test_the_build_flags_name_no_x86_option_on_another_architecture(monkeypatch):
    """-mprefer-vector-width is an x86 option (aarch64's compiler refuses it): on another
    architecture the build asks only for -march=native and the common flags."""
    monkeypatch.delenv("PREFIXSERVE_KERNEL_MARCH", raising=False)
    monkeypatch.setattr(kernels.platform, "machine", lambda: "aarch64")
    flags = kernels._cflags()
    assert "-march=native" in flags and not any("vector-width" in f for f in flags)
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    assert "-mprefer-vector-width=512" in kernels._cflags()


def test_a_kernel_march_builds_for_that_target_under_its_own_tag(monkeypatch):
    """PREFIXSERVE_KERNEL_MARCH builds another kind's kernels (an AVX2 build on an AVX-512
    host) in a build directory of its own; a value that is not a target name never reaches the
    compiler's command line."""
    monkeypatch.delenv("PREFIXSERVE_KERNEL_MARCH", raising=False)
    native_tag = kernels._build_tag()
    monkeypatch.setenv("PREFIXSERVE_KERNEL_MARCH", "Haswell")
    assert "-march=haswell" in kernels._cflags()
    assert kernels._build_tag() != native_tag
    for bad in ("native -fplugin=x.so", "haswell;rm", "../x", "-O0"):
        monkeypatch.setenv("PREFIXSERVE_KERNEL_MARCH", bad)
        with pytest.raises(ValueError, match="PREFIXSERVE_KERNEL_MARCH"):
            kernels._cflags()


def reference(q, keys, values, positions, scale, softcap, window):
    """q [n, H, D]; keys/values [L, KVH, D] of positions 0..L-1; positions of the n queries."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    k = keys.double().repeat_interleave(heads // kv_heads, dim=1)
    v = values.double().repeat_interleave(heads // kv_heads, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, p in enumerate(positions):
        lo = max(0, p - window + 1) if window else 0
        scores = torch.einsum("hd,lhd->hl", q[i].double(), k[lo : p + 1]) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[lo : p + 1])
    return out.reshape(len(positions), -1)


def build_case(seqs, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """seqs: list of (num_computed, num_new). Returns the kernel inputs and per-seq truths."""
    g = torch.Generator().manual_seed(seed)
    lengths = [c + n for c, n in seqs]
    need = sum(-(-n // block_size) for n in lengths)
    num_blocks = need + 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    k_cache[0] = float("nan")
    v_cache[0] = float("nan")
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables, info, truths = [], [], []
    rows = sum(n for _, n in seqs)
    q = torch.randn(rows, heads, head_dim, generator=g).to(dtype)
    row = 0
    for computed, new in seqs:
        length = computed + new
        table = [free.pop() for _ in range(-(-length // block_size))]
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(length)]
        )
        keys = k_cache.view(-1, kv_heads, head_dim)[slots]
        values = v_cache.view(-1, kv_heads, head_dim)[slots]
        tables.append(table)
        info.append((row, row + new, computed))
        truths.append((row, list(range(computed, length)), keys, values))
        row += new
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, torch.tensor(info, dtype=torch.int64), truths


CASES = {
    "decode_batch": [(37, 1), (5, 1), (160, 1), (0, 1)],
    "prefill_whole": [(0, 45)],
    "chunk_over_cached_prefix": [(64, 33), (17, 3)],
    "mixed_step": [(100, 1), (31, 1), (0, 20), (48, 40)],
    # Decode rows of 12 sequences: on up to 3 threads, enough that a work unit of the lanes path
    # takes all KV heads of its row (test_attention_lanes.py reaches it on more).
    "large_decode_batch": [(n, 1) for n in (3, 64, 65, 200, 17, 128, 90, 1, 33, 150, 77, 0)],
}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [0, 24])
def test_kernel_matches_reference_attention(case, dtype, window):
    heads, kv_heads, head_dim, block_size = 6, 2, 64, 16
    q, kc, vc, tables, info, truths = build_case(
        CASES[case], heads, kv_heads, head_dim, block_size, dtype
    )
    check_against_reference(kernel, q, kc, vc, tables, info, truths, window)


def check_against_reference(fn, q, k_cache, v_cache, tables, info, truths, window):
    """Run the kernel `fn` on a case (build_case's tensors) and compare every sequence's rows
    with `reference` over its truths (keys and values in float64)."""
    heads, head_dim = q.shape[1], q.shape[2]
    out = torch.full((q.shape[0], heads * head_dim), float("nan"), dtype=q.dtype)
    scale = 1 / math.sqrt(head_dim)
    fn(out, q, k_cache, v_cache, tables, info, scale, 0.0, window)
    tol = 1e-5 if q.dtype == torch.float32 else 2e-2
    for row, positions, keys, values in truths:
        want = reference(q[row : row + len(positions)], keys, values, positions, scale, 0, window)
        got = out[row : row + len(positions)].double()
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # portable path, lanes path
@pytest.mark.parametrize("case", ["large_decode_batch", "mixed_step"])
def test_kernel_gives_the_same_bits_on_any_number_of_pool_threads(case, dtype):
    """The work items run on the caller and `threads - 1` stream-pool helpers, claimed in any
    order (and, in the lanes path, all KV heads a unit only where the items are many for the
    threads): every row's bits are the same on 1 to 4 threads and on OpenMP's count (0). The
    output starts as NaN, so an item no thread ran shows."""
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    q, kc, vc, tables, info, _ = build_case(
        CASES[case], heads, kv_heads, head_dim, block_size, dtype
    )
    outs = []
    for threads in (1, 2, 3, 4, 0):
        out = torch.full((q.shape[0], heads * head_dim), float("nan"), dtype=dtype)
        kernel(out, q, kc, vc, tables, info, 0.125, 0.0, 0, threads)
        assert not out.isnan().any()
        outs.append(out)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@needs_kernel
def test_kernel_softcap_and_odd_shapes():
    """Logit soft-capping, no GQA, a head dim and block size that are not powers of two."""
    heads, kv_heads, head_dim, block_size = 3, 3, 40, 5
    q, kc, vc, tables, info, truths = build_case(
        [(12, 1), (0, 9), (7, 6)], heads, kv_heads, head_dim, block_size, torch.float32, seed=3
    )
    out = torch.empty(q.shape[0], heads * head_dim)
    kernel(out, q * 4, kc, vc, tables, info, 0.125, 5.0, 0)
    for row, positions, keys, values in truths:
        want = reference(q[row : row + len(positions)] * 4, keys, values, positions, 0.125, 5.0, 0)
        torch.testing.assert_close(
            out[row : row + len(positions)].double(), want, atol=1e-5, rtol=1e-5
        )


@needs_kernel
def test_kernel_reads_a_strided_query_view():
    """q may be a view into a fused QKV projection (rows strided, last dim contiguous)."""
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 16
    q, kc, vc, tables, info, truths = build_case(
        [(20, 1), (3, 1)], heads, kv_heads, head_dim, block_size, torch.float32, seed=5
    )
    fused = torch.randn(q.shape[0], heads * head_dim * 2)
    fused[:, : heads * head_dim] = q.reshape(q.shape[0], -1)
    view = fused[:, : heads * head_dim].view(q.shape[0], heads, head_dim)
    a = torch.empty(q.shape[0], heads * head_dim)
    b = torch.empty_like(a)
    kernel(a, q, kc, vc, tables, info, 0.2, 0.0, 0)
    kernel(b, view, kc, vc, tables, info, 0.2, 0.0, 0)
    assert torch.equal(a, b)


@needs_kernel
def test_kernel_rejects_a_block_table_that_is_too_short():
    q, kc, vc, tables, info, _ = build_case([(40, 1)], 2, 1, 16, 16, torch.float32)
    out = torch.empty(1, 32)
    with pytest.raises(RuntimeError, match="past its block table"):
        kernel(out, q, kc, vc, tables[:, :2], info, 1.0, 0.0, 0)


@needs_kernel
def test_kernel_rejects_a_block_id_outside_the_cache():
    q, kc, vc, tables, info, _ = build_case([(4, 1)], 2, 1, 16, 16, torch.float32)
    tables[0, 0] = kc.shape[0]
    with pytest.raises(RuntimeError, match="not in the cache"):
        kernel(torch.empty(1, 32), q, kc, vc, tables, info, 1.0, 0.0, 0)


@needs_kernel
@pytest.mark.parametrize("window", [None, 24])
def test_paged_attention_gives_the_same_output_with_and_without_the_kernel(window, monkeypatch):
    """The model-facing entry point: a mixed step (a decode batch, short chunks over cached
    prefixes, a long whole-history chunk) through the kernel and through the PyTorch paths
    (the kernel's share as on the Intel hosts, whatever this CPU's row says)."""
    from prefixserve.model.layers import attention
    from prefixserve.model.layers.attention import (
        ScheduledSpan,
        build_attention_metadata,
        paged_attention,
    )

    monkeypatch.setattr(attention, "KERNEL_MAX_QUERIES", 12)
    KERNEL_MAX_QUERIES = 12
    seqs = [(50, 1), (9, 1), (130, 1), (40, KERNEL_MAX_QUERIES - 1), (64, 20), (0, 140)]
    heads, kv_heads, head_dim, block_size = 6, 2, 64, 16
    q, kc, vc, tables, info, _ = build_case(
        seqs, heads, kv_heads, head_dim, block_size, torch.float32
    )
    spans = [
        ScheduledSpan(computed, new, ([b for b in row if b != 0],))
        for (computed, new), row in zip(seqs, tables.tolist(), strict=True)
    ]
    outs = []
    for fn in (kernel, None):
        meta = build_attention_metadata(spans, 0, block_size, window, fn)
        assert (meta.kernel is not None) == (fn is not None)
        outs.append(paged_attention(q, kc, vc, meta, 0.125))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize(
    "head_dim,block_size,window",
    [(128, 16, 0), (256, 32, 0), (64, 16, 5), (64, 32, 40), (48, 8, 3)],
)
def test_kernel_head_dims_block_sizes_and_small_windows(head_dim, block_size, window):
    """The AVX-512 specializations (64/128/256), the generic head dim, windows smaller than a
    block, and query row tiles that cross 16 rows."""
    heads, kv_heads = 4, 2
    q, kc, vc, tables, info, truths = build_case(
        [(70, 1), (3, 1), (33, 21), (0, 18)],
        heads,
        kv_heads,
        head_dim,
        block_size,
        torch.float32,
        seed=head_dim + block_size,
    )
    out = torch.empty(q.shape[0], heads * head_dim)
    scale = 1 / math.sqrt(head_dim)
    kernel(out, q, kc, vc, tables, info, scale, 0.0, window)
    for row, positions, keys, values in truths:
        want = reference(q[row : row + len(positions)], keys, values, positions, scale, 0, window)
        torch.testing.assert_close(
            out[row : row + len(positions)].double(), want, atol=1e-5, rtol=1e-5
        )


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 48])  # the AVX-512 path and the generic one
def test_kernel_propagates_a_nan_key(head_dim):
    """A corrupted (NaN) key in a visible slot makes the output NaN, as SDPA does, instead of
    being silently weighted to zero: that is how a read of garbage shows in the model tests."""
    q, kc, vc, tables, info, truths = build_case(
        [(20, 1)], 2, 1, head_dim, 16, torch.float32, seed=11
    )
    slot = tables[0, 0].item()
    kc[slot, 3] = float("nan")
    out = torch.empty(1, 2 * head_dim)
    kernel(out, q, kc, vc, tables, info, 0.1, 0.0, 0)
    assert out.isnan().all()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [False, True])  # Llama-style, Gemma-style
@pytest.mark.parametrize("dim", [576, 100])  # 100: a partial vector at each row's end
def test_rms_norm_kernel_matches_the_pytorch_norm(dtype, offset, dim, monkeypatch):
    from prefixserve.model.layers import common as layers
    from prefixserve.model.layers import kernel_table

    torch.manual_seed(0)
    norm = layers.RMSNorm(dim, 1e-5, offset=offset)
    with torch.no_grad():
        norm.weight.normal_()
    norm = norm.to(dtype)
    x = (torch.randn(37, dim) * 3).to(dtype)
    fused = norm(x)
    # Each row's result is its own: alone, or among 2,000 rows (several threads), the same bits.
    assert torch.equal(norm(x[5:6].contiguous()), fused[5:6])
    many = norm(x.repeat(60, 1))
    assert torch.equal(many[37 * 59 : 37 * 60], fused)
    monkeypatch.setitem(kernel_table._kernels, "rms_norm", None)  # the PyTorch path
    plain = norm(x)
    assert fused.dtype == plain.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # one bf16 rounding step
    torch.testing.assert_close(fused, plain, atol=tol, rtol=tol)
    if dtype == torch.bfloat16:
        # PyTorch's roundings: only a sum of squares in another order (an ulp of the fp32 scale)
        # tips an element across a bf16 rounding boundary, rarely; a missing or extra rounding
        # would change a large share of them.
        assert (fused == plain).float().mean() > 0.99
    # Non-contiguous 2-D inputs take the PyTorch path.
    monkeypatch.setitem(kernel_table._kernels, "rms_norm", kernels.rms_norm_kernel())
    torch.testing.assert_close(norm(x.t().contiguous().t()), plain, atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [False, True])
def test_rms_norm_kernel_norms_heads_inside_qkv_in_place_as_rows(dtype, offset):
    """q/k norms (Qwen3, Gemma 3): each head's rows inside a fused qkv [T, (H + 2 KV) D], normed in
    place through their strides, get the bits of the same rows normed as a contiguous 2-D
    tensor; the v part and the other heads' bytes stay as they were."""
    from prefixserve.model.layers import common as layers

    torch.manual_seed(1)
    t, heads, kv_heads, d = 5, 3, 1, 64
    norm = layers.RMSNorm(d, 1e-6, offset=offset)
    with torch.no_grad():
        norm.weight.normal_()
    norm = norm.to(dtype)
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * d) * 2).to(dtype)
    before = qkv.clone()
    q = qkv[:, : heads * d].view(t, heads, d)
    assert norm.forward_(q) is q
    expected = norm(before[:, : heads * d].reshape(t * heads, d)).view(t, heads * d)
    assert torch.equal(qkv[:, : heads * d], expected)
    assert torch.equal(qkv[:, heads * d :], before[:, heads * d :])


@needs_kernel
def test_rms_norm_kernel_refuses_overlapping_rows():
    kernel = kernels.rms_norm_kernel()
    weight = torch.ones(8)
    x = torch.randn(4, 8)
    overlapping = torch.empty(16).as_strided((4, 8), (2, 1))  # rows 2 apart, 8 long
    with pytest.raises(RuntimeError, match="overlap"):
        kernel(overlapping, x, weight, 1e-6, False)
    buffer = torch.randn(40)
    with pytest.raises(RuntimeError, match="single memory location"):
        kernel(buffer[:32].view(4, 8), buffer[4:36].view(4, 8), weight, 1e-6, False)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_decode_rows_sharing_a_cached_prefix(dtype):
    """Decode rows whose block tables start with the same blocks (a prefix-cache hit) are
    attended as a cascade: the shared blocks once for all of them. Covers groups larger than one
    work item, a row sharing only part of the prefix, a row whose own position lies inside the
    shared blocks, rows of other prefixes interleaved in batch order, and a multi-token chunk."""
    heads, kv_heads, head_dim, bs = 6, 2, 64, 16
    g = torch.Generator().manual_seed(21)
    num_blocks = 80
    kc = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    vc = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    kc[0] = float("nan")
    vc[0] = float("nan")
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    prefix_a = [free.pop() for _ in range(10)]  # 160 shared tokens
    prefix_b = [free.pop() for _ in range(4)]
    # (table prefix, position of the new token); each row gets its own blocks after the prefix.
    rows = [
        (prefix_a, 170),
        (prefix_b, 70),
        (prefix_a, 161),
        (prefix_a, 200),
        (prefix_a[:3], 60),  # shares 3 blocks, then its own
        (prefix_a, 165),
        (prefix_b, 64),
        (prefix_a, 100),  # its own token is inside block 6 of the shared prefix
        (prefix_a, 181),
        (prefix_a, 240),
    ]
    tables, info = [], []
    for i, (prefix, pos) in enumerate(rows):
        need = pos // bs + 1
        table = list(prefix[:need]) + [free.pop() for _ in range(need - min(need, len(prefix)))]
        tables.append(table)
        info.append((i, i + 1, pos))
    chunk_table = list(prefix_a) + [free.pop() for _ in range(2)]  # 20 new tokens at 170..189
    tables.append(chunk_table)
    info.append((len(rows), len(rows) + 20, 170))
    q = torch.randn(len(rows) + 20, heads, head_dim, generator=g).to(dtype)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    out = torch.full((q.shape[0], heads * head_dim), float("nan"), dtype=dtype)
    kernel(out, q, kc, vc, block_tables, torch.tensor(info, dtype=torch.int64), 0.125, 0.0, 0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for table, (lo, hi, pos) in zip(tables, info, strict=True):
        length = pos + (hi - lo)
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(length)])
        keys = kc.view(-1, kv_heads, head_dim)[slots]
        values = vc.view(-1, kv_heads, head_dim)[slots]
        want = reference(q[lo:hi], keys, values, list(range(pos, length)), 0.125, 0, 0)
        torch.testing.assert_close(out[lo:hi].double(), want, atol=tol, rtol=tol)
