"""The fused C rows (ops/cpu_rows.py) and the C folds of the fused-linear tiles against the float64 oracle
(reference/), and the fallback when the extension is missing. The hypothesis tests of tests/test_torch_path.py run
on both CPU paths (its `cpu_path`)."""

import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from grpo_kernels import grpo_loss
from grpo_kernels.dispatch import pick_backend
from grpo_kernels.ops import cpu_rows, torch_rows
from grpo_kernels.ops.linear_tiles import GradRows, RowStats
from grpo_kernels.vocab_parallel import merge_partials
from reference import reference_selective_log_softmax

from ..oracle_check import TOLERANCES, assert_close
from .row_oracle import check_grad, check_stats, exact_grad, exact_rows

pytestmark = [
    pytest.mark.usefixtures("nan_empty"),
    pytest.mark.skipif(not cpu_rows.available(), reason="the _cpu_rows extension is not built (pip install -e .)"),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # each has its own load/store code in the kernels
ROOT = Path(__file__).resolve().parents[2]


def _logits(batch, length, vocab, dtype, seed=0, scale=3.0):
    """A (B, T, V) strided view: time is sliced out of a longer buffer, as a model's logits are."""
    gen = torch.Generator().manual_seed(seed)
    full = (torch.randn(batch, length + 2, vocab, generator=gen) * scale).to(dtype)
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    return full[:, 1:-1], ids, gen


def _check_state(state, entropy, x):
    """The row state is the shared layout of ops/backend.py: the raw row max, and H = log Σe − Σ p·z'."""
    finite = torch.isfinite(entropy)
    assert torch.equal(state[..., 0][finite], x.float().amax(-1)[finite])
    assert_close("H from the state", (state[..., 1] - state[..., 3])[finite], entropy[finite], 1e-6, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 31, 1500])  # one column; odd; several SUM_BLOCKs per row
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_stats_and_grad_match_the_oracle(dtype, vocab, temperature):
    x, ids, gen = _logits(3, 5, vocab, dtype)
    exact_lp, exact_h, graph = exact_rows(x, ids, temperature)
    logp, entropy, state = cpu_rows.row_stats(x, ids, temperature)
    check_stats("logp", logp, exact_lp, dtype)
    check_stats("entropy", entropy, exact_h, dtype)
    _check_state(state, entropy, x)
    g, h = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    for hh in (None, h):
        out = torch.empty_like(x)
        cpu_rows.row_grad(x, ids, state, g, hh, temperature, out)
        check_grad(out, exact_grad(graph, g, hh), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [4, 20])  # two shards of 4 + 19 and 20 + 3 columns: each holds some targets
def test_shard_partials_and_shard_gradients_merge_to_the_oracle(dtype, split):
    """Each shard's partials, merged (vocab_parallel.merge_partials), give the full row's ℓ and H; each shard's
    gradient from the merged state, with shard-local ids (a target outside [0, V) gets no one-hot), is the
    oracle's gradient of those columns."""
    x, ids, gen = _logits(2, 6, 23, dtype)
    x[0, 1, :split] = -math.inf  # a shard row that is all −inf (padded vocabulary)
    ids[0, 1] = split
    shards = [(0, x[..., :split]), (split, x[..., split:])]
    parts = torch.stack([cpu_rows.shard_partials(shard, ids, offset, 0.8) for offset, shard in shards])
    logp, entropy, state = merge_partials(parts, 0.8)
    exact_lp, exact_h, graph = exact_rows(x, ids, 0.8)
    check_stats("logp", logp, exact_lp, dtype)
    check_stats("entropy", entropy, exact_h, dtype)
    g, h = torch.randn(2, 6, generator=gen), torch.randn(2, 6, generator=gen)
    grads = []
    for offset, shard in shards:
        grads.append(torch.empty_like(shard))
        cpu_rows.row_grad(shard, ids - offset, state, g, h, 0.8, grads[-1])
    check_grad(torch.cat(grads, -1), exact_grad(graph, g, h), dtype)


def test_long_rows_stay_exact_against_float64():
    """A Qwen-size vocabulary: the fp32 sums over 151936 columns (SIMD lanes in blocks, double across blocks) keep
    ℓ and H within the fp32 tolerance of the float64 oracle, with peaked and flat rows."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 3, 151936, generator=gen) * 2
    x[0, 1] *= 0.01  # nearly flat
    ids = torch.randint(0, 151936, (1, 3), generator=gen)
    x[0, 2, ids[0, 2]] = 40.0  # peaked: p_y ≈ 1, 1 − p_y must not cancel
    logp, entropy, state = cpu_rows.row_stats(x, ids, 1.0)
    rlogp, rent = reference_selective_log_softmax(x.double(), ids, temperature=1.0)
    tol = TOLERANCES[torch.float32]
    assert_close("logp", logp, rlogp, tol["loss_rtol"], tol["loss_atol"])
    assert_close("entropy", entropy, rent, tol["loss_rtol"], tol["loss_atol"])
    # 1 − p_y ≈ 5e-12, exact in float64 as Σ_{v≠y} p_v (1 − p_y itself would cancel); within 1e-4 relative, the
    # conditioning of fp32's x − max (an ulp of 40 is 4e-6), and as the torch rows get it
    e = torch.exp(x[0, 2].double() - 40.0)
    q = (e.sum() - e[ids[0, 2]]) / e.sum()
    assert abs(state[0, 2, 2].item() - q.item()) <= 1e-4 * q.item()


def test_extreme_and_non_finite_logits():
    x, ids, _ = _logits(2, 4, 50, torch.float32)
    x[0, 0] += 1e4  # large logits: everything relative to the raw max
    x[0, 1, 7:] = -math.inf  # a padded vocabulary
    ids[0, 1] = 3
    x[1, 2, 5] = math.nan
    ours = cpu_rows.row_stats(x, ids, 1.0)
    exact_lp, exact_h, _ = exact_rows(x, ids, 1.0)
    check_stats("logp", ours[0], exact_lp, torch.float32)
    check_stats("entropy", ours[1], exact_h, torch.float32)
    assert ours[0][1, 2].isnan() and ours[0][~ours[0].isnan()].isfinite().all()
    out = torch.empty_like(x)
    cpu_rows.row_grad(x, ids, ours[2], torch.ones(2, 4), torch.ones(2, 4), 1.0, out)
    assert (out[0, 1, 7:] == 0).all() and out[1, 2].isnan().all() and out[0, :2].isfinite().all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_gradient_and_thread_count_change_nothing(dtype, monkeypatch):
    monkeypatch.setattr(cpu_rows, "PARALLEL_MIN_ELEMENTS", 0)  # small as it is, the batch is split over threads
    x, ids, gen = _logits(4, 16, 700, dtype)
    adv = torch.randn(4, generator=gen)
    results = []
    threads = torch.get_num_threads()
    try:
        for n, inplace in ((1, False), (max(threads, 2), False), (max(threads, 2), True)):
            torch.set_num_threads(n)
            leaf = x.clone().requires_grad_(True)
            logits = leaf.clone() if inplace else leaf  # in place: a non-leaf buffer the gradient overwrites
            out = grpo_loss(logits, ids, adv, loss_type="dapo", entropy_coef=0.01, inplace_backward=inplace,
                            backend="torch")  # fmt: skip
            out.loss.backward()
            grad = leaf.grad
            results.append((out.loss.detach(), out.logp, grad))
    finally:
        torch.set_num_threads(threads)
    for loss, logp, grad in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(logp, results[0][1])
        assert torch.equal(grad, results[0][2])


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_linear_folds_match_the_oracle(entropy, temperature):
    """The C folds of the fused-linear tiles: two 300-column tiles folded into the statistics give the oracle's ℓ
    and H of the 600-column rows (targets before, inside and after each tile); the gradient fold of one tile, from
    the oracle's lse and Σ p·z, is the oracle's gradient of that tile."""
    gen = torch.Generator().manual_seed(5)
    rows, cols = 37, 300
    inv_t = 1.0 / temperature
    ids = torch.randint(0, 2 * cols, (rows,), generator=gen)
    z = torch.randn(rows, 2 * cols, generator=gen) * 4
    z[0, :cols] = -math.inf  # a row that is all −inf in the first tile: the second rescales an empty state
    ids[0] = cols + 7
    st = RowStats.empty(rows, torch.device("cpu"))
    for v0 in (0, cols):  # the second tile rescales the first's sums
        assert cpu_rows.fold_stats(z[:, v0 : v0 + cols].contiguous(), ids, v0, inv_t, st)  # the C fold ran
    log_sum = torch.log(st.sum_exp)
    exact_lp, exact_h, _ = exact_rows(z.unsqueeze(0), ids.unsqueeze(0), temperature)
    check_stats("logp", (st.target - st.max) - log_sum, exact_lp[0], torch.float32)
    check_stats("entropy", log_sum - st.sum_exp_z / st.sum_exp, exact_h[0], torch.float32)
    assert torch.equal(st.max, (z * inv_t).amax(-1))

    tile = z[1:, :cols].contiguous()  # one tile holding the whole rows' vocabulary
    tile_ids = ids[1:] % cols
    exact_lp, exact_h, graph = exact_rows(tile.unsqueeze(0), tile_ids.unsqueeze(0), temperature)
    lse = torch.logsumexp(tile.double() * inv_t, -1)
    g, h = torch.randn(rows - 1, generator=gen), torch.randn(rows - 1, generator=gen)
    fold_rows = GradRows(
        ids=tile_ids, lse=lse.float(), mean_z=(lse - exact_h[0]).float() if entropy else None, g=g,
        h=h if entropy else None,
    )  # fmt: skip
    got = cpu_rows.fold_grad(tile, 0, inv_t, fold_rows, torch.float32)
    assert got is not None  # the C fold ran
    want = exact_grad(graph, g.unsqueeze(0), h.unsqueeze(0) if entropy else None)[0]
    check_grad(got, want, torch.float32)


def test_bad_arguments_raise_before_any_pointer_is_used():
    x, ids, _ = _logits(2, 3, 11, torch.float32)
    with pytest.raises(ValueError, match="ids must have shape"):
        cpu_rows.row_stats(x, ids[:, :2], 1.0)
    with pytest.raises(TypeError, match="ids must be int32/int64"):
        cpu_rows.row_stats(x, ids.float(), 1.0)
    with pytest.raises(ValueError, match="unit stride"):
        cpu_rows.row_stats(x.transpose(1, 2), ids, 1.0)
    _, _, state = cpu_rows.row_stats(x, ids, 1.0)
    with pytest.raises(ValueError, match="out must match"):
        cpu_rows.row_grad(x, ids, state, torch.ones(2, 3), None, 1.0, torch.empty(2, 3, 10))
    with pytest.raises(ValueError, match="row_state"):
        cpu_rows.row_grad(x, ids, state[..., :2], torch.ones(2, 3), None, 1.0, torch.empty_like(x))
    with pytest.raises(ValueError, match="g must have shape"):
        cpu_rows.row_grad(x, ids, state, torch.ones(2, 2), None, 1.0, torch.empty_like(x))


def test_auto_picks_the_fused_rows_and_the_switch_turns_them_off(monkeypatch):
    cpu = torch.device("cpu")
    assert pick_backend(cpu, "auto") is cpu_rows and pick_backend(cpu, "torch") is cpu_rows
    monkeypatch.setenv("GRPO_KERNELS_CPU_ROWS", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # turned off on purpose: no warning
        assert pick_backend(cpu, "torch") is torch_rows


def test_missing_extension_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(cpu_rows, "_ext", None)
    monkeypatch.setattr(cpu_rows, "_IMPORT_ERROR", ImportError("no module named _cpu_rows"))
    monkeypatch.setattr(cpu_rows, "_warned", False)
    x, ids, gen = _logits(2, 3, 13, torch.float32)
    adv = torch.randn(2, generator=gen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = grpo_loss(x.clone().requires_grad_(), ids, adv, backend="torch")
        second = grpo_loss(x.clone().requires_grad_(), ids, adv, backend="torch")
    fallback = [w for w in caught if "fused CPU kernels are not built" in str(w.message)]
    assert len(fallback) == 1 and issubclass(fallback[0].category, RuntimeWarning)
    assert torch.equal(first.loss, second.loss)


def test_a_process_without_the_extension_runs_the_chunked_rows():
    """A fresh interpreter in which the extension cannot be imported at all: one warning, the torch rows' result."""
    script = (
        "import sys, warnings; sys.modules['grpo_kernels._cpu_rows'] = None\n"
        "warnings.simplefilter('always')\n"
        "import torch; from grpo_kernels import grpo_loss; from grpo_kernels.dispatch import pick_backend\n"
        "from grpo_kernels.ops import torch_rows\n"
        "x = torch.randn(2, 3, 9, requires_grad=True); ids = torch.randint(0, 9, (2, 3))\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    for _ in range(3): grpo_loss(x, ids, torch.ones(2)).loss.backward()\n"
        "assert pick_backend(torch.device('cpu'), 'auto') is torch_rows\n"
        "print(sum('not built' in str(m.message) for m in w))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("GRPO_KERNELS_CPU_ROWS", None)
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "1"


def test_a_forked_child_runs_the_kernels_on_one_thread():
    """GNU OpenMP's thread team does not survive fork(): a child that used it would hang; ours runs serially."""
    script = (
        "import os, torch; from grpo_kernels.ops import cpu_rows\n"
        "x = torch.randn(1, 8, 40000); ids = torch.randint(0, 40000, (1, 8))\n"
        "want = cpu_rows.row_stats(x, ids, 1.0)[0]\n"  # 320k logits: the parent uses the thread team
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if torch.equal(cpu_rows.row_stats(x, ids, 1.0)[0], want) else 3)\n"
        "_, status = os.waitpid(pid, 0); print(os.waitstatus_to_exitcode(status))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "0"
