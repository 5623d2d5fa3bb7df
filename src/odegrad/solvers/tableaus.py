"""Butcher tableaus of the explicit Runge–Kutta methods, as data.

Each method is one :class:`ButcherTableau`; :mod:`odegrad.solvers.explicit_rk` feeds it to the
single stepping routine. Coefficients carry over from their published sources, named beside each.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ButcherTableau:
    """An explicit Runge–Kutta method with ``s`` stages.

    Stage ``i`` is ``k_i = f(t + c_i dt, y + dt * sum_{j<i} a[i-1][j] k_j)``; the step is
    ``y1 = y + dt * sum_i b_i k_i``; the local error estimate is ``dt * sum_i b_error_i k_i``
    (``b_error = b - b_embedded``). With ``dense``, the continuous extension is
    ``y(t + theta dt) = y + dt * sum_i b_i(theta) k_i`` where
    ``b_i(theta) = sum_m dense[i][m] * theta**(m + 1)``.

    Attributes:
        c: nodes, length ``s``; ``c[0] == 0``.
        a: ``s - 1`` rows; row ``i - 1`` holds the ``i`` coefficients of stage ``i``.
        b: weights of the propagated solution, length ``s``.
        b_error: ``b - b_embedded``, length ``s``, or ``None`` without an embedded method.
        order: order of ``b``.
        embedded_order: order of the embedded method, or ``None``.
        fsal: the last stage is ``f(t + dt, y1)`` and serves as the next step's first stage.
        dense: polynomial coefficients of the continuous extension, or ``None`` (then the
            solver falls back to cubic Hermite interpolation).
        dense_order: order of the continuous extension, or ``None``.
    """

    c: tuple[float, ...]
    a: tuple[tuple[float, ...], ...]
    b: tuple[float, ...]
    b_error: tuple[float, ...] | None
    order: int
    embedded_order: int | None
    fsal: bool
    dense: tuple[tuple[float, ...], ...] | None = None
    dense_order: int | None = None

    @property
    def stages(self) -> int:
        return len(self.b)


# ---------------------------------------------------------------------------------------------
# Low-order fixed-step methods.
# ---------------------------------------------------------------------------------------------

# Forward Euler. Source: L. Euler, "Institutionum calculi integralis", vol. 1 (1768); see also
# Hairer, Nørsett & Wanner, "Solving Ordinary Differential Equations I", 2nd ed., Sec. II.1.
EULER = ButcherTableau(
    c=(0.0,),
    a=(),
    b=(1.0,),
    b_error=None,
    order=1,
    embedded_order=None,
    fsal=False,
)

# Heun's method (explicit trapezoidal rule) with forward Euler embedded for an error estimate.
# Source: K. Heun, "Neue Methoden zur approximativen Integration der Differentialgleichungen
# einer unabhängigen Veränderlichen", Z. Math. Phys. 45 (1900) 23–38.
HEUN = ButcherTableau(
    c=(0.0, 1.0),
    a=((1.0,),),
    b=(1 / 2, 1 / 2),
    b_error=(1 / 2 - 1.0, 1 / 2 - 0.0),  # b - b_euler, with b_euler = (1, 0)
    order=2,
    embedded_order=1,
    fsal=False,
)

# Explicit midpoint rule. Source: C. Runge, "Über die numerische Auflösung von
# Differentialgleichungen", Math. Ann. 46 (1895) 167–178.
MIDPOINT = ButcherTableau(
    c=(0.0, 1 / 2),
    a=((1 / 2,),),
    b=(0.0, 1.0),
    b_error=None,
    order=2,
    embedded_order=None,
    fsal=False,
)

# Ralston's second-order method (c2 = 2/3, minimum error bound). Source: A. Ralston,
# "Runge–Kutta methods with minimum error bounds", Math. Comp. 16 (1962) 431–437.
RALSTON = ButcherTableau(
    c=(0.0, 2 / 3),
    a=((2 / 3,),),
    b=(1 / 4, 3 / 4),
    b_error=None,
    order=2,
    embedded_order=None,
    fsal=False,
)

# The classic fourth-order Runge–Kutta method. Source: W. Kutta, "Beitrag zur näherungsweisen
# Integration totaler Differentialgleichungen", Z. Math. Phys. 46 (1901) 435–453.
RK4 = ButcherTableau(
    c=(0.0, 1 / 2, 1 / 2, 1.0),
    a=(
        (1 / 2,),
        (0.0, 1 / 2),
        (0.0, 0.0, 1.0),
    ),
    b=(1 / 6, 1 / 3, 1 / 3, 1 / 6),
    b_error=None,
    order=4,
    embedded_order=None,
    fsal=False,
)


# ---------------------------------------------------------------------------------------------
# Embedded pairs.
# ---------------------------------------------------------------------------------------------

# Bogacki–Shampine 3(2), FSAL. Source: P. Bogacki & L. F. Shampine, "A 3(2) pair of Runge–Kutta
# formulas", Appl. Math. Lett. 2(4) (1989) 321–325. Embedded weights (7/24, 1/4, 1/3, 1/8).
BS3 = ButcherTableau(
    c=(0.0, 1 / 2, 3 / 4, 1.0),
    a=(
        (1 / 2,),
        (0.0, 3 / 4),
        (2 / 9, 1 / 3, 4 / 9),
    ),
    b=(2 / 9, 1 / 3, 4 / 9, 0.0),
    b_error=(2 / 9 - 7 / 24, 1 / 3 - 1 / 4, 4 / 9 - 1 / 3, 0.0 - 1 / 8),
    order=3,
    embedded_order=2,
    fsal=True,
)

# Tsitouras 5(4), FSAL. Source: Ch. Tsitouras, "Runge–Kutta pairs of order 5(4) satisfying only
# the first column simplifying assumption", Comput. Math. Appl. 62(2) (2011) 770–775, Table 1
# (coefficients published to many digits; written here as the nearest doubles). The continuous
# extension is the paper's free fourth-order interpolant b_i(θ), expanded in powers of θ (the
# same numbers OrdinaryDiffEq.jl's Tsit5 interpolation uses; diffrax uses the factored form).
TSIT5 = ButcherTableau(
    c=(0.0, 0.161, 0.327, 0.9, 0.9800255409045097, 1.0, 1.0),
    a=(
        (0.161,),
        (-0.008480655492356989, 0.335480655492357),
        (2.8971530571054935, -6.359448489975075, 4.3622954328695815),
        (5.325864828439257, -11.748883564062828, 7.4955393428898365, -0.09249506636175525),
        (
            5.86145544294642,
            -12.92096931784711,
            8.159367898576159,
            -0.071584973281401,
            -0.028269050394068383,
        ),
        (
            0.09646076681806523,
            0.01,
            0.4798896504144996,
            1.379008574103742,
            -3.290069515436081,
            2.324710524099774,
        ),
    ),
    b=(
        0.09646076681806523,
        0.01,
        0.4798896504144996,
        1.379008574103742,
        -3.290069515436081,
        2.324710524099774,
        0.0,
    ),
    # b - b_embedded, with b_embedded = (0.09468075576583945, 0.009183565540343254,
    # 0.4877705284247616, 1.234297566930479, -2.7077123499835256, 1.866628418170587, 1/66).
    b_error=(
        0.0017800110522257714,
        0.0008164344596567469,
        -0.007880878010261995,
        0.1447110071732629,
        -0.5823571654525552,
        0.45808210592918697,
        -1 / 66,
    ),
    order=5,
    embedded_order=4,
    fsal=True,
    # Row i: coefficients of θ, θ², θ³, θ⁴ in b_i(θ).
    dense=(
        (1.0, -2.763706197274826, 2.9132554618219126, -1.0530884977290216),
        (0.0, 0.13169999999999998, -0.2234, 0.1017),
        (0.0, 3.9302962368947516, -5.941033872131505, 2.490627285651253),
        (0.0, -12.411077166933676, 30.33818863028232, -16.548102889244902),
        (0.0, 37.50931341651104, -88.1789048947664, 47.37952196281928),
        (0.0, -27.896526289197286, 65.09189467479366, -34.87065786149661),
        (0.0, 1.5, -4.0, 2.5),
    ),
    dense_order=4,
)

# Dormand–Prince 5(4), FSAL. Source: J. R. Dormand & P. J. Prince, "A family of embedded
# Runge–Kutta formulae", J. Comput. Appl. Math. 6(1) (1980) 19–26 (the 5(4)7M pair); embedded
# weights (5179/57600, 0, 7571/16695, 393/640, -92097/339200, 187/2100, 1/40).
# Dense output: L. F. Shampine, "Some practical Runge–Kutta formulas", Math. Comp. 46 (1986)
# 135–150, in the form used by Hairer's DOPRI5 (Hairer, Nørsett & Wanner, "Solving ODEs I",
# Sec. II.6): y(θ) = y0 + θ(Δ + (1-θ)(h k1 - Δ + θ(Δ - h k7 - (h k1 - Δ) + (1-θ) h Σ d_i k_i)))
# with Δ = y1 - y0 and d = (-12715105075/11282082432, 0, 87487479700/32700410799,
# -10690763975/1880347072, 701980252875/199316789632, -1453857185/822651844,
# 69997945/29380423). Expanding in powers of θ gives the exact rationals below (they coincide
# with diffrax's midpoint-based quartic and with SciPy's RK45 dense output).
DOPRI5 = ButcherTableau(
    c=(0.0, 1 / 5, 3 / 10, 4 / 5, 8 / 9, 1.0, 1.0),
    a=(
        (1 / 5,),
        (3 / 40, 9 / 40),
        (44 / 45, -56 / 15, 32 / 9),
        (19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729),
        (9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656),
        (35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84),
    ),
    b=(35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84, 0.0),
    # b - b_embedded: Hairer's error coefficients e_i.
    b_error=(71 / 57600, 0.0, -71 / 16695, 71 / 1920, -17253 / 339200, 22 / 525, -1 / 40),
    order=5,
    embedded_order=4,
    fsal=True,
    # Row i: coefficients of θ, θ², θ³, θ⁴ in b_i(θ).
    dense=(
        (1.0, -8048581381 / 2820520608, 8663915743 / 2820520608, -12715105075 / 11282082432),
        (0.0, 0.0, 0.0, 0.0),
        (
            0.0,
            131558114200 / 32700410799,
            -68118460800 / 10900136933,
            87487479700 / 32700410799,
        ),
        (0.0, -1754552775 / 470086768, 14199869525 / 1410260304, -10690763975 / 1880347072),
        (
            0.0,
            127303824393 / 49829197408,
            -318862633887 / 49829197408,
            701980252875 / 199316789632,
        ),
        (0.0, -282668133 / 205662961, 2019193451 / 616988883, -1453857185 / 822651844),
        (0.0, 40617522 / 29380423, -110615467 / 29380423, 69997945 / 29380423),
    ),
    dense_order=4,
)

# Prince & Dormand's RK8(7)13M: 13 stages, order 8 with an embedded order-7 method, not FSAL
# (the propagated b has a nonzero last weight, 1/4). Source: P. J. Prince & J. R. Dormand,
# "High order embedded Runge–Kutta formulae", J. Comput. Appl. Math. 7(1) (1981) 67–75, Table 2
# (rational approximations to the coefficients, as published). diffrax's Dopri8 is this method
# with one extra FSAL-style stage appended. We append it too: stage 14 is f(t1, y1) (weight 0),
# which every step computes anyway, and which the continuous extension below needs.
_DOPRI8_B = (
    14005451 / 335480064,
    0.0,
    0.0,
    0.0,
    0.0,
    -59238493 / 1068277825,
    181606767 / 758867731,
    561292985 / 797845732,
    -1041891430 / 1371343529,
    760417239 / 1151165299,
    118820643 / 751138087,
    -528747749 / 2220607170,
    1 / 4,
    0.0,
)
_DOPRI8_B_EMBEDDED = (
    13451932 / 455176623,
    0.0,
    0.0,
    0.0,
    0.0,
    -808719846 / 976000145,
    1757004468 / 5645159321,
    656045339 / 265891186,
    -3867574721 / 1518517206,
    465885868 / 322736535,
    53011238 / 667516719,
    2 / 45,
    0.0,
    0.0,
)
# Continuous extension (nominally order 7) through the 14 stages: Bogacki & Shampine, "Interpolating
# high-order Runge–Kutta formulas", Comput. Math. Appl. 20(3) (1990) 15–24 (the coefficients
# diffrax uses). Row i holds the coefficients of theta^1 .. theta^6 of b_i(theta).
_DOPRI8_DENSE = (
    (
        1.0,
        -6.6910181737837595,
        19.999006933368396,
        -30.061056828966645,
        22.139650499809406,
        -6.34483493928604,
    ),
    (0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
    (0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
    (0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
    (0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
    (
        0.0,
        -7.6142658045872675,
        52.227353279294555,
        -121.49996277313346,
        116.44221495503422,
        -39.61079198522025,
    ),
    (
        0.0,
        10.728139263042886,
        -46.89191641810936,
        83.17210046398478,
        -67.14513188259572,
        20.376121380879145,
    ),
    (
        0.0,
        0.5526637063753649,
        -0.18908932250105956,
        9.572450755599366,
        -16.56722435274965,
        7.334709882679536,
    ),
    (
        0.0,
        4.218656262566515,
        -35.70759759462221,
        87.84060576772056,
        -89.9916014847245,
        32.88017743524592,
    ),
    (
        0.0,
        -0.6627209125361597,
        6.273644808324035,
        -17.415210777076297,
        22.623748964853284,
        -10.158899052642676,
    ),
    (
        0.0,
        -1.2636789001135462,
        10.316088127245076,
        -28.590328951479098,
        32.23623401673554,
        -12.540126809878256,
    ),
    (
        0.0,
        5.410603789859042,
        -34.76507698666118,
        81.66309505843414,
        -82.10203154883598,
        29.555300148451604,
    ),
    (
        0.0,
        -7.032137906794574,
        47.745797107822554,
        -114.93752913770093,
        116.26621857911195,
        -41.79234864243906,
    ),
    (
        0.0,
        2.3537586759714983,
        -19.008209934160803,
        50.255836422617605,
        -53.90207774663854,
        20.300692582210083,
    ),
)
DOPRI8 = ButcherTableau(
    c=(
        0.0,
        1 / 18,
        1 / 12,
        1 / 8,
        5 / 16,
        3 / 8,
        59 / 400,
        93 / 200,
        5490023248 / 9719169821,
        13 / 20,
        1201146811 / 1299019798,
        1.0,
        1.0,
        1.0,
    ),
    a=(
        (1 / 18,),
        (1 / 48, 1 / 16),
        (1 / 32, 0.0, 3 / 32),
        (5 / 16, 0.0, -75 / 64, 75 / 64),
        (3 / 80, 0.0, 0.0, 3 / 16, 3 / 20),
        (
            29443841 / 614563906,
            0.0,
            0.0,
            77736538 / 692538347,
            -28693883 / 1125000000,
            23124283 / 1800000000,
        ),
        (
            16016141 / 946692911,
            0.0,
            0.0,
            61564180 / 158732637,
            22789713 / 633445777,
            545815736 / 2771057229,
            -180193667 / 1043307555,
        ),
        (
            39632708 / 573591083,
            0.0,
            0.0,
            -433636366 / 683701615,
            -421739975 / 2616292301,
            100302831 / 723423059,
            790204164 / 839813087,
            800635310 / 3783071287,
        ),
        (
            246121993 / 1340847787,
            0.0,
            0.0,
            -37695042795 / 15268766246,
            -309121744 / 1061227803,
            -12992083 / 490766935,
            6005943493 / 2108947869,
            393006217 / 1396673457,
            123872331 / 1001029789,
        ),
        (
            -1028468189 / 846180014,
            0.0,
            0.0,
            8478235783 / 508512852,
            1311729495 / 1432422823,
            -10304129995 / 1701304382,
            -48777925059 / 3047939560,
            15336726248 / 1032824649,
            -45442868181 / 3398467696,
            3065993473 / 597172653,
        ),
        (
            185892177 / 718116043,
            0.0,
            0.0,
            -3185094517 / 667107341,
            -477755414 / 1098053517,
            -703635378 / 230739211,
            5731566787 / 1027545527,
            5232866602 / 850066563,
            -4093664535 / 808688257,
            3962137247 / 1805957418,
            65686358 / 487910083,
        ),
        (
            403863854 / 491063109,
            0.0,
            0.0,
            -5068492393 / 434740067,
            -411421997 / 543043805,
            652783627 / 914296604,
            11173962825 / 925320556,
            -13158990841 / 6184727034,
            3936647629 / 1978049680,
            -160528059 / 685178525,
            248638103 / 1413531060,
            0.0,
        ),
        _DOPRI8_B[:-1],  # stage 14 = f(t1, y1) (first same as last)
    ),
    b=_DOPRI8_B,
    b_error=tuple(b - b_hat for b, b_hat in zip(_DOPRI8_B, _DOPRI8_B_EMBEDDED, strict=True)),
    order=8,
    embedded_order=7,
    fsal=True,
    dense=_DOPRI8_DENSE,
    # order 7 for the exact coefficients; with the rational approximations above the order-6
    # conditions hold only to ~1e-6, so exact order 5 is what the test suite can certify
    dense_order=5,
)


# Every tableau above, by name (lower case), in order of increasing cost.
ALL_TABLEAUS: dict[str, ButcherTableau] = {
    "euler": EULER,
    "heun": HEUN,
    "midpoint": MIDPOINT,
    "ralston": RALSTON,
    "rk4": RK4,
    "bs3": BS3,
    "tsit5": TSIT5,
    "dopri5": DOPRI5,
    "dopri8": DOPRI8,
}
