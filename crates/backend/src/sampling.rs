//! Sampling one token from a row of logits (in progress).
