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
    ($t:ty) => {
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

impl_cpu_float!(f32);
impl_cpu_float!(f64);

/// `Σ a_i b_i`.
#[inline]
pub(crate) fn dot<T: CpuFloat>(a: &[T], b: &[T]) -> T {
    let mut acc = T::ZERO;
    for (&x, &y) in a.iter().zip(b) {
        acc += x * y;
    }
    acc
}

/// `y += alpha · x`.
#[inline]
pub(crate) fn axpy<T: CpuFloat>(y: &mut [T], alpha: T, x: &[T]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
}
