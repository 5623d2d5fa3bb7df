"""Every tuning constant of the loops and the adjoints, with the measurement behind it, per backend.

The values were measured on XLA:CPU (2-core x86 machine unless said otherwise); some encode rules
of that backend alone (its small-buffer scheduling threshold), so a GPU gets its own, conservative
table until measured there. :func:`tuning` returns the table of ``jax.default_backend()``;
:func:`tuned` overrides fields for a benchmark or a test::

    with og._tuning.tuned(adaptive_all_bytes=0):
        jax.grad(loss)(params)       # traced (and so compiled) under the override
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class Tuning:
    #: XLA:CPU runs a loop body's kernels back to back only while every buffer they touch is at
    #: most this many bytes (its ThunkExecutor's ``execute_sequential_buffer_threshold``);
    #: otherwise it schedules them as a task graph, ~1 us per step of a small problem (measured:
    #: Lotka–Volterra forward sensitivities, 20 saves, 205 -> 95 us per solve). Save buffers are
    #: chunked to stay under it. Under vmap no chunk can (every row is one per member), so the
    #: batched loop does not chunk (neural ODE B=256 forward: 10.7 -> 7.0 ms). 0: never chunk.
    small_buffer_bytes: int = 512
    #: at most this many chunks (one switch branch each) for one save buffer.
    max_chunks: int = 32
    #: a static grid's saves are read after the loop from each step's stacked starting state
    #: (one re-taken step per save) while that stack is at most this many bytes: the loop body
    #: stays one fused kernel (Lotka–Volterra, RK4, 1000 steps, 20 saves: 3.7 ms -> 60 us).
    stacked_save_bytes: int = 1 << 22
    #: saves that one iteration of a reverse step's loop over its saves differentiates
    #: together: neural ODE, 100 saves in 5 steps, batch as one (256, 2) state, train step
    #: 14.6 -> 13.2 ms with 32 instead of one at a time ...
    saves_gathered: int = 32
    #: ... holding at most this many state entries at once (a large state: fewer)
    save_gather_entries: int = 1 << 14
    #: memory that ``checkpoints=None`` lets stored states take before recomputing instead.
    memory_budget: int = 256 * 2**20
    #: ... but the default budget never leaves fewer checkpoints than this (a budget passed to
    #: the adjoint is held to, down to 2): revolve re-takes each step ``r`` times where
    #: ``binomial(s + r, s) >= n``, so 2 slots re-take 25 steps 6 times over. Seed 001 at 160^3
    #: float64 (4 ROCK2 steps of 93.8 MiB states), gradient with 2 checkpoints 1866 ms, every
    #: step kept 1260 ms (forward 322 ms).
    min_checkpoints: int = 8
    #: an adaptive solve keeps every step (a buffer of ``max_steps`` rows, allocated whatever
    #: the step count) only while that buffer is at most this big: on a 64x64 diffusion (Tsit5)
    #: a 256 MiB buffer made the gradient 18 ms against 1.2 ms with 64 slots.
    adaptive_all_bytes: int = 8 * 2**20
    #: ``Discrete`` keeping every step of a run-time step count keeps each step's VJP (its
    #: residuals) instead of its state while they take at most this many states (``y`` and the
    #: solver's state): a step of FFTs, stencils or linear maps has few residuals, and its
    #: replay costs its stages (seed 004's wave: residuals 1.0 states, gradient 1.32x -> 1.05x
    #: the scan's); an elementwise step keeps every operation's output, which its replay
    #: recomputes for less than storing them (Lotka–Volterra, Tsit5: 35 states, vmap 512:
    #: 98 -> 224 ms)
    pullback_states: float = 4.0
    #: ... for states of at least this many bytes (the whole batch): a small step costs its
    #: kernels' launches, and XLA:CPU runs each write of the loop body as a kernel of its own
    pullback_min_bytes: int = 2048
    #: ``Interpolating()`` keeps every step's dense output up to this: re-taking the forward
    #: steps costs it more than ``Discrete`` (its backward solve restarts at each one). Neural
    #: ODE, 100 saves, vmap 256 (a 68 MiB buffer): train step 0.42 s against 1.2 s re-taking.
    adaptive_dense_bytes: int = 128 * 2**20
    #: ... but an adaptive solve without events keeps every step's only up to this, and else
    #: that of blocks of at least ``adaptive_slots`` steps (``DenseBlocks``). Neural ODE,
    #: vmap 256, 100 saves: the forward pass with dense output took 65 ms with 4096 rows
    #: (68 MiB) against 7.0 ms with 64; the Interpolating train step 85 ms (2.5x diffrax's
    #: default) with every step's, 36 ms with blocks of 128 and 16 steps, but 73 ms with
    #: blocks of 240 (4.2 MiB; B = 1024 with blocks of 64, 4.5 MiB, and B = 32 with 1024, 4.5
    #: MiB, showed no such cliff: 1.2x diffrax).
    dense_block_bytes: int = 2 * 2**20
    #: One trajectory (no vmap) keeps every step's dense output only up to
    #: ``adaptive_all_bytes``, then blocks of steps while two blocks and their starts take at
    #: most this, else checkpoints (revolve: its backward solve restarts at every step). Rows
    #: of dense output x 4096 ``max_steps``, ``Interpolating()`` gradient before -> after:
    #: seed 001 16^3 ROCK2 rtol 1e-6 (1125 steps, 512 MiB: revolve -> 22 MiB of blocks) 820-880
    #: -> 290 ms; a 16^2 heat equation, Tsit5, 5 steps (74 MiB: every step's -> 5 MiB) 19.9 ->
    #: 2.3 ms; the neural ODE as one (256, 2) state (66 -> 6 MiB) 160 -> 150 ms; but a 64^2 one
    #: (24 steps, 1.2 GiB: revolve, 5.5 MiB -> 37 MiB of blocks) 10.8 -> 19.2 ms and 40^3 ROCK2
    #: rtol 1e-4 (blocks of 125 MiB) 298 -> 336 ms: fresh memory costs more than the restarts.
    single_blocks_bytes: int = 32 * 2**20
    #: otherwise it keeps at most this many states, filled by the forward pass: ~2000 steps
    #: reverse with 64 slots in two recomputing sweeps, so more slots mostly cost allocation.
    adaptive_slots: int = 64
    #: ... in at most this many bytes, but at least ``adaptive_min_slots`` states: the buffer is
    #: zeroed whole on every gradient call, and on CPU fresh memory costs ~0.4 ms per MiB in
    #: page faults (64 states of 3.4 MiB cost as much as a 96^3 float32 ROCK2 forward pass).
    adaptive_prefix_bytes: int = 64 * 2**20
    #: a recomputed step costs far more than a zeroed row: 96^3 float64 ROCK2 (13 steps of
    #: 6.8 MiB) took 3.9x its forward time with 9 slots, 3.5x with 18.
    adaptive_min_slots: int = 16
    #: checkpoints keep the solver's recomputable state (an FSAL stage) beside ``y`` while that
    #: adds at most this many bytes over all of them: it spares one evaluation of ``f`` per
    #: reverse step (neural ODE, batch as one (256, 2) state, 64 checkpoints of 2 KiB: train
    #: step 16.9 -> 15.2 ms, Discrete('all') 16.0 ms).
    kept_solver_state_bytes: int = 8 * 2**20
    #: ``og.Auto`` carries forward sensitivities while states + parameters are at most this many
    #: (set on Lotka–Volterra's 6 inputs, where they beat every reverse pass; not measured at
    #: the boundary).
    forward_max_inputs: int = 32
    #: a static grid of at most this many steps of a state of at least ``unrolled_state_bytes``
    #: runs as straight-line code rather than a ``lax.scan``, whose reverse pass stacks each
    #: step's residuals and reads them back (a copy of ~5 fields per ROCK2 step). Seed 001, 4
    #: ROCK2 steps, gradient in one A/B run (freed memory reused / glibc's default): 160^3
    #: float64 1599 -> 1326 / 1652 -> 1463 ms, float32 708 -> 639 / 916 -> 871 ms; 96^3 float64
    #: 299 -> 271 ms. It costs compile time (the gradient's 5.5 -> 8-11 s), hence the size floor.
    unrolled_steps: int = 4
    unrolled_state_bytes: int = 8 << 20
    #: explicit RK stages of states with at least this many entries are written to memory
    #: before ``f`` reads them; otherwise XLA fuses a stage's linear combination into a stencil
    #: ``f`` and recomputes it at every neighbour (Tsit5 on a 32^3 Laplacian 6x slower). On
    #: small states the fusion barrier costs more than the recomputation.
    materialize_size: int = 2048
    #: ROCK/RKC steps of at most this many stages are reversed by straight-line code (no stage
    #: buffer; a buffer read at a run-time index made XLA:CPU's stencil kernels several times
    #: slower); each count up to it is one more branch to compile (~its square in transposes;
    #: the stage products are traced once and shared by the branches, XLA compiles each copy).
    kept_stages: int = 6
    #: bytes the reverse pass of one ROCK/RKC step may keep of its stages; beyond that it keeps
    #: a checkpoint every ``B`` stages and recomputes one segment at a time.
    stage_memory: int = 128 * 2**20
    #: saves a continuous adjoint's backward step may carry as columns (adjoint/columns.py):
    #: each costs one more column in every stage's product; fewer force shorter steps.
    adjoint_columns: int = 16
    #: ... and its step reaches over at most this many forward steps, so the columns read the
    #: forward dense output from a window of rows (Lotka–Volterra, 20 saves: a search of all
    #: max_steps rows per read cost more than the stepping)
    column_window_steps: int = 4
    #: ... and carries at most this many state entries in its extra columns (a step with a
    #: single save inside pays for every column)
    column_entries: int = 1 << 14
    #: ... and only while the widest array one call of ``f`` computes from ``y`` (over the whole
    #: batch, :func:`~odegrad.adjoint.columns.widest_value`) has at most this many entries: wider, a
    #: product over ``k`` columns costs ``k`` single ones and the saves stop the backward solve
    #: instead (Interpolating, 100 saves, Tsit5 at rtol 1e-4, train step, columns vs stops:
    #: ``tanh(A y)`` n = 128, widest 128: 4.2 vs 11.6 ms; 16^2 diffusion, widest 324: 11.0 vs
    #: 15.7 ms; the neural ODE as one (16, 2) state, widest 1024: 17.7 vs 15.1 ms, as (256, 2)
    #: 210 vs 137 ms; 48^2 diffusion, widest 2500: 18.7 vs 11.4 ms; ``benchmarks/columns.py``).
    #: ``None``: no limit.
    column_width: int | None = 512
    #: states of at most this many entries use the adjoint's propagator instead (n columns per
    #: stage whatever the saves, see adjoint/columns.py's PropagatorSolver); 0: never.
    propagator_entries: int = 8
    #: ... gathering at most this many saves per backward step: 100 saves over 5 forward steps
    #: took 7-8 backward steps with 16 (neural ODE, vmap 256, Interpolating: 151 ms with 16,
    #: 123 with 32, 109 with 64). Outside vmap on CPU, for an ``f`` with fewer parameters than
    #: ``backsolve_across_params`` (cheap), fewer, so that the propagators at the saves stay
    #: under ``small_buffer_bytes`` (Lotka–Volterra, 20 saves, float64: 0.78 ms with 16 saves'
    #: 512 bytes, 2.5 ms with 20); a network keeps them all (the neural ODE as one (4, 2)
    #: state, 100 saves: 6.9 ms capped at 2 saves per step, 1.6 ms with 64).
    propagator_saves: int = 64
    #: a state of ``B`` independent rows (a batch stacked into one state, adjoint/rows.py)
    #: carries one propagator per row while a row has at most this many entries: each entry is
    #: one product of the whole state per stage, which the stops at the saves undercut from 4
    #: on (tanh MLP of width 16, 100 saves, rtol 1e-6, float64, gradient, rows vs stops:
    #: 8192 x 2 236 vs 373 ms, 256 x 4 26 vs 19 ms, 8192 x 4 515 vs 440 ms, 1024 x 8 222 vs
    #: 96 ms; the neural ODE as one (256, 2) state, float32: 15 vs 144 ms)
    row_propagator_entries: int = 2
    #: ... when there are at least this many save times: a step carrying the propagator costs
    #: ``m + 1`` products per stage against the stops' one, which few saves do not repay (4096
    #: x 2, the MLP above: 10 saves 54 vs 45 ms, 30 saves 62 vs 90 ms, 50 saves 62 vs 132 ms)
    row_propagator_saves: int = 16
    #: ... and gathers at most as many saves per step as keep their propagators, ``(saves, B,
    #: m, m)``, within this many bytes (8192 x 2 float64: 8 saves, 236 ms and 68 MiB, against
    #: 64 saves, 221 ms and 87 MiB)
    row_propagator_bytes: int = 1 << 21
    #: ``Backsolve`` rides the saves in the propagator (instead of stopping at each) only with
    #: at least this many parameters: on a cheap ``f`` the propagator's bookkeeping costs more
    #: per step than the stops (Lotka–Volterra, 4 parameters, ~120 steps: 10 saves 1.3 against
    #: 2.4 ms, 100 saves 3.7 against 4.3 ms; only 400 saves favour it); on the neural ODE (4482
    #: parameters, 100 saves, B = 32) it took the train step from 87 to 23 ms
    backsolve_across_params: int = 256
    #: ``linear_solver="auto"`` factorises dense Jacobians up to this many state entries and
    #: runs matrix-free GMRES above (a dense Jacobian costs ``n`` JVPs and ``n^3 / 3`` flops).
    dense_max: int = 256
    #: derivative solves of dense implicit stages from this many entries up run GMRES on the
    #: exact JVP preconditioned by Newton's LU, instead of a fresh Jacobian and LU per stage
    #: (hybrid 200-state problem, Kvaerno5 gradient: 2.2 -> 1.4 s).
    preconditioned_min: int = 16
    #: sums over all of an array's entries (the error norm, once per attempted step) up to this
    #: many entries run as XLA's own reduction loop (``_tree.entry_sum``), not as the YNNPACK
    #: kernel XLA:CPU makes of an add reduction, which inside a loop cost ~13 us more per call:
    #: seed 001's forward (16^3 float64, ROCK2, rtol 1e-6, 1125 steps) 55.5 -> 41 ms, 24^3
    #: 127 -> 88 ms, 64^3 354 -> 322 ms; 128^3 274 -> 268 ms; at 160^3 YNNPACK's is faster (rtol
    #: 1e-4: 561 against 590 ms). 0: every sum an add reduction.
    plain_sum_entries: int = 1 << 21


#: GPU values: XLA:GPU has no small-buffer rule (no chunking), no YNNPACK reductions, and no
#: column width limit: a step
#: costs its kernel launches, not the columns' arithmetic (H200, the neural ODE as one (256, 2)
#: state, train step: Interpolating with 16 columns 12.0 ms, Auto 10.1, diffrax 23.9). The rest
#: as on CPU until measured.
_TABLES = {
    "cpu": Tuning(),
    "gpu": Tuning(small_buffer_bytes=0, column_width=None, plain_sum_entries=0),
    "tpu": Tuning(small_buffer_bytes=0, plain_sum_entries=0),
}
_override: list[Tuning] = []


def tuning() -> Tuning:
    """The tuning table in force: an override from :func:`tuned`, else the default backend's."""
    if _override:
        return _override[-1]
    return _TABLES.get(jax.default_backend(), _TABLES["gpu"])


@contextlib.contextmanager
def tuned(**changes) -> Iterator[Tuning]:
    """Trace solves with some tuning fields changed (for benchmarks and tests).

    Example:
        >>> with tuned(memory_budget=2**20):
        ...     print(og.explain_adjoint(f, y0, (0.0, 1.0), args))
    """
    table = dataclasses.replace(tuning(), **changes)
    _override.append(table)
    try:
        yield table
    finally:
        _override.pop()
