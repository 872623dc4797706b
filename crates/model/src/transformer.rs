//! (in progress: compute core)
