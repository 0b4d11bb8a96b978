"""The loop-weighted HLO cost model: hand-written HLO for the parser, then programs compiled for a v5p:2x2x1
slice on this CPU (skipped where libtpu cannot describe that topology)."""

from __future__ import annotations

import os

import pytest

from asyncrl.aot.hlo_cost import Loop, analyze, analyze_hlo
from asyncrl.aot.hlo_text import dtype_bytes, largest_buffers, parse_hlo, parse_shape

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # libtpu's lock file would refuse a second process

# ---------------------------------------------------------------- hand-written HLO

LOOP_HLO = """HloModule loop

%body (p: (s32[], f32[8,16], f32[16,32])) -> (s32[], f32[8,16], f32[16,32]) {
  %p = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %w = f32[16,32]{1,0} get-tuple-element(%p), index=2
  %y = f32[8,32]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %z = f32[8,16]{1,0} slice(%y), slice={[0:8], [0:16]}
  ROOT %t = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) tuple(%next, %z, %w)
}

%cond (p: (s32[], f32[8,16], f32[16,32])) -> pred[] {
  %p = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(10)
  ROOT %c = pred[] compare(%LHS, %RHS), direction=DIR
}

ENTRY %main (x: f32[8,16], w: f32[16,32]) -> f32[8,16] {
  %x = f32[8,16]{1,0} parameter(0)
  %w = f32[16,32]{1,0} parameter(1)
  %start = s32[] constant(2)
  %init = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) tuple(%start, %x, %w)
  %loop = (s32[], f32[8,16]{1,0}, f32[16,32]{1,0}) while(%init), condition=%cond, body=%bodyCONFIG
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%loop), index=1
}
"""
# Per run of the body: the dot's 2*8*32*16 flops and the counter's add; the dot reads x and w and writes y,
# the slice reads and writes its [8,16] part, the add reads two s32 and writes one.
BODY_FLOPS, BODY_BYTES = 2 * 8 * 32 * 16 + 1, (8 * 16 + 16 * 32 + 8 * 32) * 4 + 2 * 8 * 16 * 4 + 3 * 4
COND_BYTES = 4 + 4 + 1  # the compare reads two s32 and writes a pred


def _loop_program(lhs: str = "%i", rhs: str = "%n", direction: str = "LT", config: str = "") -> str:
    return LOOP_HLO.replace("%LHS", lhs).replace("%RHS", rhs).replace("DIR", direction).replace("CONFIG", config)


def _loop_cost(trips: int) -> tuple[float, float]:
    return trips * BODY_FLOPS + (trips + 1), trips * BODY_BYTES + (trips + 1) * COND_BYTES


def test_dtype_sizes_and_tiled_tuple_shapes() -> None:
    assert [dtype_bytes(d) for d in ("pred", "s8", "bf16", "f32", "s64", "f8e4m3fn", "s4", "c64", "token")] == [
        1, 1, 2, 4, 8, 1, 0.5, 8, 0]
    leaves = parse_shape("(s32[]{:T(128)}, bf16[64,3]{1,0:T(8,128)(2,1)}, f32[2,256]{1,0:T(8,128)S(1)}, "
                         "/*index=3*/f32[64,3]{0,1:T(4,128)}, token[], u8[5])")
    assert [(x.dtype, x.dims, x.memory_space) for x in leaves] == [
        ("s32", (), 0), ("bf16", (64, 3), 0), ("f32", (2, 256), 1), ("f32", (64, 3), 0), ("token", (), 0),
        ("u8", (5,), 0)]
    # Tiles pad the most minor physical dims: a scalar fills a 128-element tile, [64,3] row-major pads 3 to
    # 128, [2,256] pads 2 to 8, and column-major [64,3] is physically [3,64] padded to [4,128].
    assert [x.bytes for x in leaves] == [512, 64 * 128 * 2, 8 * 256 * 4, 4 * 128 * 4, 0, 5]


def test_known_trip_count_weights_the_body() -> None:
    cost = analyze_hlo(_loop_program(config=', backend_config={"known_trip_count":{"n":"36"}}'))
    assert cost.loops == (Loop("loop", 36, 0),) and cost.unknown_trip_counts == ()
    assert (cost.flops, cost.hbm_bytes) == _loop_cost(36)
    assert cost.matmul_flops == 36 * 2 * 8 * 32 * 16
    assert cost.collective_bytes == {} and cost.other_memory_bytes == {}


@pytest.mark.parametrize("lhs,rhs,direction,trips", [
    ("%i", "%n", "LT", 8),  # from 2 while i < 10, step 1
    ("%n", "%i", "GT", 8),  # the same bound, written constant first
    ("%i", "%n", "LE", 9),
])
def test_trip_count_from_the_condition(lhs: str, rhs: str, direction: str, trips: int) -> None:
    cost = analyze_hlo(_loop_program(lhs, rhs, direction))
    assert cost.loops == (Loop("loop", trips, 0),)
    assert (cost.flops, cost.hbm_bytes) == _loop_cost(trips)


def test_trip_count_through_a_fused_condition_and_a_step_of_two() -> None:
    fused_cond = """%fused_lt (a: s32[], b: s32[]) -> pred[] {
  %a = s32[] parameter(0)
  %b = s32[] parameter(1)
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

%cond"""
    program = _loop_program(lhs="%i", rhs="%n").replace("%cond", fused_cond, 1)
    program = program.replace("ROOT %c = pred[] compare(%i, %n), direction=LT",
                              "ROOT %c = pred[] fusion(%i, %n), kind=kLoop, calls=%fused_lt")
    program = program.replace("%one = s32[] constant(1)", "%one = s32[] constant(2)")
    assert "calls=%fused_lt" in program and "constant(2)" in program.split("%cond")[0]
    assert analyze_hlo(program).loops == (Loop("loop", 4, 0),)  # 2, 4, 6, 8


def test_unknown_trip_count_is_weighted_once_and_named() -> None:
    cost = analyze_hlo(_loop_program("%i", "%i", "LT"))
    assert cost.loops == (Loop("loop", None, 0),) and cost.unknown_trip_counts == ("loop",)
    assert cost.flops == BODY_FLOPS + 1


SLICE_HLO = """HloModule slices

%fused_slice (p0: f32[8,128,128], p1: s32[]) -> f32[128,128] {
  %p0 = f32[8,128,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  %ds = f32[1,128,128]{2,1,0} dynamic-slice(%p0, %p1, %c0, %c0), dynamic_slice_sizes={1,128,128}
  ROOT %b = f32[128,128]{1,0} bitcast(%ds)
}

%fused_update (p0: f32[8,128,128], p1: f32[128,128], p2: s32[]) -> f32[8,128,128] {
  %p0 = f32[8,128,128]{2,1,0} parameter(0)
  %p1 = f32[128,128]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %c0 = s32[] constant(0)
  %u = f32[1,128,128]{2,1,0} bitcast(%p1)
  ROOT %dus = f32[8,128,128]{2,1,0} dynamic-update-slice(%p0, %u, %p2, %c0, %c0)
}

ENTRY %main (w: f32[8,128,128], i: s32[], acc: f32[8,128,128]) -> (f32[8,128,128], f32[512,128], f32[128,128]) {
  %w = f32[8,128,128]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %acc = f32[8,128,128]{2,1,0} parameter(2)
  %layer = f32[128,128]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %grad = f32[8,128,128]{2,1,0} fusion(%acc, %layer, %i), kind=kLoop, calls=%fused_update
  %ag-start = (f32[128,128]{1,0}, f32[512,128]{1,0}) all-gather-start(%layer), dimensions={0}
  %ag-done = f32[512,128]{1,0} all-gather-done(%ag-start)
  %to-host = f32[128,128]{1,0:S(5)} copy(%layer)
  ROOT %t = (f32[8,128,128]{2,1,0}, f32[512,128]{1,0}, f32[128,128]{1,0:S(5)}) tuple(%grad, %ag-done, %to-host)
}
"""


def test_slices_in_place_updates_async_collectives_and_memory_spaces() -> None:
    cost = analyze_hlo(SLICE_HLO)
    layer, gathered = 128 * 128 * 4, 512 * 128 * 4
    assert cost.hbm_bytes == (
        (layer + 4) + layer  # the slicing fusion reads one layer of the stack (and the index), writes it
        + (layer + 4) + layer  # the update fusion reads the update, writes it in place, and not the buffer
        + layer + gathered  # the all-gather, counted once at its -done: its input and its result
        + layer)  # the copy to host reads from HBM; its write lands in memory space 5
    assert cost.other_memory_bytes == {5: layer}
    assert cost.collective_bytes == {"all-gather": gathered}
    assert cost.flops == 0
    top = largest_buffers(SLICE_HLO, n=4)
    assert {name for name, _, _ in top} == {"w", "acc", "grad", "ag-done"}
    assert top[0][2] == 8 * layer and top[-1] == ("ag-done", "f32[512,128]{1,0}", gathered)


def test_collectives_of_a_moe_layer_are_also_counted_apart() -> None:
    """The MoE layer's dispatch and combine (named scope `moe`, models/moe.py) also count under "<kind> (moe)"; an
    async pair by its -start's metadata."""
    meta = ', metadata={op_name="jit(step)/layers/mlp/moe/shard_map/all_gather"}'
    hlo = SLICE_HLO.replace("dimensions={0}", "dimensions={0}" + meta)
    cost = analyze_hlo(hlo)
    assert cost.collective_bytes == {"all-gather": 512 * 128 * 4, "all-gather (moe)": 512 * 128 * 4}
    assert analyze_hlo(SLICE_HLO).collective_bytes == {"all-gather": 512 * 128 * 4}  # FSDP's, say: not moe


COND_HLO = """HloModule cond

%cheap (p: f32[64]) -> f32[64] {
  %p = f32[64]{0} parameter(0)
  ROOT %n = f32[64]{0} negate(%p)
}

%dear (p: f32[64]) -> f32[64] {
  %p = f32[64]{0} parameter(0)
  %e = f32[64]{0} exponential(%p)
  ROOT %m = f32[64]{0} multiply(%e, %e)
}

ENTRY %main (b: pred[], x: f32[64]) -> f32[64] {
  %b = pred[] parameter(0)
  %x = f32[64]{0} parameter(1)
  ROOT %c = f32[64]{0} conditional(%b, %x, %x), true_computation=%dear, false_computation=%cheap
}
"""


def test_conditional_counts_its_most_expensive_branch() -> None:
    cost = analyze_hlo(COND_HLO)
    assert (cost.flops, cost.transcendentals) == (64, 64)
    assert cost.hbm_bytes == 256 * 2 + 256 * 3  # exponential reads and writes; multiply reads e twice, writes


# ---------------------------------------------------------------- programs compiled for a TPU slice


@pytest.fixture(scope="module")
def mesh():
    try:
        from jax.experimental import topologies

        topo = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")
    except Exception as e:  # noqa: BLE001 - any failure means no libtpu to compile with
        pytest.skip(f"cannot describe a v5p:2x2x1 TPU topology here: {e}")
    return topologies.make_mesh(topo, (4,), ("x",))


def _compile(mesh, f, *shapes, out_spec=None, **compiler_options):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, spec or P())) for s, d, spec in shapes]
    out = NamedSharding(mesh, out_spec) if out_spec is not None else None
    return jax.jit(f, out_shardings=out).lower(*args).compile(compiler_options=compiler_options or None)


def test_scanned_layers_cost_the_same_as_unrolled(mesh) -> None:
    import jax
    import jax.numpy as jnp

    layers, batch, dim = 8, 16, 1024

    def layer(x, w):
        return jnp.tanh(x @ w) * 1.5

    def scanned(x, ws):
        return jax.lax.scan(lambda x, w: (layer(x, w), None), x, ws)[0]

    def unrolled(x, ws):
        for i in range(layers):
            x = layer(x, ws[i])
        return x

    # Weights dominate the traffic on purpose: the scanned program also copies its carry each step and the
    # unrolled one fuses layer pairs, so their activation traffic legitimately differs (at [64,256]
    # activations and [256,256] weights the scan moves 1.7x the bytes).
    shapes = ((batch, dim), jnp.bfloat16, None), ((layers, dim, dim), jnp.bfloat16, None)
    scan_c, unroll_c = _compile(mesh, scanned, *shapes), _compile(mesh, unrolled, *shapes)
    scan, unroll = analyze(scan_c), analyze(unroll_c)
    assert scan.loops == (Loop(scan.loops[0].name, layers, 0),) and scan.unknown_trip_counts == ()
    assert scan.matmul_flops == unroll.matmul_flops == layers * 2 * batch * dim * dim
    assert scan.flops == pytest.approx(unroll.flops, rel=0.10)  # measured: 1 + 6e-8
    assert scan.flops == pytest.approx(unroll_c.cost_analysis()["flops"], rel=0.10)
    assert scan.hbm_bytes == pytest.approx(unroll.hbm_bytes, rel=0.10)  # measured: scan 5.2% above
    stack = layers * dim * dim * 2
    assert stack < scan.hbm_bytes < 1.1 * stack  # the stack is read once, a layer per step, not per step
    # The trap this module exists for: XLA counts the scanned body once.
    assert scan_c.cost_analysis()["flops"] < scan.flops / (layers - 1)


def test_f32_dots_count_their_mxu_passes(mesh) -> None:
    """TPU runs an f32 dot as bf16 passes: 1 at DEFAULT, 3 at HIGH (bf16_3x), 6 at HIGHEST. XLA counts one; the
    roofline must charge what the MXU runs. A bf16 dot is one pass whatever its precision."""
    import jax.numpy as jnp

    m, k, n = 256, 512, 1024
    for dtype, precision, passes in ((jnp.float32, "default", 1), (jnp.float32, "high", 3),
                                     (jnp.float32, "highest", 6), (jnp.bfloat16, "highest", 1)):
        compiled = _compile(mesh, lambda a, b: jnp.dot(a, b, precision=precision), ((m, k), dtype, None),
                            ((k, n), dtype, None))
        cost = analyze(compiled)
        assert cost.matmul_flops == passes * 2 * m * k * n, (dtype, precision)
        assert compiled.cost_analysis()["flops"] == 2 * m * k * n


def test_loop_free_program_matches_xla_and_the_hand_count(mesh) -> None:
    import jax.numpy as jnp

    m, k, n = 128, 256, 512
    shapes = ((m, k), jnp.bfloat16, None), ((k, n), jnp.bfloat16, None), ((n, m), jnp.bfloat16, None)

    def mm(a, b, c):
        return (a @ b) @ c

    compiled = _compile(mesh, mm, *shapes)
    cost = analyze(compiled)
    assert cost.flops == cost.matmul_flops == compiled.cost_analysis()["flops"] == 2 * m * k * n + 2 * m * n * m
    # Both matmuls compile into one fusion that keeps a @ b on chip, so HBM sees the three arguments once
    # and the result once.
    assert cost.hbm_bytes == (m * k + k * n + n * m + m * m) * 2

    # XLA prefetches an argument into VMEM (memory space 1) before the program starts. Without the prefetch
    # XLA's "bytes accessed" is exactly ours; the prefetch changes where bytes are read, not HBM traffic.
    no_prefetch = _compile(mesh, mm, *shapes, xla_msa_max_cross_program_prefetches=0)
    assert "copy-start" not in no_prefetch.as_text()
    assert analyze(no_prefetch).hbm_bytes == no_prefetch.cost_analysis()["bytes accessed"] == cost.hbm_bytes

    # With it, XLA counts the copy's tuple output (destination and source alias) and the copy-done's output,
    # where we count the source read and one destination write: twice the prefetched bytes more, plus a
    # few bytes of sync flag and tuple.
    comps = parse_hlo(compiled.as_text())
    prefetched = sum(parse_shape(c.instrs[i.operands[0]].type_str)[0].bytes
                     for c in comps.values() for i in c.instrs.values() if i.op == "copy-start")
    assert prefetched == k * n * 2 and cost.other_memory_bytes == {1: 2 * prefetched}
    ours_all_spaces = cost.hbm_bytes + sum(cost.other_memory_bytes.values())
    assert compiled.cost_analysis()["bytes accessed"] == pytest.approx(ours_all_spaces + 2 * prefetched, rel=0.01)


def test_nested_scans_multiply(mesh) -> None:
    import jax
    import jax.numpy as jnp

    outer, inner, dim = 4, 3, 256

    def nested(x, ws):
        def inner_step(x, w):
            return jnp.tanh(x @ w), None

        return jax.lax.scan(lambda x, wl: (jax.lax.scan(inner_step, x, wl)[0], None), x, ws)[0]

    compiled = _compile(mesh, nested, ((64, dim), jnp.bfloat16, None), ((outer, inner, dim, dim), jnp.bfloat16, None))
    cost = analyze(compiled)
    assert [(lp.trip_count, lp.depth) for lp in cost.loops] == [(outer, 0), (inner, 1)]
    assert cost.matmul_flops == outer * inner * 2 * 64 * dim * dim
    assert cost.transcendentals == outer * inner * 64 * dim
    assert compiled.cost_analysis()["flops"] < cost.flops / (outer * inner - 1)


@pytest.mark.parametrize("a_spec,b_spec,out_spec,kind,payload", [
    # a's columns and b's rows split over 4 chips: each chip holds a partial [128,512] f32 sum.
    ((None, "x"), ("x", None), (), "all-reduce", 128 * 512 * 4),
    ((None, "x"), ("x", None), ("x", None), "reduce-scatter", 128 * 512 * 4),
    # a's rows split: each chip computes [32,512] of the result and gathers the whole.
    (("x", None), (None, None), (), "all-gather", 128 * 512 * 4),
])
def test_sharded_matmul_collectives(mesh, a_spec, b_spec, out_spec, kind, payload) -> None:
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    compiled = _compile(mesh, lambda a, b: a @ b, ((128, 256), jnp.float32, P(*a_spec)),
                        ((256, 512), jnp.float32, P(*b_spec)), out_spec=P(*out_spec))
    cost = analyze(compiled)
    assert cost.collective_bytes == {kind: payload}
    assert cost.matmul_flops == (2 * 32 * 256 * 512 if kind == "all-gather" else 2 * 128 * 64 * 512)


def test_collectives_in_a_loop_are_weighted(mesh) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    layers = 6

    def scanned(x, ws):
        def body(x, w):
            return jax.lax.with_sharding_constraint(jnp.tanh(x @ w), NamedSharding(mesh, P(None, "x"))), None

        return jax.lax.scan(body, x, ws)[0]

    compiled = _compile(mesh, scanned, ((128, 256), jnp.float32, P(None, "x")),
                        ((layers, 256, 256), jnp.float32, P(None, "x", None)))
    cost = analyze(compiled)
    # Each layer's contraction is split over the chips; XLA reduce-scatters the [128,256] f32 partial sums.
    assert cost.collective_bytes == {"reduce-scatter": layers * 128 * 256 * 4}


def test_causal_blocks_is_the_share_of_tiles_on_or_below_the_diagonal() -> None:
    from asyncrl.aot.kernel_cost import causal_blocks

    assert causal_blocks(1024, 1024, 512, 512) == 3 / 4  # tiles (0,0), (1,0), (1,1) of 2 x 2
    assert causal_blocks(1024, 1024, 128, 128) == 36 / 64  # 1 + 2 + ... + 8 of 8 x 8
    assert causal_blocks(1024, 1024, 256, 512) == (1 + 1 + 2 + 2) / 8  # q tiles end at 256, 512 | 768, 1024


def _flash(mesh, grad: bool):
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention
    from jax.sharding import PartitionSpec as P

    from asyncrl.models.flash import _blocks

    spec = P("x", None, None, None)
    attention = jax.shard_map(lambda q, k, v: flash_attention(q, k, v, causal=True, block_sizes=_blocks(1024)),
                              mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    loss = lambda q, k, v: attention(q, k, v).astype(jnp.float32).sum()  # noqa: E731
    qkv = ((4, 8, 1024, 128), jnp.bfloat16, spec)  # [B, H, T, D], one sequence per chip
    return _compile(mesh, jax.grad(loss, argnums=(0, 1, 2)) if grad else attention, qkv, qkv, qkv)


def test_flash_kernels_are_counted_causal_by_hand_not_by_their_declared_cost(mesh) -> None:
    """JAX's forward kernel declares full non-causal attention and its backward kernels nothing; the count here is
    the matmuls of the score tiles each kernel runs: of the 2 x 2 tiles of 512 (models/flash.py's tiles for
    T = 1024), 3 run; 2 matmuls forward, 4 in the dK/dV kernel and 3 in the dQ kernel (each recomputes the scores)."""
    tile_matmul = 2 * 8 * 1024 * 1024 * 128 * 3 / 4  # one chip: B 1, H 8, T = S 1024, D 128, 3 of 4 tiles
    fwd = _flash(mesh, grad=False)
    cost, xla = analyze(fwd), fwd.cost_analysis()
    assert "tpu_custom_call" in fwd.as_text()
    assert xla["flops"] > 4 * 8 * 1024 * 1024 * 128  # what the kernel declares: every tile, both matmuls
    assert cost.matmul_flops == cost.flops == 2 * tile_matmul
    assert cost.transcendentals == 8 * 1024 * 1024 * 3 / 4
    assert cost.hbm_bytes == 4 * 8 * 1024 * 128 * 2  # q, k, v and out of one chip
    bwd = analyze(_flash(mesh, grad=True))
    assert bwd.matmul_flops == (2 + 4 + 3) * tile_matmul


def test_an_all_gather_returned_by_a_program_is_copied_to_its_output(mesh) -> None:
    """Why the weight-sync cast (cast, then gathered whole onto the hop chain's first slot) sits near 2.8x its
    ideal: XLA's TPU all-gather writes its own buffer, and a gathered array the program returns is copied from
    there into the output, so the whole gathered tree is written twice and read once more. Shown on the bare
    gather (a bf16 array sharded 4 ways, returned replicated): the shard read, the gather's write, the copy."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    shape = (28, 2048, 6144)
    full = 28 * 2048 * 6144 * 2
    for spec in (P(None, "x", None), P("x", None, None)):  # a non-major or the major dimension sharded: the same
        compiled = _compile(mesh, lambda p: p, (shape, jnp.bfloat16, spec), out_spec=P())
        text = compiled.as_text()
        assert "all-gather" in text and " copy(" in text
        assert analyze(compiled).hbm_bytes == full / 4 + full + 2 * full
