//! One module per subcommand: its flags and the glue that calls the library crates.

pub mod bench;
pub mod data;
pub mod env;
pub mod eval;
pub mod export;
pub mod keys;
pub mod launch;
pub mod plan;
pub mod reward;
pub mod serve;
pub mod train;
