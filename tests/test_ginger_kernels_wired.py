"""Whole Ginger updates with ``passes="pallas"`` (kernels interpreted on the CPU) against
``passes="jnp"`` and the float64 definition; the ``passes`` argument; the in-place rotation.

Tolerances. The two implementations evaluate the same sums in different orders (and with or
without fused multiply-adds); tests/test_kernels.py bounds each pass's difference by
``2 gamma_N A`` (Higham's bound, valid for every order). Through Brand's eigenproblem that
difference is amplified by the conditioning of the eigenvectors (Davis-Kahan: a perturbation
``e ||C||`` of the core turns its eigenvectors by ``~ e ||C|| / gap``), which has no closed
form over a trajectory. So each implementation is held to the bound the jnp path is already
held to against exact arithmetic (tests/test_ginger.py), and the two against each other to
the sum of their bounds (triangle inequality):

* float64 state (the kernels run in float64 in interpret mode): both within ``1e-8`` (relative
  to ``max |G^{-1} g|``) of the dense float64 recursion, as in
  ``test_matches_dense_reference_over_tau``, so within ``2e-8`` of each other. A wiring
  mistake (a wrong operand, a pass of the wrong block, a lost tile) gives errors of order 1.
* float32 state: within ``5e-4`` of the float64 definition, the bound of
  ``test_float32_is_exact_from_the_first_step`` (justified there from float32 rounding and the
  data's smallest kept eigenvalue gap), and exact zeros of ``sigma`` while the curvature's rank
  is below ``tau`` (the deflation bookkeeping does not depend on summation order).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from abstract_gpu import abstract_h200
from reference import (
  SubspaceGinger,
  block_vectors,
  ginger_direction,
  ginger_step,
  hard_fisher_vectors,
)

import ginger
from ginger._src import kernels, secular
from ginger._src.tuning import DEFAULT, Tuning

SHAPES = {"w": (19, 3), "b": (7,), "tiny": (2,)}  # 57 rows: several 16-row tiles, a masked tail


def _blocks(n_leaves, block):
  return [list(range(n_leaves))] if block == "global" else [[i] for i in range(n_leaves)]


@functools.cache
def _update(tau, block, passes, curvature_every, dtype, tuning=DEFAULT):
  tx = ginger.scale_by_ginger(
    tau,
    0.9,
    1e-2,
    block,
    state_dtype=dtype,
    reorthonormalise_every=3,  # every third step also runs the re-orthonormalising factors
    curvature_every=curvature_every,
    passes=passes,
    tuning=tuning,
  )
  return tx, jax.jit(tx.update), jax.jit(lambda g, s: tx.update(g, s))


def _float64_trajectory(tau, block, passes, curvature_every, steps, seed=0, tuning=DEFAULT):
  """Outputs of ``steps`` updates (float64 state), and the dense reference's directions."""
  rng = np.random.default_rng(seed)
  params = {k: jnp.zeros(s, jnp.float64) for k, s in SHAPES.items()}
  tx, with_d, without_d = _update(tau, block, passes, curvature_every, "float64", tuning)
  state = tx.init(params)
  blocks = _blocks(len(SHAPES), block)
  dense = [np.zeros((len(v),) * 2) for v in block_vectors(jax.tree.leaves(params), blocks)]
  outs, refs = [], []
  for t in range(steps):
    g = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), params)
    if t % curvature_every == 0:
      d = jax.tree.map(lambda x, t=t: jnp.asarray((1.0 + t) * rng.normal(size=x.shape)), params)
      out, state = with_d(g, state, fisher_grads=d)
      ds = block_vectors(jax.tree.leaves(d), blocks)
      dense = [ginger_step(m, x, 0.9, tau)[0] for m, x in zip(dense, ds, strict=True)]
    else:
      out, state = without_d(g, state)
    gs = block_vectors(jax.tree.leaves(g), blocks)
    outs.append(np.concatenate(block_vectors(jax.tree.leaves(out), blocks)))
    refs.append(np.concatenate([ginger_direction(m, x, 1e-2) for m, x in zip(dense, gs)]))
  return outs, refs, state


# In `make test` tau 8 every 2, one global block: its steps with d run every pass of the steps
# of every = 1, and the others the preconditioning kernel; tau = 1 differs only in U's width.
# Per-tensor blocks (stacked bases; ~17 s of Pallas in interpret mode) in `make test-all`: in
# `make test` their Pallas passes meet float64 in test_pallas_float32_is_exact_from_the_first_step
# and jnp's in test_reorthonormalise_with_pallas_matches_jnp.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("block", [pytest.param("per_tensor", marks=_SLOW), "global"])
@pytest.mark.parametrize(
  ("tau", "every"),
  [pytest.param(1, 1, marks=_SLOW), pytest.param(8, 1, marks=_SLOW), (8, 2)],
)
def test_pallas_updates_match_jnp_and_dense_float64(x64, block, tau, every):
  """``tau = 8`` over 11 curvature updates: the warm phase (rank below tau, ``sigma`` with
  exact zeros) and the steady state; ``every = 2``: every other step preconditions only
  (``kernels.precondition``). The cases marked slow (tau 1, every 1, per-tensor blocks) run no
  kernel code that ``[8-2-global]`` does not (kept in `make test`)."""
  steps = 11 * every
  got, refs, p_state = _float64_trajectory(tau, block, "pallas", every, steps)
  want, _, j_state = _float64_trajectory(tau, block, "jnp", every, steps)
  for t, (p, j, ref) in enumerate(zip(got, want, refs, strict=True)):
    scale = np.max(np.abs(ref))
    assert np.max(np.abs(j - ref)) <= 1e-8 * scale, (t, "jnp")
    assert np.max(np.abs(p - ref)) <= 1e-8 * scale, (t, "pallas")
    assert np.max(np.abs(p - j)) <= 2e-8 * scale, t
  # The curvature itself: same spectrum (exact zeros alike) and the same U diag(sigma) U^T.
  for a, b in zip(
    ginger.curvature_spectrum(p_state).values(),
    ginger.curvature_spectrum(j_state).values(),
    strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(a) == 0, np.asarray(b) == 0)
    np.testing.assert_allclose(a, b, rtol=2e-8, atol=2e-8 * float(jnp.max(b)))


def _float32_errors(tau, block, passes, steps=12, sizes=(10, 37, 130)):
  """Relative errors of float32 updates against the float64 definition, and whether ``sigma``
  kept its exact zeros (the setting of test_ginger's float32 exactness test, smaller)."""
  tx = ginger.scale_by_ginger(tau, 0.99, 1e-5, block, reorthonormalise_every=3, passes=passes)
  update = jax.jit(tx.update)
  state = tx.init([jnp.zeros(n) for n in sizes])
  blocks = _blocks(len(sizes), block)
  refs = [SubspaceGinger(sum(sizes[i] for i in b), tau, 0.99) for b in blocks]
  rng = np.random.default_rng(tau)
  scale = np.sqrt(1e5 * 1e-5 / (1 - 0.99))  # sigma_max / gamma ~ 1e5 at the first step
  errors, outs = [], []
  for t, (ds, gs) in enumerate(hard_fisher_vectors(rng, sizes, steps, scale)):
    out, state = update(gs, state, fisher_grads=ds)
    sigmas = [state.sigma] if block == "global" else state.sigma
    for b, ref in zip(blocks, refs, strict=True):
      cat = lambda xs, b=b: np.concatenate([np.asarray(xs[i], np.float64) for i in b])
      ref.step(cat(ds))
      expected = ref.direction(cat(gs), 1e-5)
      errors.append(np.max(np.abs(cat(out) - expected)) / np.max(np.abs(expected)))
      sigma = np.asarray(sigmas[b[0]] if block == "per_tensor" else sigmas[0])
      assert np.all(sigma[t + 1 :] == 0), (passes, t, sigma)  # rank <= t + 1: exact zeros
    outs.append(np.concatenate([np.asarray(x) for x in out]))
  return np.array(errors), outs


@pytest.mark.parametrize("block", ["per_tensor", pytest.param("global", marks=pytest.mark.slow)])
@pytest.mark.parametrize("tau", [pytest.param(1, marks=pytest.mark.slow), 8])
def test_pallas_float32_is_exact_from_the_first_step(block, tau):
  """In `make test` ``[8-per_tensor]``: tau 8 has a warm phase with exact zeros (tau 1 has
  none), per tensor three blocks of them; the global block's wiring is
  ``test_pallas_updates_match_jnp_and_dense_float64[8-2-global]``'s."""
  p_err, p_out = _float32_errors(tau, block, "pallas")
  j_err, j_out = _float32_errors(tau, block, "jnp")
  assert np.all(j_err < 5e-4), j_err
  assert np.all(p_err < 5e-4), p_err
  for t, (p, j) in enumerate(zip(p_out, j_out, strict=True)):
    assert np.max(np.abs(p - j)) <= 1e-3 * np.max(np.abs(j)), t  # 2 x 5e-4, up to the scale


@pytest.mark.parametrize("passes", ["triton", "", "JNP", None])
def test_bad_passes_is_refused_up_front(passes):
  for build in (
    lambda: ginger.scale_by_ginger(4, passes=passes),
    lambda: ginger.ginger(1e-3, passes=passes),
  ):
    with pytest.raises(ValueError, match="passes must be one of") as info:
      build()
    assert repr(passes) in str(info.value) and "'pallas'" in str(info.value)


def test_auto_is_jnp_off_gpu():
  """``passes="auto"`` traces the same program as ``"jnp"`` on the CPU."""
  params = {"w": jnp.zeros((9, 2))}
  texts = []
  for passes in ("auto", "jnp"):
    tx = ginger.scale_by_ginger(2, passes=passes)
    texts.append(jax.jit(tx.update).lower(params, tx.init(params), fisher_grads=params).as_text())
  assert texts[0] == texts[1]
  assert "pallas" not in texts[0]


# ---- the rotation in place ------------------------------------------------------------------

# A U of 2^22 x 32 float32 (512 MiB) dominates the step: rows of U' written into a second array
# (``U @ rot`` as a whole) would need one more U of temporary memory once U is donated.
BIG = 1 << 22


def _compiled_step(tau, block, passes, rows, platforms=None, tuning=DEFAULT):
  """The jitted update (state donated) lowered for ``rows`` parameters; nothing allocated."""
  tx = ginger.scale_by_ginger(tau, block=block, passes=passes, tuning=tuning)
  params = {"w": jax.ShapeDtypeStruct((rows,), jnp.float32)}
  state = jax.eval_shape(tx.init, params)

  def step(state, g, d):
    return tx.update(g, state, fisher_grads=d)

  if not platforms:
    return jax.jit(step, donate_argnums=(0,)).trace(state, params, params).lower()
  with abstract_h200():  # Pallas builds the Triton modules for that GPU
    traced = jax.jit(step, donate_argnums=(0,)).trace(state, params, params)
    return traced.lower(lowering_platforms=platforms)


@pytest.mark.parametrize("block", [pytest.param("per_tensor", marks=pytest.mark.slow), "global"])
def test_jnp_rotation_keeps_no_second_u(block):
  """The compiled step's temporary memory (XLA's buffer assignment, not a timing) stays well
  below one U: the rotation runs in row blocks written back into the donated U (the path of
  GPUs, forced here on the CPU). Before this, the same step held a whole second U
  (``temp_size_in_bytes`` 537 MB at this size; now 153). With one leaf both blocks are one
  block of the same rows: ``[global]`` in `make test`, ``[per_tensor]`` slow."""
  u_bytes = BIG * 32 * 4
  compiled = _compiled_step(32, block, "jnp", BIG, tuning=Tuning(jnp_row_blocks=True)).compile()
  memory = compiled.memory_analysis()
  assert memory.alias_size_in_bytes >= u_bytes  # the state is donated: U' is U's buffer
  # A row block of U' and the block's slice of U (row_block_elements each) plus a few O(d)
  # vectors (g, d, p1, the output...: 16 MiB each at this size), far from U's 512 MiB.
  block_bytes = 2 * DEFAULT.row_block_elements * 4 + 4 * BIG * 4
  assert memory.temp_size_in_bytes <= block_bytes < u_bytes / 2, memory


def _loops(rows, tuning=DEFAULT):
  """Loops in the lowered jnp step (per_tensor, tau 8, ``rows`` parameters)."""
  text = _compiled_step(8, "per_tensor", "jnp", rows, tuning=tuning).as_text()
  return text.count("stablehlo.while")


def test_jnp_row_blocks_where(monkeypatch):
  """The jnp rotation of a U of more than ``row_block_elements`` runs in row blocks (one more
  loop in the step than a U of one block has: the eigensolver's) on GPUs and wherever
  ``jnp_row_blocks`` forces them, and in one piece on the CPU by default."""
  big = DEFAULT.row_block_elements // 8 * 3  # U: 3 row_block_elements at tau 8
  one_piece = _loops(4096)
  assert _loops(big) == one_piece
  forced = Tuning(jnp_row_blocks=True)
  assert _loops(4096, forced) == one_piece
  assert _loops(big, forced) == one_piece + 1
  monkeypatch.setattr(kernels, "_on_gpu", lambda: True)  # traced as on a GPU
  assert _loops(big) == one_piece + 1


def test_jnp_rotation_on_cpu_is_one_piece():
  """On the CPU the jnp rotation of a large U runs in one piece: the compiled step then
  holds a second U (the price of the faster rotation there; XLA's buffer assignment)."""
  u_bytes = BIG * 32 * 4
  memory = _compiled_step(32, "global", "jnp", BIG).compile().memory_analysis()
  assert memory.temp_size_in_bytes >= u_bytes, memory


def test_pallas_rotation_aliases_u(monkeypatch):
  """On a GPU the rotation's kernel writes U' over U: the step traced as on a GPU and lowered
  for CUDA (no card needed: Pallas builds the Triton IR in Python) carries the aliasing of the
  pass-3 kernel (``output_operand_aliases``), which with the state donated is U's buffer. The
  secular solver's bisection lowers to Triton too (the fourth kernel; ``while`` loops left in
  the step are none: the jnp bisection's is gone)."""
  monkeypatch.setattr(kernels, "_on_gpu", lambda: True)  # compiled kernels, not interpreted
  try:
    text = _compiled_step(8, "global", "pallas", 4096, platforms=("cuda",)).as_text()
  except Exception as e:  # noqa: BLE001 (a jaxlib without the CUDA lowering rules: say so)
    pytest.skip(f"cannot lower the step for CUDA here: {e!r}")
  assert text.count("__gpu$xla.gpu.triton") == 4  # the three passes of the one bucket, bisection
  assert "ginger_secular_bisect" in text
  assert "stablehlo.while" not in text
  assert "output_operand_aliases" in text


def test_pallas_passes_run_the_bisection_kernel(monkeypatch):
  """``passes="pallas"`` (interpreted on the CPU) solves Brand's cores with the bisection
  kernel, once per rank of the buckets; ``"jnp"`` and the dense eigensolver never call it
  (traced only, nothing compiled)."""
  calls = []
  kernel = secular.bisect_pallas

  def spy(*args, **kwargs):
    calls.append(kwargs)
    return kernel(*args, **kwargs)

  monkeypatch.setattr(secular, "bisect_pallas", spy)
  params = {"w": jnp.zeros((9, 2)), "b": jnp.zeros((3,))}
  for passes, eigensolver, expected in (
    ("pallas", "secular", [{"interpret": True}]),
    ("jnp", "secular", []),
    ("pallas", "dense", []),
  ):
    calls.clear()
    tx = ginger.scale_by_ginger(2, passes=passes, eigensolver=eigensolver)
    jax.make_jaxpr(lambda s, tx=tx: tx.update(params, s, fisher_grads=params))(tx.init(params))
    assert calls == expected, (passes, eigensolver)


def test_row_blocks_change_no_update(x64):
  """The jnp rotation in row blocks (forced here on tiny U) gives the same updates as the
  rotation in one piece, to float64 rounding (rows are independent; only fused multiply-adds
  may round differently), over a trajectory with re-orthonormalising steps."""
  whole, refs, _ = _float64_trajectory(8, "global", "jnp", 1, 10)
  blocks = Tuning(jnp_row_blocks=True, row_block_elements=40)  # 57 x 8 U: 12 blocks of 5 rows
  blocked, _, _ = _float64_trajectory(8, "global", "jnp", 1, 10, tuning=blocks)
  for t, (a, b, ref) in enumerate(zip(blocked, whole, refs, strict=True)):
    assert np.max(np.abs(a - b)) <= 2e-8 * np.max(np.abs(ref)), t


def test_optax_wrappers_with_pallas():
  """``passes`` is static under ``optax.inject_hyperparams`` (a string) and survives the
  composed optimizer. With ``gamma = 1`` and ``sigma = (1 - alpha) ||g||^2 ~ 0.1`` here, ``G``
  has condition number ~1.1, so the two implementations' roundings (``2 gamma_N`` with ``N``
  ~ rows + a few operations, ~4e-6) are not amplified (with ``gamma = 1e-5`` the directions
  outside ``span U`` are scaled by ``1e5``, and so is their rounding)."""
  kwargs = dict(learning_rate=1e-2, tau=2, gamma=1.0)
  tx = optax.inject_hyperparams(ginger.ginger, static_args=("tau", "passes"))(
    passes="pallas", **kwargs
  )
  params = {"w": jnp.ones((5, 3))}
  grads = {"w": jnp.arange(15.0).reshape(5, 3) / 10}
  out, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  ref_tx = ginger.ginger(**kwargs)
  ref, _ = jax.jit(ref_tx.update)(grads, ref_tx.init(params), params)  # op by op: ~15 s
  assert np.max(np.abs(out["w"] - ref["w"])) <= 1e-5 * np.max(np.abs(ref["w"]))


# ---- the Hydra config ---------------------------------------------------------------------


def _config(*overrides: str):
  from pathlib import Path

  from hydra import compose, initialize_config_dir

  configs = str(Path(__file__).resolve().parents[1] / "configs")
  with initialize_config_dir(config_dir=configs, version_base=None):
    return compose(config_name="config", overrides=list(overrides))


def test_config_passes_is_checked_up_front():
  from training.config_check import ConfigError, check_config

  check_config(_config(), overrides=())  # ginger.yaml: passes=auto
  check_config(_config("passes=pallas"), overrides=())
  check_config(_config("passes=pallas", "mesh.data=2", "mesh.shard_optimizer_state=false"), ())
  # The kernels run per device on a split state (ginger._src.sharding.per_shard).
  check_config(_config("passes=pallas", "mesh.data=2"), overrides=())
  with pytest.raises(ConfigError, match=r"passes='triton': must be one of \['jnp', 'pallas'"):
    check_config(_config("passes=triton"), overrides=())


@pytest.mark.parametrize(
  ("mesh", "expected"),
  [
    ([], "auto"),  # one device: the library's choice (the kernels on GPUs)
    (["mesh.data=4"], "auto"),  # split over 4 devices: the kernels per device (shard_map)
    (["mesh.data=4", "mesh.shard_optimizer_state=false"], "auto"),  # replicated
  ],
)
def test_auto_is_left_to_the_library_also_where_the_state_is_split(mesh, expected):
  """The training config's default, ``passes=auto``, is handed to the library, which runs the
  Pallas kernels on GPUs, also where the optimizer state is split over several devices (the
  kernels then run per device under ``shard_map``); explicit values are taken as given."""
  from training.run_config import parse

  def passes(*overrides):
    return parse(_config("optimizer=ginger", *overrides, *mesh), overrides=()).optimizer.passes

  assert passes() == expected  # the default
  assert passes("passes=jnp") == "jnp"
  assert passes("passes=pallas") == "pallas"


def test_config_passes_reaches_the_optimizer():
  from training import registry
  from training.optimizers import build_optimizer
  from training.run_config import parse

  assert registry.PASSES == ginger._src.common.PASSES
  params = {"w": jnp.zeros((6, 2))}
  for passes, has_kernels in (("jnp", False), ("pallas", True)):
    rc = parse(_config(f"passes={passes}"), overrides=())
    tx = build_optimizer(rc, optax.constant_schedule(1e-3))
    jaxpr = jax.make_jaxpr(lambda s, tx=tx: tx.update(params, s, params, fisher_grads=params))
    assert ("pallas_call" in str(jaxpr(tx.init(params)))) == has_kernels, passes


def test_passes_is_not_part_of_the_fingerprint():
  """Configs from before ``passes`` (no key) and every value of it are the same run: the
  passes agree to float rounding, like two meshes, so run dirs of earlier versions (``jnp``)
  continue under today's default (``auto``) and a run may resume with other passes; anything
  else changed is still another run."""
  from omegaconf import OmegaConf

  from training import run_record

  config = OmegaConf.to_container(_config(), resolve=True)
  assert config["passes"] == "auto"
  older = {k: v for k, v in config.items() if k != "passes"}
  for passes in ("jnp", "pallas", "auto"):
    assert run_record.fingerprint({**config, "passes": passes}) == run_record.fingerprint(older)
  assert run_record.fingerprint({**config, "tau": 2}) != run_record.fingerprint(older)


@pytest.mark.parametrize("block", ["per_tensor", "global"])
def test_reorthonormalise_with_pallas_matches_jnp(x64, block):
  """``ginger.reorthonormalise(..., passes="pallas")`` (pass 3's kernel with a zero
  residual, interpreted) gives the jnp path's ``U`` and ``sigma``: float64, the same sums
  in another order, within ``2 gamma_N`` of each other (``1e-12`` with ``k = 4``)."""
  params = {k: jnp.zeros(s, jnp.float64) for k, s in SHAPES.items()}
  tx = ginger.scale_by_ginger(4, 0.9, 1e-2, block, state_dtype="float64", reorthonormalise_every=0)
  state, update = tx.init(params), jax.jit(tx.update)
  rng = np.random.default_rng(3)
  for _ in range(5):
    d = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape)), params)
    _, state = update(d, state, fisher_grads=d)
  u = state.u
  state = state._replace(u=type(u)([x * (1 + 1e-3 * (x != 0)) for x in u.stacks], u.layout))
  want = jax.jit(functools.partial(ginger.reorthonormalise, passes="jnp"))(state)
  got = jax.jit(functools.partial(ginger.reorthonormalise, passes="pallas"))(state)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
