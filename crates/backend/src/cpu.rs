//! The CPU reference backend (to be implemented).
