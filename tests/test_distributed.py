"""Ring attention (fa_numba.distributed) across processes: gloo on CPU, the kernels in the simulator, against
the float64 single-device reference with the rule and its ring term (proofs/L12)."""

import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="ring attention runs on torch.distributed (the torch extra)")

import fa_numba  # noqa: E402
import fa_numba.distributed as fd  # noqa: E402
from bounds import assert_within, gamma, merge_bound  # noqa: E402
from fa_numba import split_kv, tolerance, tolerance_backward  # noqa: E402

BLOCK = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, case: dict, path, timeout: float = 600):
    """Run tests/ring_worker.run on `world` processes; raises (after ending the others) if any rank fails."""
    import torch.multiprocessing as mp

    import ring_worker

    context = mp.start_processes(ring_worker.run, args=(world, free_port(), case, str(path)), nprocs=world,
                                 join=False, start_method="spawn")
    import time

    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            raise TimeoutError(f"the ring of {world} ranks did not finish in {timeout} s")


@pytest.mark.lemma("L12")
@pytest.mark.slow  # processes of their own, the kernels in the simulator: 20-60 s each
@pytest.mark.parametrize("world, layout, causal, heads_kv", [
    (2, "zigzag", True, 1), (2, "contiguous", False, 2), (3, "zigzag", True, 2), (3, "contiguous", True, 1),
    (4, "zigzag", True, 1), (4, "zigzag", False, 2)])
def test_ring_attention_forward_and_backward_match_single_device(world, layout, causal, heads_kv, tmp_path):
    """Forward (O, LSE) within the ring's rule, gradients within L7's, and the work each rank did counted."""
    count = world * (1 if layout == "contiguous" else 2)
    case = dict(seed=world * 10 + heads_kv, shape=(1, 2, heads_kv, 8 * count, 8), layout=layout, causal=causal,
                block=BLOCK, d_v=12 if world == 3 else None)  # V's head dim its own in the rings of 3
    spawn(world, case, tmp_path / "ring.npz")
    got = np.load(tmp_path / "ring.npz")
    q, k, v, dout = (got[name].astype(np.float64) for name in ("q", "k", "v", "dout"))
    atol_out, atol_lse = fd.ring_tolerances(got["q"], got["k"], got["v"], causal, world, layout, BLOCK)
    ref = tolerance.baseline(got["q"], got["k"], got["v"], causal=causal, contractions=("matmul",))
    assert tolerance.assert_close(got["out"], ref.out, atol_out, name="ring out") <= atol_out
    assert tolerance.assert_close(got["lse"], ref.lse, atol_lse, name="ring lse") <= atol_lse
    grads = tolerance_backward.check_attention_backward(got["dq"], got["dk"], got["dv"], got["q"], got["k"], got["v"],
                                                        got["dout"], causal=causal)
    assert grads.err_dq <= grads.atol_dq and grads.err_dk <= grads.atol_dk and grads.err_dv <= grads.atol_dv
    assert q.shape[:-1] == dout.shape[:-1] and k.shape[:-1] == v.shape[:-1] and v.shape[-1] == dout.shape[-1]
    # the block calls each rank made, counted in the ring itself: the schedule's pairs, and equal under zigzag
    want = [[c[fd.FULL], c[fd.PARTIAL]] for c in fd.pair_counts(world, layout, causal)]
    assert got["work"].tolist() == want
    if layout == "zigzag" and causal:
        assert all(row == [2 * world - 1, 2] for row in got["work"].tolist())


@pytest.mark.slow  # two processes, the tensor-core kernels in the simulator: about 40 s each
@pytest.mark.parametrize("engine", ["mma", "simt"])
def test_ring_attention_on_float16_runs_the_engine_asked_for(engine, tmp_path):
    """float16 shards with each block call on `engine` (every call, forward and backward, on every rank, was
    given it): on the tensor cores the forward within the ring's rule with their P-rounding term and the
    gradients within L7's with the P and dS rounding terms, on the CUDA cores within the float32 rules; the
    results come back in float16, whose rounding (half an ulp of the largest entry) joins each rule."""
    world, layout, causal, block = 2, "zigzag", True, 16
    case = dict(seed=5, shape=(1, 2, 1, 16 * 2 * world, 8), layout=layout, causal=causal, block=block,
                dtype="float16", engine=engine)
    spawn(world, case, tmp_path / "ring.npz")
    got = np.load(tmp_path / "ring.npz")
    p_dtype = "float16" if engine == "mma" else None
    atol_out, atol_lse = fd.ring_tolerances(got["q"], got["k"], got["v"], causal, world, layout, block,
                                            p_dtype=p_dtype)
    ref = tolerance.baseline(got["q"], got["k"], got["v"], causal=causal, contractions=("matmul",))
    assert got["engines"].tolist() == [engine]
    half_ulp = lambda x: float(np.abs(x).max()) * 2.0 ** -11  # noqa: E731  (float16's unit roundoff times |x|)
    atol = atol_out + half_ulp(ref.out)
    assert tolerance.assert_close(got["out"], ref.out, atol, name="ring out") <= atol
    assert tolerance.assert_close(got["lse"], ref.lse, atol_lse, name="ring lse") <= atol_lse
    base = tolerance_backward.baseline_backward(got["q"], got["k"], got["v"], got["dout"], causal=causal,
                                                p_dtype=p_dtype, contractions=("matmul",))
    for name in ("dq", "dk", "dv"):
        want = getattr(base, name)
        atol = getattr(base, "atol_" + name) + half_ulp(want)
        assert tolerance.assert_close(got[name], want, atol, name=f"ring {name}") <= atol


@pytest.mark.slow
def test_a_rank_that_raises_ends_the_ring_with_its_error(tmp_path):
    """Rank 1 raises inside the group: the ring ends with an error well within the time limit (no hang). Which
    rank's traceback comes first is a race: rank 1's own, or rank 0's gloo error on losing its peer."""
    import time

    import torch.multiprocessing as mp

    case = dict(seed=0, shape=(1, 1, 1, 16, 8), layout="zigzag", causal=True, block=BLOCK, fail_rank=1,
                timeout_s=30)
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException) as caught:  # not TimeoutError: nothing hung
        spawn(2, case, tmp_path / "ring.npz", timeout=240)
    assert time.monotonic() - start < 200
    message = str(caught.value)
    lowered = message.lower()
    assert any(words in lowered for words in ("fails on purpose", "gloo", "connection", "remote worker")), message
    assert not (tmp_path / "ring.npz").exists()


@pytest.mark.lemma("L12")
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_zigzag_gives_every_rank_the_same_causal_work(world):
    counts = fd.pair_counts(world, "zigzag", causal=True)
    assert all(c == counts[0] for c in counts)
    assert counts[0][fd.PARTIAL] == 2 and counts[0][fd.FULL] == 2 * world - 1  # 4W pairs: 2 diagonal, half below
    contiguous = fd.pair_counts(world, "contiguous", causal=True)
    assert [c[fd.FULL] for c in contiguous] == list(range(world))  # rank r: r full pairs, the imbalance zigzag fixes


@pytest.mark.lemma("L12")
@pytest.mark.parametrize("world, layout", [(1, "contiguous"), (3, "contiguous"), (2, "zigzag"), (4, "zigzag")])
def test_every_chunk_pair_is_visited_exactly_once(world, layout):
    """Over the W steps, rank r meets key chunks of every rank once: the pairs (i, j) over all ranks are each
    query chunk against each key chunk, once (the ring's schedule, read off chunk_ids and the step rule)."""
    seen = {}
    for rank in range(world):
        for step in range(world):
            source = (rank - step) % world
            for i in fd.chunk_ids(rank, world, layout):
                for j in fd.chunk_ids(source, world, layout):
                    seen[(i, j)] = seen.get((i, j), 0) + 1
    count = world * (1 if layout == "contiguous" else 2)
    assert seen == {(i, j): 1 for i in range(count) for j in range(count)}


@pytest.mark.lemma("L12")
def test_the_ring_merge_is_the_decode_combine():
    """fa_numba.distributed's torch merge of block (O, LSE)s against split_kv.combine (the NumPy fold of L2's
    merge), empty blocks included."""
    rng = np.random.default_rng(1)
    lse = rng.normal(1.0, 2.0, (4, 3))
    o = rng.standard_normal((4, 3, 5))
    lse[0, 1] = -np.inf  # a block a row sees nothing of
    o[0, 1] = 0.0
    state = fd._State()
    for lse_s, o_s in zip(lse, o):
        state.add(torch.from_numpy(o_s), torch.from_numpy(lse_s))
    got_out, got_lse = (x.numpy() for x in state.result())
    want_out, want_lse = split_kv.combine(lse, o, np.ones(3, bool))
    # Two float64 folds of the same merges from the same inputs: each within merge_bound (tests/bounds.py).
    bound_out, bound_lse = (2 * b for b in merge_bound(lse, o))
    assert_within(got_out, want_out, bound_out, name="out")
    assert_within(got_lse, want_lse, bound_lse, name="lse")


def test_bad_layouts_and_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match="layout must be one of"):
        fd.chunk_ids(0, 2, "stripe")
    x = torch.zeros(1, 1, 4, 2)
    with pytest.raises(ValueError, match="layout must be one of"):
        fd.ring_attention(x, x, x, layout="ring")
    with pytest.raises(ValueError, match="q must be a 4-D torch tensor"):
        fd.ring_attention(x[0], x, x)
    with pytest.raises(ValueError, match="engine must be one of"):
        fd.ring_attention(x, x, x, engine="tensor")
    with pytest.raises(ValueError, match=r"engine='mma-tf32' runs float32 inputs' forward only"):
        fd.ring_attention(x.requires_grad_(), x, x, engine="mma-tf32")
    x = x.detach()
    with pytest.raises(ValueError, match=r"q, k, v must be shards of one sequence"):
        fd.ring_attention(x, x, torch.zeros(1, 1, 6, 2))
    with pytest.raises(RuntimeError, match="not initialised"):
        fd.ring_attention(x, x, x)


def test_the_ring_model_on_probes_with_known_answers():
    from fa_numba import ring_model

    # W = 2, N = 8, d = 4, B = H = 1, float16: a shard is 4 keys, K + V = 2 x 4 x 4 x 2 = 64 bytes a step
    fast = ring_model.ring_steps(2, 8, 4, itemsize=2, layout="contiguous", causal=False, tflops=1e30)
    assert [s["forward_bytes"] for s in fast] == [64, 0]  # W - 1 forward transfers
    assert [s["backward_bytes"] for s in fast] == [64 + 128] * 2  # W backward ones, dK and dV in float32
    assert fast[0]["forward_s"] == 64 / ring_model.LINK_BYTES_PER_S  # compute free: the link (the same division)
    slow = ring_model.ring_steps(2, 8, 4, layout="contiguous", causal=False, tflops=1e-9, link_bytes_per_s=1e30)
    pair_flops = 4 * 4 * 4 * 4  # 4 B H c^2 d, c = 4
    # link free: one full pair at 1e3 flop/s; the model's 1.0 x flops / (fl(1e-9) x 1e12) against flops / 1e3:
    # 1e-9's own rounding, the product, the division on one side, the division on the other: gamma(4)
    assert slow[0]["forward_s"] == pytest.approx(pair_flops / 1e3, rel=float(gamma(4)), abs=0)
    causal = ring_model.ring_steps(4, 64, 8, causal=True, tflops=1.0, link_bytes_per_s=1e30)
    assert len({s["pairs"] for s in causal}) == 1 and causal[0]["pairs"] == 2  # zigzag: 2 pair-units every step


def test_compare_ring_prints_the_model(capsys):
    from fa_numba import cli

    assert cli.main(["compare", "--ring", "2", "--n-q", "64", "--causal"]) == 0
    out = capsys.readouterr().out
    assert "ring attention, W=2" in out and "not a timing" in out
    with pytest.raises(SystemExit):
        cli.main(["compare", "--ring", "3", "--n-q", "100"])
    assert "divisible by 6 chunks" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--n", "0"], "argument --n: expected a positive integer, got 0"),
    (["--n", "-4"], "argument --n: expected a positive integer, got -4"),
    (["--world", "0"], "argument --world: expected a positive integer, got 0"),
    (["--n", "30"], "argument --n: must be divisible by 4 chunks (layout zigzag on 2 ranks), got 30"),
])
def test_the_demo_refuses_bad_sizes_before_spawning_ranks(argv, message, capsys, monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "start_processes", lambda *a, **k: pytest.fail("spawned ranks before refusing"))
    with pytest.raises(SystemExit) as exit_info:
        fd.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert err.rstrip("\n").splitlines()[-1] == f"python -m fa_numba.distributed: error: {message}"


def test_the_demo_entry_point_exits_2_on_a_size_of_zero():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "fa_numba.distributed", "--n", "0"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.rstrip("\n").splitlines()[-1].endswith("error: argument --n: expected a positive integer, got 0")


@pytest.mark.slow
def test_the_readme_two_process_example_runs_and_passes():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "fa_numba.distributed", "--world", "2", "--n", "32"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.strip().endswith("pass") and "O error" in done.stdout
    readme = (__import__("pathlib").Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "python -m fa_numba.distributed --world 2 --n 32" in readme


def test_a_forward_mode_tangent_is_refused_before_the_ring_runs():
    """ring_attention has no JVP: a dual input (torch.func.jvp, forward_ad) is a NotImplementedError naming the
    input, raised before any communication (no process group is needed to see it), never a zero tangent."""
    from torch.autograd import forward_ad

    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(k, torch.ones_like(k))
        with pytest.raises(NotImplementedError, match="k carries a forward-mode tangent"):
            fd.ring_attention(q, dual, v)


@pytest.mark.lemma("L12")
@pytest.mark.slow  # two processes of their own, the kernels in the simulator: about 20 s each
@pytest.mark.parametrize("mask_text", ["window:5,0", "varlen:0,10,32;0,10,32;inf,0"])
def test_ring_attention_with_an_interval_mask_matches_single_device(mask_text, tmp_path):
    """A sliding window and a packed batch (two sequences, causal inside each) over the global sequence, zigzag
    on two ranks: each chunk pair classified by the mask and run with its restriction; forward within the ring's
    rule, gradients within L7's."""
    from fa_numba import masks

    mask = masks.parse(mask_text)
    case = dict(seed=31, shape=(1, 2, 1, 32, 8), layout="zigzag", causal=False, block=BLOCK, mask=mask_text)
    spawn(2, case, tmp_path / "ring.npz")
    got = np.load(tmp_path / "ring.npz")
    atol_out, atol_lse = fd.ring_tolerances(got["q"], got["k"], got["v"], False, 2, "zigzag", BLOCK, mask=mask)
    ref = tolerance.baseline(got["q"], got["k"], got["v"], mask=mask, contractions=("matmul",))
    tolerance.assert_close(got["out"], ref.out, atol_out, name="ring out")
    tolerance.assert_close(got["lse"], ref.lse, atol_lse, name="ring lse")
    tolerance_backward.check_attention_backward(got["dq"], got["dk"], got["dv"], got["q"], got["k"], got["v"],
                                                got["dout"], mask=mask)


@pytest.mark.lemma("L12")
@pytest.mark.parametrize("mask_text", ["window:5,2", "prefix:6", "documents-causal:12,20",
                                       "varlen:0,10,10,32;0,16,20,32;inf,0"])
def test_the_ring_merge_of_a_masks_chunk_pairs_is_the_whole_mask(mask_text):
    """In one process, the ring's work for an interval mask: every chunk pair classified by the mask (against the
    dense mask's own blocks) and run with its restriction, merged as the ring merges (its _State); within the
    ring's rule. No processes: the default tier's check of what the slow tier runs on gloo."""
    from fa_numba import masks

    mask = masks.parse(mask_text)
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 2, 32, 8)).astype(np.float32) for _ in range(3))
    dense, chunk, count = mask.dense(32, 32), 8, 4
    out, lse = np.zeros((1, 2, 32, 8), np.float32), np.zeros((1, 2, 32), np.float32)
    for i in range(count):
        state = fd._State()
        for j in range(count):
            kind, pair_mask = fd._pair(i, j, False, mask, chunk, count)
            block = dense[i * chunk:(i + 1) * chunk, j * chunk:(j + 1) * chunk]
            assert kind == (fd.SKIP if not block.any() else fd.FULL if block.all() else fd.PARTIAL), (i, j)
            if kind != fd.SKIP:
                rows, keys = slice(i * chunk, (i + 1) * chunk), slice(j * chunk, (j + 1) * chunk)
                o, m = fa_numba.attention(*(torch.tensor(x) for x in (q[..., rows, :], k[..., keys, :],
                                                                      v[..., keys, :])),
                                          mask=pair_mask, return_lse=True, block_q=BLOCK, block_k=BLOCK)
                state.add(o, m)
        o, m = state.result()
        out[..., i * chunk:(i + 1) * chunk, :], lse[..., i * chunk:(i + 1) * chunk] = o.numpy(), m.numpy()
    atol_out, atol_lse = fd.ring_tolerances(q, k, v, False, count, "contiguous", BLOCK, mask=mask)
    ref = tolerance.baseline(q, k, v, mask=mask, contractions=("matmul",))
    tolerance.assert_close(out, ref.out, atol_out, name="merged out")
    tolerance.assert_close(lse, ref.lse, atol_lse, name="merged lse")


def test_the_ring_model_counts_what_a_mask_leaves_of_each_chunk_pair(capsys):
    """ring_steps(mask=): each chunk pair costs its share of visible pairs (from the mask's row intervals), so the
    steps' work sums to the mask's visible pairs over c^2, and a pair the mask empties costs nothing."""
    from fa_numba import cli, masks, ring_model

    window = masks.sliding_window(7, 0)
    n, world = 64, 2  # zigzag: 4 chunks of 16
    dense = window.dense(n, n)
    shares = ring_model._mask_shares(window, n, 16, 4)
    blocks = dense.reshape(4, 16, 4, 16).sum(axis=(1, 3)) / 256
    assert np.array_equal(shares, blocks)
    steps = ring_model.ring_steps(world, n, 8, causal=False, mask=window)
    causal = ring_model.ring_steps(world, n, 8, causal=True)
    assert steps[1]["pairs"] < causal[1]["pairs"]  # the window leaves less of the off-diagonal pairs
    assert cli.main(["compare", "--ring", "2", "--n-q", "64", "--mask", "window:7,0"]) == 0
    assert "mask window:7,0" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["compare", "--ring", "2", "--n-q", "64", "--mask", "window:7,0", "--causal"])
