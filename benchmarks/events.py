"""Events: accuracy of event times and their gradients against closed forms, per adjoint, and
the time of a terminal-event gradient side by side with diffrax (its ``Event`` with an
optimistix Newton root finder; diffrax has terminal events only).

* terminal: a ball thrown up at ``v0 = 2`` from ``h0 = 1`` under ``g = 9.81`` hits the ground;
  the impact time ``t*`` and velocity, and ``d t* / d(h0, v0, g)``, against the closed form;
* bouncing: dropped from ``h0 = 1`` with restitution ``e = 0.8``, six bounces before ``T = 3``;
  the bounce times and ``dh(T) / d(h0, e, g)`` against the closed form;
* switches read from ``f``: a one-compartment infusion that stops at ``tau``
  (``-k y + where(t < tau, rate, 0)``), ``dy(T)/dtau`` vmapped over 64 stop times against
  ``rate exp(-k (T - tau))``, with ``og.switching_events``, a hand-written event, none, and
  diffrax (which, like odegrad without an event, differentiates ``f`` pointwise);
* repeated doses written ``where(t % P < d, rate, 0)``, ``dy(7)/dP`` vmapped over 64 periods
  against the closed form, the same ways;
* the cost of reading ``cond`` inside each step (``og.Event(interp_points=...)``, which finds a
  crossing and return within one step): the bouncing ball's gradient, the impact time's
  gradient under vmap(64), the infusion's, and a 3-D heat equation (48^3) stopped when the mean
  of its square or one point's value halves, with 0, 3 (the default on adaptive steps and small
  states) and 10 points.

Tsit5, ``rtol = atol = 1e-10``, float64.

    python benchmarks/events.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402

import odegrad as og  # noqa: E402
from _timing import fmt_time, interleaved_medians, markdown_table, warm_up_jax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_events as te  # noqa: E402  (the closed forms and the events the tests check)


def max_err(a, b) -> float:
    return float(jnp.max(jnp.abs(jnp.asarray(a) - jnp.asarray(b))))


def diffrax_impact():
    """``p -> t*`` with diffrax's terminal event, or None when diffrax is missing."""
    try:
        import diffrax as dfx
        import optimistix as optx
    except ImportError:
        return None
    term = dfx.ODETerm(lambda t, y, g: jnp.stack([y[1], -g * jnp.ones_like(y[0])]))
    event = dfx.Event(lambda t, y, args, **kw: y[0], optx.Newton(1e-12, 1e-12))

    def run(p):
        sol = dfx.diffeqsolve(
            term,
            dfx.Tsit5(),
            0.0,
            5.0,
            None,
            p[:2],
            p[2],
            stepsize_controller=dfx.PIDController(rtol=1e-10, atol=1e-10),
            event=event,
        )
        return sol.ts[-1]

    return run


def infusion(t, y, p):
    return -p["k"] * y + jnp.where(t < p["tau"], p["rate"], 0.0)


def infusion_with_mode(t, y, p):
    """The same with the switch as state: ``y = (amount, infusing)``, an event's update sets
    ``infusing`` to 0, so ``f`` is smooth inside every step (no jump for the steps to resolve)."""
    return jnp.stack([-p["k"] * y[0] + y[1] * p["rate"], jnp.zeros_like(y[1])])


STOP = og.Event(lambda t, y, p: t - p["tau"], terminal=False, update=lambda t, y, p: y.at[1].set(0))


def infusion_rows(rounds: int):
    """Rows (steps, errors, compile and run time) of ``y(3)`` and ``dy(3)/dtau``, vmapped
    over 64 stop times, for each way of writing the stop."""
    p = {"k": 0.7, "rate": 2.0, "tau": 1.2}
    taus = jnp.linspace(0.2, 2.8, 64)
    exact = p["rate"] * jnp.exp(-p["k"] * (3.0 - taus))
    found = og.switching_events(infusion, 0.0, 0.0, p)
    by_hand = og.Event(lambda t, y, p: t - p["tau"], terminal=False)
    step = og.Adaptive(1e-8, 1e-8)

    def og_solve(f, y0, events):
        return lambda tau: og.solve(f, y0, (0.0, 3.0), dict(p, tau=tau), events=events, step=step)

    solves = {
        "odegrad switching_events": og_solve(infusion, 0.0, found),
        "odegrad hand-written event": og_solve(infusion, 0.0, by_hand),
        "odegrad, switch as state (event update)": og_solve(
            infusion_with_mode, jnp.array([0.0, 1.0]), STOP
        ),
        "odegrad, no event": og_solve(infusion, 0.0, None),
    }
    return timed_rows(solves, infusion, 3.0, lambda tau: dict(p, tau=tau), 1.2, taus, exact, rounds)


def doses(t, y, p):
    return -p["k"] * y + jnp.where(t % p["P"] < p["d"], p["rate"], 0.0)


def dose_rows(rounds: int):
    """Rows of ``y(7)`` and ``dy(7)/dP`` for doses every ``P`` (``t % P < d``), vmapped over 64
    periods, for each way of writing the doses' events."""
    p, big_t = {"k": 0.7, "rate": 2.0, "d": 0.5, "P": 2.1}, 7.0
    periods = jnp.linspace(1.51, 2.99, 64)  # (not 13 / 6: its last dose ends on T, a kink)

    def exact_y(period):  # e^{kt} y gains rate/k (e^{k end} - e^{k start}) over each dose
        k, rate, d = p["k"], p["rate"], p["d"]
        starts = period * jnp.arange(5)
        ends = jnp.minimum(starts + d, big_t)
        gain = jnp.where(starts < big_t, jnp.exp(k * ends) - jnp.exp(k * starts), 0.0)
        return rate / k * jnp.exp(-k * big_t) * jnp.sum(gain)

    exact = jax.vmap(jax.grad(exact_y))(periods)
    found = og.switching_events(doses, 0.0, 0.0, p)
    by_hand = og.Event(lambda t, y, p: t % p["P"] - p["d"], terminal=False)
    step = og.Adaptive(1e-8, 1e-8)

    def og_solve(events):
        return lambda period: og.solve(doses, 0.0, (0.0, big_t), dict(p, P=period),
                                       events=events, step=step, max_events=16)  # fmt: skip

    solves = {
        "odegrad switching_events": og_solve(found),
        "odegrad hand-written event (t % P - d)": og_solve(by_hand),
        "odegrad, no event": og_solve(None),
    }
    at = lambda period: dict(p, P=period)
    return timed_rows(solves, doses, big_t, at, 2.1, periods, exact, rounds)


def timed_rows(solves, f, big_t, params, example, xs, exact, rounds):
    """Rows ``[method, steps / rejected / evals at x = example, max error of d y(T)/dx over
    xs relative to the largest, compile, median, min]`` for each ``solves[name](x)``, vmapped
    over ``xs`` (value and gradient), and diffrax's pointwise ``f`` where installed."""
    import time

    fns, stats = {}, {}
    for name, solve in solves.items():
        loss = lambda x, solve=solve: jnp.ravel(solve(x).ys[-1])[0]
        fns[name] = jax.jit(jax.vmap(jax.value_and_grad(loss)))
        st = solve(example).stats
        stats[name] = f"{int(st['accepted'])} / {int(st['rejected'])} / {int(st['rhs_evals'])}"
    try:
        import diffrax as dfx

        def dfx_loss(x):
            term = dfx.ODETerm(f)
            ctrl = dfx.PIDController(rtol=1e-8, atol=1e-8)
            return dfx.diffeqsolve(term, dfx.Tsit5(), 0.0, big_t, None, 0.0, params(x),
                                   stepsize_controller=ctrl, max_steps=16384).ys[-1]  # fmt: skip

        # value and gradient: diffrax's gradient alone is zeros, and XLA drops the solve
        fns["diffrax (pointwise)"] = jax.jit(jax.vmap(jax.value_and_grad(dfx_loss)))
        stats["diffrax (pointwise)"] = ""
    except ImportError:
        pass
    rows, calls = [], {}
    for name, fn in fns.items():
        start = time.perf_counter()
        got = fn(xs)[1].block_until_ready()
        compile_s = time.perf_counter() - start
        err = max_err(got, exact) / float(jnp.max(jnp.abs(exact)))
        rows.append([name, stats[name], f"{err:.1e}", f"{compile_s:.2f} s"])
        calls[name] = lambda fn=fn: fn(xs)
    t = interleaved_medians(calls, rounds, 5)
    for row in rows:
        row += [fmt_time(t[row[0]].median), fmt_time(t[row[0]].best)]
    return rows


def _interp(events, k):
    """``events`` (one or a tuple) reading ``cond`` at ``k`` points inside each step."""
    if isinstance(events, og.Event):
        return dataclasses.replace(events, interp_points=k)
    return tuple(dataclasses.replace(e, interp_points=k) for e in events)


def heat_until(n: int = 48):
    """``(p, events) -> t_stop`` and two events for a 3-D heat equation on ``n^3`` points
    (periodic, ``p`` its diffusivity; Tsit5 at rtol 1e-6): the mean of ``y^2`` falls to half its
    start (a ``cond`` that reads the whole field, so each point inside a step interpolates the
    whole state), or one point's value halves (XLA interpolates that point only)."""
    x = jnp.linspace(0, 2 * jnp.pi, n, endpoint=False)
    y0 = jnp.sin(x)[:, None, None] * jnp.cos(x)[None, :, None] * (1 + 0.5 * jnp.sin(2 * x))
    lap = lambda u: sum(jnp.roll(u, 1, a) + jnp.roll(u, -1, a) - 2 * u for a in range(3))
    f = lambda t, y, p: p * lap(y) * (n / (2 * jnp.pi)) ** 2
    half, at = 0.5 * jnp.mean(y0**2), 0.5 * y0[5, 3, 7]
    mean = og.Event(lambda t, y, p: jnp.mean(y**2) - half, direction=-1)
    point = og.Event(lambda t, y, p: y[5, 3, 7] - at)

    def t_stop(p, events):
        sol = og.solve(f, y0, (0.0, 10.0), p, events=events, step=og.Adaptive(1e-6, 1e-6))
        return sol.ts[-1]

    return t_stop, mean, point


def interp_points_rows(rounds: int):
    """Rows: each workload's time with ``cond`` read at 0, 3 and 10 points inside each step."""
    p_bn = te.P_BOUNCE
    batch = jnp.stack([jnp.linspace(0.5, 4.0, 64), jnp.full(64, 2.0), jnp.full(64, 9.81)], 1)
    inf_p = {"k": 0.7, "rate": 2.0, "tau": 1.2}
    found = og.switching_events(infusion, 0.0, 0.0, inf_p)
    heat, mean, point = heat_until()

    def bounce(k):
        def h_end(p):
            sol = og.solve(te.fall, jnp.stack([p[0], 0.0 * p[0]]), (0.0, te.T_BOUNCE),
                           {"e": p[1], "g": p[2]}, events=_interp(te.BOUNCE, k), step=te.TIGHT,
                           max_events=16)  # fmt: skip
            return sol.ys[-1, 0]

        g = jax.jit(jax.grad(h_end))
        return lambda: g(p_bn)

    def impact(k):
        def t_star(p):
            sol = og.solve(te.fall, p[:2], (0.0, 5.0), {"g": p[2]}, events=_interp(te.HIT, k),
                           step=te.TIGHT)  # fmt: skip
            return sol.ts[-1]

        g = jax.jit(jax.vmap(jax.grad(t_star)))
        return lambda: g(batch)

    def infusion_grad(k):
        def y_end(tau):
            sol = og.solve(infusion, 0.0, (0.0, 3.0), dict(inf_p, tau=tau),
                           events=_interp(found, k), step=og.Adaptive(1e-8, 1e-8))  # fmt: skip
            return sol.ys[-1]

        g = jax.jit(jax.vmap(jax.grad(y_end)))
        taus = jnp.linspace(0.2, 2.8, 64)
        return lambda: g(taus)

    def heat_stop(event):
        def make(k):
            g = jax.jit(lambda p: heat(p, _interp(event, k)))
            return lambda: g(0.1)

        return make

    workloads = {
        "bouncing ball, grad h(T) (Auto)": bounce,
        "impact, grad t*, vmap 64": impact,
        "infusion, switching_events, grad, vmap 64": infusion_grad,
        "heat 48^3 until mean(y^2) halves, t*": heat_stop(mean),
        "heat 48^3 until one point's value halves, t*": heat_stop(point),
    }
    rows = []
    for name, make in workloads.items():
        calls = {k: make(k) for k in (0, 3, 10)}
        values = {k: c() for k, c in calls.items()}
        agree = max(max_err(values[k], values[0]) for k in calls)
        t = interleaved_medians(calls, rounds, 5)
        base = t[0].median
        rows.append([name] + [f"{fmt_time(t[k].median)} ({t[k].median / base:.2f}x)" for k in calls]
                    + [f"{agree:.1e}"])  # fmt: skip
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--interp-only", action="store_true", help="only the interp_points table")
    args = ap.parse_args(argv)
    warm_up_jax()
    if args.interp_only:
        print(interp_table(args.rounds))
        return
    p_imp, p_bn = te.P_IMPACT, te.P_BOUNCE
    exact_imp, exact_dimp = te.impact_exact(p_imp), jax.jacfwd(te.impact_exact)(p_imp)
    exact_times, exact_y = te.bounces_exact(p_bn)
    exact_dtimes, exact_dy = jax.jacfwd(te.bounces_exact)(p_bn)
    rows, fns = [], {}
    for name in te.ADJOINTS:
        both = te.impact(name)  # p -> (value, Jacobian), one compiled program
        value, jac = both(p_imp)
        (times, y_t), (d_times, d_y) = te.bounces(name)(p_bn)
        rows.append(
            [
                name,
                f"{max_err(value, exact_imp):.1e}",
                f"{max_err(jac, exact_dimp):.1e}",
                f"{max_err(times, exact_times):.1e}, {max_err(y_t, exact_y):.1e}",
                f"{max_err(d_times, exact_dtimes):.1e}",
                f"{max_err(d_y, exact_dy):.1e}",
            ]
        )
        fns[f"odegrad {name}"] = lambda both=both: both(p_imp)
    dfx_run = diffrax_impact()
    if dfx_run is not None:
        dfx_grad = jax.jit(jax.grad(dfx_run))
        err = max_err(dfx_grad(p_imp), exact_dimp[0])
        t_err = max_err(dfx_run(p_imp), exact_imp[0])
        rows.append(
            ["diffrax Event (t* only)", f"{t_err:.1e}", f"{err:.1e}"] + ["(terminal only)"] * 3
        )
        fns["diffrax"] = lambda: dfx_grad(p_imp)
    # what a user fitting many trajectories runs: the gradient of t* vmapped over 64 drop heights
    batch = jnp.stack([jnp.linspace(0.5, 4.0, 64), jnp.full(64, 2.0), jnp.full(64, 9.81)], 1)

    def t_star(p):
        sol = og.solve(te.fall, p[:2], (0.0, 5.0), {"g": p[2]}, events=te.HIT, step=te.TIGHT)
        return sol.ts[-1]

    og_batch = jax.jit(jax.vmap(jax.grad(t_star)))
    exact_batch = jax.vmap(jax.grad(lambda p: te.impact_exact(p)[0]))(batch)
    err = max_err(og_batch(batch), exact_batch)
    rows.append(["Auto, grad of t* under vmap(64)", "", f"{err:.1e}", "", "", ""])
    fns["odegrad Auto, grad t*, vmap 64"] = lambda: og_batch(batch)
    if dfx_run is not None:
        dfx_batch = jax.jit(jax.vmap(jax.grad(dfx_run)))
        fns["diffrax, grad t*, vmap 64"] = lambda: dfx_batch(batch)
    print("\n### errors against the closed forms (max abs)\n")
    head = ["adjoint", "impact t*, v", "d(t*, v)/d(h0, v0, g)", "bounce times, (h, v)(T)",
            "d times/d(h0, e, g)", "d(h, v)(T)/d(h0, e, g)"]  # fmt: skip
    print(markdown_table(head, rows))
    t = interleaved_medians(fns, args.rounds, 5)
    print("\n### time of the impact and its Jacobian (jitted; diffrax: gradient of t* alone)\n")
    print(markdown_table(["method", "median", "min"], [
        [k, fmt_time(v.median), fmt_time(v.best)] for k, v in t.items()
    ]))  # fmt: skip
    print("\n### an infusion stopped at tau: y(3) and dy(3)/dtau, vmap 64, rtol 1e-8\n")
    head = ["method", "steps / rejected / evals (tau = 1.2)", "max error / max dy/dtau",
            "first call (compile)", "median", "min"]  # fmt: skip
    print(markdown_table(head, infusion_rows(args.rounds)))
    print("\n### doses every P (t % P < d): y(7) and dy(7)/dP, vmap 64, rtol 1e-8\n")
    head[1], head[2] = "steps / rejected / evals (P = 2.1)", "max error / max dy/dP"
    print(markdown_table(head, dose_rows(args.rounds)))
    print(interp_table(args.rounds))


def interp_table(rounds: int) -> str:
    head = ["workload", "0 (ends only)", "3", "10", "max |difference| to 0"]
    title = "\n### cond read inside each step: interp_points = 0, 3, 10 (median)\n\n"
    return title + markdown_table(head, interp_points_rows(rounds))


if __name__ == "__main__":
    main()
