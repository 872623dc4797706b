//! Admission of engines onto a GPU shared by several of them (the engines of `floe
//! serve`'s clients). An engine's [memory plan](crate::memory_plan) is checked against
//! the memory free when it is built, and everything the plan holds for good (weights,
//! gradients, moments, KV cache) is allocated then; but part of it is used only while a
//! step runs (one micro-batch's activations, logits chunks, workspaces), so the free
//! memory seen between steps does not show it. Engines on one device are therefore
//! admitted one at a time, and each admitted engine keeps a [`Reservation`] of those
//! per-step bytes until it is dropped: the next engine plans with what is free less them,
//! and is refused at creation rather than running out of memory in a later step.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

/// Per-step bytes of the admitted engines, by (device ordinal, reservation id).
#[derive(Default)]
struct Ledger {
    next_id: u64,
    reserved: BTreeMap<(usize, u64), usize>,
}

static LEDGER: Mutex<Ledger> = Mutex::new(Ledger {
    next_id: 0,
    reserved: BTreeMap::new(),
});

fn ledger() -> MutexGuard<'static, Ledger> {
    // Every edit of the ledger is one map operation: a poisoned lock holds a whole map.
    LEDGER.lock().unwrap_or_else(|e| e.into_inner())
}

impl Ledger {
    fn reserved_on(&self, ordinal: usize, except: Option<u64>) -> usize {
        self.reserved
            .range((ordinal, 0)..=(ordinal, u64::MAX))
            .filter(|((_, id), _)| Some(*id) != except)
            .map(|(_, bytes)| bytes)
            .sum()
    }
}

/// Held while one engine is built: no other engine is admitted meanwhile, so the free
/// memory it plans with is not taken by another engine being built beside it.
pub struct Gate {
    ordinal: usize,
    ledger: MutexGuard<'static, Ledger>,
}

impl Gate {
    /// Waits until no other engine is being built, then holds the gate for device
    /// `ordinal`.
    pub fn enter(ordinal: usize) -> Self {
        Self {
            ordinal,
            ledger: ledger(),
        }
    }

    /// Per-step bytes that the admitted engines of this device hold.
    pub fn reserved(&self) -> usize {
        self.ledger.reserved_on(self.ordinal, None)
    }

    /// Admits the engine: `per_step_bytes` stay reserved for its steps until the
    /// reservation is dropped; the gate opens for the next engine.
    pub fn admit(mut self, per_step_bytes: usize) -> Reservation {
        let id = self.ledger.next_id;
        self.ledger.next_id += 1;
        self.ledger
            .reserved
            .insert((self.ordinal, id), per_step_bytes);
        Reservation {
            ordinal: self.ordinal,
            id,
        }
    }
}

/// An admitted engine's per-step bytes, released when it is dropped.
#[derive(Debug)]
pub struct Reservation {
    ordinal: usize,
    id: u64,
}

impl Reservation {
    /// Per-step bytes that the other admitted engines of this device hold.
    pub fn reserved_by_others(&self) -> usize {
        ledger().reserved_on(self.ordinal, Some(self.id))
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        ledger().reserved.remove(&(self.ordinal, self.id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The ledger is one per process: each test uses device ordinals of its own.

    #[test]
    fn reservations_count_per_device_until_dropped() {
        let first = Gate::enter(100).admit(3 << 20);
        let other_device = Gate::enter(101).admit(5 << 20);
        let gate = Gate::enter(100);
        assert_eq!(gate.reserved(), 3 << 20);
        let second = gate.admit(1 << 20);
        assert_eq!(second.reserved_by_others(), 3 << 20);
        assert_eq!(first.reserved_by_others(), 1 << 20);
        drop(first);
        assert_eq!(Gate::enter(100).reserved(), 1 << 20);
        drop((second, other_device));
        assert_eq!(Gate::enter(100).reserved(), 0);
        assert_eq!(Gate::enter(101).reserved(), 0);
    }

    #[test]
    fn engines_are_admitted_one_at_a_time() {
        let gate = Gate::enter(102);
        let waiting = std::thread::spawn(|| {
            // Blocks until the first gate admits its engine, then sees its bytes.
            Gate::enter(102).reserved()
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        let admitted = gate.admit(7 << 20);
        assert_eq!(waiting.join().unwrap(), 7 << 20);
        drop(admitted);
    }
}
