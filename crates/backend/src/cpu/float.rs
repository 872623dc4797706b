//! The float types the CPU backend computes in.

use std::fmt::Debug;
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Neg, Sub, SubAssign};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

/// A float the CPU backend stores and computes in: `f32` (the default) or `f64` (exact
/// uploads and downloads, for finite-difference gradient checks). Sealed.
pub trait CpuFloat:
    sealed::Sealed
    + Copy
    + Debug
    + Default
    + PartialOrd
    + Send
    + Sync
    + 'static
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
{
    /// The type's name, for [`crate::Backend::name`].
    const NAME: &'static str;
    /// 0.
    const ZERO: Self;
    /// 1.
    const ONE: Self;
    /// −∞.
    const NEG_INFINITY: Self;
    /// Rounds from `f32`.
    fn from_f32(x: f32) -> Self;
    /// Rounds from `f64`.
    fn from_f64(x: f64) -> Self;
    /// Rounds to `f32`.
    fn to_f32(self) -> f32;
    /// Widens to `f64`.
    fn to_f64(self) -> f64;
    /// `eˣ`.
    fn exp(self) -> Self;
    /// `eˣ` in a branch-free form the compiler vectorises inside loops: for `f32` a
    /// polynomial within 2 ulp of [`CpuFloat::exp`] (`+∞` above 88.7, `0` below −103,
    /// NaN stays NaN); for `f64` the library `exp` itself, so the finite-difference
    /// checks keep full precision.
    fn exp_vec(self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
    /// Square root.
    fn sqrt(self) -> Self;
    /// Sine.
    fn sin(self) -> Self;
    /// Cosine.
    fn cos(self) -> Self;
    /// `xⁿ`.
    fn powi(self, n: i32) -> Self;
    /// The larger of two values.
    fn max(self, other: Self) -> Self;
}

macro_rules! impl_cpu_float {
    ($t:ty, $exp_vec:path) => {
        impl CpuFloat for $t {
            const NAME: &'static str = stringify!($t);
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            #[inline]
            fn from_f32(x: f32) -> Self {
                x as $t
            }
            #[inline]
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            #[inline]
            fn to_f32(self) -> f32 {
                self as f32
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn exp_vec(self) -> Self {
                $exp_vec(self)
            }
            #[inline]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline]
            fn sin(self) -> Self {
                <$t>::sin(self)
            }
            #[inline]
            fn cos(self) -> Self {
                <$t>::cos(self)
            }
            #[inline]
            fn powi(self, n: i32) -> Self {
                <$t>::powi(self, n)
            }
            #[inline]
            fn max(self, other: Self) -> Self {
                <$t>::max(self, other)
            }
        }
    };
}

impl_cpu_float!(f32, exp_f32);
impl_cpu_float!(f64, f64::exp);

/// `eˣ` for `f32` without branches or library calls: `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2`,
/// `eʳ` by Cephes' degree-6 polynomial, `2ⁿ` built in the exponent bits.
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    // Above this eˣ overflows f32; below LOWEST it is under half the smallest subnormal.
    const HIGHEST: f32 = 88.72284;
    const LOWEST: f32 = -103.97208;
    // 1.5 · 2²³: adding it rounds to an integer (ties to even) held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // `clamp` passes NaN through, so it propagates through the arithmetic.
    let clamped = x.clamp(LOWEST, HIGHEST);
    let shifted = clamped * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let n_int = shifted.to_bits() as i32 - ROUND.to_bits() as i32;
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    // 2ⁿ in two factors, so n down to −150 (subnormal results) stays representable.
    let half = n_int >> 1;
    let two_a = f32::from_bits(((half + 127) as u32) << 23);
    let two_b = f32::from_bits(((n_int - half + 127) as u32) << 23);
    let y = er * two_a * two_b;
    if x > HIGHEST {
        f32::INFINITY
    } else if x < LOWEST {
        0.0
    } else {
        y
    }
}

/// Runs `f` compiled for AVX-512 where the CPU has it (checked at run time), else for
/// the x86-64 baseline: loops that `f` inlines (exp, softmax, SwiGLU) then run 16 lanes
/// wide instead of SSE2's 4. Rust neither reorders nor fuses float operations, so the
/// results are the same bits either way. Only code inlined into `f` is recompiled:
/// pass a closure that calls `#[inline(always)]` functions.
#[inline(always)]
pub(crate) fn wide<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F, checked just above.
        return unsafe { avx512(f) };
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Independent partial sums in [`dot`] and [`sum`]: one serial chain of additions runs at
/// the adder's latency; eight fill a vector register and run at its throughput.
const LANES: usize = 8;

/// `Σ a_i b_i` over the common length.
#[inline]
pub(crate) fn dot<T: CpuFloat>(a: &[T], b: &[T]) -> T {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut lanes = [T::ZERO; LANES];
    for (x, y) in a.chunks_exact(LANES).zip(b.chunks_exact(LANES)) {
        for i in 0..LANES {
            lanes[i] += x[i] * y[i];
        }
    }
    let tail = n - n % LANES;
    let mut acc = lanes.iter().fold(T::ZERO, |s, &l| s + l);
    for (&x, &y) in a[tail..].iter().zip(&b[tail..]) {
        acc += x * y;
    }
    acc
}

/// `Σ x_i`.
#[inline]
pub(crate) fn sum<T: CpuFloat>(x: &[T]) -> T {
    let mut lanes = [T::ZERO; LANES];
    for c in x.chunks_exact(LANES) {
        for i in 0..LANES {
            lanes[i] += c[i];
        }
    }
    let tail = x.len() - x.len() % LANES;
    let acc = lanes.iter().fold(T::ZERO, |s, &l| s + l);
    x[tail..].iter().fold(acc, |s, &v| s + v)
}

/// `max_i x_i` (−∞ for an empty slice; NaN entries are skipped, as `f32::max` does).
#[inline]
pub(crate) fn max<T: CpuFloat>(x: &[T]) -> T {
    let mut lanes = [T::NEG_INFINITY; LANES];
    for c in x.chunks_exact(LANES) {
        for i in 0..LANES {
            lanes[i] = lanes[i].max(c[i]);
        }
    }
    let tail = x.len() - x.len() % LANES;
    let acc = lanes.iter().fold(T::NEG_INFINITY, |m, &l| m.max(l));
    x[tail..].iter().fold(acc, |m, &v| m.max(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between two finite `f32`s of equal sign.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_vec_is_within_two_ulp_of_exp() {
        // Every 97th float of magnitude up to 88, with both signs down to −87 (normal
        // results); then the subnormal range.
        for bits in (0..88.0_f32.to_bits()).step_by(97) {
            let x = f32::from_bits(bits);
            for x in [x, -x] {
                if x < -87.0 {
                    continue;
                }
                let (got, want) = (x.exp_vec(), x.exp());
                assert!(ulps(got, want) <= 2, "exp_vec({x}) = {got}, exp = {want}");
            }
        }
        for x in [-100.0_f32, -95.5, -90.0, -88.0] {
            let (got, want) = (x.exp_vec(), x.exp());
            assert!(
                (got - want).abs() <= 2.0 * f32::from_bits(1),
                "{x}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn exp_vec_edges() {
        assert_eq!(0.0_f32.exp_vec(), 1.0);
        assert_eq!(f32::NEG_INFINITY.exp_vec(), 0.0);
        assert_eq!((-200.0_f32).exp_vec(), 0.0);
        assert_eq!(f32::INFINITY.exp_vec(), f32::INFINITY);
        assert_eq!(100.0_f32.exp_vec(), f32::INFINITY);
        assert!(f32::NAN.exp_vec().is_nan());
        assert_eq!(1.5_f64.exp_vec(), 1.5_f64.exp());
    }

    #[test]
    fn lane_reductions_match_serial_ones() {
        for n in [0, 1, 7, 8, 9, 31, 100] {
            let x: Vec<f64> = (0..n).map(|i| ((i * 37 % 11) as f64 - 5.0) / 3.0).collect();
            let y: Vec<f64> = (0..n).map(|i| ((i * 13 % 7) as f64 - 3.0) / 5.0).collect();
            let serial_dot: f64 = x.iter().zip(&y).map(|(a, b)| a * b).sum();
            assert!((dot(&x, &y) - serial_dot).abs() < 1e-12, "dot, n = {n}");
            assert!(
                (sum(&x) - x.iter().sum::<f64>()).abs() < 1e-12,
                "sum, n = {n}"
            );
            let serial_max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            assert_eq!(max(&x), serial_max, "max, n = {n}");
        }
    }
}
