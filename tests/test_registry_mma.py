"""The tensor-core forwards in the registry (v1-mma, v2-mma): what they say they take, the errors for what they
do not, `compare` running and checking them beside the CUDA-core variants on 16-bit inputs and leaving them
out, with the reason, of float32 inputs, and their counted HBM traffic (with a block mask too).

Shapes stay tiny (N <= 32, d = 16, one head, 16 x 16 tiles): a tensor-core launch is a warp of emulated
mma.sync in the simulator.
"""

import re

import numpy as np
import pytest

from fa_numba import cli, iomodel, tolerance
from fa_numba import compare as cmp
from fa_numba.kernels import SIMT_VARIANTS, VARIANTS
from fa_numba.kernels.counting import run_counted

MMA = ("v1-mma", "v2-mma")


def test_the_registry_lists_the_tensor_core_variants_with_what_they_take():
    for name, order in zip(MMA, ("v1", "v2")):
        variant = VARIANTS[name]
        assert (variant.name, variant.order, variant.unit) == (name, order, "mma")
        assert variant.dtypes == ("float16", "bfloat16", "float32") and variant.tile_multiple == 16  # float32: 3xTF32
        assert variant.block_masks and variant.engine
        assert "tensor cores" in variant.description and "\n" not in variant.description
    assert SIMT_VARIANTS == ("v1", "v2", "v1-rowwise", "v2-rowwise")
    for name in SIMT_VARIANTS:
        variant = VARIANTS[name]
        assert variant.unit == "simt" and variant.block_masks and variant.tile_multiple == 1
        assert set(variant.dtypes) == {"float32", "float16", "bfloat16"} and variant.not_counted is None
    assert VARIANTS["v2-mma"].not_counted is None and "quad" in VARIANTS["v1-mma"].not_counted


TAKEN = dict(block_q=16, block_k=16, head_dim=16, causal=False, mask_form="none", dtype="float16")
REFUSED = [  # (arguments past the default 16, 16, d=16, causal=False; the argument the error must name)
    (dict(dtype="float64"), r"dtype must be one of \('float16', 'bfloat16', 'float32'\) for v2-mma.*got 'float64'"),
    (dict(block_q=8), r"block_q must be 16, 32, 64 or 128 for v2-mma.*got 8"),
    (dict(block_q=48), r"block_q must be 16, 32, 64 or 128 for v2-mma.*got 48"),
    (dict(block_k=24), r"block_k must be a positive multiple of 16.*got 24"),
    (dict(head_dim=200), r"head dim d must be in 1\.\.192 for the float16 tensor-core forward, got 200"),
    (dict(head_dim=160, dtype="float32"), r"head dim d must be in 1\.\.128 for the float32 tensor-core forward.*160"),
    (dict(mask_form="function"), r"mask_form 'function' \(a mask_mod\) needs its fn compiled into v2-mma"),
    (dict(block_q=128, block_k=128, head_dim=128), r"block_q 128, block_k 128, d 128: \d+ bytes of shared memory"),
]


@pytest.mark.parametrize("changes, message", REFUSED, ids=[next(iter(c)) + "-" + str(next(iter(c.values())))
                                                           for c, _ in REFUSED])
def test_a_configuration_a_tensor_core_variant_cannot_take_is_a_value_error_naming_the_argument(changes, message):
    args = TAKEN | changes
    variant = VARIANTS["v2-mma"]
    with pytest.raises(ValueError, match=message):
        variant.make(**args)
    with pytest.raises(ValueError, match=message):
        variant.config(**args)
    assert re.search(message, variant.refusal(**args))
    assert variant.refusal(**TAKEN) is None  # and without the change, the call is taken


def test_a_built_tensor_core_kernel_says_its_launch_and_refuses_what_it_cannot_read():
    """What fa_numba.profile and the launch path read off a built kernel, and the launch-time errors."""
    from numba import cuda

    kernel = VARIANTS["v2-mma"].build(16, 16, 16, False, "none", "bfloat16")
    assert kernel.launch_shape(2, 3, 40) == ((3, 6), (32,))
    assert VARIANTS["v1-mma"].build(32, 16, 16, True, "causal", "float16").launch_shape(2, 3, 40) == ((6,), (64,))
    assert len(kernel.argtypes("bfloat16")) == 15 and kernel.config.kind == "bfloat16"  # 6, 8 mask arrays, mods
    with pytest.raises(ValueError, match=r"dtype must be 'bfloat16' for this v2-mma kernel.*got 'float16'"):
        kernel.argtypes("float16")
    x32 = cuda.to_device(np.zeros((1, 1, 16, 16), np.float32))
    out, lse = cuda.to_device(np.zeros((1, 1, 16, 16), np.float32)), cuda.to_device(np.zeros((1, 1, 16), np.float32))
    with pytest.raises(TypeError, match=r"q must be float16 or the uint16 bits of bfloat16 .*got float32"):
        kernel(x32, x32, x32, out, lse, 0.25)
    b16 = cuda.to_device(np.zeros((1, 1, 16, 16), np.uint16))
    with pytest.raises(ValueError, match=r"mask must be None for a kernel without a block mask"):
        kernel(b16, b16, b16, out, lse, 0.25, mask=object())


def test_attention_orders_stay_the_cuda_core_names():
    """order= keeps naming loop orders; the tensor-core kernels are engine="mma" with order "v1" or "v2"."""
    import fa_numba

    q = np.zeros((4, 16), np.float16)
    with pytest.raises(ValueError, match=r"order must be one of \('v1', 'v2', 'v1-rowwise', 'v2-rowwise'\) "
                                         r"\(engine='mma' picks .*got 'v2-mma'"):
        fa_numba.attention(q, q, q, order="v2-mma")


def _shape(dtype, **changes):
    return cmp.Shape(**dict(dict(heads=1, n_q=32, head_dim=16, dtype=dtype, block_q=16, block_k=16), **changes))


def _expected_tolerances(s: cmp.Shape, order: str, p_dtype, products=None):
    """The rule's tolerances for this shape, built here from compare's inputs (not read from compare's rows)."""
    q, k, v = (cmp.reference_view(x) for x in cmp.inputs(s.resolved()))
    base = tolerance.baseline(q, k, v, causal=s.causal, block_q=s.block_q, block_k=s.block_k, p_dtype=p_dtype,
                              products=products)
    return base.tolerances(order)


@pytest.mark.parametrize("dtype, causal, variants", [
    ("float16", False, None),  # every variant: the CUDA-core ones beside the tensor-core ones
    ("bfloat16", True, ("v2", "v1-mma", "v2-mma")),  # causal, beside the CUDA-core v2 only: ~2 s
])
def test_compare_runs_and_passes_the_tensor_core_variants_on_16_bit_inputs(dtype, causal, variants):
    s = _shape(dtype, causal=causal)
    result = cmp.run(s, variants)
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == set(variants or VARIANTS) and all(r["passed"] for r in rows.values())
    text = cmp.render(result)
    for name in MMA:  # judged with the P-rounding term, the CUDA-core rows without it
        assert (rows[name]["atol_out"], rows[name]["atol_lse"]) == _expected_tolerances(s, rows[name]["order"], dtype)
    assert (rows["v2"]["atol_out"], rows["v2"]["atol_lse"]) == _expected_tolerances(s, "v2", None)
    assert rows["v2-mma"]["atol_out"] > rows["v2"]["atol_out"]
    # v2-mma's counted bytes are iomodel's v2 (itemsize 2: the 16-bit Q, K, V); v1-mma's are not counted, and say so
    model = iomodel.to_bytes(iomodel.traffic("v2", 32, 32, 16, 16, 16, causal, heads=1), 2)
    assert rows["v2-mma"]["bytes_counted"] == rows["v2-mma"]["bytes_model"] == model
    assert "bytes_counted" not in rows["v1-mma"] and rows["v1-mma"]["not_counted"] == VARIANTS["v1-mma"].not_counted
    v1_line = next(line for line in text.splitlines() if line.startswith("v1-mma "))
    assert v1_line.endswith("not counted") and "pass" in v1_line
    assert next(line for line in text.splitlines() if line.startswith("v2-mma ")).endswith("True")
    assert f"note: v1-mma: HBM traffic not counted: {VARIANTS['v1-mma'].not_counted}" in text.splitlines()
    assert "v2/v1 speed-up" not in text  # no GPU, no times


def test_compare_runs_the_3xtf32_variants_on_float32_with_their_products_term():
    """float32 shapes take v1-mma and v2-mma by 3xTF32, judged with the products' term (the CUDA-core row without
    it); v2-mma's counted bytes are iomodel's v2 at 4 bytes an element."""
    s = _shape("float32", n_q=16)
    result = cmp.run(s, ("v2", "v1-mma", "v2-mma"))
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["v2", "v1-mma", "v2-mma"] and all(r["passed"] for r in rows.values())
    for name in MMA:
        assert (rows[name]["atol_out"], rows[name]["atol_lse"]) == _expected_tolerances(s, rows[name]["order"], None,
                                                                                        "3xtf32")
    assert (rows["v2"]["atol_out"], rows["v2"]["atol_lse"]) == _expected_tolerances(s, "v2", None)
    assert rows["v2-mma"]["atol_lse"] > rows["v2"]["atol_lse"]
    model = iomodel.to_bytes(iomodel.traffic("v2", 16, 16, 16, 16, 16, False, heads=1), 4)
    assert rows["v2-mma"]["bytes_counted"] == rows["v2-mma"]["bytes_model"] == model


def test_compare_leaves_out_what_the_tensor_cores_do_not_take_with_a_note():
    why = r"head dim d must be in 1\.\.128 for the float32 tensor-core forward, got 160"
    result = cmp.run(_shape("float32", n_q=16, head_dim=160), ("v2", "v1-mma", "v2-mma"), count=False)
    assert [r["variant"] for r in result["rows"]] == ["v2"] and result["rows"][0]["passed"]
    for name in MMA:
        note = next(n for n in result["notes"] if n.startswith(f"{name} left out: "))
        assert re.search(why, note), note
        assert f"note: {note}" in cmp.render(result).splitlines()
    with pytest.raises(ValueError, match=r"no variant asked for takes this shape: head dim d must be in"):
        cmp.run(_shape("float32", n_q=16, head_dim=160), ("v2-mma",))


def test_the_cli_refuses_only_tensor_core_orders_it_cannot_run_without_a_traceback(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["compare", "--n-q", "16", "--heads", "1", "--head-dim", "160", "--orders", "v1-mma,v2-mma"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "argument --orders: no variant asked for takes this shape: head dim d must be in" in err
    assert "Traceback" not in err


def _bits16(rng, shape):
    return rng.standard_normal(shape).astype(np.float16)


COUNTED = [  # (n_q, n_k, d, causal): cp.async staging (d % 8 == 0) and plain loads (d = 20), causal with N_q < N_k
    (32, 32, 16, False),
    (20, 40, 20, True),
]


@pytest.mark.parametrize("n_q, n_k, d, causal", COUNTED)
def test_v2_mma_counted_traffic_equals_iomodel_v2(n_q, n_k, d, causal):
    """Counting sees the cp.async copies (counting.counting_async_copies) as well as the plain loads."""
    rng = np.random.default_rng(n_q + d)
    q, k, v = _bits16(rng, (1, 1, n_q, d)), _bits16(rng, (1, 1, n_k, d)), _bits16(rng, (1, 1, n_k, d))
    kernel = VARIANTS["v2-mma"].build(16, 16, d, causal, "causal" if causal else "none", "float16")
    assert kernel.config.async_copy == (d % 8 == 0)
    out, lse, ledger = run_counted(kernel, q, k, v, 1 / np.sqrt(d))
    assert ledger == iomodel.traffic("v2", n_q, n_k, d, 16, 16, causal)
    assert np.isfinite(out).all() and np.isfinite(lse).all()


def test_v1_mma_counted_element_reads_are_not_its_hbm_traffic():
    """Why compare says "not counted" for v1-mma: against iomodel's v1 (l, m read R + N_q times over R visits of
    a row, LSE written N_q) the simulator counts l and m read 4 R (each of a quad's 4 lanes reads its row's
    l and m: one address, one HBM read on a GPU) and LSE written 2 N_q (filled with -inf, then written at the
    last visit); every other tensor is counted as the model has it."""
    n, d = 32, 16
    rng = np.random.default_rng(3)
    q, k, v = (_bits16(rng, (1, 1, n, d)) for _ in range(3))
    _, _, ledger = run_counted(VARIANTS["v1-mma"].build(16, 16, d, False, "none", "float16"), q, k, v, 0.25)
    model = iomodel.traffic("v1", n, n, d, 16, 16, False)
    visits = model.reads["l"] - n  # R: (row, key tile) visits
    assert visits == n * 2  # every row visits both key tiles
    for stat in ("l", "m"):
        assert ledger.reads[stat] == 4 * visits and ledger.writes[stat] == model.writes[stat]
    assert ledger.writes["LSE"] == 2 * model.writes["LSE"] == 2 * n
    for name in ("Q", "K", "V", "O"):
        assert ledger.reads[name] == model.reads[name] and ledger.writes[name] == model.writes[name]
