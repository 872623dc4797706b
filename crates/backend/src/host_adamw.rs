//! AdamW over optimizer state in host memory, the update of [`crate::Backend::adamw_host`]:
//! the f32 rule of the CUDA kernel `adamw` (`cuda/kernels/elementwise.cu`) term for term,
//! so where the state lives changes an update only by the rounding of its inputs. Runs
//! in parallel over blocks of a few thousand elements (rayon), each small enough to
//! stay in cache while it is updated and rounded for the device.

use rayon::prelude::*;

use crate::AdamW;

/// Elements one rayon task updates.
const BLOCK: usize = 1 << 14;

/// One step's constants, as the CUDA kernel receives them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamWTerms {
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    grad_scale: f32,
    /// `1 - beta1^step`, computed in f64.
    bias1: f32,
    /// `1 - beta2^step`, computed in f64.
    bias2: f32,
}

impl AdamWTerms {
    pub(crate) fn new(hp: &AdamW) -> Self {
        let step = i32::try_from(hp.step).unwrap_or(i32::MAX);
        Self {
            lr: hp.lr,
            beta1: hp.beta1,
            beta2: hp.beta2,
            eps: hp.eps,
            weight_decay: hp.weight_decay,
            grad_scale: hp.grad_scale,
            bias1: (1.0 - f64::from(hp.beta1).powi(step)) as f32,
            bias2: (1.0 - f64::from(hp.beta2).powi(step)) as f32,
        }
    }

    /// One block, serially, on the widest vectors the CPU has: the build targets baseline
    /// x86-64 (SSE2), and the update's divisions and square root run 1.5× faster in AVX2
    /// lanes. The result is the same bit for bit: each lane does the same correctly
    /// rounded operations in the same order, and Rust never fuses a multiply and an add.
    fn block(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            return unsafe { self.block_avx2(p, g, m, v) };
        }
        self.block_portable(p, g, m, v)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn block_avx2(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        self.block_portable(p, g, m, v)
    }

    /// The update; inlined into each caller so it vectorizes for that caller's features.
    #[inline(always)]
    fn block_portable(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        let t = *self;
        for i in 0..p.len() {
            let g = g[i] * t.grad_scale;
            let mut w = p[i];
            w -= t.lr * t.weight_decay * w;
            let mi = t.beta1 * m[i] + (1.0 - t.beta1) * g;
            let vi = t.beta2 * v[i] + (1.0 - t.beta2) * g * g;
            m[i] = mi;
            v[i] = vi;
            w -= t.lr * (mi / t.bias1) / ((vi / t.bias2).sqrt() + t.eps);
            p[i] = w;
        }
    }
}

/// Where [`step`] writes the new weights besides `master`.
pub(crate) enum Rounded<'a> {
    /// Nowhere.
    None,
    /// As bf16 bits (round to nearest even, as the kernel's stores round).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Bf16(&'a mut [u16]),
}

/// Updates `master`, `m` and `v` (all of `grad`'s length) in place, in parallel, and
/// writes the new weights to `out`.
pub(crate) fn step(
    terms: &AdamWTerms,
    master: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    out: Rounded<'_>,
) {
    let blocks = master
        .par_chunks_mut(BLOCK)
        .zip(grad.par_chunks(BLOCK))
        .zip(m.par_chunks_mut(BLOCK).zip(v.par_chunks_mut(BLOCK)));
    match out {
        Rounded::None => blocks.for_each(|((p, g), (m, v))| terms.block(p, g, m, v)),
        Rounded::Bf16(bits) => {
            blocks
                .zip(bits.par_chunks_mut(BLOCK))
                .for_each(|(((p, g), (m, v)), bits)| {
                    terms.block(p, g, m, v);
                    for (b, &w) in bits.iter_mut().zip(p.iter()) {
                        *b = half::bf16::from_f32(w).to_bits();
                    }
                })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuBackend;
    use crate::{Backend, BufKind};

    #[test]
    fn the_host_rule_is_the_cpu_backends_adamw_bit_for_bit() {
        let n = 3 * BLOCK + 17;
        let wave = |i: usize, scale: f32| (i as f32 * 0.37).sin() * scale;
        let p: Vec<f32> = (0..n).map(|i| wave(i, 1.0)).collect();
        let hp = AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 1,
            grad_scale: 0.5,
        };
        let cpu = CpuBackend::<f32>::new();
        let mut param = cpu.upload(&p, BufKind::Full).unwrap();
        let mut m = cpu.zeros(n, BufKind::Full).unwrap();
        let mut v = cpu.zeros(n, BufKind::Full).unwrap();
        let (mut master, mut hm, mut hv) = (p.clone(), vec![0.0; n], vec![0.0; n]);
        let mut bits = vec![0u16; n];
        for k in 1..=3 {
            let g: Vec<f32> = (0..n).map(|i| wave(i * k, 0.01)).collect();
            let hp = AdamW {
                step: k as u64,
                ..hp
            };
            let gb = cpu.upload(&g, BufKind::Full).unwrap();
            cpu.adamw(&mut param, &gb, &mut m, &mut v, None, hp)
                .unwrap();
            let terms = AdamWTerms::new(&hp);
            step(
                &terms,
                &mut master,
                &g,
                &mut hm,
                &mut hv,
                Rounded::Bf16(&mut bits),
            );
        }
        assert_eq!(cpu.download(&param).unwrap(), master);
        assert_eq!(cpu.download(&m).unwrap(), hm);
        assert_eq!(cpu.download(&v).unwrap(), hv);
        for (b, w) in bits.iter().zip(&master) {
            assert_eq!(*b, half::bf16::from_f32(*w).to_bits());
        }
    }
}
