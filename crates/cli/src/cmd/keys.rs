//! `floe keys`: issue, revoke and list the API keys of a `floe serve --api-key-file`. A
//! running server re-reads the file when it changes, so changes take effect without a
//! restart.

use std::path::PathBuf;

use anyhow::Result;
use floe_server::keys::{issue_key, list_keys, revoke_key};

/// Subcommands of `floe keys`.
#[derive(clap::Subcommand)]
pub enum Command {
    /// Add a new random key to the file (created, owner-only, if absent) and print it:
    /// it is shown this once.
    Issue {
        /// The server's key file.
        #[arg(long)]
        file: PathBuf,
        /// Who the key is for; unique within the file, and what `revoke` takes.
        #[arg(long)]
        name: String,
    },
    /// Remove the key with this name (or this key) from the file.
    Revoke {
        /// The server's key file.
        #[arg(long)]
        file: PathBuf,
        /// The key's name, or the key itself.
        name: String,
    },
    /// List the keys' names and first characters.
    List {
        /// The server's key file.
        #[arg(long)]
        file: PathBuf,
    },
}

/// Runs `floe keys`.
pub fn run(command: Command) -> Result<()> {
    match command {
        Command::Issue { file, name } => {
            let key = issue_key(&file, &name).map_err(anyhow::Error::msg)?;
            eprintln!("issued a key for {name:?} into {}", file.display());
            println!("{key}");
        }
        Command::Revoke { file, name } => {
            let removed = revoke_key(&file, &name).map_err(anyhow::Error::msg)?;
            for entry in removed {
                eprintln!("revoked {} ({:?})", entry.shown(), entry.name);
            }
        }
        Command::List { file } => {
            for entry in list_keys(&file).map_err(anyhow::Error::msg)? {
                println!("{:<24} {}", entry.name, entry.shown());
            }
        }
    }
    Ok(())
}
