"""fused_linear_grpo_loss against the float64 oracle on logits = hidden @ weight.T + bias.

Loss, ℓ, H and the gradients of hidden, weight and bias, with a random upstream gradient, for both backends:
"torch" (the CPU tiles) and "triton" (the Triton folds, under TRITON_INTERPRET=1 without a GPU). Tiles are shrunk so
that every call crosses several row blocks and vocabulary tiles, the last one ragged.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from grpo_kernels.api import grpo_loss
from grpo_kernels.fused_linear import fused_linear_grpo_loss
from grpo_kernels.ops import linear_folds_torch, linear_folds_triton
from reference import reference_grpo_loss

from .conftest import needs_triton_cpu

pytestmark = pytest.mark.usefixtures("nan_empty")  # an output element a kernel forgot to write is NaN

# the CPU tiles; the Triton folds on CPU tensors (interpreted, so skipped on a machine whose interpreter is off)
BACKENDS = ["torch", pytest.param("triton", marks=needs_triton_cpu)]
TILE_BACKENDS = (linear_folds_torch.BACKEND, linear_folds_triton.BACKEND)
PRODUCTION_TILES = [(tiles, tiles.tile_elements, tiles.min_vocab_tile) for tiles in TILE_BACKENDS]

# Bounds from docs/loss.md, "Tolerances". fp32: loss/ℓ/H 1e-5 relative (1e-6 absolute); gradients 1e-5 of their max.
# Half inputs: loss/ℓ/H 1e-4 relative; gradients element by element within `_half_grad_bound` (see there).
TOLERANCES = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-6, "grad_rel_max": 1e-5},
    torch.bfloat16: {"rtol": 1e-4, "atol": 1e-6},
    torch.float16: {"rtol": 1e-4, "atol": 1e-6},
}

# B = 3 (one sequence fully masked, one half), T = 4, H = 37 (not a power of two), V = 300 (not a multiple of any tile).
B, T, H, V = 3, 4, 37, 300


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    # 12 rows in blocks of 10 and 2; vocabulary tiles of 128, 128 and 44 columns: every loop edge is crossed, in few
    # kernel launches (the interpreter pays per launch).
    for tiles in TILE_BACKENDS:
        monkeypatch.setattr(tiles, "tile_elements", 1280)
        monkeypatch.setattr(tiles, "min_vocab_tile", 128)


# ----------------------------------------------------------------------------------------------------------------
# The oracle


def oracle(hidden, weight, bias, ids, tensors, options, upstream):
    """float64 on the same input values: (loss, ℓ, H, ∂hidden, ∂weight, ∂bias, ∂logits, hidden rows)."""
    x = hidden.detach().double().reshape(-1, hidden.shape[-1])
    w = weight.detach().double()
    logits = x @ w.T
    if bias is not None:
        logits = logits + bias.detach().double()
    logits = logits.view(*hidden.shape[:2], -1).requires_grad_()
    out = reference_grpo_loss(logits, ids, **tensors, **options)
    (dz,) = torch.autograd.grad(out.loss * upstream, logits)
    dz = dz.reshape(-1, w.shape[0])
    logp, entropy = out.logp.detach(), out.entropy.detach()
    return out.loss.detach(), logp, entropy, (dz @ w).view(hidden.shape), dz.T @ x, dz.sum(0), dz, x


# ----------------------------------------------------------------------------------------------------------------
# Inputs


def make_inputs(dtype=torch.float32, extras=(), seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen)
    hidden = randn(B, T, H).to(dtype)
    weight = (randn(V, H) * 3 / math.sqrt(H)).to(dtype)  # logits of std ~3: peaked rows, as a trained head gives
    b = (randn(V) * 0.5).to(dtype) if bias else None
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T)
    mask[1, 2:] = 0
    mask[2] = 0
    true_logits = hidden.double().reshape(-1, H) @ weight.double().T + (0 if b is None else b.double())
    true_logp = true_logits.log_softmax(-1).gather(-1, ids.reshape(-1, 1)).view(B, T).float()
    tensors = {"advantages": randn(B, T) if "adv_bt" in extras else randn(B), "completion_mask": mask}
    tensors["old_logp"] = true_logp + 0.3 * randn(B, T) if "old" in extras else None  # ratios on both clip edges
    tensors["ref_logp"] = true_logp + 0.5 * randn(B, T) if "ref" in extras else None
    if "is_ratio" in extras:
        tensors["importance_sampling_ratio"] = 0.5 + torch.rand(B, T, generator=gen)
    if "sampling" in extras:
        tensors["sampling_logp"] = true_logp + 0.2 * randn(B, T)
    return hidden, weight, b, ids, tensors


def run(hidden, weight, bias, ids, tensors, options, upstream, backend):
    x = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    out = fused_linear_grpo_loss(x, w, ids, bias=b, backend=backend, **tensors, **options)
    (out.loss * upstream).backward()
    return out, x.grad, w.grad, None if b is None else b.grad


def assert_fp32_close(out, grads, ref):
    tol = TOLERANCES[torch.float32]
    loss, logp, entropy = ref[:3]
    torch.testing.assert_close(out.loss.double(), loss, rtol=tol["rtol"], atol=tol["atol"])
    torch.testing.assert_close(out.logp.double(), logp, rtol=tol["rtol"], atol=tol["atol"])
    torch.testing.assert_close(out.entropy.double(), entropy, rtol=tol["rtol"], atol=tol["atol"])
    dz, x = ref[6].abs(), ref[7].abs()
    # A sum over rows of fp32 terms is exact to eps·Σ|terms|, not to eps·|sum|: where rows cancel (∂bias = Σ dz,
    # ∂weight = dzᵀx), the scale is the largest Σ|term| (the condition of the sum), else the result's max.
    term_scales = {"weight": (dz.T @ x).max().item(), "bias": dz.sum(0).max().item()}
    for name, ours, want in zip(("hidden", "weight", "bias"), grads, ref[3:6]):
        if ours is None:
            continue
        err = (ours.double() - want).abs().max().item()
        scale = max(want.abs().max().item(), term_scales.get(name, 0.0))
        assert err <= tol["grad_rel_max"] * scale + 1e-12, f"∂{name}: max error {err:.3e} vs max {scale:.3e}"


# ----------------------------------------------------------------------------------------------------------------
# Every loss type and option, fp32

# (id, options, extra inputs): each case moves g = ∂loss/∂ℓ or h = ∂loss/∂H through a different branch.
CASES = [
    ("grpo", {}, ()),  # defaults, old_logp None: ratio exactly 1, g = −A·w
    ("grpo-old-tau", {"temperature": 0.7}, ("old",)),  # both clip edges active; τ != 1 scales z and dz
    ("bnpo-kl", {"loss_type": "bnpo", "beta": 0.04}, ("old", "ref")),  # the k3 KL term in g
    (
        "dr_grpo-biaskl",
        {"loss_type": "dr_grpo", "beta": 0.1, "use_bias_correction_kl": True, "max_completion_length": 8},
        ("old", "ref"),
    ),  # KL times the ratio
    (
        "dapo-delta",
        {"loss_type": "dapo", "epsilon_high": 0.28, "delta": 1.5},
        ("old", "is_ratio", "adv_bt"),
    ),  # two-sided
    ("luspo-gspo", {"loss_type": "luspo", "importance_sampling_level": "sequence"}, ("old",)),  # sequence-level ratio
    ("cispo", {"loss_type": "cispo", "epsilon_high": 1.2}, ("old", "is_ratio")),  # capped detached weight
    ("sapo-entropy", {"loss_type": "sapo", "entropy_coef": 0.05}, ("old",)),  # h != 0: the entropy-bonus dz term
    ("vespo", {"loss_type": "vespo"}, ("old", "is_ratio")),  # sequence-level φ with ρ folded in
    ("entropy-mask", {"top_entropy_quantile": 0.5, "entropy_coef": 0.02}, ("old",)),  # quantile mask and h together
    ("off-policy", {"off_policy_mask_threshold": 0.05}, ("old", "sampling")),  # sequence mask from sampling_logp
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_oracle_fp32(case, backend):
    name, options, extras = case
    hidden, weight, bias, ids, tensors = make_inputs(extras=extras, seed=len(name))
    upstream = 1.0 if len(name) % 2 else 0.37  # both backward branches: as-is, and scaled in place
    out, *grads = run(hidden, weight, bias, ids, tensors, options, upstream, backend)
    assert_fp32_close(out, grads, oracle(hidden, weight, bias, ids, tensors, options, upstream))


def test_metrics_match_the_logits_path():
    # Same objective code, so the metrics must agree with grpo_loss on the materialized logits.
    hidden, weight, bias, ids, tensors = make_inputs(extras=("old", "ref"))
    options = {"beta": 0.04, "entropy_coef": 0.01}
    out = fused_linear_grpo_loss(hidden, weight, ids, bias=bias, backend="torch", **tensors, **options)
    logits = hidden @ weight.T + bias
    want = grpo_loss(logits, ids, backend="torch", **tensors, **options)
    assert out.metrics.keys() == want.metrics.keys()
    for key in want.metrics:
        torch.testing.assert_close(out.metrics[key], want.metrics[key], rtol=1e-5, atol=1e-6, msg=key)


# ----------------------------------------------------------------------------------------------------------------
# bf16 / fp16


def _half_grad_bound(want, dz, other, grad_dtype, storage_dtype):
    """Element-wise bound on |ours − oracle| for a gradient GEMM product = dz @ other, stored in `storage_dtype`.

    - 1 ulp of the result: the fp32 accumulator rounded once to bf16/fp16 (≤ ½ ulp), plus the rest below.
    - dz rounded to `grad_dtype` before the GEMM (bf16 on the Triton path, for the tensor cores; fp32 on the torch
      path): each element moves by ≤ u·|dz|, so the product moves by ≤ u·(|dz| @ |other|), u the unit roundoff; in
      fp16 an element below the subnormal range can also flush, ≤ 2^-25 each.
    - fp32 accumulation (of z over H, of the products over rows/vocabulary) adds ≤ 2^-14 relative to |dz| @ |other|
      at these sizes (K·2^-24 with K ≤ 300), far below the bf16 term.
    The materialized path has the same dz rounding, since its ∂logits are stored in the logits' dtype.
    """
    u = torch.finfo(grad_dtype).eps / 2
    flush = 2.0**-25 if grad_dtype == torch.float16 else 0.0
    spread = (u + 2.0**-14) * (dz.abs() @ other.abs()) + flush * other.abs().sum(0)
    return torch.finfo(storage_dtype).eps * want.abs() + 2 * spread + torch.finfo(storage_dtype).tiny


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])  # fp16: also underflow
def test_half_precision(dtype, backend):
    # The oracle sees the same bf16/fp16 values upcast; the kernel computes the logits in fp32 from them.
    options = {"loss_type": "dapo", "beta": 0.04, "entropy_coef": 0.05, "temperature": 0.9}  # g and h both non-trivial
    hidden, weight, bias, ids, tensors = make_inputs(dtype, extras=("old", "ref"), seed=3)
    out, dx, dw, db = run(hidden, weight, bias, ids, tensors, options, 0.5, backend)
    loss, logp, entropy, want_dx, want_dw, want_db, dz, x = oracle(hidden, weight, bias, ids, tensors, options, 0.5)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.loss.double(), loss, rtol=tol["rtol"], atol=tol["atol"])
    torch.testing.assert_close(out.logp.double(), logp, rtol=tol["rtol"], atol=tol["atol"])
    torch.testing.assert_close(out.entropy.double(), entropy, rtol=tol["rtol"], atol=tol["atol"])
    assert dx.dtype == dw.dtype == db.dtype == dtype
    grad_dtype = dtype if backend == "triton" else torch.float32
    w = weight.double()
    checks = (
        ("hidden", dx.reshape(-1, H), want_dx.reshape(-1, H), dz, w),
        ("weight", dw, want_dw, dz.T, x),
        ("bias", db, want_db, dz.T, torch.ones(dz.shape[0], 1, dtype=torch.float64)),
    )
    for name, ours, want, left, right in checks:
        bound = _half_grad_bound(want.reshape(left.shape[0], -1), left, right, grad_dtype, dtype).reshape(want.shape)
        excess = (ours.double() - want).abs() - bound
        assert excess.max() <= 0, f"∂{name}: exceeds its bound by {excess.max():.3e} (max |∂| {want.abs().max():.3e})"


# ----------------------------------------------------------------------------------------------------------------
# Layouts the trainer passes: strided hidden, no bias, frozen or tied weights


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("masked", [False, True], ids=["dense", "masked"])  # every row in pass 2 / padded rows as zeros
def test_strided_hidden_without_bias(backend, masked):
    # hidden = last_hidden[:, P-1:-1] cannot be flattened without a copy: the row blocks follow each sequence.
    hidden, weight, _, ids, tensors = make_inputs(extras=("old",), bias=False)
    full = torch.randn(B, T + 3, H)
    full[:, 2:-1] = hidden
    view = full[:, 2:-1]
    with pytest.raises(RuntimeError):
        view.view(-1, H)
    if not masked:
        tensors["completion_mask"] = None  # every row active
    options = {"entropy_coef": 0.03}
    out, *grads = run(view, weight, None, ids, tensors, options, 1.0, backend)
    assert grads[2] is None
    assert_fp32_close(out, grads, oracle(hidden, weight, None, ids, tensors, options, 1.0))


def test_frozen_weight_gets_no_gradient():
    # A PEFT adapter trains the body, not lm_head: only ∂hidden is computed (pass 2 skips the ∂W GEMM).
    hidden, weight, bias, ids, tensors = make_inputs(extras=("old",))
    x = hidden.clone().requires_grad_()
    out = fused_linear_grpo_loss(x, weight, ids, bias=bias, backend="torch", **tensors)
    out.loss.backward()
    ref = oracle(hidden, weight, bias, ids, tensors, {}, 1.0)
    assert_fp32_close(out, (x.grad, None, None), ref)


def test_tied_embeddings_accumulate_both_uses():
    # The lm_head weight is the input embedding: its gradient is the sum of both uses, as with materialized logits.
    torch.manual_seed(1)
    emb = torch.nn.Embedding(V, H)
    tokens = torch.randint(0, V, (B, T))
    ids = torch.randint(0, V, (B, T))
    adv = torch.randn(B)
    grads = []
    for fused in (True, False):
        emb.zero_grad()
        hidden = torch.tanh(emb(tokens))
        if fused:
            out = fused_linear_grpo_loss(hidden, emb.weight, ids, adv, backend="torch")
        else:
            out = grpo_loss(hidden @ emb.weight.T, ids, adv, backend="torch")
        out.loss.backward()
        grads.append(emb.weight.grad.clone())
    err = (grads[0] - grads[1]).abs().max()
    assert err <= 1e-5 * grads[1].abs().max()


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_gradient_are_skipped_exactly(backend):
    # Zero advantages and no KL: every g is 0, pass 2 has no row left, and every gradient is exactly 0.
    hidden, weight, bias, ids, tensors = make_inputs(extras=("old",))
    tensors["advantages"] = torch.zeros(B)
    out, *grads = run(hidden, weight, bias, ids, tensors, {}, 1.0, backend)
    assert all(bool((x == 0).all()) for x in grads)
    torch.testing.assert_close(out.logp.double(), oracle(hidden, weight, bias, ids, tensors, {}, 1.0)[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_rows_are_absent_whatever_their_hidden_states_hold(backend):
    # Pass 2 runs every row (skipping zero rows needs a host read); a masked row's NaN or inf hidden state must not
    # reach ∂weight or ∂bias through 0·NaN, and its own ∂hidden row is exactly 0.
    hidden, weight, bias, ids, tensors = make_inputs(extras=("old",))
    poisoned = hidden.clone()
    poisoned[2, 0], poisoned[1, 3, :5] = float("nan"), float("inf")  # masked: row 2 and (1, 2:)
    out, *grads = run(poisoned, weight, bias, ids, tensors, {}, 1.0, backend)
    ref = oracle(hidden, weight, bias, ids, tensors, {}, 1.0)
    active = tensors["completion_mask"].bool()
    assert out.logp[~active].isnan().any()  # ℓ and H are outputs for every row: those of the poisoned rows are NaN
    out.logp, out.entropy = (torch.where(active, x, r.float()) for x, r in ((out.logp, ref[1]), (out.entropy, ref[2])))
    assert_fp32_close(out, grads, ref)
    assert (grads[0][2] == 0).all() and (grads[0][1, 2:] == 0).all()


def test_no_grad_gives_log_probs_only():
    hidden, weight, bias, ids, tensors = make_inputs()
    with torch.no_grad():
        out = fused_linear_grpo_loss(hidden, weight, ids, bias=bias, backend="torch", **tensors)
    ref = oracle(hidden, weight, bias, ids, tensors, {}, 1.0)
    torch.testing.assert_close(out.logp.double(), ref[1], rtol=1e-5, atol=1e-6)
    assert out.loss.grad_fn is None


def test_second_backward_is_refused():
    hidden, weight, bias, ids, tensors = make_inputs()
    x = hidden.clone().requires_grad_()
    out = fused_linear_grpo_loss(x, weight, ids, bias=bias, backend="torch", **tensors)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward called a second time"):
        out.loss.backward()


# ----------------------------------------------------------------------------------------------------------------
# Memory: no (B·T, V) tensor, ever


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def assert_never_materializes_the_logits(monkeypatch, step) -> None:
    """`step(hidden, weight, ids)` (a forward and backward) allocates nothing of the logits' size.

    64 rows x 1024 vocabulary = 65536 logits; the tile budget is 4096 (16 rows x 256) and weight has 1024 x 4."""
    monkeypatch.setattr(linear_folds_torch.BACKEND, "tile_elements", 4096)
    monkeypatch.setattr(linear_folds_torch.BACKEND, "min_vocab_tile", 256)
    rows, vocab, width = 64, 1024, 4
    hidden = torch.randn(2, rows // 2, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    ids = torch.randint(0, vocab, (2, rows // 2))
    with _LargestTensor() as spy:
        step(hidden, weight, ids)
    assert spy.largest <= max(4096, vocab * width), f"a tensor of {spy.largest} elements (logits: {rows * vocab})"
    assert hidden.grad.abs().max() > 0 and weight.grad.abs().max() > 0


def test_never_materializes_the_logits(monkeypatch):
    def step(hidden, weight, ids):
        fused_linear_grpo_loss(hidden, weight, ids, torch.randn(2), backend="torch", entropy_coef=0.1).loss.backward()

    assert_never_materializes_the_logits(monkeypatch, step)


# ----------------------------------------------------------------------------------------------------------------
# Odd shapes (V = 1, H = 1, single tokens), any tile


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch=st.integers(1, 3),
    length=st.integers(1, 5),
    width=st.integers(1, 40),
    vocab=st.sampled_from([1, 2, 63, 64, 65, 130]),  # a single token; around the tile widths; many tiles
    tile=st.sampled_from([24, 200, 1 << 20]),  # 8-column tiles of <= 3 rows ... everything in one tile
    seed=st.integers(0, 2**16),
)
def test_any_shape_torch(batch, length, width, vocab, tile, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, width, generator=gen)
    weight = torch.randn(vocab, width, generator=gen)
    bias = torch.randn(vocab, generator=gen)
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    tensors = {
        "advantages": torch.randn(batch, generator=gen),
        "completion_mask": None,
        "old_logp": None,
        "ref_logp": None,
    }
    tiles = linear_folds_torch.BACKEND
    old = (tiles.tile_elements, tiles.min_vocab_tile)
    tiles.tile_elements, tiles.min_vocab_tile = tile, 8
    try:
        out, *grads = run(hidden, weight, bias, ids, tensors, {"entropy_coef": 0.1}, 1.0, "torch")
    finally:
        tiles.tile_elements, tiles.min_vocab_tile = old
    assert_fp32_close(out, grads, oracle(hidden, weight, bias, ids, tensors, {"entropy_coef": 0.1}, 1.0))


# ----------------------------------------------------------------------------------------------------------------
# Validation


def _good():
    return {
        "hidden": torch.randn(2, 3, 8),
        "weight": torch.randn(11, 8),
        "completion_ids": torch.randint(0, 11, (2, 3)),
        "advantages": torch.randn(2),
    }


BAD = [
    ({"hidden": torch.randn(6, 8)}, ValueError, "hidden must be 3-D"),
    ({"hidden": torch.randn(2, 3, 8).to(torch.float8_e4m3fn)}, TypeError, "hidden must be float32"),
    ({"hidden": torch.randn(2, 0, 8)}, ValueError, "hidden must have B, T, H >= 1"),
    ({"weight": torch.randn(11, 9)}, ValueError, "weight must have shape (V, 8)"),
    ({"weight": torch.randn(11, 8).bfloat16()}, TypeError, "weight and hidden must have the same dtype"),
    ({"weight": [[0.0] * 8]}, TypeError, "weight must be a torch.Tensor"),
    ({"bias": torch.randn(10)}, ValueError, "bias must have shape (11,)"),
    ({"bias": torch.ones(11, dtype=torch.long)}, TypeError, "bias must be a floating-point"),
    (
        {"completion_ids": torch.full((2, 3), 11), "check_inputs": True},
        ValueError,
        "completion_ids must lie in [0, 11)",
    ),
    ({"advantages": torch.randn(3)}, ValueError, "advantages must have shape"),
    ({"beta": 0.1}, ValueError, "ref_logp is required when beta != 0"),
    ({"inplace_backward": True}, TypeError, "unknown option(s) ['inplace_backward']"),
    ({"backend": "cuda"}, ValueError, "backend must be one of"),
]


@pytest.mark.parametrize("changes,error,fragment", BAD, ids=[c[2][:40] for c in BAD])
def test_bad_input_names_the_argument(changes, error, fragment):
    kwargs = _good()
    kwargs.update(changes)
    kwargs.setdefault("backend", "torch")
    with pytest.raises(error) as info:
        fused_linear_grpo_loss(**kwargs)
    assert fragment in str(info.value)


# ----------------------------------------------------------------------------------------------------------------
# On a GPU: production tiles, cuBLAS with fp32 output, compiled Triton folds, and the memory bound


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_production_tiles(dtype, monkeypatch):
    for tiles, tile, v_min in PRODUCTION_TILES:
        monkeypatch.setattr(tiles, "tile_elements", tile)
        monkeypatch.setattr(tiles, "min_vocab_tile", v_min)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32 means fp32 here
    # 8 x 512 tokens, H = 1000 (not a power of two), V = 131079 (odd): 2 row-blocks' worth of 8192-wide tiles.
    b, t, h, v = 8, 512, 1000, 131079
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(b, t, h, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(v, h, device="cuda", generator=gen) * 3 / math.sqrt(h)).to(dtype)
    ids = torch.randint(0, v, (b, t), device="cuda", generator=gen)
    mask = (torch.arange(t, device="cuda") < torch.randint(1, t + 1, (b, 1), device="cuda", generator=gen)).float()
    tensors = {
        "advantages": torch.randn(b, device="cuda", generator=gen),
        "completion_mask": mask,
        "old_logp": None,
        "ref_logp": None,
    }
    options = {"loss_type": "dapo", "entropy_coef": 0.01}
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fused_linear_grpo_loss(x, w, ids, backend="triton", **tensors, **options)
    (out.loss * 0.5).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before  # ∂hidden and ∂weight included
    dx, dw = x.grad, w.grad
    logits_bytes = b * t * v * hidden.element_size()
    assert peak < logits_bytes, f"peak {peak / 2**20:.0f} MiB >= the logits' {logits_bytes / 2**20:.0f} MiB"
    ref = oracle(hidden, weight, None, ids, tensors, options, 0.5)
    if dtype == torch.float32:
        assert_fp32_close(out, (dx, dw, None), ref)
        return
    loss, logp, _, want_dx, want_dw, _, dz, x = ref
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.loss.double(), loss, rtol=tol["rtol"], atol=tol["atol"])
    torch.testing.assert_close(out.logp.double(), logp, rtol=tol["rtol"], atol=tol["atol"])
    for name, ours, want, left, right in (
        ("hidden", dx.reshape(-1, h), want_dx.reshape(-1, h), dz, weight.double()),
        ("weight", dw, want_dw, dz.T, x),
    ):
        bound = _half_grad_bound(want, left, right, dtype, dtype)
        excess = (ours.double() - want).abs() - bound
        assert excess.max() <= 0, f"∂{name}: exceeds its bound by {excess.max():.3e}"
