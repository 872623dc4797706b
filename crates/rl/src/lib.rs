//! RL algorithm math as pure functions over slices: advantages, policy losses, KL
//! penalties, loss reductions, schedules and metrics. No I/O, no device code.

#![deny(missing_docs)]
