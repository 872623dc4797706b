//! (in progress: text)
