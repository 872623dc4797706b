//! (in progress: data)
