//! (in progress: rewards)
