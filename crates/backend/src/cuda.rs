//! The CUDA backend (to be implemented).
