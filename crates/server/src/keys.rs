//! API keys: the file `floe keys` issues them into and revokes them from, and the set a
//! server accepts. The server re-reads the file when it changes, so an issued key works
//! and a revoked one stops working without a restart. Keys are compared through their
//! SHA-256 digests in constant time, so a response's timing says nothing about how much
//! of a guess matched.
//!
//! The file holds one key per line, `KEY  # NAME` (blank lines and `#` lines are
//! ignored); keys start with `tml-`, as the Tinker SDK requires.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use sha2::{Digest, Sha256};

/// The prefix the Tinker SDK requires of a key.
pub const KEY_PREFIX: &str = "tml-";
/// Random bytes in an issued key (192 bits).
const KEY_BYTES: usize = 24;

type KeyDigest = [u8; 32];

fn digest(key: &str) -> KeyDigest {
    Sha256::digest(key.as_bytes()).into()
}

/// One line of a key file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyEntry {
    /// The key.
    pub key: String,
    /// Its name (the comment after it), empty when none.
    pub name: String,
}

impl KeyEntry {
    /// The key's first characters, enough to tell keys apart in a listing.
    pub fn shown(&self) -> String {
        let end = self.key.len().min(KEY_PREFIX.len() + 6);
        format!("{}…", &self.key[..end])
    }
}

/// The keys of a key file's text.
pub fn parse_key_file(text: &str) -> Vec<KeyEntry> {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| {
            let (key, name) = line.split_once('#').unwrap_or((line, ""));
            KeyEntry {
                key: key.trim().to_string(),
                name: name.trim().to_string(),
            }
        })
        .collect()
}

fn read_entries(path: &Path) -> Result<Vec<KeyEntry>, String> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(parse_key_file(&text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Writes `entries` to `path` through a temporary sibling and a rename, readable by its
/// owner only.
fn write_entries(path: &Path, entries: &[KeyEntry]) -> Result<(), String> {
    let mut text = String::from("# floe serve API keys: KEY  # NAME (managed by `floe keys`)\n");
    for entry in entries {
        text.push_str(&format!("{}  # {}\n", entry.key, entry.name));
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let error = |e: std::io::Error| format!("{}: {e}", tmp.display());
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(&tmp).map_err(error)?;
    file.write_all(text.as_bytes()).map_err(error)?;
    file.sync_all().map_err(error)?;
    std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
}

/// Adds a new random key named `name` to the key file at `path` (created if absent) and
/// returns it. Names are unique within a file, so a key can be revoked by its name.
pub fn issue_key(path: &Path, name: &str) -> Result<String, String> {
    let name = name.trim();
    if name.is_empty() || name.contains('\n') {
        return Err("a key needs a one-line name (--name), to list and revoke it by".into());
    }
    let mut entries = read_entries(path)?;
    if entries.iter().any(|e| e.name == name) {
        return Err(format!(
            "{}: a key named {name:?} exists already; revoke it first or choose another name",
            path.display()
        ));
    }
    let mut bytes = [0u8; KEY_BYTES];
    getrandom::fill(&mut bytes).map_err(|e| format!("the OS random source: {e}"))?;
    let key = format!(
        "{KEY_PREFIX}{}",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    entries.push(KeyEntry {
        key: key.clone(),
        name: name.to_string(),
    });
    write_entries(path, &entries)?;
    Ok(key)
}

/// Removes the keys named `name_or_key` (or equal to it) from the key file; returns the
/// removed entries, and an error naming the file when none matched.
pub fn revoke_key(path: &Path, name_or_key: &str) -> Result<Vec<KeyEntry>, String> {
    let entries = read_entries(path)?;
    let (removed, kept): (Vec<KeyEntry>, Vec<KeyEntry>) = entries
        .into_iter()
        .partition(|e| e.name == name_or_key || e.key == name_or_key);
    if removed.is_empty() {
        return Err(format!(
            "{}: no key is named {name_or_key:?} (`floe keys list` shows them)",
            path.display()
        ));
    }
    write_entries(path, &kept)?;
    Ok(removed)
}

/// The entries of the key file at `path` (none when it does not exist).
pub fn list_keys(path: &Path) -> Result<Vec<KeyEntry>, String> {
    read_entries(path)
}

/// The keys a server accepts: fixed ones (from the environment) and those of a key
/// file, re-read when its modification time changes.
#[derive(Debug)]
pub struct ApiKeys {
    fixed: Vec<KeyDigest>,
    file: Option<PathBuf>,
    /// The file's keys as last read, with the version of the file they were read from.
    from_file: Mutex<(Option<FileVersion>, Vec<KeyDigest>)>,
}

impl ApiKeys {
    /// Accepts exactly `keys`.
    pub fn fixed<S: AsRef<str>>(keys: impl IntoIterator<Item = S>) -> Self {
        Self {
            fixed: keys.into_iter().map(|k| digest(k.as_ref())).collect(),
            file: None,
            from_file: Mutex::new((None, Vec::new())),
        }
    }

    /// Accepts `keys` and those of the key file at `path`, read now (an unreadable file is
    /// an error naming it) and again whenever it changes.
    pub fn with_file<S: AsRef<str>>(
        keys: impl IntoIterator<Item = S>,
        path: &Path,
    ) -> Result<Self, String> {
        let mut this = Self::fixed(keys);
        let version = version(path);
        let digests = read_entries(path)?.iter().map(|e| digest(&e.key)).collect();
        this.file = Some(path.to_path_buf());
        this.from_file = Mutex::new((version, digests));
        Ok(this)
    }

    /// Whether no key would be accepted (a server refuses to start so).
    pub fn is_empty(&self) -> bool {
        self.fixed.is_empty()
            && self.file.is_none()
            && self
                .from_file
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .1
                .is_empty()
    }

    /// Whether `key` is accepted, checking every accepted digest in constant time.
    pub fn accepts(&self, key: &str) -> bool {
        let candidate = digest(key);
        let mut file_keys = self.from_file.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(path) = &self.file {
            let now = version(path);
            if now != file_keys.0 {
                // A file being rewritten keeps the old keys until it reads whole.
                if let Ok(entries) = read_entries(path) {
                    *file_keys = (now, entries.iter().map(|e| digest(&e.key)).collect());
                }
            }
        }
        let mut matched = false;
        for accepted in self.fixed.iter().chain(&file_keys.1) {
            matched |= constant_time_eq(&candidate, accepted);
        }
        matched
    }
}

/// What tells one content of a key file from the next: its modification time, length and
/// (on Unix) inode, which every rewrite by `floe keys` changes, however coarse the clock.
type FileVersion = (SystemTime, u64, u64);

/// The file's version, `None` when it cannot be read.
fn version(path: &Path) -> Option<FileVersion> {
    let meta = std::fs::metadata(path).ok()?;
    #[cfg(unix)]
    let inode = std::os::unix::fs::MetadataExt::ino(&meta);
    #[cfg(not(unix))]
    let inode = 0;
    Some((meta.modified().ok()?, meta.len(), inode))
}

/// Equality of two digests whose time does not depend on where they differ.
fn constant_time_eq(a: &KeyDigest, b: &KeyDigest) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Moves the file's modification time `secs` ahead: file times may be coarser than
    /// the test's steps, and the server reloads on a changed time.
    fn bump(path: &Path, secs: u64) {
        let later = SystemTime::now() + std::time::Duration::from_secs(secs);
        let file = std::fs::File::options().write(true).open(path).unwrap();
        file.set_modified(later).unwrap();
    }

    #[test]
    fn issued_keys_are_accepted_until_revoked_without_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.txt");
        let keys = ApiKeys::with_file(["tml-from-env"], &path).unwrap();
        assert!(keys.accepts("tml-from-env") && !keys.accepts("tml-guess"));
        let alice = issue_key(&path, "alice").unwrap();
        assert!(alice.starts_with(KEY_PREFIX) && alice.len() == KEY_PREFIX.len() + 48);
        bump(&path, 2);
        assert!(keys.accepts(&alice));
        let bob = issue_key(&path, "bob").unwrap();
        assert_ne!(alice, bob);
        assert!(issue_key(&path, "bob")
            .unwrap_err()
            .contains("exists already"));
        assert_eq!(revoke_key(&path, "alice").unwrap().len(), 1);
        bump(&path, 4);
        assert!(!keys.accepts(&alice));
        assert!(keys.accepts(&bob) && keys.accepts("tml-from-env"));
        let listed = list_keys(&path).unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].name, "bob");
        assert!(revoke_key(&path, "carol").unwrap_err().contains("carol"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "only its owner reads the key file");
        }
    }

    #[test]
    fn hand_written_files_parse_with_comments_and_names() {
        let entries = parse_key_file("# comment\n\ntml-a  # first\ntml-b\n  tml-c #third  \n");
        let keys: Vec<&str> = entries.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(keys, ["tml-a", "tml-b", "tml-c"]);
        assert_eq!(entries[2].name, "third");
        assert_eq!(entries[0].shown(), "tml-a…");
    }
}
